"""Agentic rollouts: calculator episodes played all at once on one rollout engine against the same
episodes played one after another; and an asynchronous maker's episodes streamed into its buffer
against the same maker waiting for whole leases.

    .venv/bin/python benchmarks/agentic.py [--episodes 64] [--repeats 5] [--median-ms 100] [--sigma 0.5]
        [--sft-steps 600] [--seed 0] [--async-prompts 96] [--async-samples 4] [--async-in-flight 16]
        [--async-median-ms 300] [--async-sigma 1.0] [--segment-tokens 16]

One run builds the built-in tiny Llama (xray/builtin/tiny_llama.py, character tokenizer) and
warm-starts it by a short supervised fine-tuning in this process (plain torch, AdamW, batches of 32
tool-use demonstrations of `builtin:calculator`, xray/env/tasks.py: prompt, compact tool call,
the tool's answer, final answer; loss on the model's turns only), so that it writes tool calls.
The result is cached under `$XRAY_CACHE/benchmarks/` (default ~/.cache/xray), keyed by what shapes
it. It then starts one vLLM rollout WholeModel (fp32, one CPU Workhorse, built with `stop_strings`:
each turn stops at the tool call's closing tag, which the runner gives the engine) and plays
`--episodes` calculator episodes (xray/run/episodes/runner.py, `CalculatorEnv`, at most 3 turns,
temperature 1), the calculator answering each call after a latency drawn from a log-normal of
median `--median-ms` and log-sigma `--sigma`, seeded by the call's text (the same call waits as
long in both modes), awaited without using the CPU as a remote tool would.

Each round, after one warm-up round:
- concurrent: one `EpisodeRunner.run(all rows)`: the engine's turns of all episodes ready are
  batched into one generate call while other episodes wait on their tool;
- sequential: `run([row])` for each row in turn, on the same runner and engine.
Throughput = episodes (trajectories) / wall seconds of that mode's round. Figures are medians over
`--repeats` rounds. `concurrent_over_sequential` = concurrent trajectories/s (numerator) over
sequential trajectories/s (denominator). `tool_share` = the seconds of the concurrent round's wall
time during which at least one tool call was in flight (the union of the calls' intervals) over
that round's wall seconds (a median over rounds): how much of the concurrent run tools cover.

Then the asynchronous maker (xray/run/detached/episode_maker.py: a real `ExperienceMaker` and its
`EpisodeMaking` loop, in this process instead of a Ray actor, on the same engine, with an
in-process buffer that leases `--async-prompts` prompts in all, `--async-in-flight` at most at a
time, `--async-samples` episodes each, and counts the puts; the calculator's latency of median
`--async-median-ms` (a remote tool: code execution, search) and log-sigma `--async-sigma`, so that
a few episodes of each lease run long; turns in segments of
`--segment-tokens`), each round once in each of two modes, side by side (their order alternating):
- streamed: the product's loop: each prompt's group is put as soon as its episodes end, its slot
  leased again at once;
- lease-wide: the behaviour before (`LeaseWide`, benchmark-only): a lease's groups are put together
  once all its episodes have ended, and only then are its slots leased again.
Per mode and round: samples/s = episodes put / wall seconds from the loop's start to the last put;
maker busy share = the seconds the maker's engine was generating (the union of its generate calls'
intervals, `ExperienceMaker.busy`) over those wall seconds. `stream_over_lease_wide` = the median
of the rounds' ratios streamed samples/s (numerator) / lease-wide samples/s (denominator);
`busy_stream` and `busy_lease_wide` the medians of each mode's busy share.
The lines before the last two give per-round seconds, the model's behaviour (tool calls per
episode, mean reward, how episodes ended) and the generate calls.
Last lines: `concurrent_over_sequential=<x> tool_share=<y>` and
`stream_over_lease_wide=<x> busy_stream=<y> busy_lease_wide=<z>`.
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


class LocalBuffer:
    """The experience buffer as a maker sees it (`lease.remote`, `put.remote`), in this process:
    `prompts` rows in all, then no admission; `done` is set once every leased prompt is put."""

    def __init__(self, rows: list[dict]):
        from types import SimpleNamespace

        self.rows, self.serial, self.put_groups, self.done = list(rows), 0, 0, asyncio.Event()
        self.lease, self.put = SimpleNamespace(remote=self._lease), SimpleNamespace(remote=self._put)

    async def _lease(self, maker: int, most: int, version: int, wait: bool = True) -> list:
        if not self.rows:
            await asyncio.sleep(3600)  # nothing left to admit: the loop goes on with what it has
        leased, self.rows = self.rows[:most], self.rows[most:]
        self.serial += len(leased)
        return [(self.serial - len(leased) + k, row) for k, row in enumerate(leased)]

    async def _put(self, entries: list) -> None:
        self.put_groups += len(entries)
        if not self.rows and self.put_groups == self.serial:
            self.done.set()


def lease_wide():
    """`EpisodeMaking` as it was before groups streamed (benchmark-only): a lease's groups are put
    together once all its episodes have ended (its slots free only then)."""
    from xray.run.detached.episode_maker import EpisodeMaking

    class LeaseWide(EpisodeMaking):
        async def play(self, leased):
            n, epoch = self.maker.cfg.rollout.n_samples, self.maker.epoch
            trajectories = await self.runner.run([row for _, row in leased for _ in range(n)])
            await self.put(leased, trajectories, [epoch] * len(leased))
    return LeaseWide


def busy_seconds(intervals: list[tuple[float, float]], since: float, until: float) -> float:
    """Seconds of [since, until] inside the union of `intervals`."""
    total, reach = 0.0, since
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, until)
        if end > start:
            total, reach = total + end - start, end
    return total


async def maker_round(rollout, tokenizer, tools: ToolRegistry, rows: list[dict], args, streamed: bool) -> tuple:
    """(wall seconds, busy seconds, episodes put, generate calls) of one asynchronous maker playing
    `rows` (module docstring)."""
    from types import SimpleNamespace

    from xray.config.env import EnvConfig
    from xray.config.data import DataConfig
    from xray.run.detached.episode_maker import EpisodeMaking
    from xray.run.detached.maker import ExperienceMaker

    cfg = SimpleNamespace(
        async_=SimpleNamespace(segment_tokens=args.segment_tokens, max_in_flight=args.async_in_flight), seed=args.seed,
        rollout=SimpleNamespace(max_new_tokens=LIMITS.max_turn_tokens, n_samples=args.async_samples, temperature=1.0,
                                top_p=1.0, top_k=-1, stop=()),
        env=EnvConfig(name="builtin:calculator", max_turns=LIMITS.max_turns, max_turn_tokens=LIMITS.max_turn_tokens,
                      max_tokens=LIMITS.max_tokens),
        data=DataConfig())  # the chat format: the character tokenizer has no template (plain text)
    buffer = LocalBuffer(rows)
    maker = ExperienceMaker(0, rollout, None, None, buffer, cfg, [tokenizer.eos_token_id], tokenizer.pad_token_id or 0,
                            share=args.async_in_flight, version=0, tokenizer=tokenizer)
    maker.episodes = (EpisodeMaking if streamed else lease_wide())(maker, tokenizer)
    maker.episodes.runner.make_env = lambda: CalculatorEnv(tools=tools)
    started = time.time()
    loop = asyncio.ensure_future(maker.episodes.loop())
    waiter = asyncio.ensure_future(buffer.done.wait())
    await asyncio.wait([loop, waiter], return_when=asyncio.FIRST_COMPLETED)
    wall = time.time() - started
    loop.cancel()
    waiter.cancel()
    if loop.done() and not loop.cancelled() and loop.exception() is not None:
        raise loop.exception()
    busy = busy_seconds(maker.busy, started, started + wall)
    return wall, busy, maker.samples, maker.episodes.runner.stats["generate_calls"], maker.episodes.counts


def async_rounds(rollout, tokenizer, rows: list[dict], args) -> dict[str, float]:
    """The streamed and lease-wide maker, side by side each round; medians (module docstring)."""
    tool = SlowCalculator(args.async_median_ms / 1000, args.async_sigma, args.seed)
    tools = ToolRegistry({"calculator": tool})
    asyncio.run(maker_round(rollout, tokenizer, tools, rows[:8], args, streamed=True))  # warm-up
    asyncio.run(maker_round(rollout, tokenizer, tools, rows[:8], args, streamed=False))
    figures = collections.defaultdict(list)
    for r in range(args.repeats):
        got = {}
        for streamed in ((True, False) if r % 2 == 0 else (False, True)):
            got[streamed] = asyncio.run(maker_round(rollout, tokenizer, tools, rows, args, streamed))
        for streamed, name in ((True, "stream"), (False, "lease_wide")):
            wall, busy, samples, calls, counts = got[streamed]
            figures[f"samples_per_s_{name}"].append(samples / wall)
            figures[f"busy_{name}"].append(busy / wall)
            print(f"async round {r}: {name} {wall:.2f} s, {samples} episodes put, busy {busy:.2f} s, {calls} generate "
                  f"calls, ends { {k[5:]: v for k, v in counts.items() if k.startswith('ends_')} }", flush=True)
        figures["ratio"].append(figures["samples_per_s_stream"][-1] / figures["samples_per_s_lease_wide"][-1])
    return {k: statistics.median(v) for k, v in figures.items()}


def sync_rounds(rollout, tokenizer, rows: list[dict], args) -> dict[str, float]:
    """Concurrent and sequential `EpisodeRunner` rounds; medians (module docstring)."""
    from xray.run.episodes.runner import EpisodeRunner

    tool = SlowCalculator(args.median_ms / 1000, args.sigma, args.seed)
    tools = ToolRegistry({"calculator": tool})
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
    return {k: statistics.median(v) for k, v in figures.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=64, help="episodes (trajectories) per round")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds of each mode")
    p.add_argument("--median-ms", type=float, default=100.0, help="median tool latency")
    p.add_argument("--sigma", type=float, default=0.5, help="log-sigma of the tool latency")
    p.add_argument("--sft-steps", type=int, default=600, help="warm-start batches of 32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async-prompts", type=int, default=96, help="prompts an asynchronous round plays")
    p.add_argument("--async-samples", type=int, default=4, help="episodes per prompt (a group)")
    p.add_argument("--async-in-flight", type=int, default=16, help="prompts in flight at most (async.max_in_flight)")
    p.add_argument("--async-median-ms", type=float, default=300.0, help="median tool latency, asynchronous rounds")
    p.add_argument("--async-sigma", type=float, default=1.0, help="log-sigma of the tool latency, asynchronous rounds")
    p.add_argument("--segment-tokens", type=int, default=16, help="async.segment_tokens")
    args = p.parse_args()
    torch.set_num_threads(1)
    model_dir = warm_start(args.sft_steps, args.seed)

    from transformers import AutoTokenizer

    from xray.wholemodel import WholeModel
    from xray.wholemodel.cluster import ensure_ray

    ensure_ray()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [dict(r, prompt_ids=tokenizer(r["prompt"]).input_ids) for r in TASK.rows(args.episodes, seed=args.seed)]
    async_rows = [dict(r, prompt_ids=tokenizer(r["prompt"]).input_ids)
                  for r in TASK.rows(args.async_prompts, seed=args.seed + 2)]
    rollout = WholeModel.from_pretrained(str(model_dir), backend="vllm", seed=args.seed, stop_strings=True)
    try:
        med = sync_rounds(rollout, tokenizer, rows, args)
        amed = async_rounds(rollout, tokenizer, async_rows, args)
    finally:
        rollout.shutdown()
    print(f"trajectories/s: concurrent {med['concurrent']:.2f}, sequential {med['sequential']:.2f} "
          f"(medians of {args.repeats}; {args.episodes} episodes, tool latency median {args.median_ms:g} ms, "
          f"sigma {args.sigma:g})")
    print(f"asynchronous maker samples/s: streamed {amed['samples_per_s_stream']:.2f}, lease-wide "
          f"{amed['samples_per_s_lease_wide']:.2f} (medians of {args.repeats}; {args.async_prompts} prompts x "
          f"{args.async_samples} episodes, {args.async_in_flight} prompts in flight, tool latency median "
          f"{args.async_median_ms:g} ms, sigma {args.async_sigma:g}, segments of {args.segment_tokens} tokens)")
    print(f"concurrent_over_sequential={med['concurrent'] / med['sequential']:.2f} tool_share={med['tool_share']:.3f}")
    print(f"stream_over_lease_wide={amed['ratio']:.2f} busy_stream={amed['busy_stream']:.3f} "
          f"busy_lease_wide={amed['busy_lease_wide']:.3f}")


if __name__ == "__main__":
    main()
