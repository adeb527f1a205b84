"""The gated MLP: `down(act(gate(x)) * up(x))`, the activation a config option."""

from __future__ import annotations

import jax
from flax import nnx
from jaxtyping import Array, Float

from specjax import sharding
from specjax.models import linear
from specjax.models.config import Activation, ModelConfig
from specjax.models.layers import params


def activation(kind: Activation):
    """The gate's activation function."""
    match kind:
        case Activation.SILU:
            return jax.nn.silu
        case Activation.GELU_TANH:
            return lambda x: jax.nn.gelu(x, approximate=True)
        case _:
            raise ValueError(f"MLP activation {kind!r} is not supported; supported: "
                             f"{', '.join(repr(a.value) for a in Activation)}")


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        self.dtype = c.compute_dtype
        self.layout = c.weight_layout
        self.arith = c.weights_arith
        self.activation = c.mlp_activation
        self.w_gate = params.dense(rngs, c.dim, c.ffn_dim, c, c.dim**-0.5, ("embed", "ffn"))
        self.w_up = params.dense(rngs, c.dim, c.ffn_dim, c, c.dim**-0.5, ("embed", "ffn"))
        self.w_down = params.dense(rngs, c.ffn_dim, c.dim, c, c.ffn_dim**-0.5, ("ffn", "embed"))

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        dt = self.dtype
        ws = tuple(params.weight(w, dt, self.layout, keep_packed=True, arith=self.arith) for w in (self.w_gate, self.w_up))
        gate, up = linear.dense_many(x, ws, self.layout)
        h = activation(self.activation)(gate) * up
        h = sharding.constrain(h, ("batch", None, "ffn"))
        return linear.dense(h, params.weight(self.w_down, dt, self.layout, keep_packed=True, arith=self.arith),
                            self.layout)
