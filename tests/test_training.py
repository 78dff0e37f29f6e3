"""Training set-up (jax_ep.flax.shard_state): one compilation for every step, with Auto and with
Explicit mesh axes, for a small model with an embedding, an MoE layer and non-trainable state."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.flax import MoELayer, compilations, shard_state

TOKENS = ("data", "expert")


class TinyLM(nnx.Module):
    """Embed -> MoE -> tied read-out over 32 symbols; `explicit` passes the embedding lookup
    its output sharding, which nnx.Embed needs under Explicit mesh axes."""

    def __init__(self, mesh, explicit, rngs):
        cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2)
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.moe = MoELayer(cfg, 16, 16, rngs=rngs, mesh=mesh)
        self.counter = nnx.Variable(jnp.zeros((), jnp.int32))  # non-trainable state
        self.out_sharding = P(TOKENS) if explicit else None

    def __call__(self, ids):
        x = self.embed(ids, out_sharding=self.out_sharding)
        y, aux = self.moe(x)
        self.counter[...] += 1
        return self.embed.attend(x + y), aux["aux_loss"]


def _setup(axis_type):
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(kind, kind))
    model = TinyLM(mesh, axis_type == "Explicit", nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    shard_state(model, optimizer, mesh)
    return mesh, model, optimizer


@functools.lru_cache(maxsize=None)  # each run compiles a training step: share them
def _train(axis_type, steps=3):
    mesh, model, optimizer = _setup(axis_type)

    @nnx.jit
    def step(model, optimizer, ids):
        def loss_fn(model):
            logits, aux_loss = model(ids[:, :-1])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
            return ce + aux_loss
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    ids = jax.device_put(np.random.default_rng(0).integers(0, 32, (8, 5)).astype(np.int32),
                         NamedSharding(mesh, P(TOKENS)))
    losses = []
    with jax.set_mesh(mesh), compilations("step") as compiled:
        for _ in range(steps):
            losses.append(float(step(model, optimizer, ids)))
    return losses, len(compiled), model, optimizer


def test_compilations_counts_each_executable_of_the_named_function():
    """The counter the one-compilation test relies on: one per new input signature of the
    named jit, none for a cached call or for another function."""
    @jax.jit
    def double(x):
        return 2 * x

    with compilations("double") as compiled:
        for shape in ((3,), (3,), (4,)):
            double(jnp.ones(shape))
        jax.jit(lambda x: x + 1)(jnp.ones(5))
    assert len(compiled) == 2


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_shard_state_keeps_training_at_one_compilation(axis_type):
    losses, compiles, model, optimizer = _train(axis_type)
    assert compiles == 1, f"{compiles} compilations over 3 steps"
    assert int(model.counter[...]) == 3 and int(optimizer.step[...]) == 3
    assert model.moe.w_gate_up[...].sharding.spec[0] == "expert"
    assert losses[-1] < losses[0]
    if axis_type == "Explicit":  # the same losses as with Auto axes (cached run)
        np.testing.assert_allclose(losses, _train("Auto")[0], rtol=1e-5)


def test_shard_state_places_every_variable_and_checks_its_arguments():
    mesh, model, optimizer = _setup("Explicit")
    for module in (model, optimizer):
        for path, var in nnx.to_flat_state(nnx.state(module)):
            sharding = var[...].sharding
            assert isinstance(sharding, NamedSharding) and sharding.mesh == mesh, path
            want = "expert" if path[-1] in ("w_gate_up", "w_down") else None
            assert (sharding.spec[0] if sharding.spec else None) == want, path
    rngs = nnx.Rngs(3)  # typed PRNG key state goes through its key data
    shard_state(rngs, None, mesh)
    assert isinstance(rngs.default.key[...].sharding, NamedSharding)
    assert jax.random.key_data(rngs.default.key[...]).tolist() == \
        jax.random.key_data(nnx.Rngs(3).default.key[...]).tolist()
    with pytest.raises(ValueError, match="mesh: expected a jax.sharding.Mesh"):
        shard_state(model, optimizer, None)
    with pytest.raises(ValueError, match="optimizer: expected an nnx.Optimizer or None"):
        shard_state(model, optax.adam(1e-3), mesh)


def test_embed_without_out_sharding_fails_under_explicit_axes():
    """Why the README tells Explicit-axes users to pass nnx.Embed an out_sharding: a gather
    from the replicated table by batch-sharded ids has no unambiguous output sharding."""
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(explicit, explicit))
    embed = nnx.Embed(32, 16, rngs=nnx.Rngs(0))
    shard_state(embed, None, mesh)
    ids = jax.device_put(np.arange(40).reshape(8, 5) % 32, NamedSharding(mesh, P(TOKENS)))
    with jax.set_mesh(mesh):
        # jax's ShardingTypeError, not public: a bare Exception, matched by its message.
        with pytest.raises(Exception, match=r"\.at\[\.\.\.\]\.get\(out_sharding=\)"):
            nnx.jit(lambda e, i: e(i))(embed, ids)
        out = nnx.jit(lambda e, i: e(i, out_sharding=P(TOKENS)))(embed, ids)
    table = np.asarray(embed.embedding[...])
    np.testing.assert_array_equal(np.asarray(out), table[np.asarray(ids)])
    assert out.sharding.spec[0] == TOKENS
