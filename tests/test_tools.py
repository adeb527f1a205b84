"""The tools in tools/ (run by hand from a checkout) and the benchmarks in specjax.bench.experiments still
run against the code as it is: every tool is exercised by a test, the commit-comparison tools lay the
checkout out as installed, and the serving benchmark's script passes only flags the CLI has."""

import importlib
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

from specjax.bench import experiments

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLS = sorted(p for p in (ROOT / "tools").iterdir() if p.suffix in (".py", ".sh"))


def run(*args, env=None, cwd=ROOT, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([*args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


@pytest.mark.parametrize("tool", TOOLS, ids=lambda p: p.name)
def test_every_tool_is_exercised_by_a_test(tool):
    """A test names the tool's path (tools/NAME) where it runs it."""
    tests = [t for t in (ROOT / "tests").glob("test_*.py") if f"tools/{tool.name}" in t.read_text()]
    assert tests, f"tools/{tool.name} has no test: add one that runs it (tests/test_tools.py), or delete it"


def test_package_tree_imports_the_checkout_as_installed(tmp_path):
    """compare_commits' tree (also used by scheduler_host_cost and the accelerator route) maps models/ to
    specjax.models, as pyproject's package-dir does, and links train_heads/ as its own top-level package."""
    out = run(sys.executable, "tools/compare_commits.py", "HEAD", "--methods", "bogus")
    assert out.returncode == 2 and "give some of none,ngram" in out.stderr, out.stderr
    out = run(sys.executable, "tools/compare_commits.py", "HEAD", "--methods", "auto")
    assert out.returncode == 2 and "add --scheduler SLOTS" in out.stderr, out.stderr
    code = ("import pathlib, sys; sys.path.insert(0, 'tools'); from compare_commits import _package_tree; "
            f"_package_tree(pathlib.Path('.').resolve(), pathlib.Path({str(tmp_path)!r}))")
    assert run(sys.executable, "-c", code).returncode == 0
    probe = "import specjax.models.config as m, train_heads as t; print(m.__file__); print(t.__file__)"
    out = run(sys.executable, "-c", probe, env=dict(PYTHONPATH=str(tmp_path)), cwd=tmp_path)  # not the checkout's
    assert out.returncode == 0, out.stderr
    models_file, heads_file = out.stdout.split()
    assert models_file.startswith(str(tmp_path)) and pathlib.Path(models_file).resolve() == ROOT / "models" / "config.py"
    assert pathlib.Path(heads_file).resolve() == ROOT / "train_heads" / "__init__.py"


def test_scheduler_host_cost_says_how_to_run_it():
    out = run(sys.executable, "tools/scheduler_host_cost.py")
    assert out.returncode == 1 and "Usage: [MODEL=smollm2-135m]" in out.stderr, out.stderr


def test_bench_serving_script_passes_only_flags_the_cli_has():
    script = (ROOT / "tools" / "bench_serving.sh").read_text()
    assert run("bash", "-n", "tools/bench_serving.sh").returncode == 0
    known = set()
    for command in ("loadbench", "serve"):
        out = run(sys.executable, "-m", "specjax.cli", command, "--help")
        assert out.returncode == 0, out.stderr
        known |= set(re.findall(r"--[a-z][a-z-]+", out.stdout))
    used = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", script))
    assert used and used <= known, f"tools/bench_serving.sh passes flags the CLI lacks: {sorted(used - known)}"


@pytest.mark.parametrize("name", sorted(m.name for m in pkgutil.iter_modules(experiments.__path__)))
def test_every_experiment_imports_and_has_a_main(name):
    mod = importlib.import_module(f"specjax.bench.experiments.{name}")
    assert callable(mod.main) and mod.__doc__, f"specjax.bench.experiments.{name}: give it a docstring and main()"
