"""The notebooks run top to bottom (nbclient), and so does the README's Python example.

They use the real SmolLM2-135M (fetched through the registry) and read `../shared/data` at run time.
"""

import pathlib
import re

import pytest
from conftest import COMPILE_CACHE, need_module

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

pytestmark = pytest.mark.slow


def test_there_are_the_four_notebooks():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "functional_api", "acceptance_by_task", "train_heads"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    # the kernels keep XLA's optimisations (conftest turns them off for the rest): their time is the
    # real model's decode, not compiles (acceptance_by_task ran 25% slower without them)
    monkeypatch.delenv("JAX_DISABLE_MOST_OPTIMIZATIONS", raising=False)
    if COMPILE_CACHE:  # the kernels, one after another, load the programs an earlier notebook compiled
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(COMPILE_CACHE) / "notebooks"))
        monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    nbformat = need_module("nbformat")
    nbclient = need_module("nbclient")
    nb = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "strip the outputs"
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the failing cell, on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    for png in ("tau_by_task.png", "acceptance_by_position.png"):  # the plots land beside the notebook
        (path.parent / png).unlink(missing_ok=True)


def test_readme_python_example_runs(capsys, smollm2_path):
    """The first Python block of the README's Python API section, executed as written (it loads the
    real model by name; `smollm2_path` fetches it first, or skips where it cannot be had)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert len(out.strip()) > 20, out
