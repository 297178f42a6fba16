"""The `eval` section of a run config: how the held-out prompts are evaluated (sampling, pass@k,
per-source breakdown) and whether each evaluation's completions are written to the run directory
(`xray/run/evaluate.py` reads it). Held by `RunConfig` in `xray.config.schema`; when to evaluate
stays `trainer.eval_every`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from xray.config.env import response_tokens
from xray.config.typed import ConfigError


@dataclass(frozen=True)
class EvalConfig:
    """Sampling and metrics of the evaluations on the held-out prompts (`data.eval_size` of them),
    before training, every `trainer.eval_every` steps and after training."""

    n_samples: int = 1
    """Responses sampled per held-out prompt (k): `eval/mean_reward` is their mean (mean@k), and
    `eval/pass@k` is computed from them. More than 1 needs `temperature` above 0."""
    temperature: float = 0.0
    """Sampling temperature of the evaluations; 0: greedy (one deterministic response per prompt)."""
    top_p: float = 1.0
    """Nucleus sampling of the evaluations (1: off)."""
    max_new_tokens: Optional[int] = None
    """Most tokens an evaluation response may have (null: `rollout.max_new_tokens`, which bounds it:
    the rollout engine's context is sized for that). Ignored with an environment (`env.*`), whose
    episodes keep their own limits."""
    pass_k: tuple[int, ...] = (1,)
    """The k of each `eval/pass@k` reported, each between 1 and `n_samples`: the unbiased estimate
    1 - C(n-c, k) / C(n, k) per prompt (n = `n_samples` responses, c of them correct), averaged over
    the prompts."""
    correct_threshold: float = 1.0
    """A response counts as correct for pass@k when its reward is at least this (1.0: the built-in
    tasks' exact answer; a sample the reward dropped as non-finite is never correct)."""
    source_field: str = "data_source"
    """The dataset column naming each prompt's source (veRL's `data_source`): when the held-out
    prompts have it, every metric is also reported per source as `eval/<source>/mean_reward` and
    `eval/<source>/pass@k` (a prompt without it counts as `unknown`)."""
    samples_file: bool = True
    """Write each evaluation's responses to `evals/step-<N>.jsonl` in the run directory (N: the
    steps trained before it, 6 digits; the evaluation before training is step 0), one row per
    response: step, prompt_index, sample, source, prompt, completion, reward (null where the reward
    dropped it), correct."""

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ConfigError(f"eval.n_samples={self.n_samples}; give 1 or more responses per prompt")
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature={self.temperature} is negative; give 0 (greedy) or more")
        if self.n_samples > 1 and self.temperature == 0:
            raise ConfigError(f"eval.n_samples={self.n_samples} with eval.temperature=0 samples the same greedy "
                              "response each time; set eval.temperature above 0 (0.6 to 1.0 is usual) or "
                              "eval.n_samples=1")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"eval.top_p={self.top_p} must be in (0, 1]; use 1.0 to turn it off")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"eval.max_new_tokens={self.max_new_tokens}; give 1 or more, or null for "
                              "rollout.max_new_tokens")
        bad = [k for k in self.pass_k if not 1 <= k <= self.n_samples]
        if bad:
            raise ConfigError(f"eval.pass_k={list(self.pass_k)}: {bad} outside 1..eval.n_samples={self.n_samples}; "
                              f"raise eval.n_samples to {max(bad)} or drop those k")


def eval_max_new_tokens(cfg: Any) -> int:
    """The evaluations' `max_new_tokens` for a run (`cfg`: its `RunConfig`): `eval.max_new_tokens`,
    or the rollout's; ConfigError when it exceeds what the rollout engine is sized for."""
    limit = response_tokens(cfg)
    chosen = cfg.eval.max_new_tokens
    if chosen is None:
        return limit
    if chosen > limit:
        room = "env.max_tokens" if cfg.env.episodes else "rollout.max_new_tokens"
        raise ConfigError(f"eval.max_new_tokens={chosen} exceeds {room}={limit}, which sizes the rollout "
                          f"engine's context; lower eval.max_new_tokens or raise {room}")
    return chosen
