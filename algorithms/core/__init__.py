"""The shared RL math every algorithm uses: torch only, no Ray, unit-tested against hand-computed
values and transcriptions of the papers' and peers' formulas.

`masked` (masked sums, means, variances, whitening), `kl_estimators` (per-token KL estimates),
`kl_control` (fixed and adaptive KL coefficients), `rewards` (score shaping, the KL-penalised
per-token reward), `teacher` (on-policy distillation's per-token term), `policy_loss` (the
actor's picklable `LossFn` and loss aggregation), `actor_loss` (that loss built from a run's
config), `advantage_inputs` (what an advantage estimator reads) and `registry` (policy losses and
advantage estimators by name, veRL's `register_policy_loss` / `register_adv_est`). The
registered functions themselves live beside their algorithm: `algorithms/policy_losses/`,
`algorithms/ppo/gae.py`, `algorithms/critic_free/advantages.py`, `algorithms/core/teacher.py`.
"""
