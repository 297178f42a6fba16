"""Evaluating the policy on the held-out prompts, the same in both modes: the rollout engine samples
`eval.n_samples` responses to each prompt under the `eval` section's settings, the run's reward
scores them, `xray/run/eval_metrics.py` turns the scores into `eval`, `eval/mean_reward`,
`eval/pass@k` and the per-source metrics, and each evaluation's responses are written to
`evals/step-<N>.jsonl` in the run directory (`eval.samples_file`).

The loop (`xray/run/loop.py`) evaluates through `Evaluations` before training, every
`trainer.eval_every` steps (also in an asynchronous run: the driver's trainer holds the whole
rollout model) and after training; `RLTrainer.evaluate` (`xray/run/step.py`) is the bare number
for scripts and benchmarks. The trainer is used through its `rollout`, `score`, `wake_rollout`,
`cfg` and `stop_ids` only.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xray.config.eval import eval_max_new_tokens
from xray.data import columns as C
from xray.data.batch import Batch
from xray.data.records import RecordWriter
from xray.run.eval_metrics import PromptResult, eval_metrics
from xray.run.outputs import RunDir
from xray.run.phases import rollout_sampling


def eval_sampling(cfg, stop_ids: list[int]) -> dict[str, Any]:
    """The rollout engine's sampling settings for an evaluation (`cfg`: the run's `RunConfig`): the
    rollout's call of step 0 (its stops, and the step-0 seed, which no training step uses: every
    evaluation of a run has the same seed, so evaluations differ only by the weights) with the
    `eval` section's temperature, top-p, length and responses per prompt, and top-k off."""
    e = cfg.eval
    return {**rollout_sampling(cfg, stop_ids, 0), "temperature": e.temperature, "top_p": e.top_p, "top_k": 0,
            "max_new_tokens": eval_max_new_tokens(cfg), "n": e.n_samples}


@dataclass
class EvalSamples:
    """One evaluation's responses as scored: `n` consecutive responses per prompt row."""

    rows: list[dict]
    """The held-out prompt rows (`PromptSet.rows()`: `prompt`, `prompt_ids`, the other columns)."""
    response_ids: list[list[int]]
    """len(rows) x n responses, each prompt's side by side."""
    rewards: list[float | None]
    """One per response; None where the reward dropped it (non-finite, `reward.on_nonfinite: skip`)."""
    n: int

    def source(self, row: dict, field: str) -> str | None:
        value = row.get(field)
        return None if value is None else str(value)

    def results(self, source_field: str) -> list[PromptResult]:
        """Each prompt's rewards and source, for `eval_metrics`."""
        return [PromptResult(tuple(self.rewards[i * self.n:(i + 1) * self.n]), self.source(row, source_field))
                for i, row in enumerate(self.rows)]

    def records(self, step: int, decode, threshold: float, source_field: str) -> list[dict]:
        """The rows of the samples file: one per response, its text from `decode(token_ids)`."""
        out = []
        for i, ids in enumerate(self.response_ids):
            row, reward = self.rows[i // self.n], self.rewards[i]
            out.append({"step": step, "prompt_index": i // self.n, "sample": i % self.n,
                        "source": self.source(row, source_field), "prompt": row["prompt"], "completion": decode(ids),
                        "reward": reward, "correct": reward is not None and reward >= threshold})
        return out


async def sample_eval(trainer, rows: list[dict]) -> EvalSamples:
    """Sample and score `eval.n_samples` responses to each of `rows` with `trainer`'s rollout and
    reward (a pending generation is scored by reference, as in a step)."""
    cfg = trainer.cfg
    n = cfg.eval.n_samples
    await trainer.wake_rollout()
    pending = await trainer.rollout(rows, eval_sampling(cfg, trainer.stop_ids))
    generated = pending if isinstance(pending, Batch) else await pending
    scores, keep = await trainer.score([rows[i // n] for i in range(len(generated))], generated, pending)
    kept = [True] * len(scores) if keep is None else [bool(k) for k in keep]
    rewards = [float(s) if k else None for s, k in zip(scores.tolist(), kept)]
    return EvalSamples(rows, [list(r) for r in generated[C.RESPONSE_IDS]], rewards, n)


async def evaluation(trainer, rows: list[dict]) -> tuple[EvalSamples, dict[str, float]]:
    """One evaluation of `trainer`'s policy on `rows`: its responses, and its metrics (`eval_metrics`)."""
    e = trainer.cfg.eval
    samples = await sample_eval(trainer, rows)
    return samples, eval_metrics(samples.results(e.source_field), e.pass_k, e.correct_threshold)


class Evaluations:
    """The evaluations of one run on the driver: `await evaluations(step)` evaluates the held-out
    prompts, writes their responses to `evals/step-<step>.jsonl` (`eval.samples_file`) and
    returns the metrics; `last` keeps the latest metrics (`eval.json` holds the final ones)."""

    def __init__(self, trainer, rows: list[dict], run: RunDir, tokenizer):
        self.trainer, self.rows, self.run, self.tokenizer = trainer, rows, run, tokenizer
        self.last: dict[str, float] = {}

    async def __call__(self, step: int) -> dict[str, float]:
        e = self.trainer.cfg.eval
        samples, metrics = await evaluation(self.trainer, self.rows)
        if e.samples_file:
            self.write(step, samples)
        self.last = metrics
        return metrics

    def write(self, step: int, samples: EvalSamples) -> Path:
        """`evals/step-<step>.jsonl`, whole once it has its name (`RecordWriter`)."""
        e = self.trainer.cfg.eval
        writer = RecordWriter(self.run.eval_samples_path(step))
        writer.write(samples.records(step, self.decode, e.correct_threshold, e.source_field))
        return writer.close()

    def decode(self, ids: list[int]) -> str:
        """A response's text as the reward function sees it (special tokens left out)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
