"""Layering: `import xray, algorithms` works with the backend libraries blocked, fast, without Ray."""
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.unit

PROBE = """
import sys, time
for name in ("vllm", "megatron", "deepspeed"):
    sys.modules[name] = None  # any import of them now raises ImportError
t0 = time.perf_counter()
import xray, algorithms
elapsed = time.perf_counter() - t0
import xray.config, xray.config.plan, xray.data, xray.backends, xray.train, xray.wholemodel
import algorithms.ppo.trainer, algorithms.sft
started = [m for m in ("ray", "vllm", "megatron.core", "deepspeed") if sys.modules.get(m) is not None]
print(f"{elapsed:.3f} {','.join(started) or 'none'}")
"""


def test_import_without_backends_is_fast_and_starts_no_ray():
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr
    import_s, loaded = p.stdout.split()
    assert loaded == "none", f"import xray loaded {loaded}"
    assert float(import_s) < 3.0 and wall < 10.0
