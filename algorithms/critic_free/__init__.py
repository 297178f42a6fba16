"""The critic-free family on xray's WholeModels: GRPO, Dr. GRPO, RLOO and REINFORCE++.

`advantages` holds the estimators (pure torch, unit-tested against hand-computed values);
`trainer` the step, PPO's clipped update on the actor alone (it reuses `algorithms.ppo`'s losses,
KL estimators, run loop, checkpoints and recovery).
"""
