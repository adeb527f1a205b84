"""Saving and loading EAGLE heads: a directory with `manifest.json` and one orbax checkpoint.

The checkpoint holds the head's parameters and its draft vocabulary (`draft_ids`, the token ids the
head may propose, most frequent first). The manifest names the target (`model`, `weights_id`), the
`EagleConfig`, and what trained the head. Saving writes the checkpoint under a fresh name and then
replaces the manifest, so a reader sees the old head or the new one, never a mix.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from specjax.models.eagle import EagleConfig, EagleHead, check_draft_ids
from specjax.models.heads_io import params_path, save_atomically

MANIFEST = "manifest.json"
FORMAT = "specjax-eagle-head/1"
SHIPPED = pathlib.Path(__file__).resolve().parent / "shipped"


def shipped_eagle_dir(model_name: str) -> pathlib.Path | None:
    """The EAGLE head shipped for `model_name` (`shipped/<model_name>-eagle/`), or None."""
    path = SHIPPED / f"{model_name}-eagle"
    return path if (path / MANIFEST).is_file() else None


def abstract_head(config: EagleConfig) -> EagleHead:
    return nnx.eval_shape(lambda: EagleHead(config, rngs=nnx.Rngs(0)))


def params_of(head: EagleHead) -> dict:
    return nnx.to_pure_dict(nnx.state(head, nnx.Param))


def head_from_params(config: EagleConfig, params: dict) -> EagleHead:
    graphdef, abstract = nnx.split(abstract_head(config))
    want = jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(abstract))
    got = jax.tree.map(lambda x: tuple(x.shape), params)
    if want != got:
        raise ValueError("EAGLE head parameters do not match its config (a checkpoint of another shape)")
    return nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))


def save_head(path: str | os.PathLike, head: EagleHead, draft_ids, manifest: dict) -> None:
    """Saves `head`, its draft vocabulary and `manifest` (needs `model` and `weights_id`) into `path`."""
    ids = check_draft_ids(draft_ids, head.config.vocab_size, fix=": a draft vocabulary holds token ids of the target")
    if ids.shape != (head.config.draft_vocab,):
        raise ValueError(f"draft_ids has shape {ids.shape}; the head's draft vocabulary is {head.config.draft_vocab}")
    save_atomically(path, dict(head=params_of(head), draft_ids=ids),
                    dict(manifest, eagle_config=head.config.to_dict(), format=FORMAT),
                    read_manifest(pathlib.Path(path), missing_ok=True))


def read_manifest(path: pathlib.Path, *, missing_ok: bool = False) -> dict | None:
    f = pathlib.Path(path) / MANIFEST
    if not f.is_file():
        if missing_ok:
            return None
        raise ValueError(f"{path} holds no EAGLE head ({MANIFEST} missing): train one with "
                         "`specjax train-heads --kind eagle --out DIR`")
    manifest = json.loads(f.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not an EAGLE head (format {manifest.get('format')!r}, expected {FORMAT!r})")
    return manifest


def load_head(path: str | os.PathLike, *, model_name: str | None = None,
              weights_id: str | None = None) -> tuple[EagleHead, np.ndarray, dict]:
    """(head, draft_ids, manifest) from a directory written by `save_head`.

    Raises ValueError when it is not an EAGLE head, was trained for another target, names a
    checkpoint outside its directory, or its draft vocabulary holds an id outside the vocabulary.
    """
    path = pathlib.Path(path)
    manifest = read_manifest(path)
    for key, have in (("model", model_name), ("weights_id", weights_id)):
        if have is not None and manifest.get(key) not in (None, have):
            raise ValueError(f"the EAGLE head in {path} was trained for {key}={manifest.get(key)!r}, the loaded "
                             f"target has {have!r}: train a head for this target (specjax train-heads --kind eagle)")
    checkpoint = params_path(path, manifest.get("params"))
    config = EagleConfig.from_dict(manifest["eagle_config"])
    abstract = dict(
        head=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          nnx.to_pure_dict(nnx.state(abstract_head(config), nnx.Param))),
        draft_ids=jax.ShapeDtypeStruct((config.draft_vocab,), jnp.int32))
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(checkpoint, abstract)
    ids = check_draft_ids(np.asarray(params["draft_ids"]), config.vocab_size, what=f"draft_ids in {checkpoint}",
                          fix="; re-copy the head directory or retrain it (specjax train-heads --kind eagle)")
    return head_from_params(config, params["head"]), ids, manifest
