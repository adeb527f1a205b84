"""A heads manifest names its checkpoint inside its own directory; any other path is refused.

`save_atomically` removes the checkpoint the previous manifest named, and the loaders restore the one
it names: a manifest saying `../x`, an absolute path, the directory itself or a link out of it must
give one clear error, and nothing outside the directory may be read or removed.
"""

import json
import os

import numpy as np
import pytest
from flax import nnx

from specjax.serving.engine import Engine
from specjax.models import eagle_io, heads_io
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.models.heads import HeadsConfig, MedusaHeads

BAD = ["../outside", "ABSOLUTE", ".", "params-link", "", "sub/../../outside"]


def _medusa(model):
    return MedusaHeads(HeadsConfig.for_model(model.config, num_heads=2), rngs=nnx.Rngs(0))


def _eagle(model):
    return EagleHead(EagleConfig.for_model(model.config, draft_vocab=8), rngs=nnx.Rngs(0))


def _sentinel(tmp_path):
    out = tmp_path / "outside"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    (out / "params-a").mkdir()  # shaped like a checkpoint, so a careless rmtree would take it
    return out


def _point_manifest_at(heads_dir, bad, sentinel):
    """Rewrites `params` in the manifest; returns the manifest text."""
    if bad == "ABSOLUTE":
        bad = str(sentinel)
    if bad == "params-link":
        os.symlink(sentinel, heads_dir / "params-link")
    manifest = json.loads((heads_dir / "manifest.json").read_text())
    manifest["params"] = bad
    text = json.dumps(manifest)
    (heads_dir / "manifest.json").write_text(text)
    return text


def _untouched(heads_dir, sentinel, text, before):
    assert (sentinel / "keep.txt").read_text() == "precious" and (sentinel / "params-a").is_dir()
    assert (heads_dir / "manifest.json").read_text() == text  # the manifest was not replaced
    assert sorted(p.name for p in heads_dir.iterdir()) == before  # no new checkpoint was written


@pytest.mark.parametrize("bad", BAD)
def test_medusa_manifest_outside_its_directory_is_refused(tiny_model, tmp_path, bad):
    heads_dir = tmp_path / "heads"
    sentinel = _sentinel(tmp_path)
    heads_io.save_heads(heads_dir, _medusa(tiny_model), dict(model="tiny", weights_id="w"))
    text = _point_manifest_at(heads_dir, bad, sentinel)
    before = sorted(p.name for p in heads_dir.iterdir())
    with pytest.raises(ValueError, match="not inside") as e:
        heads_io.load_heads(heads_dir)
    assert str(heads_dir / "manifest.json") in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not inside"):
        Engine(tiny_model, name="tiny").load_asset("medusa", str(heads_dir))
    with pytest.raises(ValueError, match="not inside"):  # saving would have removed what it names
        heads_io.save_heads(heads_dir, _medusa(tiny_model), dict(model="tiny", weights_id="w"))
    _untouched(heads_dir, sentinel, text, before)


@pytest.mark.parametrize("bad", BAD)
def test_eagle_manifest_outside_its_directory_is_refused(tiny_model, tmp_path, bad):
    head_dir = tmp_path / "head"
    sentinel = _sentinel(tmp_path)
    ids = np.arange(8)
    eagle_io.save_head(head_dir, _eagle(tiny_model), ids, dict(model="tiny", weights_id="w"))
    text = _point_manifest_at(head_dir, bad, sentinel)
    before = sorted(p.name for p in head_dir.iterdir())
    with pytest.raises(ValueError, match="not inside"):
        eagle_io.load_head(head_dir)
    with pytest.raises(ValueError, match="not inside"):
        Engine(tiny_model, name="tiny").load_asset("eagle", str(head_dir))
    with pytest.raises(ValueError, match="not inside"):
        eagle_io.save_head(head_dir, _eagle(tiny_model), ids, dict(model="tiny", weights_id="w"))
    _untouched(head_dir, sentinel, text, before)


def test_saving_again_replaces_the_checkpoint_inside(tiny_model, tmp_path):
    """The check does not get in the way of the normal case: the old checkpoint is removed."""
    heads_dir = tmp_path / "heads"
    heads_io.save_heads(heads_dir, _medusa(tiny_model), dict(model="tiny", weights_id="w"))
    first = json.loads((heads_dir / "manifest.json").read_text())["params"]
    heads_io.save_heads(heads_dir, _medusa(tiny_model), dict(model="tiny", weights_id="w"))
    second = json.loads((heads_dir / "manifest.json").read_text())["params"]
    assert first != second and not (heads_dir / first).exists() and (heads_dir / second).is_dir()
    heads_io.load_heads(heads_dir, model_name="tiny")


def test_shipped_manifests_name_their_own_checkpoints():
    for d in (heads_io.shipped_heads_dir("smollm2-135m"), eagle_io.shipped_eagle_dir("smollm2-135m")):
        name = json.loads((d / "manifest.json").read_text())["params"]
        assert heads_io.params_path(d, name) == (d / name).resolve()
