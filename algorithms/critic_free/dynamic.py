"""DAPO's dynamic sampling for the critic-free step (`critic_free.dynamic_sampling`): groups whose
rewards are all equal carry no advantage (GRPO's is exactly 0), so the step drops them and samples
more prompts until it holds `ppo.rollout_batch_size` groups that vary, at most
`critic_free.max_sample_rounds` rounds; short of that it fills the batch with the first dropped
groups (zero advantage: the batch keeps its size, the mini-batches theirs), as veRL's
`filter_groups` with a cap that does not fail the run.

The run's step (`xray/run/step.py`) samples rounds (`Sampled`: generate, score, the forwards it
needs) while the algorithm wants them (`CriticFree.wants_more`), and `select` joins them (rows of
different widths padded: each round's columns are left-aligned) and keeps whole groups in the
order they were sampled. Its metrics count the step's rounds, the
varied groups among all sampled and the dropped ones used to fill.
"""
from __future__ import annotations

import torch

from algorithms.critic_free.advantages import varied_groups
from xray.data.batch import Batch
from xray.run.algorithm import Sampled


def varied_count(s: Sampled, n: int) -> int:
    """The round's groups whose rewards vary."""
    return int(varied_groups(s.scores, n, s.keep).sum())


def select(rounds: list[Sampled], n: int, groups: int) -> tuple[Sampled, dict[str, float]]:
    """The rounds joined, `groups` whole groups of `n` kept: those whose rewards vary first (in
    sampling order), then dropped ones to fill; and the step's `dynamic_sampling/*` metrics."""
    keeps = [r.keep if r.keep is not None else torch.ones(len(r.scores)) for r in rounds]
    scores, keep = torch.cat([r.scores.float() for r in rounds]), torch.cat([k.float() for k in keeps])
    varied = varied_groups(scores, n, keep)
    order = torch.cat([torch.nonzero(varied).flatten(), torch.nonzero(~varied).flatten()])[:groups]
    if len(order) < groups:
        raise ValueError(f"dynamic sampling drew {len(varied)} groups, fewer than the batch's {groups}")
    rows = (order[:, None] * n + torch.arange(n)[None, :]).flatten()
    exp = Batch.concat([r.exp for r in rounds], pad_width=True).index(rows)
    answers = {role: Batch.concat([r.answers[role] for r in rounds], pad_width=True).index(rows)
               for role in rounds[0].answers}
    kept = None if all(r.keep is None for r in rounds) else keep[rows]
    filled = int((~varied[order]).sum())
    metrics = {"dynamic_sampling/rounds": float(len(rounds)), "dynamic_sampling/varied_groups": float(varied.sum()),
               "dynamic_sampling/sampled_groups": float(len(varied)), "dynamic_sampling/filled_groups": float(filled)}
    return Sampled(exp, scores[rows], kept, answers), metrics
