"""EchoWorkhorse: a Workhorse with no model, for checking a cluster and measuring the runtime.

Its methods exercise each part of the fan-out protocol and the process group: echo a batch slice
back, fail on chosen ranks, sleep, all-reduce across the group, report the node. The runtime tests
and `benchmarks/wholemodel_overhead.py` use it; users can use it to check a new cluster.
"""
from __future__ import annotations

import os
import time

import torch

from xray.data.batch import Batch
from xray.protocol import fanout
from xray.workhorse.base import Workhorse


class EchoWorkhorse(Workhorse):
    """Protocol and transport checks without a model."""

    REJOINS = True  # it holds nothing but its process group: a live shard rejoins a restart as itself

    @fanout(dispatch="slice", collect="flatten")
    def echo(self, batch: Batch) -> Batch:
        """This shard's slice, tagged with the shard's dp_rank and rank."""
        out = Batch(dict(batch.tensors), dict(batch.lists), dict(batch.meta))
        out["dp_rank"] = torch.full((len(batch),), self.shard_info().dp_rank)
        out["rank"] = torch.full((len(batch),), self.rank)
        return out

    @fanout(dispatch="slice", collect=lambda layout, results: results, reads=("x",))
    def received(self, batch: Batch) -> list[str]:
        """The columns that reached this shard (the method declares it reads only `x`)."""
        return batch.keys()

    @fanout(dispatch="all", collect=lambda layout, results: results)
    def noop(self) -> None:
        return None

    @fanout(dispatch="slice", collect=lambda layout, results: results)
    def consume(self, batch: Batch) -> int:
        """Receive a slice, return its size in bytes (the transport benchmark)."""
        return batch.nbytes()

    @fanout(dispatch="all", collect=lambda layout, results: results)
    def fail_on(self, ranks: list[int], message: str = "boom") -> int:
        if self.rank in ranks:
            raise ValueError(f"{message} on purpose")
        return self.rank

    @fanout(dispatch="all", collect=lambda layout, results: results, deadline_s=60.0)
    def sleep(self, seconds: float, ranks: list[int] | None = None) -> int:
        """Sleep on `ranks` (all by default), stopping early if the call is cancelled."""
        if ranks is None or self.rank in ranks:
            end = time.monotonic() + seconds
            while time.monotonic() < end and not self.cancelled():
                time.sleep(0.02)
        return self.rank

    @fanout(dispatch="all", collect="flatten")
    def payload(self, megabytes: int) -> Batch:
        """A Batch of `megabytes` MiB from every replica, joined (return-path tests and benchmark)."""
        return Batch({"x": torch.full((megabytes << 18,), float(self.rank))})

    @fanout(dispatch="all", collect=lambda layout, results: None)
    def wire_payload(self, megabytes: int) -> dict:
        """`megabytes` MiB of bfloat16 1.5s as a snapshot's files travel (`to_wire`): the caller keeps the references."""
        from xray.backends.snapshot import to_wire

        return to_wire({"x": torch.full((megabytes << 19,), 1.5, dtype=torch.bfloat16)})

    @fanout(dispatch="all", collect=lambda layout, results: results)
    def all_reduce(self, value: float) -> dict:
        """Sum `value + rank` over the group; report where this shard runs."""
        import torch.distributed as dist

        t = torch.tensor([value + self.rank], dtype=torch.float64)
        dist.all_reduce(t)
        return {"rank": self.rank, "sum": float(t.item()), "node": self.node_id(), "pid": os.getpid()}

    @fanout(dispatch="all", execute="first")
    def hello(self) -> str:
        return f"{self.role} rank {self.rank}"
