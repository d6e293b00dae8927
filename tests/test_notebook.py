"""The quickstart notebook runs top to bottom on the NumPy backend (any cell error fails the test)."""

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
