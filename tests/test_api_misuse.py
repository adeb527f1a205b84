"""API misuse gets one clear error before anything compiles: a string where a list of prompts is
expected, a batch size below 1, a streaming chunk or a step count below 1, a prompt that is not a
list of token ids. (Before, `generate("text")` decoded one prompt per character, `batch_size=-1`
returned [], and `stream(chunk=0)` never returned.)"""

import pytest

from specjax.methods.config import SpecConfig
from specjax.core.decoder import Inputs
from specjax.serving.engine import Engine, GenerateOptions
from specjax.serving.scheduler import Scheduler


class CharTokenizer:
    """One token per character (mod the vocabulary): enough for the engine's string path."""

    stop_ids = ()

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text, add_bos=True):
        return [ord(c) % self.vocab for c in text]

    def decode(self, ids, skip_special=False):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.fixture
def eng(tiny_model):
    return Engine(tiny_model, CharTokenizer(tiny_model.config.vocab_size))


def test_a_string_for_the_prompts_is_refused(eng):
    for call in (lambda: eng.generate("text", max_new_tokens=2),
                 lambda: eng.start("text", GenerateOptions(max_new_tokens=2)),
                 lambda: eng.check("text", GenerateOptions(max_new_tokens=2))):
        with pytest.raises(ValueError, match=r"pass a list of prompts, e\.g\. \['text'\]"):
            call()
    assert eng.compile_count == 0


@pytest.mark.parametrize("prompts, match", [
    ([1, 2, 3], "prompt 0 is 1: each prompt is a string or a list of integer token ids"),
    ([[1, 2], [3, 2.5]], "prompt 1 is"),
    ([[1, [2]]], "prompt 0 is"),
    (42, "pass a list of prompts"),
])
def test_prompts_that_are_not_lists_of_token_ids_are_refused(eng, prompts, match):
    with pytest.raises(ValueError, match=match):
        eng.generate(prompts, max_new_tokens=2)
    assert eng.compile_count == 0


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, "2", True])
def test_batch_size_below_one_is_refused(eng, batch_size):
    with pytest.raises(ValueError, match=f"batch_size={batch_size!r}: must be an integer >= 1"):
        eng.generate([[1, 2], [3]], max_new_tokens=2, batch_size=batch_size)
    with pytest.raises(ValueError, match="batch_size.*must be an integer >= 1"):
        eng.start([[1, 2]], GenerateOptions(max_new_tokens=2), batch_size=batch_size)
    assert eng.compile_count == 0


def test_stream_chunk_and_decode_steps_below_one_are_refused(eng):
    batch = eng.start([[1, 2, 3]], GenerateOptions(max_new_tokens=4), spec=SpecConfig(method="ngram", k=2))
    for chunk in (0, -3, 1.5, None):
        with pytest.raises(ValueError, match=f"chunk={chunk!r}: must be an integer >= 1"):
            batch.stream(chunk=chunk)  # at the call, not at the first next()
    assert batch.state is None  # nothing ran
    batch.prefill()
    for steps in (0, -1):
        with pytest.raises(ValueError, match=f"steps={steps}: must be an integer >= 1"):
            batch.decode(steps)
    chunks = list(batch.stream(chunk=1))  # the valid calls still work, and end
    assert sum(len(c[0]) for c in chunks) == 4


def test_functional_inputs_refuse_the_same_misuse():
    with pytest.raises(ValueError, match="pass a list of prompts"):
        Inputs.create("123")
    with pytest.raises(ValueError, match="pass a list of prompts"):
        Inputs.create([1, 2, 3])
    with pytest.raises(ValueError, match="pass a list of prompts"):
        Inputs.create(["abc"])
    for b in (0, -1):
        with pytest.raises(ValueError, match=f"batch_size={b}: must be an integer >= 1"):
            Inputs.create([[1, 2]], batch_size=b)
    with pytest.raises(ValueError, match="prompt 1 has a negative token id"):
        Inputs.create([[1, 2], [3, -4]])
    assert Inputs.create([[1, 2]], batch_size=2).batch_size == 2


def test_scheduler_submit_refuses_a_prompt_that_is_not_token_ids(eng):
    sched = Scheduler(eng, slots=2, opts=GenerateOptions(max_new_tokens=4))
    with pytest.raises(ValueError, match="prompt 0 is 7"):
        sched.submit(7)
    with pytest.raises(ValueError, match="prompt 0 is"):
        sched.submit([[1, 2]])
    assert sched.submit([1, 2]) == 0 and sched.submit("hi") == 1


def test_a_mesh_is_an_explicit_argument_and_unknown_axis_names_are_refused(eng):
    """A mesh reaches specjax only as an argument (`Decoder(mesh=)`, `Engine(mesh=)`), checked there:
    one whose axes are not specjax's would run without any sharding constraint, so it is one clear
    error. JAX's ambient mesh (`jax.set_mesh`) is not read: the same call under it gives the same
    tokens and traces no constraint."""
    import jax
    import numpy as np

    from specjax import Decoder, sharding

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match=r"mesh axes \('dp',\): specjax needs exactly .*make_mesh"):
        Decoder(cache_length=16, mesh=mesh)
    with pytest.raises(ValueError, match="make_mesh"):
        Engine(eng.model, mesh=mesh)
    with pytest.raises(ValueError, match="make_mesh"):
        with sharding.use(mesh):
            pass
    want = eng.generate([[1, 2, 3]], max_new_tokens=3)[0].tokens
    with jax.set_mesh(mesh):
        assert not sharding.active()
        assert eng.generate([[1, 2, 3]], max_new_tokens=3)[0].tokens == want
    assert not sharding.active()
