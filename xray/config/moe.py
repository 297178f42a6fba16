"""Mixture-of-experts settings of a trained role (`actor.moe`, `critic.moe`) and their plan-time checks.

Sits in the config layer: the typed section both training backends read (Megatron-core's router
options through `xray/backends/megatron/spec.py`; DeepSpeed's Hugging Face models through their
own router loss, `xray/backends/deepspeed/model.py`), and `check_experts`, which the plan calls
for a role's expert parallelism (`<role>.ep`) and these options. The defaults compute what
Hugging Face's Qwen3-MoE / Qwen2-MoE compute: no load-balancing loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xray.config.engines import engine, labels, names
from xray.config.typed import ConfigError

BALANCING = ("none", "aux_loss", "seq_aux_loss")


class MoeConfigError(ConfigError):
    """A mixture-of-experts setting that cannot be used; the message says the fix."""


@dataclass(frozen=True)
class MoeConfig:
    """The router's training options of a mixture-of-experts role (ignored by dense models'
    engines only where left at their defaults: a dense model given any other value is refused)."""

    load_balancing: Literal["none", "aux_loss", "seq_aux_loss"] = "none"
    """The load-balancing loss added to the policy's: `none` (Hugging Face's training loss without
    `output_router_logits`), `aux_loss` (the Switch/GShard loss over each micro-batch's tokens:
    the fraction routed to each expert times its mean router probability, summed over experts, times
    experts; Megatron's `aux_loss`, Hugging Face's `load_balancing_loss_func`), `seq_aux_loss` (the
    same per sequence; Megatron only)."""
    aux_loss_coef: float = 0.0
    """Its weight (Megatron's `moe_aux_loss_coeff`, Hugging Face's `router_aux_loss_coef`; 0.001
    to 0.01 is usual); positive exactly when `load_balancing` is not `none`."""
    routing_replay: bool = False
    """The actor's forwards route each token to the experts the rollout engine chose for it (routing
    replay, R3), instead of choosing again: the critic-free commands, synchronous, with the dsinfer
    rollout (it runs the Hugging Face model and reports its routing; vLLM on CPU cannot, and the
    plan says why)."""

    def __post_init__(self) -> None:
        if self.load_balancing not in BALANCING:
            raise MoeConfigError(f"moe.load_balancing={self.load_balancing!r}; choose one of {', '.join(BALANCING)}")
        if self.aux_loss_coef < 0:
            raise MoeConfigError(f"moe.aux_loss_coef={self.aux_loss_coef} is negative; give 0 or a positive weight")
        if (self.load_balancing == "none") != (self.aux_loss_coef == 0):
            raise MoeConfigError(
                f"moe.load_balancing={self.load_balancing} with moe.aux_loss_coef={self.aux_loss_coef}: a "
                "load-balancing loss needs a positive weight and a weight needs a loss; set both (aux_loss and "
                "0.001, say) or neither")

    @property
    def balanced(self) -> bool:
        return self.load_balancing != "none"


def check_routing_replay(cfg, gen_backend: str, command: str, replays: bool) -> None:
    """`actor.moe.routing_replay` against the run (`cfg`: its RunConfig) of `command`, whose spec
    allows replay or not (`replays`); ValueError naming the fix."""
    if any(getattr(cfg, role).moe.routing_replay for role in ("critic", "reference")):
        raise MoeConfigError("moe.routing_replay is the actor's (its forwards replay the rollout's routing); "
                             "set it on actor.moe only")
    if not cfg.actor.moe.routing_replay:
        return
    if not engine(gen_backend).reports_routing:
        why = engine(gen_backend).no_routing
        raise MoeConfigError(f"actor.moe.routing_replay with the {gen_backend} rollout: {why}; use --backend "
                             f"<train>-{'|'.join(names('generation', 'reports_routing'))} (a rollout that reports its "
                             "routing), or set it false (rollout_logprob_gap_mean shows what routing differences cost)")
    off = [why for why, on in ((f"{command} (critic-free commands only)", not replays),
                               ("trainer.mode async", cfg.trainer.mode != "sync"), ("env episodes", cfg.env.episodes),
                               ("actor.packing", cfg.actor.packing)) if on]
    if off:
        raise MoeConfigError(f"actor.moe.routing_replay with {off[0]}: replay runs in synchronous critic-free "
                             "steps of single completions, padded; turn one of them off")


def check_experts(role: str, rc, train_backend: str) -> None:
    """A role's expert parallelism and router options against its backend (`rc`: its RoleConfig);
    ValueError naming the fix."""
    moe, e = rc.moe, engine(train_backend)
    if moe.load_balancing not in e.load_balancing:
        theirs = [n for n in names("train") if moe.load_balancing in engine(n).load_balancing]
        owners = " and ".join(engine(n).label for n in theirs)
        raise MoeConfigError(f"{role}.moe.load_balancing={moe.load_balancing} is {owners}'s; "
                             f"the {e.name} backend computes {', '.join(e.load_balancing[1:])}: use that, or "
                             f"--backend {'|'.join(theirs)}-*")
    if rc.ep == 1:
        return
    if not e.expert_parallel:
        raise MoeConfigError(f"{role}.ep={rc.ep}: expert parallelism runs on {labels('train', 'expert_parallel')}; "
                             f"set --{role}.ep=1 or use --backend {'|'.join(names('train', 'expert_parallel'))}-*")
    if rc.ep < 1 or rc.dp % rc.ep:
        raise MoeConfigError(f"{role}.ep={rc.ep} must divide {role}.dp={rc.dp}: the experts split over "
                             f"data-parallel replicas; choose ep among the divisors of {rc.dp}")
    others = [k for k, on in (("packing", rc.packing), ("lora", rc.lora is not None),
                              ("elasticity", rc.elasticity is not None)) if on]
    if others:
        raise MoeConfigError(f"{role}.ep={rc.ep} with {role}.{others[0]}: an expert-parallel group runs padded "
                             f"micro-batches of full weights over a fixed dp; set {role}.ep=1 or turn "
                             f"{role}.{others[0]} off")
