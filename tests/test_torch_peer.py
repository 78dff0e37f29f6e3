"""Layer 1 side by side with the PyTorch code it ports (skipped when torch is not installed;
CI installs the CPU wheel).

The peers are the unfused PyTorch formulations users run today, written out here: Megatron-Core
`moe_utils.permute` / `unpermute` and the flex dispatcher's `_indices_to_multihot`, DeepEP's
`per_token_cast_to_fp8` / `per_token_cast_back` and `get_dispatch_layout`, and the
all_to_all dispatch module's `compute_send_counts` / `build_send_layout` (seeds 000-003).
jax_ep must equal them on everything both define. Where jax_ep's contract differs on purpose
(docs/contract.md: padding rows are zero / -1 / 0, where Megatron pads drop_and_pad blocks
with real token ids), the tests compare the routed rows and check the padding separately.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _helpers import random_routing

from jax_ep import ops

torch = pytest.importorskip("torch")

IMPLS = ["ffi", "xla"]
SEEDS = range(6)


# ----------------------------------------------------------------------------- the peers


def megatron_permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False):
    """Megatron-Core moe_utils.permute, unfused: expert-major, token-ascending."""
    num_tokens = tokens.shape[0]
    num_experts = routing_map.shape[1]
    permuted_probs = None
    if drop_and_pad:
        capacity = num_out_tokens // num_experts
        by_expert = routing_map.to(torch.int8).T.contiguous()
        sorted_indices = by_expert.argsort(dim=-1, descending=True, stable=True)[:, :capacity]
        sorted_indices = sorted_indices.reshape(-1)
        if probs is not None:
            flat = (torch.arange(num_experts)[:, None] * num_tokens
                    + sorted_indices.view(num_experts, capacity)).reshape(-1)
            permuted_probs = probs.T.contiguous().reshape(-1).index_select(0, flat)
    else:
        by_expert = routing_map.bool().T.contiguous()
        sorted_indices = torch.arange(num_tokens).expand(num_experts, -1).masked_select(by_expert)
        if probs is not None:
            permuted_probs = probs.T.contiguous().masked_select(by_expert)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def megatron_unpermute(permuted, sorted_indices, num_tokens, permuted_probs=None):
    """Megatron-Core moe_utils.unpermute given the permuted probs: scatter_add of the rows."""
    if permuted_probs is not None:
        permuted = permuted * permuted_probs[:, None]
    out = torch.zeros((num_tokens, permuted.shape[1]), dtype=permuted.dtype)
    out.scatter_add_(0, sorted_indices[:, None].expand(-1, permuted.shape[1]), permuted)
    return out


def megatron_indices_to_multihot(indices, probs, num_experts):
    """The flex dispatcher's _indices_to_multihot."""
    routing_map = torch.zeros((indices.shape[0], num_experts), dtype=torch.long)
    dense = torch.zeros((indices.shape[0], num_experts), dtype=torch.float)
    mask = indices != -1
    rows = torch.arange(indices.shape[0]).repeat_interleave(mask.sum(dim=1))
    routing_map[rows, indices[mask]] = 1
    dense[rows, indices[mask]] = probs[mask]
    return routing_map.bool(), dense


def deepep_cast_to_fp8(x, round_scale=False):
    """DeepEP's per_token_cast_to_fp8 (per 128 channels)."""
    m, n = x.shape
    blocks = x.view(m, n // 128, 128)
    amax = blocks.abs().float().amax(dim=2).clamp(1e-4)
    if round_scale:
        scale_inv = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
        codes = blocks * (1.0 / scale_inv[..., None])
    else:
        scale_inv = amax / 448.0
        codes = blocks * (448.0 / amax[..., None])
    return codes.to(torch.float8_e4m3fn).view(m, n), scale_inv


def deepep_cast_back(x_fp8, scale_inv, dtype):
    m, n = x_fp8.shape
    blocks = x_fp8.to(torch.float32).view(m, n // 128, 128) * scale_inv[..., None]
    return blocks.view(m, n).to(dtype)


def deepep_dispatch_layout(topk_idx, num_experts, num_ranks):
    """DeepEP Buffer.get_dispatch_layout, from its definition."""
    valid = topk_idx >= 0
    experts = torch.where(valid, topk_idx, torch.full_like(topk_idx, num_experts))
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64)
    per_expert.scatter_add_(0, experts.reshape(-1), torch.ones(experts.numel(), dtype=torch.int64))
    rank = torch.where(valid, topk_idx // (num_experts // num_ranks), torch.full_like(topk_idx, -1))
    in_rank = (rank[..., None] == torch.arange(num_ranks)).any(dim=1)
    return in_rank.sum(0).int(), in_rank, per_expert[:num_experts].int()


def peer_send_layout(topk_idx, topk_weights, num_ranks, num_local_experts):
    """compute_send_counts + build_send_layout of the all_to_all dispatch module (seed 002)."""
    dest = torch.where(topk_idx >= 0, topk_idx // num_local_experts,
                       torch.full_like(topk_idx, -1))
    in_rank = (dest[..., None] == torch.arange(num_ranks)).any(dim=1)
    rank, token = in_rank.T.nonzero(as_tuple=True)  # rank-major, token-ascending
    owned = dest[token] == rank[:, None]
    local = torch.where(owned, topk_idx[token] - rank[:, None] * num_local_experts,
                        torch.full_like(topk_idx[token], -1))
    weights = torch.where(owned, topk_weights[token], torch.zeros_like(topk_weights[token]))
    return in_rank.sum(0).int(), token.int(), rank.int(), local.int(), weights


# ----------------------------------------------------------------------------- helpers


def _t(a):
    """numpy (bf16 included) -> torch, without a copy through float64."""
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _np(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.detach().numpy()


def _case(seed, T=24, E=8, K=3, H=16, dtype=np.float32, unrouted=0.15):
    rng = np.random.default_rng(seed)
    idx = random_routing(rng, T, K, E, unrouted=unrouted)
    w = rng.random((T, K)).astype(np.float32) + 0.05
    routing_map = np.zeros((T, E), bool)
    dense = np.zeros((T, E), np.float32)
    for t, k in zip(*np.nonzero(idx >= 0)):
        routing_map[t, idx[t, k]] = True
        dense[t, idx[t, k]] = w[t, k]
    tokens = rng.standard_normal((T, H)).astype(dtype)
    return tokens, routing_map, dense, idx, np.where(idx >= 0, w, 0).astype(np.float32)


# ----------------------------------------------------------------------------- permute family


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("seed", SEEDS)
def test_permute_unpermute_and_grads_equal_megatron(seed, dtype, impl):
    tokens, routing_map, dense, _, _ = _case(seed, dtype=dtype)
    n = int(routing_map.sum())
    want_x, want_p, want_idx = megatron_permute(_t(tokens), _t(routing_map), _t(dense))
    got_x, got_p, got_idx, got_tpe = ops.permute(tokens, routing_map, dense, num_out_tokens=n,
                                                 impl=impl)
    np.testing.assert_array_equal(np.asarray(got_idx), _np(want_idx))
    np.testing.assert_array_equal(np.asarray(got_x), _np(want_x))
    np.testing.assert_array_equal(np.asarray(got_p), _np(want_p))
    np.testing.assert_array_equal(np.asarray(got_tpe), routing_map.sum(0))

    # unpermute with the permuted probs: Megatron scatter-adds rows * probs (fp32 here).
    rows = np.random.default_rng(seed + 100).standard_normal((n, tokens.shape[1]))
    rows = rows.astype(np.float32)
    want = megatron_unpermute(_t(rows), want_idx, tokens.shape[0], want_p)
    got = ops.unpermute(rows, got_idx, num_tokens=tokens.shape[0], probs=got_p, impl=impl)
    np.testing.assert_allclose(np.asarray(got), _np(want), rtol=1e-6, atol=1e-6)

    # Gradients of permute -> scale -> unpermute(probs), torch autograd vs jax.grad. A token's
    # row cotangents are summed in fp32 and rounded once, as torch's index_select backward.
    scale = np.random.default_rng(seed + 200).standard_normal((n, 1)).astype(np.float32)
    x_t = _t(tokens).requires_grad_()
    p_t = _t(dense).requires_grad_()
    px, pp, si = megatron_permute(x_t, _t(routing_map), p_t)
    y = megatron_unpermute(px.float() * _t(scale), si, tokens.shape[0], pp)
    (y ** 2).sum().backward()

    def loss(x, p):
        px, pp, si, _ = ops.permute(x, routing_map, p, num_out_tokens=n, impl=impl)
        y = ops.unpermute(px.astype(jnp.float32) * scale, si, num_tokens=x.shape[0], probs=pp)
        return (y ** 2).sum()
    g_x, g_p = jax.grad(loss, argnums=(0, 1))(jnp.asarray(tokens), jnp.asarray(dense))
    assert g_x.dtype == tokens.dtype
    np.testing.assert_allclose(np.asarray(g_x, np.float32), _np(x_t.grad).astype(np.float32),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_p), _np(p_t.grad), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", SEEDS)
def test_bf16_permute_backward_sums_rows_like_torch(seed, impl):
    """Bitwise: the bf16 token gradient of permute is torch's index_select backward."""
    tokens, routing_map, _, _, _ = _case(seed, dtype=ml_dtypes.bfloat16, K=6, unrouted=0.0)
    n = int(routing_map.sum())
    d_rows = np.random.default_rng(seed).standard_normal((n, tokens.shape[1]))
    d_rows = d_rows.astype(ml_dtypes.bfloat16)
    x_t = _t(tokens).requires_grad_()
    megatron_permute(x_t, _t(routing_map))[0].backward(_t(d_rows))
    _, vjp = jax.vjp(lambda x: ops.permute(x, routing_map, num_out_tokens=n, impl=impl)[0],
                     jnp.asarray(tokens))
    np.testing.assert_array_equal(np.asarray(vjp(jnp.asarray(d_rows))[0]), _np(x_t.grad))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", SEEDS)
def test_drop_and_pad_keeps_megatrons_tokens(seed, impl):
    """Each expert keeps Megatron's first c tokens; where Megatron fills a short block with
    unrouted token ids, jax_ep's rows are padding (zero data, index -1, prob 0)."""
    tokens, routing_map, dense, _, _ = _case(seed, T=20, E=4, K=2)
    E = routing_map.shape[1]
    capacity = [2, 4, 6][seed % 3]
    n = E * capacity
    want_x, want_p, want_idx = megatron_permute(_t(tokens), _t(routing_map), _t(dense),
                                                num_out_tokens=n, drop_and_pad=True)
    got_x, got_p, got_idx, got_tpe = map(np.asarray, ops.permute(
        tokens, routing_map, dense, num_out_tokens=n, drop_and_pad=True, impl=impl))
    np.testing.assert_array_equal(got_tpe, np.full(E, capacity))
    want_idx, want_x, want_p = _np(want_idx), _np(want_x), _np(want_p)
    for e in range(E):
        block = slice(e * capacity, (e + 1) * capacity)
        kept = min(capacity, int(routing_map[:, e].sum()))
        real = slice(e * capacity, e * capacity + kept)
        np.testing.assert_array_equal(got_idx[real], want_idx[real])
        np.testing.assert_array_equal(got_x[real], want_x[real])
        np.testing.assert_array_equal(got_p[real], want_p[real])
        pad = slice(block.start + kept, block.stop)
        assert (got_idx[pad] == -1).all() and not got_x[pad].any() and not got_p[pad].any()
        assert not want_p[pad].any()  # Megatron's padding rows carry prob 0 as well


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", SEEDS)
def test_multihot_equals_megatron(seed, impl):
    _, _, _, idx, w = _case(seed)
    E = 8
    want_map, want_probs = megatron_indices_to_multihot(_t(idx).long(), _t(w), E)
    got_map, got_probs = ops.indices_to_multihot(idx, w, num_experts=E, impl=impl)
    np.testing.assert_array_equal(np.asarray(got_map), _np(want_map))
    np.testing.assert_array_equal(np.asarray(got_probs), _np(want_probs))


# ----------------------------------------------------------------------------- FP8


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("seed", range(3))
def test_fp8_cast_equals_deepep(seed, dtype, round_scale, impl):
    """Codes bitwise; scales bitwise with round_scale and to 1 ulp without it (jax_ep computes
    amax * fl32(1/448), what CUDA PyTorch does for `amax / 448.0`; CPU torch divides)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((5, 512)) * rng.choice([1e-3, 1.0, 300.0], (5, 1)))
    x = x.astype(dtype)
    x[1, :128] = 0  # an all-zero block: amax is clamped to 1e-4
    want_q, want_s = deepep_cast_to_fp8(_t(x).float(), round_scale=round_scale)
    got_q, got_s = ops.per_token_cast_to_fp8(x, round_scale=round_scale, impl=impl)
    np.testing.assert_array_equal(np.asarray(got_q).view(np.uint8), _np(want_q))
    if round_scale:
        np.testing.assert_array_equal(np.asarray(got_s), _np(want_s))
    else:
        ulps = np.abs(np.asarray(got_s).view(np.int32) - _np(want_s).view(np.int32))
        assert ulps.max() <= 1
    for out_dtype, torch_dtype in ((jnp.bfloat16, torch.bfloat16), (jnp.float32, torch.float32)):
        back = ops.per_token_cast_back(got_q, got_s, dtype=out_dtype, impl=impl)
        want = deepep_cast_back(want_q, _t(np.asarray(got_s)), torch_dtype)
        np.testing.assert_array_equal(np.asarray(back), _np(want))


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_dispatch_and_send_layouts_equal_the_peers(seed, num_ranks, impl):
    _, _, _, idx, w = _case(seed, T=17, E=8, K=3, unrouted=0.3)
    idx[3] = -1  # a token routed nowhere
    E, L = 8, 8 // num_ranks
    want = deepep_dispatch_layout(_t(idx).long(), E, num_ranks)
    got = ops.get_dispatch_layout(idx, num_experts=E, num_ranks=num_ranks, impl=impl)
    for g, t in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), _np(t))

    counts, token, rank, local, weights = peer_send_layout(_t(idx).long(), _t(w), num_ranks, L)
    layout = ops.build_send_layout(idx, w, num_ranks=num_ranks, num_local_experts=L, impl=impl)
    num_send = int(counts.sum())
    np.testing.assert_array_equal(np.asarray(layout.send_counts), _np(counts))
    assert int(layout.num_send) == num_send
    np.testing.assert_array_equal(np.asarray(layout.token_idx)[:num_send], _np(token))
    np.testing.assert_array_equal(np.asarray(layout.rank)[:num_send], _np(rank))
    np.testing.assert_array_equal(np.asarray(layout.local_idx)[:num_send], _np(local))
    np.testing.assert_array_equal(np.asarray(layout.weights)[:num_send], _np(weights))
    assert (np.asarray(layout.token_idx)[num_send:] == -1).all()
    assert not np.asarray(layout.weights)[num_send:].any()
