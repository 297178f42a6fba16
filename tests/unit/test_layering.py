"""Layering: `import xray, algorithms` works with the backend libraries blocked, fast, without Ray;
`xray` never imports `algorithms` (the CLI finds commands through the `xray.commands` registry);
production code never imports the checks of `xray.check`; no import runs up DESIGN.md's layers
(`LAYERS`) and no two project modules import each other, at any depth (`import_graph`)."""
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
import xray.run.step, algorithms.sft
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
PROJECT = ("xray", "algorithms")

LAYERS = (
    ("xray.config", "xray.data"),
    ("xray.backends", "xray.rewards", "xray.env", "xray.builtin"),
    ("xray.protocol",),
    ("xray.transport",),
    ("xray.workhorse",),
    ("xray.wholemodel",),
    ("xray.sync",),
    ("xray.run", "xray.report", "xray.check"),
    ("xray.commands", "xray.train", "xray.export", "xray"),
    ("algorithms",),
)
"""DESIGN.md's layers, lowest first: a module may import its own layer or a lower one. `xray` is
`xray/__init__.py`; every other package or top module of `xray` must be named here. In layer 1,
`xray.env` imports `xray.rewards` and `xray.builtin` imports `xray.env` and `xray.data`, never the
reverse. `xray.config` importing `xray.backends` runs up a layer: engines are rows of the config's
own registry."""
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def imported_modules(path: Path, package: str = "", is_module=lambda name: False) -> set[str]:
    """Every module `path` imports: import statements at any depth (in functions, under
    TYPE_CHECKING), and importlib / __import__ calls with a literal name. `from pkg import name`
    names `pkg.name` where `is_module` says that is a module, else `pkg`; a relative import is
    resolved against `package`, the package the file's module sits in."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{source}.{a.name}" if is_module(f"{source}.{a.name}") else source for a in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def offenders(files: list[Path], forbidden: str) -> list[str]:
    return [f"{p.relative_to(ROOT)} imports {m}" for p in files for m in sorted(imported_modules(p))
            if m == forbidden or m.startswith(forbidden + ".")]


def project_modules(root: Path) -> dict[str, Path]:
    """The modules of `xray` and `algorithms` under `root`, by dotted name (a package by its
    `__init__.py`)."""
    modules = {}
    for top in PROJECT:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name that is no module counts as the module
    that holds it: `xray.a.b.f` -> `xray.a.b`); outside modules are left out."""
    modules = project_modules(root)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = {owner(m) for m in imported_modules(path, package, modules.__contains__)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of `graph` with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through every import edge that lies on one, as `a -> b -> a`."""
    cycles = set()
    for component in strongly_connected(graph):
        for u in sorted(component):
            for v in sorted(graph[u] & component):
                back, frontier = {v: None}, [v]  # breadth-first from v back to u, inside the component
                while u not in back:
                    frontier = [w for x in frontier for w in sorted(graph[x] & component)
                                if w not in back and back.setdefault(w, x) == x]
                path, at = [], u
                while at is not None:
                    path.append(at)
                    at = back[at]
                cycle = [u] + path[::-1]  # u -> v -> ... -> u
                turn = cycle.index(min(cycle[:-1]))
                cycles.add(" -> ".join(cycle[turn:-1] + cycle[:turn + 1]))
    return sorted(cycles)


def unit_of(module: str) -> str:
    """The entry of LAYERS a module belongs to: `algorithms`, `xray`, or `xray.<package or module>`."""
    parts = module.split(".")
    return parts[0] if parts[0] == "algorithms" else ".".join(parts[:2])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a higher layer, and every module whose package LAYERS does not place."""
    found = {f"{unit_of(m)} is in no layer: place it in LAYERS" for m in graph if unit_of(m) not in RANK}
    for module, targets in graph.items():
        for target in sorted(targets):
            low, high = RANK.get(unit_of(module)), RANK.get(unit_of(target))
            if low is not None and high is not None and high > low:
                found.add(f"{module} (layer {low}) imports {target} (layer {high})")
    return sorted(found)


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
                   "__import__('algorithms')", "if TYPE_CHECKING:\n    from algorithms import sft"):
        probe.write_text(source)
        assert any(m.startswith("algorithms") for m in imported_modules(probe)), source
    probe.write_text("from xray.checkpoints import x\nimport algorithmsx")
    assert offenders([probe], "algorithms") == [] and offenders([probe], "xray.check") == []
    probe.write_text("from . import a\nfrom .. import b\nfrom ..c import d\nfrom .e import f")
    assert imported_modules(probe, "xray.p.q", {"xray.p.q.a", "xray.p.c.d"}.__contains__) == {
        "xray.p.q.a", "xray.p", "xray.p.c.d", "xray.p.q.e"}


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 150 and sum(map(len, graph.values())) > 300
    cycles = import_cycles(graph)
    for cycle in cycles:
        print("import cycle:", cycle)
    assert cycles == [], "import cycles (move the shared name down into the lower module):\n" + "\n".join(cycles)


def test_no_import_runs_up_the_layers():
    found = upward_imports(import_graph())
    for line in found:
        print("upward import:", line)
    assert found == [], "imports up the layers (DESIGN.md, Layers):\n" + "\n".join(found)


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)


def test_the_scan_finds_a_planted_cycle_and_upward_import(tmp_path):
    _plant(tmp_path, {
        "xray/__init__.py": "", "xray/config/__init__.py": "", "xray/backends/__init__.py": "",
        "xray/workhorse/__init__.py": "", "algorithms/__init__.py": "",
        "xray/config/a.py": "from xray.config import b, NAME\n",  # b a module, NAME not one: xray.config
        "xray/config/b.py": "def f():\n    from . import a\n",  # a cycle a <-> b through a function
        "xray/backends/c.py": "if TYPE_CHECKING:\n    from ..config.a import x\n",
        "xray/config/d.py": "importlib.import_module('xray.backends.c')\n",  # up a layer
        "xray/wholemodel/e.py": "import xray.workhorse\n",  # lower: fine
        "xray/newpackage/f.py": "",
        "algorithms/g.py": "import xray.train\n",  # no such module: its package, `xray`
    })
    graph = import_graph(tmp_path)
    assert graph["xray.config.a"] == {"xray.config.b", "xray.config"}
    assert graph["xray.backends.c"] == {"xray.config.a"} and graph["algorithms.g"] == {"xray"}
    assert import_cycles(graph) == ["xray.config.a -> xray.config.b -> xray.config.a"]
    assert upward_imports(graph) == ["xray.config.d (layer 0) imports xray.backends.c (layer 1)",
                                     "xray.newpackage is in no layer: place it in LAYERS"]
    _plant(tmp_path, {"xray/config/b.py": "from xray.backends import c\n"})  # a longer cycle, also upward
    graph = import_graph(tmp_path)
    assert import_cycles(graph) == ["xray.backends.c -> xray.config.a -> xray.config.b -> xray.backends.c"]
    assert "xray.config.b (layer 0) imports xray.backends.c (layer 1)" in upward_imports(graph)
