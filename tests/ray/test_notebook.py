"""The example notebook runs to the end in a fresh kernel."""
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_notebook_runs(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples/wholemodel_quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = {i: c.get("outputs", []) for i, c in enumerate(nb.cells) if c.cell_type == "code"}

    def result(i):
        return next(o for o in outputs[i] if o["output_type"] == "execute_result")["data"]["text/plain"]

    assert result(1) == "[(0, 0, True), (1, 1, True)]"
    assert result(3) == "torch.Size([8, 15])"
    assert float(result(4)) > 0
    assert result(5) == "torch.Size([8, 15])"
