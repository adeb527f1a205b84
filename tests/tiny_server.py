"""The tiny served model and the helpers the server tests share: a character-level tokenizer over
the tiny random model, its server (prompt lookup k=4 beside the plain loop, 4 slots), and a
uvicorn runner on a free port of 127.0.0.1 that always stops. Every wait is bounded."""

import contextlib
import functools
import socket
import threading
import time

import httpx
from conftest import need_module
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from specjax.core.slots import RunningBatch
from specjax.methods.config import SpecConfig
from specjax.models import config as model_config
from specjax.models import loader
from specjax.models.tokenizer import Tokenizer
from specjax.serving import server as srv
from specjax.serving.engine import Engine

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,:\n=-_0")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MODEL = "tiny"
MAX_TOKENS = 24
PROMPTS = ["abc abc abc", "key = value\nkey = ", "Hello there", "x: 1, y: 2, z:"]


def tiny_engine() -> Engine:
    """The tiny random model (vocabulary 64) with a character-level tokenizer and ChatML."""
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    backend = Backend(models.WordLevel(vocab, unk_token="_"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    backend.add_special_tokens(SPECIALS)
    backend.decoder = decoders.Fuse()
    tok = Tokenizer(backend, bos_id=None, eos_id=0, chat_template=CHATML)
    return Engine(loader.init_model(model_config.preset("tiny"), seed=0), tok, buckets=(32, 64), name=MODEL)


class HookedBatch(RunningBatch):
    """The server tests' batch engine (`Scheduler(batch_engine=)`, a `specjax.core.slots.BatchEngine`):
    the library's own, with two hooks a test sets to inject what a device or a request may do.

    Attributes:
      before_insert: called with a request's inputs before its prefill; it may raise (a failed prefill).
      before_run: called before each chunk; it may raise (a device error) or sleep (a slow chunk).
    """

    before_insert = None
    before_run = None

    def insert(self, slot, inputs, *, bare=False):
        if self.before_insert is not None:
            self.before_insert(inputs)
        return super().insert(slot, inputs, bare=bare)

    def run(self, o, steps, *, size=None):
        if self.before_run is not None:
            self.before_run()
        return super().run(o, steps, size=size)


def tiny_server(eng: Engine, temperature: float = 0.0, **config) -> srv.Server:
    sched = srv.scheduler_for(eng, method="ngram", spec=SpecConfig(method="ngram", k=4), slots=4,
                              max_tokens=MAX_TOKENS, max_prompt_tokens=64, chunk=4, history=64,
                              temperature=temperature, batch_engine=HookedBatch)
    return srv.Server(sched, srv.ServeConfig(model_name=MODEL, **{"max_queue": 40, **config}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, timeout: float, what: str, every: float = 0.05):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if cond():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def running(server):
    """The server (or a bare ASGI app with /health) on a free port of 127.0.0.1 in a thread, until
    warm; stopped afterwards."""
    uvicorn = need_module("uvicorn")
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(getattr(server, "app", server), host="127.0.0.1", port=port,
                                       log_level="warning"))
    th = threading.Thread(target=uv.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: healthy(url), 300, "the server's warm-up")
        yield url
    finally:
        uv.should_exit = True
        th.join(timeout=60)
        engine = getattr(server, "engine", None)
        if engine is not None and engine.thread.ident is not None:  # started
            engine.thread.join(timeout=60)
        # a server or engine thread left running would compute beside the tests that follow
        assert not th.is_alive(), "the uvicorn thread did not stop within 60 s"
        assert engine is None or not engine.thread.is_alive(), "the engine thread did not stop within 60 s"


@functools.cache
def shared_engine() -> Engine:
    """One tiny engine for the server test modules of a process: its programs compile once."""
    return tiny_engine()


def idle(server: srv.Server) -> bool:
    return server.sched.snapshot().idle and server.engine.pending == 0
