"""RoPE scaling (Llama 3.1+ "llama3", "linear"): read from HF config.json and GGUF metadata, applied as
transformers and llama.cpp apply it, anything else refused at load.

Tiny random checkpoints written by transformers' `save_pretrained`, and the same weights written as a
GGUF the way llama.cpp's converter writes them (the `rope_freqs` tensor for llama3, `rope.scaling.*`
for linear), run past their original context: our logits equal transformers' in fp32.
"""

import dataclasses
import json
import math

import gguf
import numpy as np
import pytest
from conftest import need_module
from test_loaders import flat_weights, random_model, write_gguf
from test_oracle import hf_logits, our_logits

from specjax.models import eagle, gguf_loader, hf_config, hf_loader, loader
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.gguf_loader import GGUFError
from specjax.models.layers.rope import inv_freq as rope_inv_freq

transformers = need_module("transformers")
torch = need_module("torch")

ORIGINAL = 64  # the checkpoints' original context; the prompts run to position T - 1 = 95
T = 96
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL}
LINEAR = {"rope_type": "linear", "factor": 4.0}
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10_000.0,
            initializer_range=0.3)  # sharp attention, so a wrong angle shows in the logits


def tolerance(ref: np.ndarray) -> float:
    """fp32 on CPU: max |ours - transformers| <= 1e-4 * max(1, max |logit|)."""
    return 1e-4 * max(1.0, float(np.abs(ref).max()))


# ---- helpers -----------------------------------------------------------------------------------


def save_hf(path, arch: str, rope: dict, **overrides):
    """A random transformers model with `rope` scaling, saved with save_pretrained (safetensors)."""
    cls, config_cls = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                       "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[arch]
    torch.manual_seed(0)
    hf = cls(config_cls(**{**TINY, **overrides}, rope_scaling=dict(rope))).eval()
    with torch.no_grad():  # random norms and biases too, not their 1 / 0 init
        for _, p in hf.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def load_hf(path):
    config = hf_loader.config_from_hf(path, name="src")
    return loader.model_from_weights(config, hf_loader.weights_from_hf(path, config))


def llama_cpp_rope_freqs(theta: float, head_dim: int, rope: dict) -> np.ndarray:
    """convert_hf_to_gguf.py `LlamaModel.generate_extra_tensors` for rope_type "llama3", step for step.

    (The script reads original_max_position_embeddings from the top level of config.json, default 8192,
    which Llama 3.1's own configs also give; our tiny model's is only in rope_scaling, so it is read there.)
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def gguf_rope_writer(config: ModelConfig, rope: dict):
    """The rope metadata and tensors llama.cpp's converter adds for `rope` (HF's rope_scaling)."""
    def extra(writer: gguf.GGUFWriter):
        writer.add_rope_dimension_count(config.head_dim)
        if rope["rope_type"] == "llama3":
            writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                              llama_cpp_rope_freqs(config.rope_theta, config.head_dim, rope))
        elif rope["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        else:  # what the converter writes for yarn
            writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    return extra


def ids() -> list[int]:
    return [int(i) for i in np.random.default_rng(0).integers(0, TINY["vocab_size"], T)]


# ---- the frequencies ---------------------------------------------------------------------------


def _hf_inv_freq(rope: dict, head_dim: int, theta: float = 10_000.0) -> np.ndarray:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(**{**TINY, "rope_theta": theta}, head_dim=head_dim, rope_scaling=dict(rope))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    assert attention_factor == 1.0  # neither kind rescales the attention
    return inv_freq.numpy()


def _config(rope: dict, head_dim: int, theta: float = 10_000.0) -> ModelConfig:
    c = json.loads(transformers.LlamaConfig(**{**TINY, "rope_theta": theta}, head_dim=head_dim,
                                            rope_scaling=dict(rope)).to_json_string())
    c["architectures"] = ["LlamaForCausalLM"]
    theta_read, scaling = hf_config.rope_from_hf(c)
    assert theta_read == theta
    return ModelConfig(vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                       ffn_dim=64, rope_theta=theta, rope_scaling=scaling)


@pytest.mark.parametrize("head_dim, theta", [(8, 10_000.0), (16, 10_000.0), (64, 500_000.0), (128, 500_000.0)])
@pytest.mark.parametrize("rope", [LLAMA3, {**LLAMA3, "original_max_position_embeddings": 8192},
                                  {**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 16.0}, LINEAR],
                         ids=["llama3", "llama3-8192", "llama3-2-16", "linear"])
def test_inv_freq_matches_transformers(rope, head_dim, theta):
    """`rope_inv_freq` against transformers' own `ROPE_INIT_FUNCTIONS`: within 8 float32 ulp (observed
    at most 5, in the interpolated band, where HF's float32 steps amplify torch's 1-ulp pow rounding)."""
    ours = rope_inv_freq(_config(rope, head_dim, theta))
    ref = _hf_inv_freq(rope, head_dim, theta)
    assert ours.dtype == np.float32 and ours.shape == (head_dim // 2,)
    np.testing.assert_array_max_ulp(ours, ref, maxulp=8)
    plain = rope_inv_freq(dataclasses.replace(_config(rope, head_dim, theta), rope_scaling=None))
    assert not np.allclose(ours, plain)  # the scaling does something at this size


def test_llama3_test_sizes_cover_all_three_bands():
    """The end-to-end models below have kept, interpolated and divided frequencies (HF's bands)."""
    for head_dim in (8, 16):
        inv = _hf_inv_freq(LLAMA3, head_dim)
        plain = 1.0 / (10_000.0 ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
        ratio = plain / inv
        assert np.any(np.isclose(ratio, 1.0)), ratio
        assert np.any(np.isclose(ratio, LLAMA3["factor"])), ratio
        assert np.any(~np.isclose(ratio, 1.0) & ~np.isclose(ratio, LLAMA3["factor"])), ratio


@pytest.mark.parametrize("head_dim, theta", [(8, 10_000.0), (64, 500_000.0), (128, 500_000.0)])
def test_gguf_rope_freqs_equal_llama3(head_dim, theta):
    """llama.cpp's rope_freqs divisors (its converter's numbers) give HF's llama3 frequencies."""
    divisors = llama_cpp_rope_freqs(theta, head_dim, LLAMA3)
    config = dataclasses.replace(_config(LLAMA3, head_dim, theta),
                                 rope_scaling=RopeScaling(kind="rope_freqs", divisors=tuple(divisors)))
    np.testing.assert_allclose(rope_inv_freq(config), _hf_inv_freq(LLAMA3, head_dim, theta), rtol=1e-6, atol=0)


# ---- end to end: HF checkpoint and GGUF against transformers, past the original context ------

CASES = [
    pytest.param("llama", LLAMA3, dict(tie_word_embeddings=True), id="llama3-tied"),
    pytest.param("llama", LLAMA3, dict(tie_word_embeddings=False, head_dim=16), id="llama3-untied-head_dim16"),
    pytest.param("llama", LINEAR, dict(tie_word_embeddings=True), id="linear-tied"),
    pytest.param("llama", LINEAR, dict(tie_word_embeddings=False, head_dim=16), id="linear-untied-head_dim16"),
    pytest.param("qwen2", LINEAR, dict(tie_word_embeddings=False), id="qwen2-linear-biases"),
]


@pytest.mark.parametrize("arch, rope, overrides", CASES)
def test_logits_match_transformers_past_original_context(tmp_path, arch, rope, overrides):
    """HF directory and GGUF of the same weights: logits equal transformers' at all 96 positions, 32 of
    them past the original context of 64; without the scaling they are far off there.

    Observed (jax 0.10 / torch 2.13, CPU): max |ours - HF| 1e-5 to 2.5e-5 on logits up to |8|, against a
    tolerance of 6e-4 to 8e-4; without the scaling, 6 to 9 past the original context."""
    hf = save_hf(tmp_path / "hf", arch, rope, **overrides)
    ref = hf_logits(hf, ids())
    tol = tolerance(ref)

    model = load_hf(tmp_path / "hf")
    c = model.config
    assert c.tie_embeddings == overrides["tie_word_embeddings"] and c.qkv_bias == (arch == "qwen2")
    assert c.rope_scaling.kind == rope["rope_type"] and c.rope_scaling.factor == rope["factor"]
    hash(c)  # static under jit
    ours = our_logits(model, ids())
    assert np.abs(ours - ref).max() <= tol, np.abs(ours - ref).max()

    # the negative control: the same weights without the scaling (what the loader did before)
    unscaled = loader.model_from_weights(dataclasses.replace(c, rope_scaling=None), flat_weights(model))
    off = np.abs(our_logits(unscaled, ids()) - ref)
    assert off[ORIGINAL:].max() > 100 * tol, off[ORIGINAL:].max()

    path = write_gguf(tmp_path / "m.gguf", model, arch=arch, extra=gguf_rope_writer(c, rope))
    lm = loader.load(str(path))
    want_kind = "rope_freqs" if rope["rope_type"] == "llama3" else "linear"
    assert lm.config.rope_scaling.kind == want_kind
    np.testing.assert_allclose(rope_inv_freq(lm.config), rope_inv_freq(c), rtol=1e-6, atol=0)
    from_gguf = our_logits(lm.model, ids())
    assert np.abs(from_gguf - ref).max() <= tol, np.abs(from_gguf - ref).max()


# ---- HF config formats -------------------------------------------------------------------------


def _hf_dir(tmp_path, config: dict):
    """config.json (and a placeholder safetensors file: the config is refused before weights are read)."""
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"placeholder": np.zeros(1, np.float32)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def _base_config(**kw) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
            "max_position_embeddings": 512, **kw}


@pytest.mark.parametrize("form", [
    # transformers < 5: rope_theta at the top, rope_scaling with "rope_type" or the legacy "type"
    {"rope_theta": 500_000.0, "rope_scaling": LLAMA3},
    {"rope_theta": 500_000.0, "rope_scaling": {**{k: v for k, v in LLAMA3.items() if k != "rope_type"},
                                               "type": "llama3"}},
    # transformers >= 5: everything under rope_parameters
    {"rope_parameters": {**LLAMA3, "rope_theta": 500_000.0}},
    # rope_scaling wins over rope_parameters, as in transformers
    {"rope_theta": 500_000.0, "rope_scaling": LLAMA3, "rope_parameters": {"rope_type": "default"}},
], ids=["rope_scaling", "rope_scaling-type", "rope_parameters", "both"])
def test_hf_config_forms(tmp_path, form):
    config = hf_loader.config_from_hf(_hf_dir(tmp_path, _base_config(**form)))
    assert config.rope_theta == 500_000.0
    assert config.rope_scaling == RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_context=ORIGINAL)


@pytest.mark.parametrize("form", [{}, {"rope_scaling": None}, {"rope_parameters": {"rope_type": "default",
                                                                                   "rope_theta": 10_000.0}},
                                  {"rope_scaling": {"type": "default"}}])
def test_hf_no_scaling(tmp_path, form):
    assert hf_loader.config_from_hf(_hf_dir(tmp_path, _base_config(**form))).rope_scaling is None


def test_hf_llama3_original_context_defaults_like_transformers(tmp_path):
    """Without original_max_position_embeddings in the rope dict: the top-level one, else the
    model's max_position_embeddings (transformers' standardize_rope_params)."""
    rope = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    c = hf_loader.config_from_hf(_hf_dir(tmp_path, _base_config(rope_scaling=rope)))
    assert c.rope_scaling.original_context == 512
    c = hf_loader.config_from_hf(_hf_dir(tmp_path, _base_config(rope_scaling=LLAMA3,
                                                                original_max_position_embeddings=32)))
    assert c.rope_scaling.original_context == 32


UNSUPPORTED = ["yarn", "dynamic", "longrope", "su"]


@pytest.mark.parametrize("kind", UNSUPPORTED)
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_hf_unsupported_kind_refused(tmp_path, kind, key):
    rope = {"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    path = _hf_dir(tmp_path, _base_config(**{key: rope}))
    with pytest.raises(ValueError) as e:
        loader.load(str(path))
    msg = str(e.value)
    assert "\n" not in msg and f"rope scaling '{kind}'" in msg and "supported: 'llama3', 'linear'" in msg, msg


def test_hf_unsupported_kind_from_transformers_refused(tmp_path):
    """A yarn checkpoint as transformers saves it."""
    save_hf(tmp_path, "qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    with pytest.raises(ValueError, match=r"^\S*config.json: rope scaling 'yarn' is not supported; supported: "
                                         r"'llama3', 'linear' or none \(rope_type 'default'\)$"):
        loader.load(str(tmp_path))


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "linear"}, "rope scaling 'linear' lacks factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "lacks low_freq_factor, high_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0},
     "0 < low_freq_factor < high_freq_factor"),
    ({"rope_type": "linear", "factor": 0.0}, "factor=0.0 must be a positive number"),
])
def test_hf_bad_scaling_parameters(tmp_path, rope, match):
    with pytest.raises(ValueError, match=match):
        hf_loader.config_from_hf(_hf_dir(tmp_path, _base_config(rope_scaling=rope)))


# ---- GGUF metadata -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig(name="src", vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=8, ffn_dim=64)
    return random_model(config, seed=0)


@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_gguf_unsupported_kind_refused(tmp_path, tiny, kind):
    rope = {"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    path = write_gguf(tmp_path / "m.gguf", tiny, tokenizer=False, extra=gguf_rope_writer(tiny.config, rope))
    with pytest.raises(GGUFError) as e:
        loader.load(str(path))
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg == (f"GGUF rope scaling '{kind}' (llama.rope.scaling.type) is not supported; supported: "
                   "'llama3', 'linear' (llama3 as the rope_freqs tensor) or none")


def test_gguf_plain_and_factor_without_type(tmp_path, tiny):
    """No scaling metadata: none. A factor alone is linear (llama.cpp's default type); a factor with
    rope_freqs divides by both, as llama.cpp does."""
    reader = gguf_loader.open_reader(write_gguf(tmp_path / "a.gguf", tiny, tokenizer=False))
    assert gguf_loader.config_from_gguf(reader).rope_scaling is None

    def factor_only(writer):
        writer.add_rope_scaling_factor(2.0)
    reader = gguf_loader.open_reader(write_gguf(tmp_path / "b.gguf", tiny, tokenizer=False, extra=factor_only))
    assert gguf_loader.config_from_gguf(reader).rope_scaling == RopeScaling(kind="linear", factor=2.0)

    freqs = np.array([1.0, 1.5, 8.0, 8.0], np.float32)

    def both(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
        writer.add_tensor("rope_freqs.weight", freqs)
    reader = gguf_loader.open_reader(write_gguf(tmp_path / "c.gguf", tiny, tokenizer=False, extra=both))
    config = gguf_loader.config_from_gguf(reader)
    assert config.rope_scaling == RopeScaling(kind="rope_freqs", divisors=tuple(2.0 * freqs))
    plain = rope_inv_freq(tiny.config)
    np.testing.assert_allclose(rope_inv_freq(config), plain / (2.0 * freqs), rtol=1e-6)


def test_gguf_inconsistent_rope_metadata(tmp_path, tiny):
    def short_freqs(writer):
        writer.add_tensor("rope_freqs.weight", np.ones(3, np.float32))
    path = write_gguf(tmp_path / "a.gguf", tiny, tokenizer=False, extra=short_freqs)
    with pytest.raises(GGUFError, match="rope_freqs.weight has 3 entries; head_dim=8 needs 4"):
        gguf_loader.config_from_gguf(gguf_loader.open_reader(path))

    def partial(writer):
        writer.add_rope_dimension_count(4)
    path = write_gguf(tmp_path / "b.gguf", tiny, tokenizer=False, extra=partial)
    with pytest.raises(GGUFError, match="rope.dimension_count=4 but head_dim=8"):
        gguf_loader.config_from_gguf(gguf_loader.open_reader(path))


# ---- the config: hashable, validated, carried to the EAGLE head -------------------------------


def test_rope_scaling_config_validation():
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        RopeScaling(kind="yarn", factor=2.0)
    with pytest.raises(ValueError, match="positive finite divisors"):
        RopeScaling(kind="rope_freqs", divisors=(1.0, 0.0))
    with pytest.raises(ValueError, match="rope_freqs has 2 divisors; head_dim=8 needs 4"):
        ModelConfig(vocab_size=8, dim=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, ffn_dim=8,
                    rope_scaling=RopeScaling(kind="rope_freqs", divisors=(1.0, 2.0)))


def test_eagle_head_of_scaled_target_uses_its_frequencies():
    """The EAGLE head's layer config carries the target's scaling, through its JSON manifest too."""
    for scaling in (RopeScaling(kind="llama3", factor=8.0, original_context=ORIGINAL),
                    RopeScaling(kind="rope_freqs", divisors=(1.0, 1.25, 8.0, 8.0))):
        target = ModelConfig(vocab_size=64, dim=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                             ffn_dim=64, rope_scaling=scaling)
        head = eagle.EagleConfig.for_model(target)
        back = eagle.EagleConfig.from_dict(json.loads(json.dumps(head.to_dict())))
        assert back == head and hash(back) == hash(head)
        np.testing.assert_array_equal(rope_inv_freq(back.layer), rope_inv_freq(target))
