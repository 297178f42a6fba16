"""`xray.workhorse.heap`: the pages a train step's freed activations leave in the heap go back to the node."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_the_heap_freed_by_a_step_goes_back_to_the_node():
    """glibc keeps the pages of tensors freed after its mmap threshold rose (what a train step's
    activations do); `give_back` returns them. In a fresh process: the allocator's state is its own."""
    script = """
import torch
from xray.workhorse import heap
big = torch.ones(16 << 18)  # 16 MiB, freed: glibc's mmap threshold rises to it
del big
held = [torch.ones(8 << 18) for _ in range(64)]  # 64 x 8 MiB, now in the heap
last = held.pop()
del held
before = heap.resident_anon_bytes()
assert heap.give_back()
print((before - heap.resident_anon_bytes()) / 2**20)
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) > 400  # 504 MiB freed and held; measured: all of it given back


def test_a_full_collection_after_the_freeze_scans_the_shard_alone_and_still_frees_its_cycles():
    """`freeze_imports` before a shard is built: a later `gc.collect` (a survivor's teardown) scans
    only what was made after it (not torch's ~10^5 import-time objects), frees the cycles made after
    it (an engine's), and a second call freezes nothing more. In a fresh process: the freeze is
    process-wide."""
    script = """
import gc, weakref
import torch
from xray.workhorse import heap
heap.freeze_imports()
frozen = gc.get_freeze_count()
class Engine:
    pass
engine = Engine(); engine.me = engine; engine.weights = torch.ones(4)
alive = weakref.ref(engine)
del engine
heap.freeze_imports()
assert gc.get_freeze_count() == frozen, "a second freeze took the engine's cycle"
tracked = len(gc.get_objects())
gc.collect()
print(frozen, tracked, alive() is None)
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    frozen, tracked, freed = out.stdout.split()
    assert int(frozen) > 50_000 and int(tracked) < 5_000, out.stdout  # torch's objects frozen, few left to scan
    assert freed == "True"
