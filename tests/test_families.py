"""The family registry: a new family is one module (here, this file), its loader name map and its
registry entry; nothing else in the code changes for it."""

import json

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from specjax.methods.config import SpecConfig
from specjax.models import config as model_config
from specjax.models import families, hf_config, loader
from specjax.models.layers.attention import Attention
from specjax.models.layers.mlp import MLP
from specjax.models.layers.norms import RMSNorm
from specjax.models.transformer import Transformer
from specjax.serving.engine import Engine


# ---- a toy family, from this file alone: GPT-J's parallel block over the shared layers -------------


class ParallelBlock(nnx.Module):
    """`x + attn(norm(x)) + mlp(norm(x))`: one norm, attention and MLP side by side."""

    def __init__(self, config, layer, rngs):
        self.norm = RMSNorm(config.dim, config.norm_eps, config.weight_dtype)
        self.attn = Attention(config, rngs, config.kind(layer))
        self.mlp = MLP(config, rngs)

    def __call__(self, x, access, k_buf, v_buf):
        h = self.norm(x)
        a, k_buf, v_buf = self.attn(h, access, k_buf, v_buf)
        return x + a + self.mlp(h), k_buf, v_buf


class Toy(Transformer):
    Block = ParallelBlock


TOY_NAMES = {"ln.weight": "norm.scale", "attn.q.weight": "attn.wq", "attn.k.weight": "attn.wk",
             "attn.v.weight": "attn.wv", "attn.o.weight": "attn.wo", "mlp.gate.weight": "mlp.w_gate",
             "mlp.up.weight": "mlp.w_up", "mlp.down.weight": "mlp.w_down"}


def toy_options(c: dict, arch: str, where: str) -> dict:
    theta, scaling = hf_config.rope_from_hf(c, where)
    return dict(rope_theta=theta, rope_scaling=scaling)


@pytest.fixture
def toy():
    family = families.register(families.Family(name="toy", model=Toy, hf_architectures=("ToyForCausalLM",),
                                               hf_options=toy_options, hf_layer_names=TOY_NAMES))
    yield family
    families.unregister("toy")


CONFIG = model_config.preset("tiny", family="toy")


def _write(path, model, extra=None):
    """An HF-style directory of the toy family: config.json, safetensors in its own names."""
    c = model.config
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["ToyForCausalLM"], "vocab_size": c.vocab_size, "hidden_size": c.dim,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "intermediate_size": c.ffn_dim, "tie_word_embeddings": True, "rope_theta": c.rope_theta}))
    ours_to_toy = {v: k for k, v in TOY_NAMES.items()}
    tensors = {}
    for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, w = ".".join(map(str, p)), np.asarray(v[...])
        if v.get_metadata().get("dense_layout") == "kn":
            w = w.T  # HF's [out, in]
        if name == "embed":
            key = "model.embed_tokens.weight"
        elif name == "norm.scale":
            key = "model.norm.weight"
        else:
            _, i, rest = name.split(".", 2)
            key = f"model.layers.{i}.{ours_to_toy[rest]}"
        tensors[key] = np.ascontiguousarray(w)
    save_file({**tensors, **(extra or {})}, str(path / "model.safetensors"))
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path


def test_a_family_registered_from_a_test_file_loads_and_decodes(toy, tmp_path):
    model = loader.init_model(CONFIG, seed=3)
    assert isinstance(model, Toy) and families.num_params(CONFIG) == model.num_params
    lm = loader.load(str(_write(tmp_path / "toy", model)), weight_layout="kn")
    assert lm.config.family == "toy" and isinstance(lm.model, Toy)
    prompts = [[5, 9, 12, 5, 9, 12, 5, 9], [40, 41, 42, 43, 40, 41]]
    eng = Engine(lm.model, lm.tokenizer)
    plain = eng.generate(prompts, max_new_tokens=12, stop_ids=())
    ref = Engine(model).generate(prompts, max_new_tokens=12, stop_ids=())
    assert [r.tokens for r in plain] == [r.tokens for r in ref]
    spec = eng.generate(prompts, max_new_tokens=12, stop_ids=(), spec=SpecConfig(method="ngram", k=3))
    assert [r.tokens for r in spec] == [r.tokens for r in plain]


def test_the_toy_loader_names_an_unknown_tensor(toy, tmp_path):
    model = loader.init_model(CONFIG, seed=3)
    path = _write(tmp_path / "toy", model, extra={"model.layers.0.attn.q_norm.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="tensor 'model.layers.0.attn.q_norm.weight' has no place in specjax's toy"):
        loader.load(str(path))


def test_registry_refuses_clashes_and_unknown_families(toy):
    with pytest.raises(ValueError, match="family 'toy' is already registered"):
        families.register(families.Family(name="toy", model=Toy))
    with pytest.raises(ValueError, match="architecture 'ToyForCausalLM' already belongs to family 'toy'"):
        families.register(families.Family(name="toy2", model=Toy, hf_architectures=("ToyForCausalLM",)))
    with pytest.raises(ValueError, match="unknown model family 'nope'; registered: gemma3, llama, qwen3, toy"):
        loader.init_model(model_config.preset("tiny", family="nope"))
    with pytest.raises(ValueError, match="HF architecture \\['FooForCausalLM'\\] is not supported; supported: "
                                         "Gemma3ForCausalLM, LlamaForCausalLM"):
        families.for_hf(["FooForCausalLM"], "config.json")


def test_the_built_in_families_and_their_published_sizes():
    """Parameter counts HF reports: Gemma 3 270M (the tied 262k head counted once)."""
    assert sorted(families.FAMILIES) == ["gemma3", "llama", "qwen3"]
    assert families.num_params(model_config.preset("gemma3-270m")) == 268_098_176
