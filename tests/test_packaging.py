"""The wheel holds every Python package in the repository: `[tool.setuptools] packages` lists each folder
with an `__init__.py` under its installed name (models/ is specjax.models through package-dir;
train_heads/ is the top-level package train_heads). A folder missing from the list still imports in
an editable install, and is absent from a wheel."""

import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_roots(setuptools: dict) -> dict[str, str]:
    """Package -> folder: pyproject's package-dir, and each other top-level package (train_heads) in
    the folder of its own name."""
    roots = dict(setuptools["package-dir"])
    roots.update({name: name for name in setuptools["packages"] if "." not in name and name not in roots})
    return roots


def test_every_package_folder_is_listed_for_the_wheel():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    roots = package_roots(setuptools)
    found = {
        ".".join((name, *init.parent.relative_to(ROOT / path).parts))
        for name, path in roots.items()
        for init in (ROOT / path).rglob("__init__.py")
    }
    assert found - listed == set(), f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
    assert listed - found == set(), f"{sorted(listed - found)} are listed in pyproject.toml, and no folder holds them"


def test_every_data_file_in_a_package_is_package_data():
    """A file the library reads beside its code (models/pins.toml, the kernel's source, the shipped heads
    and prompt sets) is matched by `[tool.setuptools.package-data]`: otherwise a wheel lacks it, and an
    editable install, reading the checkout, does not show it."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = package_roots(setuptools)

    def folder(package: str) -> Path:  # pyproject's package-dir: the longest mapped prefix
        top = max((p for p in dirs if package == p or package.startswith(p + ".")), key=len)
        return ROOT / dirs[top] / Path(*package[len(top):].split(".")[1:])

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    packaged = {f.resolve() for package, patterns in setuptools["package-data"].items()
                for pattern in patterns for f in folder(package).glob(pattern) if f.is_file()}
    folders = {folder(package): package for package in setuptools["packages"]}
    missing = []
    for line in tracked.stdout.splitlines():
        path = (ROOT / line).resolve()
        owner = next((p for p in path.parents if p in folders), None)  # the innermost package holding it
        if owner is not None and path.suffix != ".py" and path not in packaged:
            missing.append(f"{line} (package {folders[owner]})")
    assert not missing, f"add these to [tool.setuptools.package-data] in pyproject.toml: {missing}"
    assert (ROOT / "models" / "pins.toml").resolve() in packaged
