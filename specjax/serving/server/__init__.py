"""`specjax serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

One engine thread owns the `Scheduler` (`engine_thread`); the Starlette app (`app`) validates
requests (`protocol`) behind API keys (`auth`) and limits (`guard`), hands them over as messages,
and streams the tokens back; `metrics` exports the Prometheus metrics. `run` serves until SIGTERM /
SIGINT, then drains: the port stays open, new requests get 503 with Retry-After, those in flight
finish (bounded by `drain_timeout`, then they end "cancelled"), and it returns 0.

Example:
  >>> eng = Engine.load("smollm2-135m")
  >>> server = Server(scheduler_for(eng, method="auto", slots=8), ServeConfig(model_name="smollm2-135m"))
  >>> run(server, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import signal
import threading
from typing import Callable

from specjax.core.slots import BatchEngine, RunningBatch
from specjax.methods.config import SpecConfig
from specjax.serving.constraints import ConstraintLimits
from specjax.serving.controller import ControllerConfig
from specjax.serving.engine import Engine, GenerateOptions
from specjax.serving.scheduler import Scheduler
from specjax.serving.server.app import MAX_BODY_BYTES, ServeConfig, Server
from specjax.serving.server.auth import read_key_file
from specjax.serving.server.engine_thread import End, EngineThread, Job, NotAccepting, QueueFull

__all__ = ["MAX_BODY_BYTES", "ConstraintLimits", "End", "EngineThread", "Job", "NotAccepting", "QueueFull",
           "ServeConfig", "Server", "read_key_file", "run", "scheduler_for"]


def scheduler_for(engine: Engine, *, method: str = "auto", spec: SpecConfig | None = None, slots: int = 8,
                  max_tokens: int = 256, max_prompt_tokens: int = 512, temperature: float = 0.0,
                  chunk: int = 8, batch_sizes=None, controller: ControllerConfig | None = None,
                  history: int = 4096, constraint_pool: ConstraintLimits | None = None,
                  logit_bias: int = 300, logprobs: int | None = 20,
                  batch_engine: Callable[..., BatchEngine] = RunningBatch) -> Scheduler:
    """The scheduler a server runs: `method` "auto" (the controller; plain among its options),
    "none", or a fixed method (`spec`) with the plain loop compiled beside it, so that a request
    may say "speculation": "off". `temperature` > 0 compiles the sampled programs (and is each
    request's default); `history` bounds the request list and the chunk log; `constraint_pool`: the
    largest constraint a request may bring (`response_format`, `regex`, `choice`; None: refused);
    `logit_bias`: the most logit_bias entries a request may bring (0: refused); `logprobs`: the
    most alternatives per token a request may ask for with its logprobs (None: refused);
    `batch_engine`: what builds the batch in flight (`Scheduler(batch_engine=)`)."""
    opts = GenerateOptions(max_new_tokens=max_tokens, temperature=temperature)
    if method == "auto":
        s = "auto"
    elif method == "none":
        s = SpecConfig()
    else:
        s = spec or SpecConfig(method=method, k=4)
    return Scheduler(engine, slots=slots, spec=s, controller=controller, opts=opts, chunk=chunk,
                     max_prompt_tokens=max_prompt_tokens, batch_sizes=batch_sizes,
                     with_plain=True, history=history, constraint_pool=constraint_pool, logit_bias=logit_bias,
                     logprobs=logprobs, batch_engine=batch_engine)


def run(server: Server, *, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
        log_level: str = "info") -> int:
    """Serves until SIGTERM or SIGINT, then drains: the port stays open and new requests get 503
    with Retry-After (/health 503 "draining"), while those in flight get `drain_timeout` seconds to
    finish; then what is left ends with finish_reason "cancelled" (its clients get that answer),
    the port closes once every response is sent, and it returns 0. A second SIGINT exits at once."""
    import uvicorn

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):  # no re-raise of the signal afterwards: a drain is a clean exit
            if not server.draining:
                drainer = server.drain(drain_timeout)
                threading.Thread(target=lambda: (drainer.join(), setattr(self, "should_exit", True)),
                                 name="specjax-drained", daemon=True).start()
            elif sig == signal.SIGINT:
                self.should_exit = self.force_exit = True

    # uvicorn waits for the connections past the drain, so that the "cancelled" ends reach their clients
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=10)
    _Uvicorn(config).run()
    return 0
