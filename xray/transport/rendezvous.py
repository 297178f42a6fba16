"""Rendezvous points of the process groups Workhorses form: a model's world (`Workhorse.address`
and `init_dist`), a rollout replica's own world (`RolloutWorkhorse.replica_world`,
`alone_world`), all three joined through `join_world`, and a weight-sync group
(`xray/transport/pg.py`).

A point is a `TCPStore` served by one member of the group: the member that opens it
(`open_point`) binds its store to a port the kernel picks, then tells the others the port, and
every member joins through `store_at` (the opener its own store, the others a client of it). The
port is bound before anyone hears of it: a port found free, closed, and bound again by
`torch.distributed` later could be taken in between by any connection of the node (a gloo pair's
outgoing port comes from the same range), which a recovery's rejoin met as EADDRINUSE. Every
member of a group builds it on the store itself (`init_process_group(store=)`), without a prefix
of its own: all must join the same way.
"""
from __future__ import annotations

import datetime
import os
from collections import OrderedDict

from torch.distributed import Store, TCPStore

OPEN_POINTS = 4
"""Points a process keeps open, not yet joined; an older one's group was abandoned (a failed
start asks for a new point) and its store is closed."""

_open: OrderedDict[tuple[str, int], TCPStore] = OrderedDict()
"""(ip, port) -> the store this process serves there, until a member of its group joins it here."""


def open_point(ip: str) -> tuple[str, int]:
    """A new rendezvous point served by this process on `ip`: its store bound now; (ip, port)."""
    store = TCPStore(ip, 0, None, True, timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
    _open[(ip, store.port)] = store
    while len(_open) > OPEN_POINTS:
        _open.popitem(last=False)
    return ip, store.port


def store_at(addr: str, port: int, world: int, timeout_s: float) -> Store:
    """The store of point addr:port for a member of a group of `world`: the one this process
    serves when it opened the point (handed over once: the group keeps it alive), else a
    client of it, which waits up to `timeout_s` for the point to answer."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _open.pop((addr, port), None)
    if store is not None:
        store.set_timeout(timeout)
        return store
    return TCPStore(addr, port, world, False, timeout=timeout)


def join_world(backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float,
               local_rank: int = 0) -> None:
    """Make this process's default group: rank `rank` of `world` at point addr:port (`store_at`),
    with the MASTER_*/RANK/WORLD_SIZE/LOCAL_RANK variables set as a launcher would for the libraries
    that read them (Megatron, vLLM's `external_launcher`, DeepSpeed's device choice). `local_rank`:
    0 for a Workhorse, which sees its one device only; the rank's device index where a process
    sees them all (the test harness's ranks)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(local_rank))
    dist.init_process_group(backend, store=store_at(addr, port, world, timeout_s), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def serving() -> list[tuple[str, int]]:
    """The points this process serves and no member joined yet (tests)."""
    return list(_open)
