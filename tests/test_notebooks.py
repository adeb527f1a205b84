"""The notebooks run top to bottom (nbclient), and so does the README's Python example.

They use the real SmolLM2-135M (fetched through the catalog) and the prompt sets shipped in the package;
they are what tools/make_notebooks.py writes, and nothing that runs reads outside the repository.
"""

import importlib.util
import pathlib
import re

import pytest
from conftest import COMPILE_CACHE, need_module

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

pytestmark = pytest.mark.slow


def test_there_are_the_four_notebooks():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "functional_api", "acceptance_by_task", "train_heads"}


def test_the_notebooks_are_what_their_sources_write():
    spec = importlib.util.spec_from_file_location("make_notebooks", ROOT / "tools" / "make_notebooks.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    nbformat = need_module("nbformat")
    assert set(make.NOTEBOOKS) == {p.stem for p in NOTEBOOKS}
    for path in NOTEBOOKS:
        cells = lambda nb: [(c.cell_type, c.source) for c in nb.cells]
        assert cells(nbformat.read(path, as_version=4)) == cells(make.build(path.stem)), (
            f"{path.name} differs from tools/make_notebooks.py: edit the cells there and run it")


def test_nothing_that_runs_reads_beside_the_repository():
    # a user's clone has no sibling folder: the notebooks, the Makefile, the README's commands, the
    # tests and CI read the package's own prompt sets (`--prompts-file tasks` / `ops`)
    runs = [*NOTEBOOKS, ROOT / "Makefile", ROOT / "README.md", ROOT / ".ci" / "run", ROOT / "tools" / "make_notebooks.py",
            *(ROOT / "tests").glob("*.py"), *(ROOT / "docs").glob("*.md")]
    for path in runs:
        if path.name == pathlib.Path(__file__).name or path.name in ("BENCHMARKS.md",):
            continue
        assert "../shared" not in path.read_text(encoding="utf-8"), f"{path.relative_to(ROOT)} reads ../shared"


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
    # per cell: the longest, acceptance_by_task's generation cell (one batch per method), takes ~60 s here;
    # the bound leaves room for a machine several times slower
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
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
