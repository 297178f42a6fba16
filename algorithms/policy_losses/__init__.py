"""The registered policy losses, one per file (`algorithms.core.registry.register_policy_loss`):
`vanilla` (PPO's clipped surrogate), `gspo` (GSPO's sequence-level ratio), `cispo` (CISPO's
clipped, detached importance weight). Each is one function of the signature the registry names;
`algorithms.core.policy_loss.PolicyLoss(name=...)` calls it, and `ppo.policy_loss` picks it.
"""
