"""Data-parallel balance of a train step: a long-tailed mini-batch over dp=2, its rows spread by cost
against equal row counts as they come.

Two processes in a gloo group, each a Megatron engine at tp=1 pp=1 (dp=2) holding a benchmark model
of xray/builtin/tiny_llama.py (random weights), one thread each. Each round draws a seeded
mini-batch of `--rows` rows whose lengths are uniform in [`--short`, 1.5 x `--short`] except one
row in eight, four times as long, shuffled; then takes the same train step (PPO's policy loss,
micro-batches of `--micro` rows, length-grouped and trimmed as the trainer's are, the mini-batch's
loss totals: `xray.data.lengths.with_totals`) in each layout, rotating which goes first:
- **rows**: the rows as they come, the first half to replica 0 (equal row counts: xray before
  issue 42);
- **balanced**: the rows ordered by `xray.run.step.balanced_rows` (Karmarkar-Karp on
  tokens and attention) before the same cut into replicas, each replica's rows then cut into
  micro-batches by a token budget (`--budget`, default the longest row a round can draw, 6 x
  `--short`: `actor.max_tokens_per_micro_batch`, `xray/data/budget.py`) rather than by rows, and
  each micro-batch's rows packed into one sequence without padding (`actor.packing`,
  `xray/data/packing.py`; the budget then counts a micro-batch's tokens; `--no-packing`: padded).
A third layout, **budget** (the rows as they come, cut by the same budget, packed likewise), is
timed alongside and printed (not in the last line) to show which share of the gain is the
budget's and packing's and which the balance's. A step's time is the slower replica's wall time (the gradient reduction makes them wait for it).

    .venv/bin/python benchmarks/balance.py [--rows 16] [--short 48] [--micro 2] [--budget N] [--no-packing] [--rounds 7]

Last line `balanced_over_rows=<median over rounds of balanced step s / rows step s>
padding_share_before=<padded / all token slots of the rows layout's micro-batches>
padding_share_after=<the same for the balanced layout>` (both summed over rounds and replicas; a
padded micro-batch holds rows x its longest row, a packed one its tokens alone).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: xray and tests

import torch  # noqa: E402

from tests.dist_harness import run_distributed  # noqa: E402
from xray.builtin.tiny_llama import TinySpec, build_tiny_model  # noqa: E402
from xray.data import columns as C  # noqa: E402
from xray.data.batch import Batch  # noqa: E402

SPEC = TinySpec(vocab_size=256, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, num_kv_heads=4,
                max_position_embeddings=1024)


def long_tailed(rows: int, short: int, seed: int) -> Batch:
    """A mini-batch of `rows` rows (module docstring), right-padded, with advantages and old log-probs."""
    rng = random.Random(seed)
    lengths = [rng.randint(short, short * 3 // 2) * (4 if i % 8 == 0 else 1) for i in range(rows)]
    rng.shuffle(lengths)
    width = max(lengths)
    g = torch.Generator().manual_seed(seed)
    attn = torch.zeros(rows, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        attn[i, :n] = 1
    mask = attn[:, 1:].float()
    mask[:, :7] = 0  # an 8-token prompt
    return Batch({C.INPUT_IDS: torch.randint(3, SPEC.vocab_size, (rows, width), generator=g) * attn,
                  C.ATTENTION_MASK: attn, C.LOSS_MASK: mask,
                  C.OLD_LOGPROBS: -torch.rand(rows, width - 1, generator=g) * 3 - 2,
                  C.ADVANTAGES: torch.randn(rows, width - 1, generator=g)})


def padding(batch: Batch, micro: int, replicas: int, budget: int | None, packed: bool) -> tuple[int, int]:
    """(padded slots, all slots) of the length-grouped, trimmed micro-batches of each replica's slice
    (by `micro` rows, or with a `budget` by tokens; `packed`: no padded slot)."""
    from algorithms.core.policy_loss import PolicyLoss
    from xray.data.lengths import train_micro_batches, with_totals

    padded = slots = 0
    for part in with_totals(batch).split(replicas):
        for mb in train_micro_batches(part, PolicyLoss(), micro, replicas=replicas, max_tokens=budget,
                                      packed=packed):
            attn = mb[C.ATTENTION_MASK]
            if packed:
                slots += int(attn.sum())
                continue
            slots += attn.numel()
            padded += int(attn.numel() - attn.sum())
    return padded, slots


def _steps(rank, world_size, model_dir, batches, micro, budget, packing):
    from megatron.core import parallel_state

    from algorithms.core.policy_loss import PolicyLoss
    from xray.backends.base import OptimConfig
    from xray.backends.megatron import build_engine
    from xray.config.parallel import ParallelDims
    from xray.data.lengths import with_totals

    engine = build_engine(model_dir, ParallelDims(1, 1, world_size), "actor", OptimConfig(lr=1e-6), seed=0)
    loss = PolicyLoss(cliprange=0.2)
    engine.train_step(with_totals(batches[0][0][1]).split(world_size)[rank], loss, micro)  # warm-up
    times = []
    for i, pair in enumerate(batches):
        got = {}
        for name, batch in pair[i % len(pair):] + pair[:i % len(pair)]:
            part = with_totals(batch).split(world_size)[rank]
            engine.max_tokens = None if name == "rows" else budget
            engine.packing = packing and name != "rows"
            torch.distributed.barrier()
            t = time.perf_counter()
            engine.train_step(part, loss, micro)
            got[name] = time.perf_counter() - t
        times.append(got)
    parallel_state.destroy_model_parallel()
    return times


def main() -> None:
    from xray.run.minibatches import balanced_rows

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--short", type=int, default=48)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--no-packing", action="store_true")
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    budget = a.budget or 6 * a.short
    packing = not a.no_packing
    model_dir = str(build_tiny_model(Path(tempfile.mkdtemp()) / "m", SPEC, seed=0))
    pairs, before, after = [], [0, 0], [0, 0]
    for seed in range(a.rounds):
        batch = long_tailed(a.rows, a.short, seed)
        balanced = batch.index(balanced_rows(batch, torch.arange(a.rows), 2, SPEC.hidden_size))
        pairs.append([("rows", batch), ("balanced", balanced), ("budget", batch)])
        for total, b, cut in ((before, batch, None), (after, balanced, budget)):
            padded, slots = padding(b, a.micro, 2, cut, packing and cut is not None)
            total[0] += padded
            total[1] += slots
    ranks = run_distributed(_steps, 2, model_dir, pairs, a.micro, budget, packing)
    steps = [{k: max(r[i][k] for r in ranks) for k in ("rows", "balanced", "budget")} for i in range(a.rounds)]
    for i, s in enumerate(steps):
        print(f"round {i}: rows {s['rows']:.3f} s  balanced {s['balanced']:.3f} s  budget only {s['budget']:.3f} s")
    print(f"budget_only_over_rows={statistics.median(s['budget'] / s['rows'] for s in steps):.3f} "
          f"(the rows as they come, cut by the token budget {budget}{', packed' if packing else ''})")
    ratio = statistics.median(s["balanced"] / s["rows"] for s in steps)
    print(f"median step: rows {statistics.median(s['rows'] for s in steps):.3f} s, "
          f"balanced {statistics.median(s['balanced'] for s in steps):.3f} s")
    print(f"balanced_over_rows={ratio:.3f} padding_share_before={before[0] / before[1]:.3f} "
          f"padding_share_after={after[0] / after[1]:.3f}")


if __name__ == "__main__":
    main()
