"""Rendezvous points (`xray/transport/rendezvous.py`): a point's port is bound from the moment it is
opened (no other socket can take it before the group joins: the EADDRINUSE a rejoin met when the
port was found free, closed, then bound again), its opener joins on its own store and every other
member as a client, a real gloo group forms on it, and points no member joined are closed once
newer ones replace them."""
from __future__ import annotations

import datetime
import errno
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from xray.transport import rendezvous
from xray.transport.rendezvous import OPEN_POINTS, open_point, serving, store_at

pytestmark = pytest.mark.unit


def bind_error(ip: str, port: int) -> int | None:
    """The errno a new socket meets binding ip:port (None: it bound)."""
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError as exc:
            return exc.errno
    return None


def test_a_point_is_bound_before_it_is_told_and_a_gloo_group_forms_on_it():
    ip, port = open_point("127.0.0.1")
    assert bind_error(ip, port) == errno.EADDRINUSE  # nobody can take it between the telling and the join
    assert (ip, port) in serving()
    sums, errors = [], []

    def member(rank: int) -> None:
        try:
            store = store_at(ip, port, 2, 30.0)
            group = dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, 2, datetime.timedelta(seconds=30))
            t = torch.full((3,), float(rank + 1))
            group.allreduce([t]).wait()
            sums.append(t.tolist())
        except BaseException as exc:  # noqa: BLE001 - to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sums == [[3.0, 3.0, 3.0]] * 2
    assert (ip, port) not in serving()  # handed over once: the next member is a client


def test_points_nobody_joined_are_closed_when_newer_ones_replace_them():
    rendezvous._open.clear()
    points = [open_point("127.0.0.1") for _ in range(OPEN_POINTS + 1)]
    assert serving() == points[1:]
    ip, port = points[0]
    assert bind_error(ip, port) is None  # the oldest one's store was closed: its port is free again
    assert all(bind_error(*p) == errno.EADDRINUSE for p in points[1:])
    rendezvous._open.clear()
