"""`xray.backends.megatron.imports`: megatron-core imported for a Workhorse's build without
torch.compile's set-up and without Weights & Biases, which the process may still import after."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_megatron_imports_without_wandb_and_leaves_both_as_they_were():
    """In a fresh process (imports are process-wide): after `import_megatron`, torch.compile is
    torch's again, megatron's timers hold no wandb and the process has not imported it, and a later
    `import wandb` (a user's reward function) gets the real package."""
    script = """
import sys
import torch
compile_before = torch.compile
from xray.backends.megatron.imports import import_megatron
import_megatron()
import megatron.core.timers as timers
assert torch.compile is compile_before
assert timers.wandb is None and "wandb" not in sys.modules, (timers.wandb, sys.modules.get("wandb"))
import wandb
print(type(wandb).__name__, hasattr(wandb, "init"))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["module", "True"]
