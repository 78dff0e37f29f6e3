"""`all_to_all_single`: the differentiable uneven all-to-all of PyTorch's
`all_to_all_single(x, output_splits, input_splits, group)`, with static shapes, inside
`jax.shard_map` over `axis_name`.

Built on `jax_ep.transport`: the splits become an `ExchangePlan` (one all_gather of the P
input splits, as every dispatch does), the rows move with `transport="auto"` (the peer
exchange within one process, else padded all_to_all on CPU and ragged_all_to_all on
GPU/TPU). The VJP is the reverse trip of the forward's own plan (`transport.return_rows`):
the cotangent rows return to the rows of x they came from, rows the forward dropped get
zero, and the backward exchanges no counts.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_ep import _ffi, ops
from jax_ep import transport as tp
from jax_ep._checks import (MAX_INT32, check_positive, check_rows, check_shape,
                            check_whole_bytes)

__all__ = ["all_to_all_single", "all_to_all_single_equal"]


def all_to_all_single(x, output_splits, input_splits, *, axis_name, num_recv=None):
    """Uneven all-to-all along dim 0.

      x: [S, ...] any dtype of whole bytes (int4 / uint4 / float4: ValueError); rows grouped by
        destination rank: input_splits[0] rows for rank 0 first, then rank 1, ... (rows past
        sum(input_splits) are not sent).
      output_splits: i32[P], rows received from each source rank (as in PyTorch, it must
        agree with the senders' input_splits; it is checked for shape only: the receive
        layout both ways comes from the exchanged input_splits, so a disagreeing
        output_splits cannot misplace rows).
      input_splits: i32[P], rows sent to each destination rank (both splits may also be
        lists of P ints, as PyTorch takes them; negative counts as 0; a sum
        above S is cut at S, the last destinations' rows first, as the rows past S do not
        exist).
      num_recv: rows of the result (default P*S, the worst case).
    Returns [num_recv, ...] in x.dtype, rows grouped by source rank ascending, zero rows past
    the received ones. Rows that do not fit in num_recv are dropped (the highest source
    ranks' last rows first). Differentiable in x; the splits get no gradient.
    """
    _, num_ranks = tp.axis_rank_and_size(axis_name)
    check_rows(x, "x")
    check_whole_bytes(x, "x")
    if isinstance(output_splits, (list, tuple)):
        output_splits = jnp.asarray(output_splits)
    if isinstance(input_splits, (list, tuple)):
        input_splits = jnp.asarray(input_splits)
    for splits, name in ((output_splits, "output_splits"), (input_splits, "input_splits")):
        check_shape(splits, (num_ranks,), name)
        if not jnp.issubdtype(jnp.result_type(splits), jnp.integer):
            raise ValueError(f"{name}: expected integer row counts, got "
                             f"{jnp.result_type(splits)}")
    num_send = x.shape[0]
    num_recv = num_ranks * num_send if num_recv is None else check_positive(
        num_recv, "num_recv", allow_zero=True, upper=MAX_INT32)
    output_splits = jnp.asarray(output_splits, jnp.int32)
    starts, ends = ops.group_bounds(jnp.asarray(input_splits), num_send)
    input_splits = ends - starts
    # the rows move per rank: typed as varying over the axis (and the splits' axes), so a
    # replicated x gets its cotangent summed over them
    rank, _ = tp.axis_rank_and_size(axis_name)
    x = _ffi.vary_like(x, rank, output_splits, input_splits)
    return tp.named(_exchange(x, output_splits, input_splits, axis_name, num_recv, num_send),
                    tp.DISPATCH_NAME)


def _rows(x, count_matrix, axis_name, num_recv, capacity):
    """x [S, ...] -> [num_recv, ...]: blocks of count_matrix[rank] rows to each rank (i32[P_src,
    P_dst], every rank's splits), no block longer than `capacity`."""
    rank, _ = tp.axis_rank_and_size(axis_name)
    plan = tp.make_plan(count_matrix, rank, capacity, num_recv)
    row_map = jnp.arange(x.shape[0], dtype=jnp.int32)
    return tp.send_rows(x, row_map, plan, num_recv=num_recv, capacity=capacity,
                        axis_name=axis_name, transport=tp.resolve_transport("auto"), impl="ffi")


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _exchange(x, output_splits, input_splits, axis_name, num_recv, num_send):
    return _exchange_fwd(x, output_splits, input_splits, axis_name, num_recv, num_send)[0]


def _exchange_fwd(x, output_splits, input_splits, axis_name, num_recv, num_send):
    del output_splits  # the layout comes from the exchanged input_splits
    count_matrix = tp.exchange_counts(input_splits, axis_name, tp.resolve_transport("auto"))
    # A block is at most S = num_send rows both ways (a source sends <= its S rows).
    return _rows(x, count_matrix, axis_name, num_recv, num_send), count_matrix


def _exchange_bwd(axis_name, num_recv, num_send, count_matrix, d_out):
    # The forward's plan again (no second count exchange): the cotangent rows of the blocks
    # this rank received return to their sources, into the rows of x they came from; rows the
    # forward dropped (past a block's capacity or num_recv) get zero.
    rank, _ = tp.axis_rank_and_size(axis_name)
    plan = tp.make_plan(count_matrix, rank, num_send, num_recv)
    rows = jnp.arange(num_send, dtype=jnp.int32)
    back, owner, _ = tp.return_rows(d_out, rows, plan, num_send=num_send, capacity=num_send,
                                    axis_name=axis_name,
                                    transport=tp.resolve_transport("auto"), impl="ffi")
    # each row of x answers at most one returned row: a scatter, for any dtype
    d_x = jnp.zeros((num_send,) + d_out.shape[1:], d_out.dtype)
    return d_x.at[jnp.where(owner >= 0, owner, num_send)].set(back, mode="drop"), None, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def all_to_all_single_equal(x, *, axis_name):
    """Equal-split all-to-all along dim 0: x [S, ...] (S a multiple of P) sends its p-th block
    of S/P rows to rank p; returns [S, ...] with the block from source rank q at q*S/P.
    Differentiable (its VJP is the same exchange)."""
    _, num_ranks = tp.axis_rank_and_size(axis_name)
    check_rows(x, "x")
    if x.shape[0] % num_ranks:
        raise ValueError(f"x: expected a leading dimension divisible by the {num_ranks} ranks "
                         f"of {axis_name!r}, got shape {jnp.shape(x)}")
    if num_ranks == 1:
        return x
    blocks = x.reshape((num_ranks, x.shape[0] // num_ranks) + x.shape[1:])
    out = jax.lax.all_to_all(blocks, axis_name, 0, 0)
    return checkpoint_name(out.reshape(x.shape), tp.DISPATCH_NAME)
