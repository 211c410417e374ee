"""notebooks/quickstart.ipynb runs top to bottom on the current interpreter and learns.

The notebook is executed with nbclient in a temporary directory, on a kernel started from
`sys.executable` (a kernelspec written to a temporary JUPYTER_PATH), so it sees exactly the
environment the tests run in. About 30 s on 2 CPU cores.
"""

import json
import os
import re
import shutil
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import ROOT, needs_fmnist

NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
KERNEL_NAME = "fedjax-pan-test"
FINAL = re.compile(r"final test accuracy: ([0-9.]+)")


def _register_kernel(jupyter_dir):
    """A kernelspec whose kernel is this interpreter; returns its name."""
    spec_dir = os.path.join(jupyter_dir, "kernels", KERNEL_NAME)
    os.makedirs(spec_dir)
    with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
        json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f",
                            "{connection_file}"],
                   "display_name": "fedjax_pan tests", "language": "python"}, f)
    return KERNEL_NAME


def _outputs(nb, output_type):
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
            if out.output_type == output_type]


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@needs_fmnist
@pytest.mark.slow  # runs the notebook in a kernel
def test_quickstart_notebook_runs_and_learns(tmp_path, monkeypatch):
    jupyter_dir = tmp_path / "jupyter"
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_dir))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    kernel = _register_kernel(str(jupyter_dir))
    workdir = tmp_path / "run"
    workdir.mkdir()
    shutil.copy(NOTEBOOK, workdir / "quickstart.ipynb")
    nb = nbformat.read(str(workdir / "quickstart.ipynb"), as_version=4)

    # Raises CellExecutionError (with the traceback) on the first failing cell.
    NotebookClient(nb, kernel_name=kernel, timeout=300,
                   resources={"metadata": {"path": str(workdir)}}).execute()

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    assert not _outputs(nb, "error")
    text = "".join(out.text for out in _outputs(nb, "stream") if out.name == "stdout")
    # Five rounds were run and reported.
    assert len(re.findall(r"^round \d+: train loss", text, re.M)) == 5, text
    # Both figures (label distribution, accuracy curve) were rendered.
    pngs = [o for o in _outputs(nb, "display_data") if "image/png" in o.data]
    assert len(pngs) == 2
    # The last code cell reports the final accuracy: well above chance (0.1) after 5 rounds.
    last = "".join(out.text for out in code[-1].outputs if out.output_type == "stream")
    match = FINAL.search(last)
    assert match, last
    assert float(match.group(1)) > 0.3, last
