"""trlX-style PPO on xray's WholeModels.

The pure parts, each one concept, torch only, no Ray (unit-tested against hand-computed values):
`masked` (masked mean / variance), `rewards` (score shaping and the per-token KL-penalised
reward), `gae` (generalised advantage estimation, whitening), `losses` (clipped policy and value
losses, as picklable `LossFn`s for the training backends), `kl` (adaptive and fixed KL
controllers). The driver that calls the WholeModels lives in `algorithms.ppo.trainer`.
"""
