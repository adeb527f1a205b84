"""jaxtyping's pytest hook (pyproject.toml's addopts, beartype through tests/typecheck.py) covers every
module of specjax and its models that writes shape annotations, and it runs on the real forward path:
a block, the Transformer's forward and Gemma 3's block fail in the checker on a dimension bound to two
sizes, before any array op sees it."""

import pathlib
import re
import tomllib

import jax.numpy as jnp
import pytest
from jaxtyping import TypeCheckError

from test_kv_cache import CONFIG as GEMMA3  # a tiny Gemma 3: sliding and global layers

from specjax.models import config as model_config, loader
from specjax.models.kv_cache import Access

ROOT = pathlib.Path(__file__).resolve().parents[1]
# a jaxtyping annotation: a dtype class subscripted with an array type and a shape string
SHAPED = re.compile(r"\b(Float|Int|Bool|UInt8|UInt32|Shaped|Key|Real|Num|Integer)\[(jax\.)?Array\b")


def hooked() -> list[str]:
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    return re.search(r"--jaxtyping-packages=(\S+)", addopts).group(1).split(",")


def shaped_modules() -> list[str]:
    """Dotted names of the library modules with a shape annotation (models/ installs as specjax.models)."""
    out = []
    for top, package in (("specjax", "specjax"), ("models", "specjax.models")):
        for path in sorted((ROOT / top).rglob("*.py")):
            if SHAPED.search(path.read_text(encoding="utf-8")):
                parts = path.relative_to(ROOT / top).with_suffix("").parts
                out.append(".".join((package, *(p for p in parts if p != "__init__"))))
    return out


def test_the_hook_covers_every_module_with_shape_annotations():
    names = hooked()
    covered = lambda m: any(m == n or m.startswith(n + ".") for n in names)  # noqa: E731
    modules = shaped_modules()
    assert {"specjax.models.transformer", "specjax.models.layers.attention", "specjax.core.decoder"} <= set(modules)
    missing = [m for m in modules if not covered(m)]
    assert not missing, f"add these to --jaxtyping-packages in pyproject.toml's addopts: {missing}"


def test_the_hook_names_only_modules_that_exist():
    import importlib.util

    for name in hooked():
        if name != "typecheck.typechecked":
            assert importlib.util.find_spec(name) is not None, f"--jaxtyping-packages names {name}, which is gone"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_forward_and_a_block_fail_in_the_checker_on_mismatched_shapes(family):
    cfg = model_config.preset("tiny") if family == "llama" else GEMMA3
    model = loader.init_model(cfg, seed=0)
    assert type(model).__module__ == f"specjax.models.{family}"
    cache = model.init_cache(2, 16)
    positions = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(TypeCheckError):  # B: 1 in tokens, 2 in positions
        model.features(jnp.zeros((1, 4), jnp.int32), positions, cache)
    block, access = model.layers[0], Access.of(cache, cfg, positions)
    x = jnp.zeros((2, 4, cfg.dim), cfg.compute_dtype)
    block(x, access, cache.k[0], cache.v[0])  # the same call with matching shapes runs
    with pytest.raises(TypeCheckError):  # B: 1 in x, 2 in the cache
        block(x[:1], access, cache.k[0], cache.v[0])
