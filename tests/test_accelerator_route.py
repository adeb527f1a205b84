"""The accelerator route of the draft heads (`tools/accelerator_heads.py`), run here on CPU at the
smallest size: what `pack` writes fits the device tool's carry, and `train` needs no tokenizer, only
the two carried halves, and leaves a loadable head per budget."""

import json
import runpy
import shutil
import sys

import numpy as np
import pytest

SCRIPT = "tools/accelerator_heads.py"
NO_TOKENIZER = ("tokenizers", "jinja2", "safetensors", "starlette", "uvicorn", "pydantic", "prometheus_client",
                "httpx", "transformers", "torch")


@pytest.fixture(scope="module")
def route():
    return runpy.run_path(SCRIPT)


def test_ids_round_trip(route):
    items = [(np.arange(n, dtype=np.int32), np.arange(n) % 2 == 0) for n in (3, 1, 5)]
    back = route["_unflat"](**route["_flat"](items))
    assert all((a == c).all() and (b == d).all() for (a, b), (c, d) in zip(items, back))


@pytest.mark.slow
def test_pack_then_train_without_a_tokenizer(route, smollm2_path, tmp_path, monkeypatch):
    from specjax.models import eagle_io

    manifest = route["pack"](tmp_path / "stage", conversations=2, self_prompts=2, seq_len=64, log=lambda m: None)
    for half in ("a", "b"):
        assert route["_size"](tmp_path / "stage" / half) <= route["LIMIT"]
    device = tmp_path / "device"  # what the two device calls leave on the machine
    shutil.copytree(tmp_path / "stage" / "a", device)
    with pytest.raises(FileNotFoundError, match="copy both carried halves"):
        route["train"](device, tmp_path / "out", budgets=(1,), log=lambda m: None)
    shutil.copytree(tmp_path / "stage" / "b", device, dirs_exist_ok=True)
    for name in NO_TOKENIZER:
        monkeypatch.setitem(sys.modules, name, None)  # importing any of them now fails
    report = route["train"](device, tmp_path / "out", budgets=(1, 2), batch_size=2, seq_len=64, unroll=2,
                            max_new_tokens=4, gen_batch_size=2, forward_batch_size=2, n_eval=1, minutes=10,
                            log=lambda m: None)
    assert report["sequences"] == manifest["conversations"] + manifest["self_prompts"] == 4
    assert [r["step"] for r in report["budgets"]] == [1, 2]
    assert set(report["seconds"]) == {"load", "self_distill", "extract", "train"}
    for b in (1, 2):
        head, ids, meta = eagle_io.load_head(tmp_path / "out" / f"head-{b}")
        assert meta["weights_id"] == manifest["weights_id"] and meta["steps"] == b
    assert json.loads((tmp_path / "out" / "report.json").read_text())["positions"] > 0
    assert not (tmp_path / "out" / "checkpoints").exists()
