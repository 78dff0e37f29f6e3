"""The CPU handlers' loops and XLA's intra-op pool (`ParallelFor` in xla_ffi/cpu_util.h): the
three modes of `jax_ep._jax_ep.set_cpu_pool_helpers` give the same bits in an MoE layer's
training step (grouped GEMMs, permute, unpermute, FP8 casts and the peer exchange, with loops
of several chunks) and each takes effect; "auto" shares a loop's chunks with the pool while
the handlers have run for fewer distinct devices than the pool has threads (checked in fresh
processes of 1 and 8 devices); a bad mode is refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _jax_ep
from jax_ep.flax import MoELayer, shard_params

MODES = ("always", "never", "auto")


@pytest.fixture
def restore_mode():
    yield
    _jax_ep.set_cpu_pool_helpers("auto")


def _layer_step(transport):
    """A jitted value-and-grad step of an MoE layer on mesh (data 2, expert 4): 1,024 tokens
    of width 256 (f32), E = 8, K = 2, FP8 on the wire; and its arguments."""
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    cfg = jax_ep.TokenDispatcherConfig(num_moe_experts=8, moe_router_topk=2,
                                       moe_permute_fusion=True, moe_fp8_dispatch=True,
                                       transport=transport)
    layer = shard_params(MoELayer(cfg, 256, 256, rngs=nnx.Rngs(0), mesh=mesh), mesh)
    graphdef, state = nnx.split(layer)
    x = jax.random.normal(jax.random.key(1), (8, 128, 256), jnp.float32)
    x = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x)
        return jnp.mean(y ** 2)

    return mesh, jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (state, x)


def _calls():
    stats = _jax_ep.cpu_pool_stats()
    return stats["shared_calls"], stats["inline_calls"]


@pytest.mark.parametrize("transport", ["all_to_all", "peer"])
def test_every_mode_gives_the_same_bits_and_takes_effect(transport, restore_mode):
    mesh, step, args = _layer_step(transport)
    results = {}
    with jax.set_mesh(mesh):
        for mode in MODES:
            _jax_ep.set_cpu_pool_helpers(mode)
            assert _jax_ep.cpu_pool_stats()["mode"] == mode
            shared, inline = _calls()
            results[mode] = jax.tree.leaves(jax.block_until_ready(step(*args)))
            shared_after, inline_after = _calls()
            if mode == "always":
                assert shared_after > shared and inline_after == inline
            elif mode == "never":
                assert inline_after > inline and shared_after == shared
    stats = _jax_ep.cpu_pool_stats()
    assert stats["devices_seen"] >= 8 and stats["pool_threads"] >= 1
    for mode in ("never", "auto"):
        for got, want in zip(results[mode], results["always"], strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


_PROBE = """
import json, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax_ep import ops, _jax_ep
x = jnp.arange(4096 * 256, dtype=jnp.float32).reshape(4096, 256)
rows = jnp.arange(4096, dtype=jnp.int32)[::-1]
n = jax.device_count()
mesh = jax.make_mesh((n,), ("d",))
gather = jax.jit(jax.shard_map(lambda x, r: ops.gather_rows(x, r), mesh=mesh,
                               in_specs=(P(), P()), out_specs=P("d")))
stats = [_jax_ep.cpu_pool_stats()]
for _ in range(2):
    y = jax.block_until_ready(gather(x, rows))
    assert (y.reshape(n, 4096, 256) == x[::-1]).all()
    stats.append(_jax_ep.cpu_pool_stats())
print(json.dumps(stats))
"""


@pytest.mark.parametrize("devices", [1, 8])
def test_auto_shares_while_fewer_devices_than_pool_threads(devices):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    before, first, second = json.loads(run.stdout.strip().splitlines()[-1])
    assert before["devices_seen"] == 0 and first["devices_seen"] == devices
    assert second["devices_seen"] == devices and second["mode"] == "auto"
    assert second["pool_threads"] >= devices  # XLA:CPU's pool: max(cores, devices) threads

    def calls(a, b):
        return b["shared_calls"] - a["shared_calls"], b["inline_calls"] - a["inline_calls"]

    # each device's gather moves 4 MiB, 64 chunks' worth: every call chooses
    assert sum(calls(before, first)) == devices
    # once every device has been seen, each call shares iff they are fewer than the threads
    shares = devices < second["pool_threads"]
    assert calls(first, second) == ((devices, 0) if shares else (0, devices))


def test_a_mode_other_than_the_three_is_refused(restore_mode):
    for bad in ("on", "", "AUTO"):
        with pytest.raises(ValueError, match="mode: expected 'auto', 'always' or 'never'"):
            _jax_ep.set_cpu_pool_helpers(bad)
    with pytest.raises(TypeError):
        _jax_ep.set_cpu_pool_helpers(True)
    assert _jax_ep.cpu_pool_stats()["mode"] == "auto"
