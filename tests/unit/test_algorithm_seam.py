"""The seam between the run machinery and the algorithms (issue 56): `xray/config` names no command
(the plan takes the command's spec), every registered command's spec plans its own default config,
and the run machinery meets every RL algorithm only through `xray/run/algorithm.py`."""
import ast
from pathlib import Path

import pytest

from algorithms.specs import command_spec
from xray.commands import registered
from xray.config import CONFIG_DIR, load_config
from xray.config.job import KINDS
from xray.config.plan import plan_run

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            found.update(id(x.value) for x in node.body
                         if isinstance(x, ast.Expr) and isinstance(x.value, ast.Constant))
    return found


def named_commands(path: Path, names: set[str]) -> list[str]:
    """`path`'s string constants (docstrings aside) that are command names."""
    tree = ast.parse(path.read_text(), str(path))
    skip = docstrings(tree)
    return [f"{path.relative_to(ROOT)}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names and id(n) not in skip]


def test_the_config_layer_names_no_command():
    names = set(registered())
    assert {"ppo", "grpo", "rloo", "reinforce_pp", "opd", "sft", "pt", "rm", "sample", "distill"} <= names
    files = sorted((ROOT / "xray/config").glob("*.py"))
    assert len(files) > 15
    assert [hit for p in files for hit in named_commands(p, names)] == []
    for text in ("kind = 'grpo'\n", "if algo == 'opd':\n    pass\n", "CHECKS = {'sft': 1}\n"):  # the scan sees them
        probe = ROOT / "tests/unit/_probe_seam.py"
        try:
            probe.write_text(text)
            assert named_commands(probe, names), text
        finally:
            probe.unlink()


@pytest.mark.parametrize("name", sorted(registered()))
def test_every_registered_spec_plans_its_default_config(name):
    spec = command_spec(name)
    assert spec.name == name and spec.kind in KINDS and (CONFIG_DIR / spec.config).is_file()
    cfg = load_config(CONFIG_DIR / spec.config)
    plan = plan_run(cfg, "megatron-vllm", spec)
    assert {r.role for r in plan.roles} == set(spec.roles(cfg))
    if spec.kind == "rl":  # the algorithm object the run and the asynchronous trainer both call
        algorithm = spec.algorithm(cfg)
        assert algorithm.name == name and set(algorithm.trained) <= {"actor", "critic"}
        assert ("critic" in algorithm.trained) == ("critic" in spec.roles(cfg))
        assert algorithm.kl_in in ("reward", "loss", "none")


def test_the_run_machinery_knows_no_algorithm_by_name():
    names = {n for n in registered() if command_spec(n).kind == "rl"}
    files = sorted((ROOT / "xray/run").rglob("*.py"))
    assert [hit for p in files for hit in named_commands(p, names)] == []
