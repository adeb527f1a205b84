"""Saving and loading Medusa heads (apart from the base model); the heads shipped with specjax.

A heads directory holds `manifest.json` and the orbax-saved parameters in `params-<id>/`, the
directory the manifest names. `save_heads` writes a fresh `params-<id>/` first and then replaces
`manifest.json` in one `os.replace`: that rename is the commit point, so a reader sees the old heads
or the new ones, never a mix, and a save that fails leaves the previous heads loadable.

The manifest says what the heads belong to: the target model's name and `weights_id`, the
`HeadsConfig` fields (K = num_heads), the training data and steps, and the measured accuracies.
`load_heads` refuses heads trained for another model with a message that names both.

Training checkpoints live in `train_heads.checkpoint` (inference never imports training).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import uuid
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from specjax.models.eagle import check_draft_ids
from specjax.models.heads import HeadsConfig, MedusaHeads

MANIFEST = "manifest.json"
SHIPPED = pathlib.Path(__file__).resolve().parent / "shipped"


def shipped_heads_dir(model_name: str) -> pathlib.Path | None:
    """The heads shipped in the package for `model_name` (`shipped/<model_name>/`), or None."""
    path = SHIPPED / model_name
    return path if (path / MANIFEST).is_file() else None


def params_of(heads: MedusaHeads) -> dict:
    """The heads' trainable parameters as a plain dict of arrays ({"w", "b"[, "proj"]})."""
    return nnx.to_pure_dict(nnx.state(heads, nnx.Param))


def heads_from_params(config: HeadsConfig, params: dict) -> MedusaHeads:
    """A `MedusaHeads` module holding `params` (shapes are checked against `config`)."""
    graphdef, abstract = nnx.split(abstract_heads(config))
    want = nnx.to_pure_dict(abstract)
    if set(want) != set(params):
        raise ValueError(f"heads parameters {sorted(params)} do not match the config's {sorted(want)}")
    for k, v in want.items():
        if tuple(params[k].shape) != tuple(v.shape):
            raise ValueError(f"heads parameter {k}: shape {tuple(params[k].shape)}, config expects {v.shape}")
    return nnx.merge(graphdef, {k: jnp.asarray(v) for k, v in params.items()})


def abstract_heads(config: HeadsConfig) -> MedusaHeads:
    """Shapes only; an own projection is given a stand-in base, since its values are restored anyway."""
    def make():
        base = None
        if config.own_projection:  # traced under eval_shape: nothing is allocated
            lm_head = jnp.zeros((config.dim, config.vocab_size), jnp.float32)
            base = SimpleNamespace(lm_head_weight=lambda: (lm_head, "kn"))
        return MedusaHeads(config, base=base)

    return nnx.eval_shape(make)


def save_heads(path: str | os.PathLike, heads: MedusaHeads, manifest: dict) -> None:
    """Saves heads and their manifest into directory `path`, atomically (see module docstring).

    Args:
      path: the heads directory (created if needed; earlier heads in it are replaced).
      heads: the trained heads.
      manifest: JSON-serialisable facts about them: at least `model` and `weights_id` of the target.
        `heads_config` (the `HeadsConfig` fields) and `num_heads` are filled in here.
    """
    manifest = dict(manifest, heads_config=dataclasses.asdict(heads.config), num_heads=heads.config.num_heads,
                    format="specjax-medusa-heads/1")
    save_atomically(path, params_of(heads), manifest, _read_manifest(pathlib.Path(path), missing_ok=True))


def save_atomically(path: str | os.PathLike, tree, manifest: dict, old: dict | None) -> None:
    """Writes `tree` (orbax) under a fresh `params-*` name, then replaces `manifest.json` (which
    names it), then removes the checkpoint the `old` manifest named: a reader sees the old set or
    the new one, never a mix. The manifest must be JSON-serialisable; that fails before any write,
    and so does an `old` manifest whose `params` lies outside `path` (nothing outside is removed)."""
    path = pathlib.Path(path).resolve()
    stale = params_path(path, old["params"]) if old and old.get("params") is not None else None
    path.mkdir(parents=True, exist_ok=True)
    params_dir = f"params-{uuid.uuid4().hex[:12]}"
    text = json.dumps(dict(manifest, params=params_dir), indent=1, sort_keys=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / params_dir, tree)
        ckptr.wait_until_finished()
    tmp = path / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(text)
    os.replace(tmp, path / MANIFEST)
    if stale is not None and stale != path / params_dir:
        shutil.rmtree(stale, ignore_errors=True)


def params_path(directory: str | os.PathLike, name) -> pathlib.Path:
    """The checkpoint a manifest in `directory` names (`params`), resolved; it must lie inside
    `directory` (symbolic links followed), so that nothing outside is read or removed.

    Raises:
      ValueError: `name` is not a relative path to something below `directory` (`../x`, an absolute
        path, the directory itself, a link out of it).
    """
    base = pathlib.Path(directory).resolve()
    try:
        ok = isinstance(name, str) and bool(name) and not os.path.isabs(name)
        target = (base / name).resolve() if ok else None
    except (OSError, RuntimeError, ValueError):  # a link loop, a NUL byte
        ok = False
    if not ok or base not in target.parents:
        raise ValueError(f"{base / MANIFEST} names params={name!r}, which is not inside {base}: a manifest "
                         "names a checkpoint in its own directory (params-<id>), and nothing outside it is "
                         "read or removed. Re-copy the directory, or remove its manifest.json to save anew")
    return target


def load_heads(path: str | os.PathLike, *, model_name: str | None = None,
               weights_id: str | None = None) -> tuple[MedusaHeads, dict]:
    """Loads heads saved by `save_heads`; returns (heads, manifest).

    Args:
      path: the heads directory.
      model_name: the loaded target's name; heads trained for another model are refused.
      weights_id: the loaded target's `weights_id`; heads trained on other weights are refused.

    Raises:
      ValueError: no or corrupt checkpoint, or heads trained for another model; the message says
        which model the heads belong to, which is loaded, and what to do.
    """
    path = pathlib.Path(path)
    manifest = _read_manifest(path)
    _check_target(path, manifest, model_name, weights_id)
    checkpoint = params_path(path, manifest["params"])
    try:
        config = HeadsConfig(**manifest["heads_config"])
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                              nnx.to_pure_dict(nnx.state(abstract_heads(config), nnx.Param)))
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(checkpoint, target)
        return heads_from_params(config, params), manifest
    except Exception as e:  # orbax raises many kinds; they all mean the same thing here
        raise ValueError(f"Medusa heads checkpoint at {path} is corrupt or incomplete "
                         f"({type(e).__name__}: {str(e)[:200]}); re-copy it or retrain with "
                         "`specjax train-heads`") from e


def load_extras(path: str | os.PathLike, vocab_size: int) -> dict:
    """What `specjax tune-heads` wrote beside the heads: `vocab` (token ids the heads may propose,
    from `vocab.json`) and `tree` (the tuned candidate tree, from `tree.json`); None where absent.

    Raises:
      ValueError: a file that is not JSON, or a vocabulary that is not token ids in [0, vocab_size);
        the message names the file (and the first bad id).
    """
    out = {}
    for name in ("vocab", "tree"):
        f = pathlib.Path(path) / f"{name}.json"
        try:
            out[name] = json.loads(f.read_text()) if f.is_file() else None
        except ValueError as e:
            raise ValueError(f"{f} is not valid JSON ({e}); re-run `specjax tune-heads` or delete it") from None
    if out["vocab"] is not None:
        fix = "; re-run `specjax tune-heads` for these heads or delete the file"
        vocab = out["vocab"] if isinstance(out["vocab"], list) else None  # np.asarray would take a dict whole
        ids = check_draft_ids(vocab, vocab_size, what=str(pathlib.Path(path) / "vocab.json"), fix=fix)
        out["vocab"] = tuple(int(t) for t in ids)
    return out


def _read_manifest(path: pathlib.Path, *, missing_ok: bool = False) -> dict | None:
    file = path / MANIFEST
    if not file.is_file():
        if missing_ok:
            return None
        what = "does not exist" if not path.exists() else f"has no {MANIFEST}"
        raise ValueError(f"no Medusa heads at {path}: it {what}. Pass a directory written by "
                         "`specjax train-heads --out DIR`")
    try:
        manifest = json.loads(file.read_text())
        if not isinstance(manifest, dict) or "heads_config" not in manifest or "params" not in manifest:
            raise ValueError("heads_config or params missing")
    except ValueError as e:
        if missing_ok:
            return None
        raise ValueError(f"Medusa heads manifest {file} is corrupt ({e}); re-copy the heads directory "
                         "or retrain with `specjax train-heads`") from None
    return manifest


def _check_target(path, manifest: dict, model_name: str | None, weights_id: str | None) -> None:
    theirs = f"{manifest.get('model')!r} (weights {manifest.get('weights_id')})"
    ours = f"{model_name!r} (weights {weights_id})"
    fix = (f"Load them with that model, or train heads for this one: "
           f"`specjax train-heads --model {model_name or 'MODEL'} --out DIR`.")
    if model_name is not None and manifest.get("model") != model_name:
        raise ValueError(f"Medusa heads at {path} were trained for model {theirs}, "
                         f"but the loaded model is {ours}. {fix}")
    if weights_id is not None and manifest.get("weights_id") not in (None, weights_id):
        raise ValueError(f"Medusa heads at {path} were trained on other weights of {theirs}; "
                         f"the loaded model is {ours}. {fix}")
