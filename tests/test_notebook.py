"""The notebooks run top to bottom on the NumPy backend (any cell error fails the test)."""

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    # The kernel imports cupa from this checkout (installed or not) and draws with Agg.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors


def test_quickstart_exists():
    assert (REPO / "notebooks" / "01_quickstart.ipynb") in NOTEBOOKS


def test_mla_notebook_exists_and_is_stored_without_outputs():
    path = REPO / "notebooks" / "04_mla.ipynb"
    assert path in NOTEBOOKS
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
    assert any("import cupy as xp" in c.source for c in nb.cells)  # the one line that switches to the GPU


def test_subbyte_notebook_exists_and_is_stored_without_outputs():
    path = REPO / "notebooks" / "05_subbyte.ipynb"
    assert path in NOTEBOOKS
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
    assert any("import cupy as xp" in c.source for c in nb.cells)
    assert any("import matplotlib" in c.source and "except ImportError" in c.source for c in nb.cells)
