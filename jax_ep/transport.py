"""Moving rows between the ranks of an expert mesh axis, inside `jax.shard_map`.

Every EP mode describes its traffic the same way: a compact send buffer of S rows grouped by
destination rank (destination-major), `send_counts[p]` rows for rank p starting at
`send_offsets[p]`, and a compact receive buffer of R rows grouped by source rank ascending.
An `ExchangePlan` (a pytree of i32 arrays, built once from one count exchange) holds every
count and offset both directions need, so a backward or a combine replays it with no new
count exchange.

Transports:
  "all_to_all" - `jax.lax.all_to_all` of a [P, C, ...] padded buffer, C rows per destination
                 (every backend, XLA:CPU included);
  "ragged"     - `jax.lax.ragged_all_to_all` of exactly the used rows (GPU/TPU only);
  "peer"       - jax_ep's own exchange among the devices of this process (the FFI target
                 jax_ep_peer_exchange, xla_ffi/peer.cc): each receiver copies exactly its rows
                 straight out of the senders' buffers (the send packing fused into the copy),
                 counts and small tables included, so a dispatch runs no XLA collective. Every
                 mesh axis must be manual in the enclosing shard_map and every device in this
                 process;
  "auto"       - peer on CPU in a single process, else ragged on GPU/TPU, all_to_all on CPU.
All give identical results (ragged and peer also leave the rows nobody sends zero). The
collectives are tagged with `checkpoint_name` ("ep_counts", "ep_dispatch", "ep_combine") so
remat policies can save or recompute them by name.

Backends (`check_backend`): "deepep" and its alias "uccl_ep" run the FFI kernels for the
layouts, packing and reductions around the wire, "alltoall" the XLA reference ops.
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_ep import _ffi, ops
from jax_ep._index import segment_of

__all__ = [
    "BACKENDS",
    "TRANSPORTS",
    "check_backend",
    "named",
    "with_transpose",
    "with_fp8_wire",
    "fp8_cast_back",
    "FP8_PAIR_NO_GRAD",
    "as_bits",
    "from_bits",
    "ExchangePlan",
    "exclusive_cumsum",
    "exchange_rows",
    "PEER_TIMEOUT_ENV",
    "MAX_PEER_TIMEOUT_S",
    "peer_timeout_s",
    "peer_unavailable",
    "axis_rank_and_size",
    "exchange_blocks",
    "exchange_counts",
    "make_plan",
    "resolve_transport",
    "NODE_HOP",
    "xla_only",
    "receive_buffer",
    "receive_rows",
    "return_buffer_size",
    "return_rows",
    "return_slots",
    "send_row_ranks",
    "send_rows",
]

TRANSPORTS = ("auto", "all_to_all", "ragged", "peer")
BACKENDS = ("deepep", "alltoall", "uccl_ep")
_IMPL_OF_BACKEND = {"deepep": "ffi", "uccl_ep": "ffi", "alltoall": "xla"}
COUNTS_NAME = "ep_counts"
DISPATCH_NAME = "ep_dispatch"
COMBINE_NAME = "ep_combine"
_REVERSED = {DISPATCH_NAME: COMBINE_NAME, COMBINE_NAME: DISPATCH_NAME}


PEER_TIMEOUT_ENV = "JAX_EP_PEER_TIMEOUT_S"
# The bound's default: 60 s on XLA:CPU, whose emulated devices share few cores and may arrive
# far apart; 5 s on GPUs, where a meeting waits only for the other devices' host threads to
# enqueue their work, and XLA's GPU client ends the whole process 10 s after one device's
# execution fails while others still run (PjRtStreamExecutorLoadedExecutable::Execute): a
# bound under that fails the waiting devices' calls first, so the error reaches Python.
DEFAULT_PEER_TIMEOUT_S = 60.0
DEFAULT_GPU_PEER_TIMEOUT_S = 5.0
MAX_PEER_TIMEOUT_S = 1e6  # about 11.6 days
_GPU_PLATFORMS = ("gpu", "cuda")
# Platforms with a peer handler: XLA:CPU always, CUDA GPUs when the CUDA handlers were built.
_PEER_PLATFORMS = ("cpu",) + _GPU_PLATFORMS if _ffi.WITH_CUDA else ("cpu",)


def peer_unavailable() -> str | None:
    """Why the "peer" transport cannot run in the program being traced, or None when it can:
    it needs every device of the mesh in this process and every mesh axis manual (inside
    `jax.shard_map` over all of them), since the devices find their peers by mesh position;
    on GPUs, peer access between every two GPUs of the process (_ffi.gpus_without_peer_access:
    PCIe topologies and virtual machines may have none)."""
    if jax.process_count() > 1:
        instead = "'all_to_all'" if _ffi.trace_platform() == "cpu" else "'ragged' or 'all_to_all'"
        return (f"this is one of {jax.process_count()} processes (jax.distributed): the peer "
                f"transport reads peers' buffers inside one process only; across processes use "
                f"{instead} (docs/peer_transport.md)")
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.manual_axes:
        return "it runs inside jax.shard_map only (the mesh names the peers), not under vmap"
    auto = [a for a, n in zip(mesh.axis_names, mesh.axis_sizes)
            if n > 1 and a not in mesh.manual_axes]
    if auto:
        return (f"mesh axes {auto} are not manual in the enclosing jax.shard_map: the peer "
                "transport needs every axis manual (the devices find their peers by mesh "
                "position)")
    if _ffi.trace_platform() in _GPU_PLATFORMS:
        try:
            pairs = _ffi.gpus_without_peer_access()
        except RuntimeError as err:
            return f"CUDA cannot say whether the GPUs reach each other's memory: {err}"
        if pairs:
            shown = ", ".join(f"{a} and {b}" for a, b in pairs[:4])
            return (f"GPUs {shown}{' and more' if len(pairs) > 4 else ''} cannot read each "
                    f"other's memory (cudaDeviceCanAccessPeer): the peer transport reads "
                    f"peers' buffers directly; use 'ragged' on this machine")
    return None


def resolve_transport(transport: str, no_peer: str | None = None) -> str:
    """"auto" -> "peer" where it can run (CPU, or CUDA with the CUDA handlers built; one process,
    every mesh axis manual), else "ragged" on GPU/TPU and "all_to_all" on CPU (the platform of
    the mesh's devices, so a CPU mesh on a GPU host gets a CPU transport). Checks the name, and
    that "peer" / "ragged" can run here. no_peer: None, or why this exchange stays on XLA
    collectives (`NODE_HOP`, or `xla_only(impl)` of the "alltoall" backend): then "auto" never
    picks "peer" and "peer" is refused, naming that reason."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
    platform = _ffi.trace_platform()
    if transport == "auto":
        if no_peer is None and platform in _PEER_PLATFORMS and not peer_unavailable():
            return "peer"
        return "all_to_all" if platform == "cpu" else "ragged"
    if transport == "peer" and no_peer is not None:
        raise ValueError(f"transport: 'peer' cannot serve this exchange ({no_peer})")
    if transport == "ragged" and platform == "cpu":
        raise ValueError("transport: 'ragged' (ragged_all_to_all) is not supported by XLA:CPU; "
                         "use 'all_to_all', 'peer' or 'auto'")
    if transport == "peer" and (why := peer_unavailable() or (
            None if platform in _PEER_PLATFORMS else f"no peer handler for {platform!r}")):
        raise ValueError(f"transport: 'peer' cannot run here: {why}")
    return transport


#: why the node hop of a two-hop exchange never takes the peer transport
NODE_HOP = "the node hop of a two-hop exchange stays on XLA collectives"


def xla_only(impl: str) -> str | None:
    """The no_peer reason of a backend's kernels (check_backend's "ffi" / "xla"): the
    "alltoall" backend is built only from XLA ops, so its "auto" is XLA's collective."""
    return ("backend 'alltoall' is built only from XLA ops; backend 'deepep' takes the peer "
            "transport" if impl == "xla" else None)


def check_backend(backend: str) -> str:
    """Returns the kernel implementation ("ffi" / "xla") of a dispatcher backend name."""
    if backend not in _IMPL_OF_BACKEND:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return _IMPL_OF_BACKEND[backend]


def check_distinct_axes(axis_name) -> None:
    """ValueError if a tuple of axes names one twice (JAX multiplies such an axis's size in
    again: a rank layout no mesh has) or a name is an int (JAX reads an int as an array
    dimension, not a mesh axis)."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if any(isinstance(name, (int, np.integer)) for name in names):
        raise ValueError(f"axis_name: expected a mesh axis name or a tuple of them, got "
                         f"{axis_name!r}")
    if isinstance(axis_name, (tuple, list)) and len(set(axis_name)) != len(axis_name):
        raise ValueError(f"axis_name: expected distinct mesh axes, got {tuple(axis_name)!r}")


def axis_rank_and_size(axis_name):
    """(this rank's index, P) on the expert axis; ValueError if the axis is not bound or a
    tuple names one twice."""
    check_distinct_axes(axis_name)
    try:
        size = jax.lax.axis_size(axis_name)
    except NameError as err:
        raise ValueError(f"axis_name: {axis_name!r} is not a mesh axis bound by the enclosing "
                         "jax.shard_map") from err
    rank = jax.lax.axis_index(axis_name) if size > 1 else jnp.zeros((), jnp.int32)
    return rank, size


def exchange_counts(send_counts, axis_name, transport="all_to_all"):
    """send_counts i32[..., P] on every rank -> the count matrix i32[P_src, ..., P_dst] of the
    whole axis: one all_gather (the only count exchange of a dispatch), or one peer call."""
    rank, size = axis_rank_and_size(axis_name)
    if size == 1:
        return send_counts[None]
    if transport != "peer":
        return checkpoint_name(jax.lax.all_gather(send_counts, axis_name), COUNTS_NAME)
    ids = jnp.arange(size, dtype=jnp.int32)
    out, _ = _peer(send_counts.reshape(1, -1), jnp.zeros((size,), jnp.int32), ids,
                   jnp.ones((size,), jnp.int32), jnp.full((size,), rank, jnp.int32),
                   out_rows=size, axis_name=axis_name, name=COUNTS_NAME)
    return out.reshape((size,) + send_counts.shape)


def exchange_rows(x, axis_name, transport, name):
    """x [P, ...]: row p goes to rank p -> [P, ...], row q from rank q (`jax.lax.all_to_all`
    over the leading axis, or one peer call)."""
    rank, size = axis_rank_and_size(axis_name)
    if size == 1:
        return x
    if transport != "peer":
        return checkpoint_name(jax.lax.all_to_all(x, axis_name, 0, 0), name)
    ids = jnp.arange(size, dtype=jnp.int32)
    out, _ = _peer(x, ids, ids, jnp.ones((size,), jnp.int32), jnp.full((size,), rank, jnp.int32),
                   out_rows=size, axis_name=axis_name, name=name)
    return out


def named(value, name):
    """`checkpoint_name` on every leaf of value (None: value unchanged). Exchanges wrapped in a
    `jax.custom_vjp` name their results with this outside the wrapper: a remat policy sees
    only the names of the equations it partial-evaluates, never those inside a custom_vjp."""
    return value if name is None else checkpoint_name(value, name)


def vary_with_handle(rows, handle):
    """rows typed as varying over every manual mesh axis a leaf of handle varies over (inside
    shard_map): what the exchange's results vary over, so its custom_vjp's cotangent has the
    rows' type, and rows replicated over an axis get their cotangent summed over it (the
    cast's transpose)."""
    return _ffi.vary_like(rows, *jax.tree.leaves(handle))


def with_transpose(forward, transpose, name=None):
    """A map rows -> forward(rows, handle) that is linear in rows, with `jax.custom_vjp` so its
    VJP is transpose(cotangent, handle) (e.g. a dispatch and the combine that returns its
    rows); the handle gets no cotangent. The transpose is itself such a map, whose VJP is
    forward, so gradients of gradients work; it is the result's `adjoint` attribute.
    name: the checkpoint name of the map's results (DISPATCH_NAME or COMBINE_NAME, the
    adjoint's the other one), so `save_only_these_names` saves them instead of re-running the
    exchange in the backward."""

    @jax.custom_vjp
    def linear(rows, handle):
        return forward(rows, handle)

    @jax.custom_vjp
    def adjoint(rows, handle):
        return transpose(rows, handle)

    linear.defvjp(lambda rows, handle: (linear(rows, handle), handle),
                  lambda handle, d_out: (adjoint(d_out, handle), None))
    adjoint.defvjp(lambda rows, handle: (adjoint(rows, handle), handle),
                   lambda handle, d_out: (linear(d_out, handle), None))

    def named_linear(rows, handle):
        return named(linear(vary_with_handle(rows, handle), handle), name)

    def named_adjoint(rows, handle):
        return named(adjoint(vary_with_handle(rows, handle), handle), _REVERSED.get(name))
    named_linear.adjoint = named_adjoint
    return named_linear


FP8_PAIR_NO_GRAD = (
    "fp8_output: the FP8 pair (codes, scales) is forward-only (JAX types the cotangent of FP8 "
    "codes as FP8); dispatch with use_fp8=True, fp8_output=\"cast_back\" to differentiate - its "
    "backward runs in x's dtype")


def fp8_cast_back(codes, scales, use_ue8m0, dtype, impl):
    """Received FP8 rows codes [..., H] with their scales [..., G] -> rows [..., H] in dtype."""
    rows = ops.per_token_cast_back(codes.reshape(-1, codes.shape[-1]),
                                   scales.reshape(-1, scales.shape[-1]),
                                   use_ue8m0=use_ue8m0, dtype=dtype, impl=impl)
    return rows.reshape(codes.shape)


def with_fp8_wire(send, transpose, name=DISPATCH_NAME):
    """A dispatch of rows that moves them as FP8 on the wire, with a straight-through gradient.

    Returns rows_fp8(x, handle, round_scale, use_ue8m0, cast_back): x [T,H] f32/bf16/f16 is
    cast per token and 128 channels (ops.per_token_cast_to_fp8, handle.impl), the codes
    float8_e4m3fn[T,H] and scales (f32[T,H/128], or i32[T,H/512] with use_ue8m0) both travel
    through send(rows, handle) -> [..., H] (one layout, the same rows), and the result is the
    pair (codes [...,H], scales [...,G]) or, with cast_back, the rows cast back to x.dtype
    [...,H]. Backward (cast_back only): transpose(cotangent in x.dtype, handle), the backward
    of the same dispatch without FP8 - the cast counts as the identity. The pair has no
    gradient (JAX would type its cotangent FP8), so differentiating it raises. The results
    carry the checkpoint name `name` (see `with_transpose`).
    """

    def _forward(x, handle, round_scale, use_ue8m0, cast_back):
        codes, scales = ops.per_token_cast_to_fp8(x, round_scale=round_scale,
                                                  use_ue8m0=use_ue8m0, impl=handle.impl)
        recv_codes, recv_scales = send(codes, handle), send(scales, handle)
        if not cast_back:
            return recv_codes, recv_scales
        return fp8_cast_back(recv_codes, recv_scales, use_ue8m0, x.dtype, handle.impl)

    @partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
    def rows_fp8(x, handle, round_scale, use_ue8m0, cast_back):
        return _forward(x, handle, round_scale, use_ue8m0, cast_back)

    def _fwd(x, handle, round_scale, use_ue8m0, cast_back):
        return rows_fp8(x, handle, round_scale, use_ue8m0, cast_back), handle

    straight_through = with_transpose(send, transpose).adjoint

    def _bwd(round_scale, use_ue8m0, cast_back, handle, d_out):
        if not cast_back:
            raise ValueError(FP8_PAIR_NO_GRAD)
        return straight_through(d_out, handle), None

    rows_fp8.defvjp(_fwd, _bwd)

    def named_rows_fp8(x, handle, round_scale, use_ue8m0, cast_back):
        return named(rows_fp8(vary_with_handle(x, handle), handle, round_scale, use_ue8m0,
                              cast_back), name)
    return named_rows_fp8


class ExchangePlan(NamedTuple):
    """Counts and offsets of one exchange (all i32[P]); see the module docstring.

    send_counts: rows sent to each destination (capacity and receive budget applied).
    send_offsets: start of each destination's block in the compact send buffer.
    recv_counts: rows received from each source (capacity and receive budget applied).
    recv_offsets: start of each source's block in the compact receive buffer.
    remote_recv_offsets: where this rank's rows start in each destination's receive buffer.
    remote_send_offsets: where each source's block for this rank starts in that source's send
      buffer (the return trip of `return_rows`).
    """

    send_counts: jax.Array
    send_offsets: jax.Array
    recv_counts: jax.Array
    recv_offsets: jax.Array
    remote_recv_offsets: jax.Array
    remote_send_offsets: jax.Array


def exclusive_cumsum(x, axis=-1):
    """The exclusive prefix sum of x along axis (x[0] -> 0)."""
    return jnp.cumsum(x, axis=axis) - x


def make_plan(count_matrix, rank, capacity, num_recv):
    """count_matrix i32[P_src, P_dst] of uncapped block sizes -> ExchangePlan of `rank`.

    Blocks larger than `capacity` keep their first `capacity` rows (the rest are dropped by
    the sender); send offsets stay those of the uncapped compact send buffer. Every
    destination fills its `num_recv` receive rows (R) source by source, in rank order, and
    each sender drops the rows of its block that no longer fit (none when R >= P*capacity).
    """
    capped = jnp.minimum(count_matrix, capacity)
    capped = jnp.clip(num_recv - exclusive_cumsum(capped, axis=0), 0, capped)
    offsets_in_source = exclusive_cumsum(count_matrix, axis=1)
    offsets_in_dest = exclusive_cumsum(capped, axis=0)
    recv_counts = capped[:, rank]
    fields = (capped[rank], offsets_in_source[rank], recv_counts, exclusive_cumsum(recv_counts),
              offsets_in_dest[rank], offsets_in_source[:, rank])
    return ExchangePlan(*(f.astype(jnp.int32) for f in fields))


def send_row_ranks(plan, num_rows):
    """i32[num_rows]: the destination rank of each row of the compact, rank-major send buffer
    (plan.send_offsets); rows past the last block read the last rank."""
    return segment_of(plan.send_offsets, jnp.arange(num_rows, dtype=jnp.int32))


def _block_slots(counts, offsets, capacity):
    """[P*C] index of the compact row held by padded slot (p, j), -1 past counts[p]."""
    num_ranks = counts.shape[0]
    j = jnp.arange(capacity, dtype=jnp.int32)
    rows = offsets[:, None] + j[None, :]
    return jnp.where(j[None, :] < counts[:, None], rows, -1).reshape(num_ranks * capacity)


def _compact_slots(counts, offsets, capacity, num_rows):
    """[num_rows] padded slot p*C + j holding compact row r (grouped by p), -1 past the end."""
    r = jnp.arange(num_rows, dtype=jnp.int32)
    p = segment_of(offsets, r)
    j = r - offsets[p]
    return jnp.where(j < counts[p], p * capacity + j, -1).astype(jnp.int32)


def as_bits(x):
    """Sub-32-bit floats as same-width unsigned ints, for the wire: XLA:CPU widens bf16/f16/FP8
    collectives to f32 (twice the bytes, plus converts); the bits move unchanged anywhere."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{jnp.finfo(x.dtype).bits}"))
    return x


def from_bits(x, dtype):
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def _all_to_all(buf, axis_name, num_ranks, capacity, name):
    blocks = as_bits(buf).reshape((num_ranks, capacity) + buf.shape[1:])
    out = jax.lax.all_to_all(blocks, axis_name, 0, 0)
    return checkpoint_name(from_bits(out.reshape(buf.shape), buf.dtype), name)


def _ragged(rows, out_rows, in_offsets, in_sizes, out_offsets, out_sizes, axis_name, name):
    bits = as_bits(rows)
    output = jnp.zeros((out_rows,) + rows.shape[1:], bits.dtype)
    out = jax.lax.ragged_all_to_all(bits, output, in_offsets, in_sizes, out_offsets, out_sizes,
                                    axis_name=axis_name)
    return checkpoint_name(from_bits(out, rows.dtype), name)


def _peer(src, row_map, send_offsets, send_counts, dest_offsets, *, out_rows, axis_name, name,
          recv_rows=None):
    """One peer exchange (xla_ffi/peer.cc): this rank's rows for rank q are src[row_map[j]]
    for j in send_offsets[q] + [0, send_counts[q]) (a zero row where row_map[j] is outside
    src), landing at rows dest_offsets[q] onward of q's receive layout [out_rows, ...] (src's
    dtype and row shape; rows nobody writes are zero). Returns (that layout, or with recv_rows
    i32[N] its rows recv_rows [N, ...] (-1 or past the layout: zero rows) gathered by the copy
    itself, and recv_counts i32[P])."""
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    num_ranks = math.prod(sizes[a] for a in axes)
    gather = recv_rows is not None
    rows_out = recv_rows.shape[0] if gather else out_rows
    if row_map.shape[0] == 0:  # static and alike on every rank: nobody sends, so no meeting
        zeros = jnp.zeros((rows_out,) + src.shape[1:], src.dtype)
        return (checkpoint_name(_ffi.vary_like(zeros, src, row_map), name),
                _ffi.vary_like(jnp.zeros((num_ranks,), jnp.int32), src, row_map))
    others = tuple(a for a in mesh.axis_names if a not in axes and sizes[a] > 1)
    rank = jax.lax.axis_index(axes if len(axes) > 1 else axes[0])
    group = jax.lax.axis_index(others) if others else jnp.zeros((), jnp.int32)
    timeout_s = peer_timeout_s(_ffi.trace_platform())
    i32 = jnp.int32
    out, recv_counts = _ffi.call(
        "jax_ep_peer_exchange",
        (jax.ShapeDtypeStruct((rows_out,) + src.shape[1:], src.dtype),
         jax.ShapeDtypeStruct((num_ranks,), i32)),
        src, row_map.astype(i32), send_offsets.astype(i32), send_counts.astype(i32),
        dest_offsets.astype(i32), jnp.stack([rank, group]).astype(i32),
        recv_rows.astype(i32) if gather else jnp.zeros((0,), i32),
        num_ranks=num_ranks, num_devices=mesh.size,
        timeout_ms=max(1, round(timeout_s * 1000)), num_recv=out_rows, gather=gather,
        axis=str(axis_name))
    return checkpoint_name(out, name), recv_counts


def peer_timeout_s(platform: str = "cpu") -> float:
    """The peer meetings' bound in seconds on `platform` ("cpu", "gpu" / "cuda"):
    JAX_EP_PEER_TIMEOUT_S, by default 60 on the CPU and 5 on GPUs (DEFAULT_GPU_PEER_TIMEOUT_S
    says why: above 10 s, a device that fails alone ends the process on XLA's GPU client); a
    number in (0, MAX_PEER_TIMEOUT_S], anything else a ValueError naming the variable (the
    handlers keep their deadlines in int64 nanoseconds, so the bound is capped well inside)."""
    default = DEFAULT_PEER_TIMEOUT_S if platform == "cpu" else DEFAULT_GPU_PEER_TIMEOUT_S
    text = os.environ.get(PEER_TIMEOUT_ENV, str(default))
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_PEER_TIMEOUT_S:
        raise ValueError(f"{PEER_TIMEOUT_ENV}: expected seconds in (0, {MAX_PEER_TIMEOUT_S:g}], "
                         f"got {text!r}")
    return value


def _compact(transport, size):
    """Whether the exchange moves only the used rows into a compact layout (ragged, peer)."""
    return size > 1 and transport in ("ragged", "peer")


def exchange_blocks(src, send_sizes, recv_sizes, *, capacity, axis_name, transport, name,
                    row_map=None, recv_rows=None, impl="ffi"):
    """Fixed blocks of C rows to every rank, moving only the used rows on "ragged" / "peer".

    The send buffer buf [P*C, ...] is src itself, or src[row_map] (row_map i32[P*C], -1: a
    zero row): block p (rows p*C ...) goes to rank p and holds send_sizes[p] used rows first,
    zero rows after them. The receive buffer [P*C, ...] holds in block q what rank q sent here
    (recv_sizes[q] used rows first); returned whole, or its rows recv_rows (i32[N], -1: a zero
    row) [N, ...]. "all_to_all" moves the whole blocks; "ragged" and "peer" only the used rows,
    into the same slots, the rest staying zero: all give the same result. On "peer" both
    gathers are the copy itself (the receivers read src[row_map] and write the recv_rows
    order); elsewhere they are ops.gather_rows with `impl`.
    """
    rank, size = axis_rank_and_size(axis_name)
    # block p starts at row p*C of the send buffer; every block lands at row rank*C of its peer
    starts = jnp.arange(size, dtype=jnp.int32) * capacity
    here = jnp.full((size,), rank * capacity, jnp.int32)
    if transport == "peer" and size > 1:
        rows = jnp.arange(size * capacity, dtype=jnp.int32) if row_map is None else row_map
        return _peer(src, rows, starts, send_sizes, here, out_rows=size * capacity,
                     axis_name=axis_name, name=name, recv_rows=recv_rows)[0]
    buf = src if row_map is None else ops.gather_rows(src, row_map, impl=impl)
    if size > 1 and not _compact(transport, size):
        buf = _all_to_all(buf, axis_name, size, capacity, name)
    elif size > 1:
        buf = _ragged(buf, buf.shape[0], starts, send_sizes.astype(jnp.int32), here,
                      recv_sizes.astype(jnp.int32), axis_name, name)
    return buf if recv_rows is None else ops.gather_rows(buf, recv_rows, impl=impl)


def _peer_send(src, row_map, plan, num_recv, axis_name, recv_rows=None):
    """The dispatch of `plan` on "peer": the receivers read src through row_map (no send
    packing) into the compact receive layout [num_recv, ...], or straight into the recv_rows
    order (i32[N], -1: a zero row) [N, ...]."""
    return _peer(src, row_map, plan.send_offsets, plan.send_counts, plan.remote_recv_offsets,
                 out_rows=num_recv, axis_name=axis_name, name=DISPATCH_NAME,
                 recv_rows=recv_rows)[0]


def receive_buffer(src, row_map, plan, *, num_recv, capacity, axis_name, transport, impl):
    """Send rows to their destinations without compacting what arrives.

    src [M, ...] holds the data; row_map i32[S] names the src row of each compact send row
    (-1: nothing). Returns (buffer [B, ...], slot i32[num_recv]): compact receive row r is
    buffer[slot[r]] (-1: padding). Callers fuse their own gather over `slot` (HybridEP's
    permute reads the buffer directly); `send_rows` compacts it.
    """
    _, size = axis_rank_and_size(axis_name)
    if _compact(transport, size):
        if transport == "peer":  # the receivers read src through row_map: no send packing
            buffer = _peer_send(src, row_map, plan, num_recv, axis_name)
        else:
            buffer = _ragged(ops.gather_rows(src, row_map, impl=impl), num_recv,
                             plan.send_offsets, plan.send_counts, plan.remote_recv_offsets,
                             plan.recv_counts, axis_name, DISPATCH_NAME)
        r = jnp.arange(num_recv, dtype=jnp.int32)
        return buffer, jnp.where(r < plan.recv_counts.sum(), r, -1)
    slot_rows = _block_slots(plan.send_counts, plan.send_offsets, capacity)
    slot_src = jnp.where(slot_rows >= 0, jnp.take(row_map, jnp.clip(slot_rows, 0)), -1)
    padded = ops.gather_rows(src, slot_src, impl=impl)
    if size > 1:
        padded = _all_to_all(padded, axis_name, size, capacity, DISPATCH_NAME)
    return padded, _compact_slots(plan.recv_counts, plan.recv_offsets, capacity, num_recv)


def receive_rows(src, row_map, plan, recv_rows, *, num_recv, capacity, axis_name, transport,
                 impl):
    """Sends rows as `send_rows` does and returns the compact receive rows recv_rows (i32[N],
    -1: a zero row) [N, ...]: on "peer" the receivers copy them straight from the senders into
    that order (no receive buffer at all); elsewhere `receive_buffer`, then one gather."""
    _, size = axis_rank_and_size(axis_name)
    if transport == "peer" and size > 1:
        return _peer_send(src, row_map, plan, num_recv, axis_name, recv_rows)
    buffer, slot = receive_buffer(src, row_map, plan, num_recv=num_recv, capacity=capacity,
                                  axis_name=axis_name, transport=transport, impl=impl)
    rows = jnp.where(recv_rows >= 0, jnp.take(slot, jnp.clip(recv_rows, 0)), -1)
    return ops.gather_rows(buffer, rows, impl=impl)


def send_rows(src, row_map, plan, *, num_recv, capacity, axis_name, transport, impl):
    """Send rows to their destinations; returns the compact receive buffer [num_recv, ...]
    (grouped by source rank ascending, zero rows past the received ones)."""
    buffer, slot = receive_buffer(src, row_map, plan, num_recv=num_recv, capacity=capacity,
                                  axis_name=axis_name, transport=transport, impl=impl)
    if _compact(transport, axis_rank_and_size(axis_name)[1]):
        return buffer  # already compact
    return ops.gather_rows(buffer, slot, impl=impl)


def return_buffer_size(num_recv, capacity, num_ranks, transport):
    """Rows of the buffer `return_rows` sends from (the received rows, going back): P*C
    padded, or the compact receive size num_recv."""
    return num_recv if _compact(transport, num_ranks) else num_ranks * capacity


def return_slots(plan, *, num_recv, capacity, axis_name, transport):
    """i32[num_recv]: where each compact receive row goes in the buffer `return_rows` sends
    (-1: nowhere), so a producer can write that buffer directly."""
    _, size = axis_rank_and_size(axis_name)
    if _compact(transport, size):
        r = jnp.arange(num_recv, dtype=jnp.int32)
        return jnp.where(r < plan.recv_counts.sum(), r, -1)
    return _compact_slots(plan.recv_counts, plan.recv_offsets, capacity, num_recv)


def return_rows(y, send_map, plan, *, num_send, capacity, axis_name, transport, impl,
                prepacked=False):
    """The reverse trip of `send_rows`: y [num_recv, ...] rows go back to their sources.

    With prepacked=True, y is already the send buffer laid out by `return_slots`.
    Returns (rows, owner, source_rank): rows [Q, ...] that came back to this rank, owner
    i32[Q], the entry of send_map (i32[num_send], one per compact send row) each row answers
    (-1: none), and source_rank i32[Q], the rank each row came back from.
    Reducing rows by owner (`ops.unpermute`) finishes a combine.
    """
    _, size = axis_rank_and_size(axis_name)
    if _compact(transport, size):
        if transport == "peer":
            rows, _ = _peer(y, jnp.arange(y.shape[0], dtype=jnp.int32), plan.recv_offsets,
                            plan.recv_counts, plan.remote_send_offsets, out_rows=num_send,
                            axis_name=axis_name, name=COMBINE_NAME)
        else:
            rows = _ragged(y, num_send, plan.recv_offsets, plan.recv_counts,
                           plan.remote_send_offsets, plan.send_counts, axis_name, COMBINE_NAME)
        j = jnp.arange(num_send, dtype=jnp.int32)
        p = send_row_ranks(plan, num_send)
        sent = (j - plan.send_offsets[p]) < plan.send_counts[p]
        return rows, jnp.where(sent, send_map, -1), p
    padded = y if prepacked else ops.gather_rows(
        y, _block_slots(plan.recv_counts, plan.recv_offsets, capacity), impl=impl)
    if size > 1:
        padded = _all_to_all(padded, axis_name, size, capacity, COMBINE_NAME)
    send_slots = _block_slots(plan.send_counts, plan.send_offsets, capacity)
    owner = jnp.where(send_slots >= 0, jnp.take(send_map, jnp.clip(send_slots, 0)), -1)
    return padded, owner, jnp.arange(size * capacity, dtype=jnp.int32) // max(capacity, 1)
