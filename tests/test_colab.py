"""launch/colab.ipynb runs top to bottom (small settings: a tiny random model)."""

from __future__ import annotations

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "launch", "colab.ipynb")


def _kernel_for_this_python(root) -> str:
  """A kernelspec running this interpreter (a bare `python` might be another one)."""
  spec = root / "kernels" / "flexdraft-test"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "flexdraft test", "language": "python"}))
  return "flexdraft-test"


def _text(nb) -> str:
  out = []
  for cell in nb.cells:
    for o in cell.get("outputs", []):
      out.append(o.get("text", "") + o.get("data", {}).get("text/plain", ""))
  return "\n".join(out)


def test_colab_notebook_executes(tmp_path, monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  workdir = tmp_path / "sweep"
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
  monkeypatch.setenv("FLEXDRAFT_COLAB_SMALL", "1")
  monkeypatch.setenv("FLEXDRAFT_COLAB_WORKDIR", str(workdir))
  monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")  # faster compiles
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name=_kernel_for_this_python(tmp_path),
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError on any failing cell

  text = _text(nb)
  assert "install skipped" in text
  assert "identical to AR: True" in text
  assert "RANDOMLY INITIALISED" in text
  assert "2 cells run, 0 reused" in text
  for name in ("results.json", "results.csv", "results.md", "speedup_vs_batch_T0.png"):
    assert (workdir / name).is_file(), name
  images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
  assert len(images) == 3
