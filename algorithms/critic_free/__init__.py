"""The critic-free family on xray's WholeModels: GRPO, Dr. GRPO, RLOO and REINFORCE++.

`advantages` holds the estimators (pure torch, unit-tested against hand-computed values,
registered as `grpo`, `rloo`, `reinforce_pp`); `trainer` the step, PPO's clipped update on the
actor alone (it reuses `algorithms.core`'s policy loss, KL estimators and rewards, and the run
machinery of `xray.run`).
"""
