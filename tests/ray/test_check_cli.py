"""`python -m xray.check parity|sync`: the user-facing checks run end to end through the runtime (each
command joins the tier's shared Ray head, `tests/ray/conftest.py`)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("subprocess_head")]
ROOT = Path(__file__).resolve().parents[2]


def check(*args: str) -> tuple[subprocess.CompletedProcess, str]:
    p = subprocess.run([sys.executable, "-m", "xray.check", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    lines = [ln for ln in p.stdout.strip().splitlines() if ln]
    return p, lines[-1] if lines else ""


@pytest.mark.parametrize("args", [
    ("--backend", "megatron", "--tp", "2", "--pp", "1", "--dp", "1"),
    # ZeRO-3's parity: tests/backends/test_deepspeed_zero.py; its command line, in the slow tier (budget)
    pytest.param(("--backend", "deepspeed", "--zero", "3", "--dp", "2"), marks=pytest.mark.slow),
])
def test_parity_check_passes_within_tolerance(args):
    p, last = check("parity", *args)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    m = re.fullmatch(r"max_abs_logprob_diff=(\S+) max_rel_param_diff_after_step=(\S+)", last)
    assert m, last
    assert float(m.group(1)) <= 1e-4 and float(m.group(2)) <= 1e-5


def test_parity_check_rejects_a_bad_layout_before_starting():
    p, _ = check("parity", "--backend", "megatron", "--tp", "3")
    assert p.returncode == 2
    assert "tp=3 does not divide the model's 4 attention heads" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.slow  # 32 s: the default tier's budget (every e2e run verifies its syncs)
def test_sync_check_reports_the_figures():
    p, last = check("sync", "--backend", "megatron-vllm", "--tp", "2", "--replicas", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.fullmatch(r"max_abs_logprob_diff=(\S+) sync_s=(\S+)", last)
    assert m, last
    assert float(m.group(1)) <= 1e-4 and float(m.group(2)) > 0
