"""What a call through a WholeModel costs over the same calls made directly on its Workhorses.

Measured side by side in one run, each pair in its own loop, interleaved round by round so machine
noise hits both alike, with the side that goes first alternating between rounds (a call that
follows one that returned a large answer pays for freeing that answer's buffers):
  - a no-op method on 2 shards: WholeModel call vs. direct calls on both Workhorses;
  - a `slice` call carrying a 4 MB batch over 2 shards: WholeModel vs. splitting the batch and
    calling both Workhorses directly;
  - the return path: a method that returns a 4 MB batch from 2 shards (2 MB each), collected by the
    WholeModel vs. fetched from both Workhorses directly and joined.
Last line: `overhead_ms=<added ms per no-op call> ratio_4mb=<wholemodel time / direct time>
ratio_4mb_return=<wholemodel time / direct time, returning>`; times are medians.

    .venv/bin/python benchmarks/wholemodel_overhead.py [--rounds 200]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

import ray
import torch

from xray.config.parallel import ParallelDims
from xray.data.batch import Batch
from xray.protocol import slice_parts
from xray.wholemodel import WholeModel
from xray.workhorse.echo import EchoWorkhorse


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    wm = WholeModel(EchoWorkhorse, role="bench", parallel=ParallelDims(dp=2))
    shards = wm.shard_handles()
    batch = Batch({"x": torch.randn(1024, 1024)})  # 4 MiB of float32
    assert batch.nbytes() == 4 << 20

    def wm_noop():
        wm.noop().get()

    def direct_noop():
        ray.get([s.call.remote("noop", ((), {})) for s in shards])

    def wm_4mb():
        assert sum(wm.consume(batch).get()) == batch.nbytes()

    def direct_4mb():
        parts = [ray.put(p) for p in slice_parts(2, (batch,), {})]
        assert sum(ray.get([s.call.remote("consume", p) for s, p in zip(shards, parts)])) == batch.nbytes()

    def wm_return():
        assert wm.payload(2).get().nbytes() == 4 << 20

    def direct_return():
        parts = ray.get([s.call.remote("payload", ((2,), {})) for s in shards])
        assert Batch.concat(parts).nbytes() == 4 << 20

    cases = (wm_noop, direct_noop, wm_4mb, direct_4mb, wm_return, direct_return)
    for fn in cases:  # warm-up
        for _ in range(10):
            fn()
    t = {fn.__name__: [] for fn in cases}
    pairs = [((wm_noop, direct_noop), args.rounds), ((wm_4mb, direct_4mb), max(20, args.rounds // 4)),
             ((wm_return, direct_return), max(20, args.rounds // 4))]
    for pair, rounds in pairs:
        for i in range(rounds):
            for fn in (pair if i % 2 == 0 else pair[::-1]):
                t[fn.__name__].append(timed(fn))
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    for k, v in med.items():
        print(f"{k:<12} median {v:7.3f} ms over {len(t[k])} calls")
    wm.shutdown()
    ray.shutdown()
    print(f"overhead_ms={med['wm_noop'] - med['direct_noop']:.3f} ratio_4mb={med['wm_4mb'] / med['direct_4mb']:.3f} "
          f"ratio_4mb_return={med['wm_return'] / med['direct_return']:.3f}")


if __name__ == "__main__":
    main()
