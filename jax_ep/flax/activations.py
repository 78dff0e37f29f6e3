"""The experts' activations: Megatron's GLU experts (fc1 gives [gate | up], the activation
gives act(gate) * up for fc2: SwiGLU, GEGLU, gpt-oss's Quick-GEGLU) and its non-gated MLP
experts (act(fc1): GELU, Nemotron's squared ReLU), and `GatedActivation`, the one MoEConfig
chooses (gated_linear_unit, activation_func, glu_linear_offset,
activation_func_clamp_value, moe_mlp_glu_interleave_size)."""

from __future__ import annotations

import dataclasses
import numbers
from functools import partial

import jax
import jax.numpy as jnp

from jax_ep import _checks

__all__ = ["ACTIVATION_FUNCS", "GatedActivation", "QUICK_GELU_ALPHA", "SWIGLU",
           "activation_name", "clamp_glu_halves", "geglu", "quick_geglu", "quick_gelu",
           "remove_glu_interleaving", "squared_relu", "swiglu"]

QUICK_GELU_ALPHA = 1.702


def quick_gelu(y, alpha: float = QUICK_GELU_ALPHA):
    """y * sigmoid(alpha * y): GELU's sigmoid approximation. alpha: a finite float, or a 0-d
    array (it may be traced)."""
    _checks.check_float_weights(y, "y")
    if not (hasattr(alpha, "dtype") and jnp.ndim(alpha) == 0):
        _checks.check_real(alpha, "alpha")
    return y * jax.nn.sigmoid(alpha * y)


def squared_relu(y):
    """relu(y)^2 (Megatron's squared_relu, Nemotron's non-gated experts)."""
    return jnp.square(jax.nn.relu(y))


# Megatron's activation_func choices, by the torch / Megatron function's name: F.silu,
# F.gelu (exact, erf), GELU's tanh form (HF's "gelu_pytorch_tanh"), quick_gelu, F.relu and
# squared_relu.
_GATE_FUNCS = {
    "silu": jax.nn.silu,
    "gelu": partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": partial(jax.nn.gelu, approximate=True),
    "quick_gelu": quick_gelu,
    "relu": jax.nn.relu,
    "squared_relu": squared_relu,
}
ACTIVATION_FUNCS = tuple(_GATE_FUNCS)


def activation_name(func):
    """activation_func as one of ACTIVATION_FUNCS: a name, or a PyTorch / Megatron function
    (F.silu, F.gelu, F.relu, Megatron's quick_gelu and squared_relu: what a pasted Megatron
    config holds) read by its __name__, or jax.nn.silu / jax.nn.relu. Any other function
    (jax.nn.gelu: tanh by default, where torch's F.gelu is exact) is refused (ValueError
    naming activation_func): pass the name."""
    if isinstance(func, str):
        name = func
    elif func is jax.nn.silu or func is jax.nn.relu:
        name = func.__name__
    elif callable(func) and getattr(func, "__module__", "").split(".")[0] in ("torch",
                                                                             "megatron"):
        name = getattr(func, "__name__", None)
    else:
        name = None
    if name not in _GATE_FUNCS:
        raise ValueError(f"activation_func: expected one of {ACTIVATION_FUNCS} (or torch's / "
                         f"Megatron's function of that name, jax.nn.silu or jax.nn.relu), got "
                         f"{func!r}")
    return name


def remove_glu_interleaving(x, interleave_size: int):
    """Megatron's _remove_glu_interleaving: x [..., 2F] in blocks of interleave_size s columns
    alternating gate and up ([gate_0 | up_0 | gate_1 | up_1 | ...], block b holding the FFN
    units b*s ... b*s + s - 1) -> [gate | up]. 2F must be a multiple of 2s (ValueError naming
    moe_mlp_glu_interleave_size)."""
    *lead, width = x.shape
    if width % (2 * interleave_size):
        raise ValueError(f"moe_mlp_glu_interleave_size: expected fc1's {width} columns to be "
                         f"whole blocks of 2 * {interleave_size}")
    blocks = x.reshape(*lead, width // (2 * interleave_size), 2, interleave_size)
    return jnp.swapaxes(blocks, -3, -2).reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class GatedActivation:
    """fc1's output -> fc2's input, act one of ACTIVATION_FUNCS. Gated (gated_linear_unit,
    the default): [..., 2F] = [gate | up] -> act(gate) * (up + glu_linear_offset) [..., F];
    with clamp_value c the gate is first clamped to at most c and up to [-c, c] (Megatron's
    activation_func_clamp_value, gpt-oss's 7.0). glu_interleave_size s (Megatron's
    moe_mlp_glu_interleave_size): fc1's output is in blocks of s columns alternating gate and
    up instead (`remove_glu_interleaving`). Not gated (Megatron's MLP experts): [..., F] ->
    act [..., F], offset, clamp and interleave unused, as in Megatron. Hashable: it is a
    static argument of the experts' custom_vjp."""

    activation_func: str = "silu"
    glu_linear_offset: float = 0.0
    clamp_value: float | None = None
    gated_linear_unit: bool = True
    glu_interleave_size: int | None = None

    def __post_init__(self):
        if not isinstance(self.gated_linear_unit, bool):
            raise ValueError(f"gated_linear_unit: expected a bool, got "
                             f"{self.gated_linear_unit!r}")
        if self.activation_func not in _GATE_FUNCS:
            raise ValueError(f"activation_func: expected one of {ACTIVATION_FUNCS}, got "
                             f"{self.activation_func!r}")
        _checks.check_real(self.glu_linear_offset, "glu_linear_offset")
        _checks.check_real(self.clamp_value, "activation_func_clamp_value", positive=True,
                           allow_none=True)
        s = self.glu_interleave_size
        if s is not None and (not isinstance(s, numbers.Integral) or isinstance(s, bool)
                              or s < 1):
            raise ValueError(f"moe_mlp_glu_interleave_size: expected None or a positive int, "
                             f"got {s!r}")

    def fc1_columns(self, ffn_hidden_size: int) -> int:
        """fc1's output width for an FFN hidden size F: 2F gated ([gate | up]), else F."""
        return 2 * ffn_hidden_size if self.gated_linear_unit else ffn_hidden_size

    def __call__(self, fc1_out):
        _checks.check_float_weights(fc1_out, "y")
        if self.gated_linear_unit and (jnp.ndim(fc1_out) < 1 or fc1_out.shape[-1] % 2):
            raise ValueError(f"y: expected [..., 2F] ([gate | up]: an even last axis), got "
                             f"shape {tuple(jnp.shape(fc1_out))}")
        if not self.gated_linear_unit:
            return _GATE_FUNCS[self.activation_func](fc1_out)
        if self.glu_interleave_size is not None:
            fc1_out = remove_glu_interleaving(fc1_out, self.glu_interleave_size)
        gate, up = jnp.split(fc1_out, 2, axis=-1)
        if self.clamp_value is not None:
            gate, up = clamp_glu_halves(gate, up, self.clamp_value)
        if self.glu_linear_offset:
            up = up + self.glu_linear_offset
        return _GATE_FUNCS[self.activation_func](gate) * up


def clamp_glu_halves(gate, up, clamp_value):
    """Megatron's activation_func_clamp_value on the two halves: gate to at most c, up to
    [-c, c], with torch.clamp's gradient (1 up to and at the bounds, 0 beyond; jnp.clip's
    and jnp.minimum's is 1/2 at a bound)."""
    c = clamp_value
    gate = jnp.where(gate > c, c, gate)
    return gate, jnp.where(up > c, c, jnp.where(up < -c, -c, up))


SWIGLU = GatedActivation()


def swiglu(y):
    """[..., 2F] = [gate | up] -> silu(gate) * up [..., F]."""
    return SWIGLU(y)


def geglu(y):
    """[..., 2F] -> gelu_tanh(gate) * up (GELU's tanh approximation, Gemma's experts)."""
    return GatedActivation("gelu_tanh")(y)


def quick_geglu(y, linear_offset: float = 0.0):
    """[..., 2F] -> quick_gelu(gate) * (up + linear_offset) (gpt-oss's experts)."""
    return GatedActivation("quick_gelu", _checks.check_real(linear_offset, "linear_offset"))(y)
