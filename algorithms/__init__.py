"""RL algorithms on xray's WholeModels (PPO first). They use xray; xray never imports them."""
