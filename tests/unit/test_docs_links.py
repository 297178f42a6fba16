"""The README and `docs/*.md` stand alone in the repository: no link or path leads outside it,
every relative link (and its `#anchor`) points to something that exists, the repository paths
and `xray` / `algorithms` modules they name exist, and the README links every docs page."""
import importlib.util
import re
from pathlib import Path

import pytest

from xray.config.reference import anchor

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
TOP = ("xray", "algorithms", "configs", "tests", "benchmarks", "examples", "docs", "requirements")
REPO_PATH = re.compile(rf"^(?:{'|'.join(TOP)})/[\w./-]*$")
MODULE = re.compile(r"^(?:xray|algorithms)(?:\.\w+)+(?::\w+)?$")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings."""
    return {anchor(line.lstrip("#").strip()) for line in _prose(page.read_text()).splitlines()
            if line.startswith("#")}


def test_the_pages_exist():
    names = {p.name for p in PAGES}
    assert {"README.md", "quickstart.md", "concepts.md", "algorithms.md", "config.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_path_outside_the_repository(page):
    text = page.read_text()
    for bad in ("../", "/work/", "DESIGN.md", "FACTS.md", "file://"):
        lines = [i + 1 for i, line in enumerate(text.splitlines()) if bad in line]
        assert not lines, f"{page.name} names {bad!r} (lines {lines}): it must not point outside the repository"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_anchors(page):
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, fragment = target.partition("#")
        assert not path.startswith("/"), f"{page.name}: absolute link {target!r}; link relative to the page"
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.is_relative_to(ROOT), f"{page.name}: link {target!r} leaves the repository"
        assert resolved.exists(), f"{page.name}: link {target!r} points to nothing ({resolved} is missing)"
        if fragment and resolved.suffix == ".md":
            assert fragment in anchors(resolved), (f"{page.name}: link {target!r}: {resolved.name} has no heading "
                                                   f"with anchor #{fragment}")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_and_modules_exist(page):
    for span in CODE.findall(_prose(page.read_text())):
        span = span.strip()
        if REPO_PATH.match(span) and not any(c in span for c in "*<"):
            assert (ROOT / span.rstrip("/")).exists(), f"{page.name} names `{span}`, which is not in the repository"
        elif MODULE.match(span):
            module, _, attr = span.partition(":")
            assert _module_exists(module), f"{page.name} names module `{span}`, which does not exist"
            if attr:
                assert hasattr(importlib.import_module(module), attr), f"{page.name} names `{span}`: no {attr}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_opening_lines_of_code_blocks_exist(page):
    """A tree drawn in a code block (the README's layout): each line's leading path exists."""
    for block in FENCE.findall(page.read_text()):
        for line in block.splitlines()[1:-1]:
            head = line.split(" ", 1)[0]
            if REPO_PATH.match(head):
                assert (ROOT / head.rstrip("/")).exists(), f"{page.name} draws `{head}`, which is not in the repository"


def _module_exists(name: str) -> bool:
    """Whether `name` is a module, or an attribute of one (`xray.protocol.fanout`)."""
    while "." in name:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:
            pass
        parent, _, attr = name.rpartition(".")
        try:
            spec = importlib.util.find_spec(parent)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            module = importlib.import_module(parent)
            return hasattr(module, attr)
        name = parent
    return False


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    linked = {target.partition("#")[0] for target in LINK.findall(readme)}
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in linked, f"README.md does not link docs/{page.name}"


NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_the_notebooks_import_what_exists(notebook):
    """Every `from xray... import NAME` / `from algorithms... import NAME` of a notebook's code cells
    names a module and an attribute that exist (a moved module fails here, not in the ray tier)."""
    import ast
    import importlib
    import json

    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    source = "\n".join("".join(c["source"]) for c in cells)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("xray", "algorithms"):
            module = importlib.import_module(node.module)
            found += [(node.module, a.name) for a in node.names if not hasattr(module, a.name)]
            found += [] if node.names else [(node.module, "")]
    assert NOTEBOOKS and found == [], found
