"""The experts of MoELayer on the rows the dispatcher delivers: the grouped gated (SwiGLU by
default) or MLP FFN of every local expert (`swiglu_experts`: `jax_ep.ops.grouped_matmul`,
jax_ep's CPU handler, the tiled loop or `jax.lax.ragged_dot`; `swiglu_expert_blocks` for
blocks of equal size),
with Megatron's linear biases, expert tensor parallelism over a tensor mesh axis
(`gate_up_to_etp` / `gate_up_from_etp`, the column / row split and its one reduction), the
capacity padding of drop-and-pad (`pad_expert_blocks` / `unpad_expert_blocks`), the router
probabilities applied on the output or on the input, and the shared expert's dense FFN."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_ep import _ffi, ops, transport
from jax_ep._checks import (check_float, check_float_weights, check_positive, check_rank,
                            check_shape)
from jax_ep._index import search
from jax_ep.flax.activations import SWIGLU
from jax_ep.flax.moe_config import MoEConfig

__all__ = ["expert_tile_rows", "gate_up_from_etp", "gate_up_to_etp", "pad_expert_blocks",
           "swiglu_expert_blocks", "swiglu_experts", "unpad_expert_blocks"]


def swiglu_experts(tokens, tokens_per_expert, w_gate_up, w_down, *, impl="auto",
                   tile_rows=None, activation=SWIGLU, b_gate_up=None, b_down=None):
    """Grouped experts (SwiGLU by default): tokens [N,H] in expert-major blocks of
    tokens_per_expert i32[L] rows, w_gate_up (fc1) [L,H,2F] ([L,H,F] with a non-gated
    activation), w_down [L,F,H] -> [N,H] (rows past the blocks give zeros). impl and
    tile_rows: the grouped GEMM's (`jax_ep.ops.grouped_matmul`: "auto", "ffi", "tiled",
    "blocks" or "ragged_dot"); "blocks" keeps the rows in [L, C, ...] expert blocks from the
    first GEMM to the second (one gather in, one out) instead of calling grouped_matmul twice.
    activation: between the GEMMs, fc1's [..., 2F] (or [..., F]) -> [..., F] (a
    `jax_ep.flax.activations.GatedActivation`). b_gate_up [L, 2F] (or [L, F]) and b_down
    [L, H]: optional per-expert biases of fc1 and fc2 (Megatron's add_bias_linear), each added
    to its expert's rows."""
    _check_expert_operands(tokens, tokens_per_expert, w_gate_up, w_down, activation)
    dtype = jnp.result_type(tokens, w_gate_up, w_down)
    biases = _checked_biases(b_gate_up, b_down, w_gate_up, w_down, dtype)
    impl = ops.grouped_matmul_impl(impl, dtype, num_rows=jnp.shape(tokens)[0],
                                   w_shape=jnp.shape(w_gate_up))
    if impl == "blocks":
        return _blocked_swiglu(tokens, tokens_per_expert, w_gate_up, w_down, biases, tile_rows,
                               activation)
    gmm = partial(ops.grouped_matmul, group_sizes=tokens_per_expert, impl=impl,
                  tile_rows=tile_rows)
    add_b_gate_up, add_b_down = (partial(_add_group_bias, b, tokens_per_expert) for b in biases)
    return add_b_down(gmm(activation(add_b_gate_up(gmm(tokens, w_gate_up))), w_down))


def _check_expert_operands(tokens, tokens_per_expert, w_gate_up, w_down, activation):
    """swiglu_experts' operands checked under their own names: tokens float [N,H],
    tokens_per_expert integer [L], w_gate_up float [L,H,fc1 columns], w_down float [L,F,H_out]
    with activation.fc1_columns(F) = fc1 columns; ValueError naming the argument."""
    ops.check_grouped_operands(tokens, w_gate_up, tokens_per_expert, "w_gate_up", "tokens",
                               "tokens_per_expert")
    check_rank(w_down, 3, "w_down")
    if w_down.shape[0] != w_gate_up.shape[0] or activation.fc1_columns(
            w_down.shape[1]) != w_gate_up.shape[2]:
        raise ValueError(f"w_down: expected [L={w_gate_up.shape[0]}, F, H_out] with fc1's "
                         f"{activation.fc1_columns(1)}F columns = w_gate_up's "
                         f"{w_gate_up.shape[2]}, got shape {w_down.shape}")
    check_float(w_down, "w_down")


def _checked_biases(b_gate_up, b_down, w_gate_up, w_down, dtype):
    """(b_gate_up, b_down) checked against the weights (b_gate_up [L, fc1 columns], b_down
    [L, H_out], or None) and cast to the GEMMs' dtype, so they promote nothing; else
    ValueError naming the bias."""
    L = jnp.shape(w_gate_up)[0]
    wanted = {"b_gate_up": (L, jnp.shape(w_gate_up)[-1]), "b_down": (L, jnp.shape(w_down)[-1])}
    checked = []
    for name, bias in (("b_gate_up", b_gate_up), ("b_down", b_down)):
        if bias is not None:
            check_shape(bias, wanted[name], name)
            check_float_weights(bias, name)
            bias = jnp.asarray(bias).astype(dtype)
        checked.append(bias)
    return tuple(checked)


def _add_group_bias(bias, group_sizes, rows):
    """rows [N, F] in consecutive groups of group_sizes i32[G] plus bias [G, F] (None: none)
    on each group's rows, in the rows' dtype."""
    if bias is None:
        return rows
    return rows + ops.group_rows(bias, group_sizes, rows.shape[0]).astype(rows.dtype)


def _blocked_swiglu(tokens, tokens_per_expert, w_gate_up, w_down, biases, tile_rows,
                    activation):
    """swiglu_experts with impl="blocks": the rows gathered once into [L, C, H] expert blocks
    (`jax_ep.ops.grouped_matmul`'s ladder of C, chosen by a lax.switch on the largest group),
    both GEMMs and the activation in that layout, one gather back to [N,H]. The tiled grouped
    GEMM runs instead when the largest group is above ceil(N/L) or the blocks would hold more
    than ops.BLOCKS_MAX_WORK times the routed rows plus ops.BLOCK_MIN_ROWS per expert (a
    lopsided step). Either way the gate/up activations are kept for the backward, so it
    recomputes no GEMM. Both GEMMs run in the promoted dtype of all three operands (the other
    impls promote per GEMM: with bf16 tokens and w_gate_up and an f32 w_down, their gate/up
    activations are bf16, here f32). biases: (b_gate_up or None, b_down or None)."""
    tile = ops.grouped_tile_rows(tile_rows)
    given = [b for b in biases if b is not None]
    *operands, sizes = ops.grouped_operands((tokens, w_gate_up, w_down, *given),
                                            tokens_per_expert)
    cast = iter(operands[3:])
    biases = tuple(None if b is None else next(cast) for b in biases)
    x, w_gate_up, w_down = operands[:3]
    if tokens.size == 0 or w_gate_up.size == 0 or w_down.size == 0:
        return _ffi.vary_like(jnp.zeros((tokens.shape[0], w_down.shape[2]), x.dtype), *operands,
                              sizes)
    ladder = ops.block_ladder(tokens.shape[0], w_gate_up.shape[0])
    return _swiglu_blocks(x, w_gate_up, w_down, biases, sizes, ladder, tile, activation)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _swiglu_blocks(x, w_gate_up, w_down, biases, sizes, ladder, tile, activation):
    return _swiglu_blocks_fwd(x, w_gate_up, w_down, biases, sizes, ladder, tile, activation)[0]


def _swiglu_blocks_fwd(x, w_gate_up, w_down, biases, sizes, ladder, tile, activation):
    """-> (y [N,H], residuals: the operands and fc1's output gate/up [L*Cmax, 2F] (F columns
    non-gated), Cmax = ladder[-1]: each expert's block padded to Cmax rows, or where the tiled
    loop ran, gate/up in row layout padded to L*Cmax >= N rows)."""
    num_rows, num_experts = x.shape[0], w_gate_up.shape[0]
    kept_rows = num_experts * ladder[-1]
    b_gate_up, b_down = biases

    def blocks(capacity, starts, ends):
        def forward(x, w_gate_up, w_down):
            gate_up = _add_block_bias(b_gate_up, ops.block_matmul(
                "lch,lhf->lcf", ops.to_group_blocks(x, starts, ends, capacity), w_gate_up))
            y = _add_block_bias(b_down, ops.block_matmul("lcf,lfh->lch", activation(gate_up),
                                                         w_down))
            kept = jnp.pad(gate_up, ((0, 0), (0, ladder[-1] - capacity), (0, 0)))
            return ops.from_group_blocks(y, starts, ends, num_rows), kept.reshape(kept_rows, -1)
        return forward

    def tiled(x, w_gate_up, w_down):
        gmm = partial(ops.grouped_matmul, group_sizes=sizes, impl="tiled", tile_rows=tile)
        gate_up = _add_group_bias(b_gate_up, sizes, gmm(x, w_gate_up))
        kept = jnp.pad(gate_up, ((0, kept_rows - num_rows), (0, 0)))
        return _add_group_bias(b_down, sizes, gmm(activation(gate_up), w_down)), kept

    y, gate_up = ops.switch_block_sizes(sizes, num_rows, ladder, blocks, tiled, x, w_gate_up,
                                        w_down)
    return y, (x, w_gate_up, w_down, biases, sizes, gate_up)


def _add_block_bias(bias, blocks):
    """blocks [L, C, F] plus bias [L, F] (None: none) on every row of block l."""
    return blocks if bias is None else blocks + bias[:, None, :].astype(blocks.dtype)


def _swiglu_blocks_bwd(ladder, tile, activation, residuals, dy):
    x, w_gate_up, w_down, biases, sizes, gate_up = residuals
    num_rows, num_experts = x.shape[0], w_gate_up.shape[0]
    dy = dy.astype(x.dtype)

    def bias_grads(per_expert_sum, d_gate_up, dy):
        """(d_b_gate_up, d_b_down): fc1's and fc2's output cotangents summed per expert by
        per_expert_sum(bias, cotangent) -> f32[L, .], None where there is no bias."""
        return tuple(None if b is None else per_expert_sum(b, d).astype(b.dtype)
                     for b, d in zip(biases, (d_gate_up, dy)))

    def blocks(capacity, starts, ends):
        def backward(x, w_gate_up, w_down, gate_up, dy):
            xb, dyb = (ops.to_group_blocks(a, starts, ends, capacity) for a in (x, dy))
            gate_up = gate_up.reshape(num_experts, ladder[-1], -1)[:, :capacity]
            act, act_vjp = jax.vjp(activation, gate_up)
            d_act = ops.block_matmul("lch,lfh->lcf", dyb, w_down)
            d_w_down = jnp.einsum("lcf,lch->lfh", act, dyb, preferred_element_type=jnp.float32)
            d_gate_up, = act_vjp(d_act)  # zero on padding rows, as dy is
            dx = ops.block_matmul("lcf,lhf->lch", d_gate_up, w_gate_up)
            d_w_gate_up = jnp.einsum("lch,lcf->lhf", xb, d_gate_up,
                                     preferred_element_type=jnp.float32)
            return (ops.from_group_blocks(dx, starts, ends, num_rows),
                    d_w_gate_up.astype(w_gate_up.dtype), d_w_down.astype(w_down.dtype),
                    bias_grads(lambda _, d: d.sum(axis=1, dtype=jnp.float32), d_gate_up, dyb))
        return backward

    def tiled(x, w_gate_up, w_down, gate_up, dy):
        act, act_vjp = jax.vjp(activation, gate_up[:num_rows])
        d_act, d_w_down = ops.tiled_grouped_matmul_grads(act, w_down, sizes, dy, tile)
        d_gate_up, = act_vjp(d_act)
        dx, d_w_gate_up = ops.tiled_grouped_matmul_grads(x, w_gate_up, sizes, d_gate_up, tile)
        def group_sums(bias, d):  # d [N, F] -> f32[L, F]: each expert's rows summed
            spread = jax.vjp(lambda v: ops.group_rows(v, sizes, num_rows),
                             bias.astype(jnp.float32))[1]
            return spread(d.astype(jnp.float32))[0]
        return dx, d_w_gate_up, d_w_down, bias_grads(group_sums, d_gate_up, dy)

    grads = ops.switch_block_sizes(sizes, num_rows, ladder, blocks, tiled, x, w_gate_up,
                                   w_down, gate_up, dy)
    return (*grads, None)


_swiglu_blocks.defvjp(_swiglu_blocks_fwd, _swiglu_blocks_bwd)


def swiglu_expert_blocks(tokens, w_gate_up, w_down, activation=SWIGLU, b_gate_up=None,
                         b_down=None):
    """The experts (SwiGLU by default; `activation` and the optional biases b_gate_up [L, 2F]
    / b_down [L, H] as swiglu_experts') on blocks of equal size
    (moe_pad_expert_input_to_capacity): tokens [L*C,H], block l = rows l*C ... (l+1)*C - 1
    for expert l, w_gate_up [L,H,2F] (non-gated [L,H,F]), w_down [L,F,H] -> [L*C,H] in
    tokens' dtype (fp32 accumulation, as grouped_matmul). One batched GEMM per weight over
    [L, C, H]: no group bookkeeping, no tile loop (on XLA:CPU the tiled grouped GEMM computes
    whole tiles; here every row is a block row)."""
    b_gate_up, b_down = _checked_biases(b_gate_up, b_down, w_gate_up, w_down,
                                        jnp.result_type(tokens, w_gate_up, w_down))
    blocks = tokens.reshape(w_gate_up.shape[0], -1, tokens.shape[-1])
    gate_up = _add_block_bias(b_gate_up, ops.block_matmul("lcx,lxy->lcy", blocks, w_gate_up))
    return _add_block_bias(b_down, ops.block_matmul("lcx,lxy->lcy", activation(gate_up),
                                                    w_down)).reshape(tokens.shape)


def gate_up_to_etp(w_gate_up, etp):
    """w_gate_up [..., 2F] in the unsharded layout [gate | up] -> the expert-tensor-parallel
    layout of `etp` column shards of 2F/etp columns each, shard t = [gate_t | up_t] (gate_t,
    up_t: columns t*F/etp ... (t+1)*F/etp - 1 of gate and up; Megatron's per-rank fc1).
    etp=1 leaves it unchanged. F must be divisible by etp. (A non-gated fc1 [..., F] needs no
    conversion: its column shards are the plain split.)"""
    *lead, _ = w_gate_up.shape
    etp, f = _etp_shard_width(w_gate_up, etp)
    return jnp.swapaxes(w_gate_up.reshape(*lead, 2, etp, f), -3, -2).reshape(w_gate_up.shape)


def gate_up_from_etp(w_gate_up, etp):
    """The inverse of `gate_up_to_etp`: [..., 2F] in `etp` column shards [gate_t | up_t] ->
    [gate | up]."""
    *lead, _ = w_gate_up.shape
    etp, f = _etp_shard_width(w_gate_up, etp)
    return jnp.swapaxes(w_gate_up.reshape(*lead, etp, 2, f), -3, -2).reshape(w_gate_up.shape)


def _etp_shard_width(w_gate_up, etp):
    """(etp, F/etp) for a gated fc1 w_gate_up [..., 2F] split in `etp` column shards, after
    checking etp is a positive int and 2F a multiple of 2*etp."""
    etp = check_positive(etp, "etp")
    shape = jnp.shape(w_gate_up)
    if not shape or shape[-1] % (2 * etp):
        raise ValueError(f"w_gate_up: expected a last dimension 2F with F divisible by etp={etp}"
                         f", got shape {shape}")
    return etp, shape[-1] // (2 * etp)


def _expert_major_order(counts, num_rows):
    """Where each row of S stacked blocks goes in one expert-major order: counts i32[S,L] are
    the blocks' group sizes (block s: num_rows rows, expert-major groups of counts[s] rows,
    then padding; sum(counts[s]) <= num_rows). Returns i32[S*num_rows], a permutation: expert
    l's rows of block 0, of block 1, ..., of block S-1, then expert l+1's, ..., then every
    block's padding rows in block order."""
    sizes = jnp.concatenate([counts, num_rows - counts.sum(axis=1, keepdims=True)], axis=1)
    ends = jnp.cumsum(sizes, axis=1)  # [S, L+1]; the padding is group L
    rows = jnp.arange(num_rows, dtype=counts.dtype)
    group = jax.vmap(lambda e: search(e, rows))(ends)  # [S, N]
    within = rows - jnp.take_along_axis(ends - sizes, group, axis=1)
    totals = sizes.sum(axis=0)
    earlier_blocks = jnp.cumsum(sizes, axis=0) - sizes
    dst = (jnp.cumsum(totals) - totals)[group] + jnp.take_along_axis(earlier_blocks, group,
                                                                      axis=1) + within
    return dst.reshape(-1)


def _tensor_parallel(experts, axis, rows, tokens_per_expert, w_gate_up, w_down, b_gate_up=None,
                     b_down=None):
    """`experts` (swiglu_experts' signature) tensor-parallel over the mesh `axis` of S devices
    (inside shard_map), Megatron's alltoall-dispatcher flow for expert tensor parallelism:
    each device's rows [N,H] (expert-major blocks of tokens_per_expert i32[L]) are
    all-gathered over `axis`, put expert-major across the S blocks, multiplied by this
    device's column shard w_gate_up [L,H,2F/S] ([gate_t | up_t]; whole blocks of an
    interleaved fc1; non-gated [L,H,F/S]) and
    row shard w_down [L,F/S,H] (one grouped GEMM each), and the partial outputs
    reduce-scattered (summed in at least float32, as Megatron's reduce-scatter in the probs'
    dtype) back to each device's own rows -> [N,H] in the rows' dtype. Biases: b_gate_up
    [L, 2F/S] this device's column shard (fc1's layout), b_down [L,H] added once, after the
    reduction (Megatron's row-parallel fc2). The gathers and the reduce-scatter carry the
    exchanges' remat names (ep_counts, ep_dispatch, ep_combine)."""
    n, h = rows.shape
    counts = checkpoint_name(jax.lax.all_gather(tokens_per_expert, axis),  # [S, L]
                             transport.COUNTS_NAME)
    dst = _expert_major_order(counts, n)
    src = jnp.zeros_like(dst).at[dst].set(jnp.arange(dst.shape[0], dtype=dst.dtype),
                                           unique_indices=True)
    gathered = checkpoint_name(jax.lax.all_gather(rows, axis), transport.DISPATCH_NAME)
    out = experts(gathered.reshape(-1, h)[src], counts.sum(axis=0), w_gate_up, w_down,
                  b_gate_up=b_gate_up)
    partial = out[dst].astype(jnp.promote_types(out.dtype, jnp.float32)).reshape(
        counts.shape[0], n, h)
    summed = checkpoint_name(jax.lax.psum_scatter(partial, axis, scatter_dimension=0),
                             transport.COMBINE_NAME)
    return _add_group_bias(b_down, tokens_per_expert, summed).astype(rows.dtype)


def expert_tile_rows(num_tokens, top_k, num_local_experts):
    """Rows per tile of the experts' tiled grouped GEMM: the balanced load of one local expert,
    T*K/L rows, as the nearest power of two in [32, 128]. Measured on XLA:CPU (bench_moe
    --tile-rows, 8 emulated devices): at 32, 64 and 128 balanced rows per expert the tile of
    that size was the fastest of 32, 64 and 128, by 8-12% over the next best; a tile much
    larger than a group computes masked rows, a much smaller one pays more loop steps."""
    check_positive(num_tokens, "num_tokens", allow_zero=True)
    check_positive(top_k, "top_k", allow_zero=True)
    check_positive(num_local_experts, "num_local_experts")
    balanced = max(num_tokens * top_k / num_local_experts, 1.0)
    return int(min(128, max(32, 2 ** round(math.log2(balanced)))))


def pad_expert_blocks(rows, tokens_per_expert, probs, capacity):
    """moe_pad_expert_input_to_capacity: expert-major rows [N,H] in blocks of
    tokens_per_expert i32[L] (each <= capacity), probs [N] -> (padded [L*C,H] with block l at
    rows l*C.., zero rows after each block; its probs [L*C] (0 on padding); slots i32[L*C]: the
    row of `rows` each padded row holds, -1 for padding), C = capacity. The grouped GEMM then
    sees exactly C rows per expert, as Megatron's drop-and-pad dispatch gives it; padding rows
    carry probability 0, so outputs and gradients are those without padding."""
    L = tokens_per_expert.shape[0]
    starts = jnp.cumsum(tokens_per_expert) - tokens_per_expert
    offset = jnp.arange(capacity, dtype=jnp.int32)
    slots = jnp.where(offset[None, :] < tokens_per_expert[:, None],
                      starts[:, None] + offset[None, :], -1).reshape(L * capacity)
    held = (slots >= 0)[:, None]
    padded = jnp.where(held, rows[jnp.maximum(slots, 0)], 0).astype(rows.dtype)
    return padded, jnp.where(held[:, 0], probs[jnp.maximum(slots, 0)], 0), slots


def unpad_expert_blocks(padded, slots, num_rows):
    """pad_expert_blocks' inverse for the experts' outputs: padded [L*C,H], slots i32[L*C] ->
    [num_rows, H] (rows no slot holds are zero)."""
    return jnp.zeros((num_rows,) + padded.shape[1:], padded.dtype).at[
        jnp.where(slots >= 0, slots, num_rows)].add(padded, mode="drop")


def _weighted(expert_out, probs):
    """Expert outputs [..., H] times their probs [...]: the product in the probs' (router)
    dtype, cast back to the outputs' dtype, as PyTorch MoE experts weight bf16 activations."""
    return (expert_out * probs[..., None]).astype(expert_out.dtype)


def _with_probs(experts, rows, probs, cfg: MoEConfig):
    """experts(rows [N,H]) -> [N,H] weighted by the rows' probs [N]: on its output, or with
    moe_apply_probs_on_input on its input rows (Megatron's rule, K = 1)."""
    if cfg.moe_apply_probs_on_input:
        return experts(_weighted(rows, probs))
    return _weighted(experts(rows), probs)


def _shared_expert(x, shared, activation):
    """The shared expert: x [T,H], shared (gate_up, down, gate [H,1] or None) -> [T,H], scaled
    by sigmoid(x @ gate) with moe_shared_expert_gate."""
    gate_up, down, gate = shared
    y = _ffn(x, gate_up, down, activation)
    return y if gate is None else y * jax.nn.sigmoid(x @ gate)


def _linear(x, weight, bias=None):
    """x [..., A] @ weight [A, B] (+ bias [B]) -> [..., B]."""
    y = x @ weight
    return y if bias is None else y + bias


def _ffn(x, w_gate_up, w_down, activation, b_gate_up=None, b_down=None):
    """One expert (or the shared expert): x [T,H] -> activation(x @ fc1 + b_gate_up) @ fc2 +
    b_down [T,H] (biases None: none)."""
    return _linear(activation(_linear(x, w_gate_up, b_gate_up)), w_down, b_down)
