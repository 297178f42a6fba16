"""The engine registry (`xray/config/engines.py`): engines are rows of facts, read instead of
compared by name. A scan fails on any comparison of an engine name outside `xray/backends` (and
the registry itself); the rows' facts are held against the code (modules, Workhorse classes,
pairs, roles, quantization), and lookups of unknown names raise with the valid list. Nothing here
imports megatron, deepspeed or vllm."""
import ast
import json
import re
from pathlib import Path

import pytest

from xray.config.engines import (ENGINES, KINDS, PAIRS, QUANTIZATIONS, EngineError, engine, labels, names, playing,
                                 split_pair)

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("xray", "algorithms", "benchmarks", "examples")
"""Where engine names must not be compared (tests may)."""
ALLOWED = ("xray/backends/", "xray/config/engines.py")
"""Where they may: the backends themselves, and the registry."""
ENGINE_NAMES = frozenset(names("train") + names("generation") + names("reward"))
COMPARING = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _engine_names_in(node: ast.AST) -> list[str]:
    """The engine names `node` is, or holds as a tuple / list / set display."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [n.value for n in items if isinstance(n, ast.Constant) and n.value in ENGINE_NAMES]


def comparisons(source: str, where: str) -> list[str]:
    """`where:line: name` for each comparison of an engine name in `source`: `x == "vllm"`,
    `x != "dsinfer"`, `x in ("vllm", ...)` (tuple, list or set), `x not in [...]`, either side;
    and `x.startswith("deepspeed")` / `x.endswith(...)`."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Compare) and any(isinstance(op, COMPARING) for op in node.ops):
            hits = [n for side in (node.left, *node.comparators) for n in _engine_names_in(side)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and node.args):
            hits = _engine_names_in(node.args[0])
        else:
            continue
        found += [f"{where}:{node.lineno}: {name}" for name in hits]
    return found


def _notebook_code(path: Path) -> str:
    """A notebook's code cells as one script (IPython's `!` and `%` lines left out)."""
    cells = json.loads(path.read_text())["cells"]
    lines = [line for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines()]
    return "\n".join(line for line in lines if not line.lstrip().startswith(("!", "%")))


def scan(root: Path) -> list[str]:
    """Every comparison of an engine name under `root`'s scanned folders, outside `ALLOWED`."""
    found = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*")):
            rel = path.relative_to(root).as_posix()
            if path.suffix not in (".py", ".ipynb") or rel.startswith(ALLOWED) or ".ipynb_checkpoints" in rel:
                continue
            source = path.read_text() if path.suffix == ".py" else _notebook_code(path)
            found += comparisons(source, rel)
    return found


def test_no_engine_name_is_compared_outside_the_backends():
    found = scan(ROOT)
    assert not found, ("engine names compared by string; read the engine's facts from its registry row instead "
                       "(`engine(name).sleeps`, `.zero`, `.checks_layout`..., xray/config/engines.py; add a field "
                       "if none says it): " + "; ".join(found))


PLANTED = '''\
if backend == "vllm": pass
if "dsinfer" != gen: pass
if train in ("megatron", "other"): pass
if train not in ["deepspeed"]: pass
if gen in {"vllm", "dsinfer"}: pass
if pair.startswith("deepspeed"): pass
if role_plan.backend is "megatron": pass
'''
HARMLESS = '''\
load_backend("megatron")
kwargs = dict(backend="vllm")
table = {"deepspeed": 1}
if name == "vllm_moe": pass
if role in ("rollout", "sampler"): pass
if engine("dsinfer").reports_routing: pass
'''


def test_the_scan_catches_each_form_and_nothing_else(tmp_path):
    (tmp_path / "xray" / "backends").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "xray" / "planted.py").write_text(PLANTED)
    (tmp_path / "xray" / "harmless.py").write_text(HARMLESS)
    (tmp_path / "xray" / "backends" / "allowed.py").write_text(PLANTED)  # the backends may compare
    (tmp_path / "benchmarks" / "planted.py").write_text(PLANTED.splitlines()[0])
    assert sorted(scan(tmp_path)) == ["benchmarks/planted.py:1: vllm", "xray/planted.py:1: vllm",
                                      "xray/planted.py:2: dsinfer", "xray/planted.py:3: megatron",
                                      "xray/planted.py:4: deepspeed", "xray/planted.py:5: dsinfer",
                                      "xray/planted.py:5: vllm", "xray/planted.py:6: deepspeed",
                                      "xray/planted.py:7: megatron"]


def test_the_scan_reads_notebook_code_cells(tmp_path):
    (tmp_path / "examples").mkdir()
    cells = [{"cell_type": "markdown", "source": ["if backend == 'vllm'"]},
             {"cell_type": "code", "source": ["%matplotlib inline\n", "if backend == 'vllm':\n", "    pass\n"]}]
    (tmp_path / "examples" / "nb.ipynb").write_text(json.dumps({"cells": cells}))
    assert scan(tmp_path) == ["examples/nb.ipynb:1: vllm"]


def _module_file(module: str) -> Path | None:
    """The file a dotted module name imports from, in this repository (None: there is none)."""
    base = ROOT.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _package_sources(module: str) -> str:
    """The source of `module`, or of every file of its package."""
    path = _module_file(module)
    files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
    return "\n".join(f.read_text() for f in files)


@pytest.mark.parametrize("row", ENGINES, ids=lambda e: e.name)
def test_each_engine_names_a_module_and_a_workhorse_class_that_exist(row):
    assert row.kind in KINDS
    module, cls = row.workhorse.split(":")
    path = _module_file(module)
    assert path is not None, f"{row.name}: no file for Workhorse module {module}"
    classes = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    assert cls in classes, f"{row.name}: {path} defines no class {cls}"
    if row.kind in ("train", "generation"):
        assert row.module is not None and _module_file(row.module) is not None, f"{row.name}: {row.module}"
    source = _package_sources(row.module) if row.module else path.read_text()
    if row.checks_layout:
        assert re.search(r"^def check_layout\(", source, re.M), f"{row.name} has no check_layout"
    forwards = any(isinstance(n, ast.FunctionDef) and n.name == "build_engine" and n.args.kwarg
                   for n in ast.walk(ast.parse(source)))  # further keywords go to the library itself
    for option in row.options:  # every option it takes is a name its code reads, or the library's
        assert option in source or option in path.read_text() or forwards, f"{row.name}: {option!r} is read nowhere"


def test_load_backend_imports_the_registry_module_lazily(monkeypatch):
    import xray.backends as backends

    imported = []
    monkeypatch.setattr(backends.importlib, "import_module", lambda name: imported.append(name) or name)
    for name in names(having="module"):
        assert backends.load_backend(name) == engine(name).module
    assert imported == [engine(n).module for n in names("train") + names("generation")]
    with pytest.raises(backends.BackendError, match="unknown backend 'hf'; choose one of megatron, deepspeed, "
                                                     "vllm, dsinfer"):
        backends.load_backend("hf")  # a Workhorse that holds its model itself: no backend module


def test_pairs_are_every_training_engine_with_every_generation_engine():
    assert PAIRS[0] == "megatron-vllm"
    assert {split_pair(p) for p in PAIRS} == {(t, g) for t in names("train") for g in names("generation")}
    assert len(set(PAIRS)) == len(PAIRS)
    with pytest.raises(EngineError, match="unknown --backend 'megatron-hf'; choose one of " + ", ".join(PAIRS)):
        split_pair("megatron-hf")


def test_unknown_names_raise_with_the_valid_list():
    with pytest.raises(EngineError, match=r"unknown engine 'sglang'; choose one of megatron, deepspeed, vllm, "
                                          r"dsinfer, hf, hf-reward, fn-reward, echo"):
        engine("sglang")
    with pytest.raises(EngineError, match="unknown train engine 'vllm'; choose one of megatron, deepspeed$"):
        engine("vllm", "train")
    with pytest.raises(EngineError, match="role 'critic' is played by none of the engines vllm, hf-reward"):
        playing("critic", ("vllm", "hf-reward"))


def test_roles_are_those_a_plan_places():
    from xray.config.plan import TRAINED_ROLES

    for name in names("train"):
        assert engine(name).roles == TRAINED_ROLES
    for name in names("generation"):
        assert engine(name).roles == ("rollout", "sampler")
    for row in ENGINES:
        if row.roles:
            assert set(row.pretrained_roles) <= set(row.roles), row.name
    assert playing("orm", ("megatron", "vllm", "fn-reward", "hf-reward")) == "fn-reward"
    assert playing("prm", ("megatron", "vllm", "fn-reward", "hf-reward")) == "hf-reward"
    assert playing("teacher", ("deepspeed", "dsinfer")) == "deepspeed"


def test_facts_agree_with_the_config():
    from typing import get_args, get_type_hints

    from xray.config.moe import BALANCING
    from xray.config.schema import RolloutConfig

    assert get_args(get_type_hints(RolloutConfig)["quantization"]) == QUANTIZATIONS
    for row in ENGINES:
        assert set(row.load_balancing) <= set(BALANCING) and row.load_balancing[0] == "none", row.name
        assert row.zero == ("zero_stage" in row.options), row.name
        for device, schemes in row.quant_schemes.items():
            assert device in ("cpu", "cuda") and set(schemes) <= set(QUANTIZATIONS) - {"none"}, row.name
            assert row.quant_dtypes, f"{row.name} quantizes from no dtype"
        assert set(row.quant_refused) <= set(QUANTIZATIONS), row.name
        assert row.reports_routing or row.kind != "generation" or row.no_routing, f"{row.name}: say why not"
        assert row.lora_sync in ((None,) if row.kind != "generation" else ("adapters", "merged")), row.name
    assert names("generation", "sleeps") == ("vllm",) and names("generation", "reports_routing") == ("dsinfer",)
    assert labels("train", "expert_parallel") == "Megatron"
    assert engine("dsinfer").offered("cuda") == ("none",)


def test_the_concepts_table_lists_every_engine():
    text = (ROOT / "docs/concepts.md").read_text()
    rows = re.findall(r"^\| `([\w-]+)` \|", text, re.M)
    assert rows == [e.name for e in ENGINES if e.kind in ("train", "generation", "reward")] + ["hf"], rows
    for name in names("generation"):
        row = engine(name)
        line = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
        assert f"| {row.lora_sync} |" in line and line.endswith(f"| {'yes' if row.reports_routing else 'no'} |"), line


def test_the_registry_imports_only_the_config_layer():
    tree = ast.parse((ROOT / "xray/config/engines.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + \
        [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert all(m == "__future__" or m == "dataclasses" or m.startswith("xray.config.") for m in imported), imported
