"""DeepEP's `Buffer` (and UCCL-EP's `UCCLBuffer`) over jax_ep's functional API, for code
ported from DeepEP / UCCL-EP.

Same class, method, argument and result names, order and defaults as DeepEP's
`deep_ep.Buffer`; every method calls `jax_ep.dispatch` / `combine` /
`low_latency_dispatch` / `low_latency_combine` / `ops.get_dispatch_layout` (no second
implementation). The object holds no arrays: build it anywhere, close over it in `jit`, and
call its methods inside `jax.shard_map` over the expert axis `group`.

Arguments that have no effect under XLA (accepted so that ported calls run unchanged):

| argument | where | why it has no effect |
|---|---|---|
| `num_nvl_bytes`, `num_rdma_bytes` | `Buffer(...)` | XLA allocates every buffer of the compiled program |
| `low_latency_mode`, `num_qps_per_rank`, `allow_nvlink_for_low_latency_mode`, `allow_mnnvl` | `Buffer(...)` | both modes are always available; XLA picks the links |
| `explicitly_destroy` | `Buffer(...)` | nothing to release (`destroy()` does nothing) |
| `is_intranode` | `Buffer(...)` | kept as an attribute; `UCCLBuffer` sets it from the group |
| `config` | `dispatch`, `combine` | no SM / chunk tuning (`Config` is a plain record) |
| `previous_event`, `async_finish`, `allocate_on_comm_stream` | normal-mode methods | XLA orders and schedules the collectives; results are `EventOverlap()` |
| `async_finish`, `return_recv_hook` | low-latency methods | as above; the hook is a callable returning None |
| `num_tokens_per_rdma_rank` | `dispatch` | recomputed from topk_idx by the two-hop dispatch (a (node, local) `group`) |
| `dispatch_wait_recv_cost_stats`, `combine_wait_recv_cost_stats` | low-latency methods | no timers inside a compiled program; left untouched |
| `zero_copy` | `low_latency_combine` | `x` already is the combine buffer |
| `new_num_sms` | `set_num_sms` | no SM partitioning |

Differences forced by static shapes: `num_worst_tokens=0` means DeepEP's worst case (P*T
receive rows; there is no host sync to size it exactly); `num_recv_tokens_per_expert_list`
is an i32[L] array, not a list; `out=` is not written in place (the result is returned);
`cumulative_local_expert_recv_stats` is not updated in place: the handle carries the new
value as `handle.cumulative_local_expert_recv_stats`. `use_logfmt=True` sends the combine's
rows in DeepEP's LogFMT-10 encoding (`jax_ep.low_latency_combine(..., use_logfmt=True)`; with
`zero_copy=True` it raises, as DeepEP's assertion does).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_ep import deepep, low_latency, ops, transport as tp
from jax_ep._checks import check_positive, check_shape
from jax_ep.all_to_all import all_to_all_single_equal

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "UCCLBuffer"]


@dataclasses.dataclass(frozen=True)
class Config:
    """DeepEP's performance-tuning record (`deep_ep.Config`); it has no effect under XLA."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256


class EventHandle:
    """DeepEP's CUDA event handle; under XLA there is no event to hold."""


class EventOverlap:
    """DeepEP's event wrapper. XLA orders every operation of the compiled program, so there is
    nothing to wait for: `current_stream_wait()` and the `with` block do nothing."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Does nothing (XLA already orders the program)."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.current_stream_wait()


def _no_hook():
    """The receive hook of a low-latency call: data has always arrived under XLA."""
    return None


def _check_group(group):
    """The expert axis: a name, or a (node_axis, local_axis) pair (DeepEP's internode mode:
    the normal-mode methods run the two-hop dispatch/combine)."""
    if isinstance(group, str):
        return group
    if isinstance(group, (tuple, list)) and len(group) == 2 and all(
            isinstance(a, str) for a in group):
        return tuple(group)
    raise ValueError(f"group: expected the name (str) of the expert mesh axis or a "
                     f"(node_axis, local_axis) pair of names, got {group!r}")


class Buffer:
    """DeepEP's expert-parallel communication buffer over the expert mesh axis `group`.

    The methods run inside `jax.shard_map` over `group` (P ranks, L = E / P local experts);
    see the module docstring for the arguments that have no effect under XLA.
    """

    num_sms: int = 20
    #: dispatch backend of the normal and low-latency modes (see jax_ep.transport.BACKENDS).
    backend: str = "deepep"

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, is_intranode: bool = False):
        self.group = _check_group(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.explicitly_destroy = explicitly_destroy
        self.is_intranode = is_intranode

    @property
    def group_size(self):
        """P, the size of the expert axis (inside shard_map)."""
        return tp.axis_rank_and_size(self.group)[1]

    @property
    def rank(self):
        """This rank's index on the expert axis, i32[] (inside shard_map)."""
        return tp.axis_rank_and_size(self.group)[0]

    # -- no-ops and records --------------------------------------------------------------

    def destroy(self) -> None:
        """Does nothing: the buffer holds no resources."""

    def reset_rdma_buffer(self) -> None:
        """Does nothing: every call's buffers are fresh arrays."""

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Does nothing: low-latency buffers are zero-initialised on every call."""

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Does nothing: XLA does not partition SMs."""

    @staticmethod
    def capture() -> EventOverlap:
        """An `EventOverlap` (nothing to record under XLA)."""
        return EventOverlap()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A `Config` (no effect under XLA)."""
        return Config(num_sms=Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A `Config` (no effect under XLA)."""
        return Config(num_sms=Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes that one rank's low-latency dispatch + combine move through their exchanges
        at most (send and receive buffer of each, BF16 rows, as DeepEP sizes it): the i32
        counts [P, L] and source tokens [E*Tmax] of the dispatch plan, the dispatch rows and
        the combine rows [E*Tmax, hidden] bf16. The exchanges move P blocks of
        min(L*Tmax, T*min(K, L)) rows: exactly this at T = Tmax and K >= L, less below."""
        tmax = check_positive(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
        hidden = check_positive(hidden, "hidden")
        num_ranks = check_positive(num_ranks, "num_ranks")
        num_experts = check_positive(num_experts, "num_experts")
        slots = num_experts * tmax
        int32, bf16 = 4, 2
        one_way = num_experts * int32 + slots * int32 + 2 * slots * hidden * bf16
        return 2 * one_way  # each exchange has a send and a receive buffer

    # -- normal mode ---------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """topk_idx [T,K] int32/int64 global expert ids (-1 = unrouted) ->
        (num_tokens_per_rank i32[P], num_tokens_per_rdma_rank, num_tokens_per_expert
        i32[E], is_token_in_rank bool[T,P], event); num_tokens_per_rdma_rank is i32[N] (this
        rank's tokens going to each node, once per node) when `group` is a (node, local)
        pair of N x G ranks, else None."""
        impl = tp.check_backend(self.backend)
        per_rank, in_rank, per_expert = ops.get_dispatch_layout(
            topk_idx, num_experts=num_experts, num_ranks=self.group_size, impl=impl)
        per_node = None
        if isinstance(self.group, tuple):
            per_node = ops.get_dispatch_layout(
                topk_idx, num_experts=num_experts,
                num_ranks=tp.axis_rank_and_size(self.group[0])[1], impl=impl)[0]
        return per_rank, per_node, per_expert, in_rank, EventOverlap()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config=None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """DeepEP normal dispatch (`jax_ep.dispatch`).

          x: [T,H] bf16/f32/f16, or the FP8 pair (x_fp8 float8_e4m3fn[T,H], scales
            f32[T,H/128]).
          num_tokens_per_expert: i32[E] from get_dispatch_layout; gives E (required without
            a handle). With num_tokens_per_rank i32[P] and is_token_in_rank bool[T,P] it is
            passed on as the precomputed layout.
          topk_idx: [T,K] global expert ids (-1 = unrouted); topk_weights: f32[T,K]. Without
            topk_idx (and no handle) tokens go where is_token_in_rank says, recv_topk_idx and
            recv_topk_weights are None and num_recv_tokens_per_expert_list sums the senders'
            num_tokens_per_expert, as in DeepEP.
          num_worst_tokens: receive rows R; 0 means the worst case P*T.
        Returns (recv_x [R,H] (or the pair), recv_topk_idx i32[R,K] local ids,
        recv_topk_weights f32[R,K], num_recv_tokens_per_expert_list i32[L], handle, event);
        with `handle=` (cached dispatch, the handle's routing): (recv_x, None, None, None,
        None, event).
        """
        if num_worst_tokens != 0:
            check_positive(num_worst_tokens, "num_worst_tokens")
        worst = num_worst_tokens or None
        if handle is not None:
            recv_x, _, _, _ = deepep.dispatch(x, handle=handle, axis_name=self.group,
                                              backend=self.backend)
            return recv_x, None, None, None, None, EventOverlap()
        if num_tokens_per_expert is None:
            raise ValueError("num_tokens_per_expert: expected the i32[E] counts of "
                             "get_dispatch_layout without a handle (they give E), got None")
        num_experts = jnp.shape(num_tokens_per_expert)[0]
        layout = None
        if num_tokens_per_rank is not None and is_token_in_rank is not None:
            layout = (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)
        if topk_idx is None:
            return self._dispatch_by_rank(x, is_token_in_rank, num_tokens_per_expert,
                                          expert_alignment, worst, layout)
        recv_x, recv_idx, recv_w, handle = deepep.dispatch(
            x, topk_idx, topk_weights, num_experts=num_experts, axis_name=self.group,
            backend=self.backend, num_worst_tokens=worst, expert_alignment=expert_alignment,
            layout=layout)
        return (recv_x, recv_idx, recv_w, handle.num_recv_tokens_per_expert, handle,
                EventOverlap())

    def _dispatch_by_rank(self, x, is_token_in_rank, num_tokens_per_expert, expert_alignment,
                          worst, layout):
        """DeepEP's dispatch without top-k: token t goes to every rank p with
        is_token_in_rank[t, p] (routed as rank p's first expert), and the per-expert receive
        counts are the senders' num_tokens_per_expert summed per local expert."""
        if is_token_in_rank is None:
            raise ValueError("is_token_in_rank: expected bool[T,P] when topk_idx is None "
                             "(no handle), got None")
        num_ranks = self.group_size
        num_experts = jnp.shape(num_tokens_per_expert)[0]
        rows = x[0] if isinstance(x, (tuple, list)) else x
        check_shape(is_token_in_rank, (jnp.shape(rows)[0], num_ranks), "is_token_in_rank")
        first_expert = jnp.arange(num_ranks, dtype=jnp.int32) * (num_experts // num_ranks)
        topk_idx = jnp.where(is_token_in_rank, first_expert, -1)
        recv_x, _, _, handle = deepep.dispatch(
            x, topk_idx, None, num_experts=num_experts, axis_name=self.group,
            backend=self.backend, num_worst_tokens=worst, layout=layout)
        per_source = all_to_all_single_equal(jnp.asarray(num_tokens_per_expert, jnp.int32),
                                             axis_name=self.group)
        per_local = per_source.reshape(num_ranks, -1).sum(axis=0)
        align = check_positive(expert_alignment, "expert_alignment")
        per_local = (per_local + align - 1) // align * align
        return recv_x, None, None, per_local, handle, EventOverlap()

    def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """DeepEP normal combine (`jax_ep.combine`): x [R,H] -> (combined_x [T,H],
        combined_topk_weights f32[T,K] or None, event). Unweighted sum of a token's copies in
        fp32; `bias` ([T,H], or a pair of them) is added to that sum in fp32 before the cast
        to x.dtype."""
        deepep.check_combine_rows(x, handle, "x")
        combined, combined_w = deepep.combine(x, handle, topk_weights=topk_weights)
        if bias is not None:
            biases = tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
            total = combined.astype(jnp.float32)
            for i, b in enumerate(biases):
                name = "bias" if len(biases) == 1 else f"bias[{i}]"
                check_shape(b, combined.shape, name)
                total = total + jnp.asarray(b).astype(jnp.float32)
            combined = total.astype(x.dtype)
        return combined, combined_w, EventOverlap()

    # -- low-latency mode ----------------------------------------------------------------

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """DeepEP low-latency dispatch (`jax_ep.low_latency_dispatch`; FP8 by default, as in
        DeepEP): x [T,H] bf16 (T <= Tmax), topk_idx [T,K] ->
        (recv_x, recv_count i32[L], handle, event, hook). recv_x is
        (x_fp8 float8_e4m3fn[L,P*Tmax,H], scales f32[L,P*Tmax,H/128] or i32[L,P*Tmax,H/512]
        with use_ue8m0), or [L,P*Tmax,H] in x.dtype without use_fp8.
        cumulative_local_expert_recv_stats i32[L]: returned plus recv_count as
        handle.cumulative_local_expert_recv_stats. hook: a callable returning None when
        return_recv_hook, else None."""
        recv_x, recv_count, handle = low_latency.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            num_experts=num_experts, axis_name=self.group, use_fp8=use_fp8,
            round_scale=round_scale, use_ue8m0=use_ue8m0, backend=self.backend)
        if cumulative_local_expert_recv_stats is not None:
            check_shape(cumulative_local_expert_recv_stats, recv_count.shape,
                        "cumulative_local_expert_recv_stats")
            stats = jnp.asarray(cumulative_local_expert_recv_stats)
            handle = dataclasses.replace(
                handle, cumulative_local_expert_recv_stats=stats + recv_count.astype(stats.dtype))
        return recv_x, recv_count, handle, EventOverlap(), _no_hook if return_recv_hook else None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out=None,
                            combine_wait_recv_cost_stats=None):
        """DeepEP low-latency combine (`jax_ep.low_latency_combine`): x [L,P*Tmax,H] bf16,
        topk_idx [T,K], topk_weights f32[T,K] of the dispatch -> (combined_x [T,H] =
        Σ_k w_k · x_{idx_k}(t), event, hook). `out` ([T,H]) is not written in place: its
        dtype is the result's. use_logfmt (x bf16, H % 512 == 0): the rows travel in DeepEP's
        LogFMT-10 encoding (2H + H/32 bytes a row: an (amax, amin) bf16 pair per 128
        channels, 10-bit log codes for each 1024-channel chunk (512 when H % 1024 != 0) whose
        values are below 1 and not constant, raw bf16 for the others), decoded on arrival;
        gradients straight-through. DeepEP forbids it with zero_copy: so does this."""
        if use_logfmt and zero_copy:
            raise ValueError("use_logfmt: DeepEP's combine does not allow use_logfmt with "
                             "zero_copy=True")
        low_latency.check_combine_rows(x, handle, "x")
        if use_logfmt:
            low_latency.check_logfmt_rows(x, "x")
        combined = low_latency.low_latency_combine(x, topk_idx, topk_weights, handle,
                                                   use_logfmt=use_logfmt)
        if out is not None:
            check_shape(out, combined.shape, "out")
            combined = combined.astype(out.dtype)
        return combined, EventOverlap(), _no_hook if return_recv_hook else None

    def get_next_low_latency_combine_buffer(self, handle):
        """A zero bf16 [L, P*Tmax, H] buffer for the next low_latency_combine's x."""
        if not isinstance(handle, low_latency.LowLatencyHandle):
            raise ValueError(f"handle: expected the LowLatencyHandle of a low_latency_dispatch, "
                             f"got {type(handle).__name__}")
        return jnp.zeros(handle.src_info.shape + (handle.hidden,), jnp.bfloat16)


class UCCLBuffer(Buffer):
    """UCCL-EP's DeepEP-compatible buffer (backend "uccl_ep"); `is_intranode` follows the
    group: a single expert axis is intranode, a (node, local) pair is not."""

    backend = "uccl_ep"

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, is_intranode: bool = False):
        super().__init__(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
                         num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
                         explicitly_destroy, is_intranode=isinstance(group, str))
