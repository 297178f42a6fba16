"""Layering: `import xray, algorithms` works with the backend libraries blocked, fast, without Ray;
`xray` never imports `algorithms` (the CLI finds commands through the `xray.commands` registry) and
production code never imports the checks of `xray.check`."""
import ast
import subprocess
import sys
import time
from pathlib import Path

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


ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports: import statements at any depth, and importlib / __import__ calls
    with a literal name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def offenders(files: list[Path], forbidden: str) -> list[str]:
    return [f"{p.relative_to(ROOT)} imports {m}" for p in files for m in sorted(imported_modules(p))
            if m == forbidden or m.startswith(forbidden + ".")]


def test_xray_never_imports_algorithms_and_production_code_never_imports_checks():
    xray_files = sorted((ROOT / "xray").rglob("*.py"))
    production = [p for p in xray_files if "check" not in p.relative_to(ROOT / "xray").parts[:1]]
    production += sorted((ROOT / "algorithms").rglob("*.py"))
    assert len(xray_files) > 50 and len(production) > 80
    assert offenders(xray_files, "algorithms") == []
    assert offenders(production, "xray.check") == []


def test_the_layering_scan_sees_every_form_of_import(tmp_path):
    probe = tmp_path / "probe.py"
    for source in ("import algorithms.ppo", "from algorithms import sft", "from algorithms.sft import run_sft",
                   "def f():\n    import algorithms", "importlib.import_module('algorithms.rm')",
                   "__import__('algorithms')"):
        probe.write_text(source)
        assert any(m.startswith("algorithms") for m in imported_modules(probe)), source
    probe.write_text("from xray.checkpoints import x\nimport algorithmsx")
    assert offenders([probe], "algorithms") == [] and offenders([probe], "xray.check") == []
