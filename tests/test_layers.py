"""The import contract in pyproject.toml ([tool.importlinter]) holds: core below hosts below the CLI,
training above inference, no cycles. Deferred imports count (the linter reads every import)."""

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

from conftest import need_module

ROOT = pathlib.Path(__file__).resolve().parents[1]


def installed_layout(into: pathlib.Path) -> pathlib.Path:
    """The packages as installed under `into`: specjax/ copied (a test may edit the copy), models/
    linked as specjax.models (pyproject's package-dir), and every other top-level package of
    `[tool.setuptools] packages` (train_heads/) linked under its own name. The linter walks
    directories, and in the checkout specjax/ holds neither models/ nor train_heads/."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = setuptools["package-dir"]
    shutil.copytree(ROOT / dirs["specjax"], into / "specjax", ignore=shutil.ignore_patterns("__pycache__"))
    for package, folder in dirs.items():
        if package != "specjax":
            (into / package.replace(".", "/")).symlink_to(ROOT / folder)
    for package in setuptools["packages"]:
        if "." not in package and package not in dirs:
            (into / package).symlink_to(ROOT / package)
    return into


def lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True, no_logo=True))")
    env = dict(os.environ, PYTHONPATH=str(root))  # the laid-out tree first, not the checkout
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_import_contract_holds(tmp_path):
    need_module("importlinter")
    out = lint(installed_layout(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout and "KEPT" in out.stdout


def test_contract_catches_an_upward_import(tmp_path):
    """Negative control: the core importing the CLI breaks the layers contract."""
    need_module("importlinter")
    root = installed_layout(tmp_path)
    state = root / "specjax" / "core" / "state.py"  # a copy: the checkout is not touched
    state.write_text(state.read_text() + "\nfrom specjax import cli  # noqa: E402,F401\n")
    out = lint(root)
    assert out.returncode != 0 and "specjax.core is not allowed to import specjax.cli" in out.stdout, out.stdout
