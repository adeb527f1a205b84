"""The wheel holds every Python package in the repository: `[tool.setuptools] packages` lists each folder
with an `__init__.py` under its installed name (models/ is specjax.models, train_heads/ is
specjax.train_heads). A folder missing from the list still imports in an editable install, and is absent
from a wheel."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_for_the_wheel():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {
        ".".join((name, *init.parent.relative_to(ROOT / path).parts))
        for name, path in setuptools["package-dir"].items()
        for init in (ROOT / path).rglob("__init__.py")
    }
    assert found - listed == set(), f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
    assert listed - found == set(), f"{sorted(listed - found)} are listed in pyproject.toml, and no folder holds them"
