"""Which plots a run report holds, and which metrics each one draws (pure: no plotting here).

The run report (`xray.report`) walks `PANELS` in order; a panel whose metrics the run did not
record (a critic-free run has no value loss, an asynchronous one no `time/*`) is left out. Keys
are the metric names the trainers write to `metrics.jsonl` (`xray/run/step.py`,
`xray/run/detached/trainer.py`, the algorithms' `targets`), or glob patterns over them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal


@dataclass(frozen=True)
class Panel:
    """One plot of the report: one PNG file, `<name>.png`."""

    name: str
    """File stem of the PNG, and the anchor of its section on the page."""
    title: str
    ylabel: str
    keys: tuple[str, ...]
    """Metric names or glob patterns (`time/*`), drawn in this order."""
    kind: Literal["lines", "band", "stacked", "eval"] = "lines"
    """`lines`: a line per metric; `band`: the first metric's line with +-`spread` around it;
    `stacked`: a stacked bar per step (seconds per phase); `eval`: before, during and after training."""
    spread: str | None = None
    """With `band`: the metric giving the band's half-width (a standard deviation)."""
    about: str = ""
    """One sentence under the plot on the page."""

    def keys_in(self, available: set[str]) -> list[str]:
        """The metrics of this panel among `available`, in the panel's order."""
        found: list[str] = []
        for pattern in self.keys:
            found += [k for k in sorted(available) if fnmatchcase(k, pattern) and k not in found]
        return found


PHASES = ("time/generate_s", "time/rollout_sleep_s", "time/score_s", "time/train_s", "time/rollout_wake_s",
          "time/sync_s", "time/*")
"""A step's phases in the order they run (`PhaseTimer` in `xray/run/step.py`), then any other."""

PANELS: tuple[Panel, ...] = (
    Panel("reward", "Reward", "score", ("reward/mean",), kind="band", spread="reward/std",
          about="Mean score of the step's responses; the band is one standard deviation either side."),
    Panel("eval", "Evaluation", "score", ("eval",), kind="eval",
          about="Mean score of the responses to the held-out prompts (greedy unless the eval section "
                "samples): before training, every trainer.eval_every steps, and after training."),
    Panel("eval_detail", "Evaluation: pass@k and per source", "score", ("eval/pass@*", "eval/*/mean_reward"),
          about="Every trainer.eval_every steps: pass@k for each eval.pass_k (the unbiased estimate from "
                "eval.n_samples responses per prompt), and the mean score per data source (eval.source_field)."),
    Panel("kl", "KL", "nats per token", ("kl", "kl_k3", "actor/approx_kl"),
          about="kl, kl_k3: the actor's KL to the reference (k1 and k3 estimates); actor/approx_kl: "
                "to the policy that sampled (within a step's PPO epochs)."),
    Panel("policy_loss", "Policy loss (actor)", "loss", ("actor/policy_loss", "actor/kl_loss"),
          about="The clipped policy loss, and the KL loss term (before its kl_coef) where the algorithm "
                "puts the KL in the loss."),
    Panel("value_loss", "Value loss (critic)", "loss", ("critic/value_loss",),
          about="The clipped value loss, before its weight ppo.vf_coef."),
    Panel("clip_fractions", "Clip fractions", "fraction of tokens", ("*clipfrac*",),
          about="Share of tokens whose policy ratio (actor) or value (critic) was clipped."),
    Panel("entropy", "Entropy", "nats per token", ("*entropy",),
          about="Mean entropy of the actor's next-token distribution on the step's responses."),
    Panel("response_length", "Response length", "tokens", ("response_length",),
          about="Mean response length of the step's samples."),
    Panel("phase_seconds", "Seconds per phase", "seconds", PHASES, kind="stacked",
          about="Wall-clock seconds of each phase of a step (the time/* metrics), stacked."),
)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of metric `key` over the rows that hold a finite number for it."""
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(int(row["step"]))
            values.append(float(value))
    return steps, values


def available_keys(rows: list[dict]) -> set[str]:
    """Every metric some row holds a number for."""
    return {k for row in rows for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def panels_for(rows: list[dict], evals: dict[str, float]) -> list[tuple[Panel, list[str]]]:
    """The panels this run can draw, each with its metrics; the eval panel also from `evals`
    (`eval_before`, `eval_after`)."""
    available = available_keys(rows)
    chosen = []
    for panel in PANELS:
        keys = panel.keys_in(available)
        if keys or (panel.kind == "eval" and evals):
            chosen.append((panel, keys))
    return chosen
