"""Agentic rollouts: calculator episodes played all at once on one rollout engine against the same
episodes played one after another.

    .venv/bin/python benchmarks/agentic.py [--episodes 64] [--repeats 5] [--median-ms 100] [--sigma 0.5]
        [--sft-steps 600] [--seed 0]

One run builds the built-in tiny Llama (xray/builtin/tiny_llama.py, character tokenizer) and
warm-starts it by a short supervised fine-tuning in this process (plain torch, AdamW, batches of 32
tool-use demonstrations of `builtin:calculator`, xray/env/tasks.py: prompt, compact tool call,
the tool's answer, final answer; loss on the model's turns only), so that it writes tool calls.
The result is cached under `$XRAY_CACHE/benchmarks/` (default ~/.cache/xray), keyed by what shapes
it. It then starts one vLLM rollout WholeModel (fp32, one CPU Workhorse) and plays `--episodes`
calculator episodes (xray/run/episodes/runner.py, `CalculatorEnv`, at most 3 turns, temperature 1), the
calculator answering each call after a latency drawn from a log-normal of median `--median-ms`
and log-sigma `--sigma`, seeded by the call's text (the same call waits as long in both modes),
awaited without using the CPU as a remote tool would.

Each round, after one warm-up round:
- concurrent: one `EpisodeRunner.run(all rows)`: the engine's turns of all episodes ready are
  batched into one generate call while other episodes wait on their tool;
- sequential: `run([row])` for each row in turn, on the same runner and engine.
Throughput = episodes (trajectories) / wall seconds of that mode's round. Figures are medians over
`--repeats` rounds. `concurrent_over_sequential` = concurrent trajectories/s (numerator) over
sequential trajectories/s (denominator). `tool_share` = the seconds of the concurrent round's wall
time during which at least one tool call was in flight (the union of the calls' intervals) over
that round's wall seconds (a median over rounds): how much of the concurrent run tools cover.
The lines before the last give per-round seconds, the model's behaviour (tool calls per episode,
mean reward, how episodes ended) and the runner's generate calls.
Last line: `concurrent_over_sequential=<x> tool_share=<y>`.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import math
import random
import shutil
import statistics
import time
from pathlib import Path

import torch

from algorithms.warm_start import cache_root
from xray.builtin.tiny_llama import build_base_model
from xray.data.trajectory import TrajectoryLimits
from xray.env.tasks import CalculatorEnv, CalculatorTask, demonstration_ids
from xray.env.tools import ToolRegistry, calculate

TASK = CalculatorTask()
LIMITS = TrajectoryLimits(max_turns=3, max_turn_tokens=48, max_tokens=110)
"""Room for the demonstrated episode (~99 tokens with the prompt) inside the model's 128 positions."""


def sft_batches(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids [N, T] (right-padded) and labels [N, T] (-100 off the model's turns)."""
    data = [demonstration_ids(r, tokenizer) for r in rows]
    width = max(len(ids) for ids, _ in data)
    ids = torch.full((len(data), width), tokenizer.pad_token_id or 0, dtype=torch.long)
    labels = torch.full((len(data), width), -100, dtype=torch.long)
    for k, (seq, mask) in enumerate(data):
        ids[k, :len(seq)] = torch.tensor(seq)
        labels[k, :len(seq)] = torch.tensor([t if m else -100 for t, m in zip(seq, mask)])
    return ids, labels


def warm_start(steps: int, seed: int, lr: float = 1e-3, batch: int = 32) -> Path:
    """The built-in tiny Llama fine-tuned on `steps` batches of calculator demonstrations (cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = hashlib.sha256(json.dumps([steps, seed, lr, batch, repr(TASK), 1]).encode()).hexdigest()[:12]
    target = cache_root() / "benchmarks" / f"agentic-calculator-{key}"
    if (target / "model.safetensors").is_file():
        print(f"warm start: cached {target}", flush=True)
        return target
    tmp = target.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_base_model(tmp, seed)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    ids, labels = sft_batches(tokenizer, TASK.rows(4096, seed=seed + 1))  # disjoint seed from the episodes'
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    for step in range(steps):
        pick = torch.randint(0, len(ids), (batch,), generator=g)
        loss = model(input_ids=ids[pick], labels=labels[pick]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"warm start: step {step} loss {loss.item():.4f} ({time.perf_counter() - started:.0f} s)", flush=True)
    model.save_pretrained(tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)
    return target


class SlowCalculator:
    """The calculator behind a seeded log-normal latency; keeps each call's (start, end) times."""

    def __init__(self, median_s: float, sigma: float, seed: int):
        self.median_s, self.sigma, self.seed = median_s, sigma, seed
        self.intervals: list[tuple[float, float]] = []

    def latency(self, expression: str) -> float:
        return random.Random(f"{self.seed}\x00{expression}").lognormvariate(math.log(self.median_s), self.sigma)

    async def __call__(self, expression: str) -> str:
        started = time.perf_counter()
        await asyncio.sleep(self.latency(expression))
        self.intervals.append((started, time.perf_counter()))
        return calculate(expression)

    def covered(self, since: float) -> float:
        """Seconds after `since` with at least one call in flight (the union of the intervals)."""
        total, reach = 0.0, since
        for start, end in sorted(self.intervals):
            start = max(start, reach)
            if end > start:
                total, reach = total + end - start, end
        return total


async def play_round(runner, rows: list[dict], tool: SlowCalculator, concurrent: bool) -> tuple[float, float, list]:
    """(wall seconds, seconds with a tool call in flight, trajectories) of one round."""
    tool.intervals.clear()
    started = time.perf_counter()
    if concurrent:
        trajectories = await runner.run(rows)
    else:
        trajectories = [t for row in rows for t in await runner.run([row])]
    wall = time.perf_counter() - started
    return wall, tool.covered(started), trajectories


def describe(trajectories: list) -> str:
    calls = [t.info.get("tool_calls", 0) for t in trajectories]
    rewards = [sum(t.rewards) for t in trajectories]
    ends = collections.Counter(t.end for t in trajectories)
    return (f"tool calls per episode {statistics.mean(calls):.2f}, episodes with a call "
            f"{sum(c > 0 for c in calls)}/{len(calls)}, mean reward {statistics.mean(rewards):.3f}, "
            f"ends {dict(ends)}, turns {statistics.mean(len(t.turns) for t in trajectories):.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=64, help="episodes (trajectories) per round")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds of each mode")
    p.add_argument("--median-ms", type=float, default=100.0, help="median tool latency")
    p.add_argument("--sigma", type=float, default=0.5, help="log-sigma of the tool latency")
    p.add_argument("--sft-steps", type=int, default=600, help="warm-start batches of 32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    model_dir = warm_start(args.sft_steps, args.seed)

    from transformers import AutoTokenizer

    from xray.run.episodes.runner import EpisodeRunner
    from xray.wholemodel import WholeModel
    from xray.wholemodel.cluster import ensure_ray

    ensure_ray()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tool = SlowCalculator(args.median_ms / 1000, args.sigma, args.seed)
    tools = ToolRegistry({"calculator": tool})
    rows = [dict(r, prompt_ids=tokenizer(r["prompt"]).input_ids) for r in TASK.rows(args.episodes, seed=args.seed)]
    rollout = WholeModel.from_pretrained(str(model_dir), backend="vllm", seed=args.seed)
    try:
        runner = EpisodeRunner(rollout, tokenizer, lambda: CalculatorEnv(tools=tools), LIMITS,
                               dict(temperature=1.0, seed=args.seed))
        asyncio.run(play_round(runner, rows, tool, concurrent=True))  # warm-up
        asyncio.run(play_round(runner, rows[:4], tool, concurrent=False))
        figures = collections.defaultdict(list)
        for r in range(args.repeats):
            calls = runner.stats["generate_calls"]
            wall_c, tools_c, played = asyncio.run(play_round(runner, rows, tool, concurrent=True))
            calls_c, calls = runner.stats["generate_calls"] - calls, runner.stats["generate_calls"]
            wall_s, tools_s, _ = asyncio.run(play_round(runner, rows, tool, concurrent=False))
            calls_s = runner.stats["generate_calls"] - calls
            figures["concurrent"].append(len(rows) / wall_c)
            figures["sequential"].append(len(rows) / wall_s)
            figures["tool_share"].append(tools_c / wall_c)
            print(f"round {r}: concurrent {wall_c:.2f} s ({calls_c} generate calls, tools in flight "
                  f"{tools_c:.2f} s), sequential {wall_s:.2f} s ({calls_s} generate calls, tools in flight "
                  f"{tools_s:.2f} s)", flush=True)
            print(f"round {r}: concurrent episodes: {describe(played)}", flush=True)
    finally:
        rollout.shutdown()
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"trajectories/s: concurrent {med['concurrent']:.2f}, sequential {med['sequential']:.2f} "
          f"(medians of {args.repeats}; {args.episodes} episodes, tool latency median {args.median_ms:g} ms, "
          f"sigma {args.sigma:g})")
    print(f"concurrent_over_sequential={med['concurrent'] / med['sequential']:.2f} tool_share={med['tool_share']:.3f}")


if __name__ == "__main__":
    main()
