"""Every cookbook notebook executes top to bottom (small settings), so the notebooks cannot rot."""

from __future__ import annotations

from pathlib import Path

import pytest

# Without the `cookbook` extra the notebooks cannot run: skip this file, not the whole collection.
nbformat = pytest.importorskip("nbformat", reason="the cookbook extra is not installed (pip install -e '.[cookbook]')")
NotebookClient = pytest.importorskip(
    "nbclient", reason="the cookbook extra is not installed (pip install -e '.[cookbook]')").NotebookClient

pytestmark = pytest.mark.integration

COOKBOOK = Path(__file__).resolve().parents[2] / "cookbook"
NOTEBOOKS = sorted(COOKBOOK.glob("*.ipynb"))


def test_the_cookbook_has_its_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert names and all(n[:2].isdigit() for n in names), names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_notebook_runs_without_errors(path, monkeypatch, tmp_path):
    monkeypatch.setenv("RKSC_COOKBOOK_QUICK", "1")  # the notebooks read it to shrink their workloads
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    # Executed in memory: the committed notebook (and its saved outputs) is never rewritten by CI.
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
