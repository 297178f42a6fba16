"""trlX-style PPO on xray's WholeModels.

PPO's own math, each one concept, torch only, no Ray (unit-tested against hand-computed values):
`gae` (generalised advantage estimation, and the `gae` advantage estimator: KL-penalised rewards,
GAE, whitening), `value_loss` (the critic's clipped value loss, a picklable `LossFn`). What PPO
shares with the other algorithms (masked statistics, KL estimators and controllers, rewards, the
actor's policy loss) is in `algorithms.core`; PPO's clip is the `vanilla` policy loss
(`algorithms.policy_losses`). The driver that calls the WholeModels lives in `xray.run.step`.
"""
