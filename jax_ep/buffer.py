"""DeepEP's `Buffer` (and UCCL-EP's `UCCLBuffer`) over jax_ep's functional API, for code
ported from DeepEP / UCCL-EP.

Same class, method, argument and result names, order and defaults as DeepEP's
`deep_ep.Buffer`; every method calls `jax_ep.dispatch` / `combine` /
`low_latency_dispatch` / `low_latency_combine` / `ops.get_dispatch_layout` (no second
implementation). The object holds no arrays: build it anywhere, close over it in `jit`, and
call its methods inside `jax.shard_map` over the expert axis `group`.

Arguments that have no effect under XLA (accepted so that ported calls run unchanged):

- `num_nvl_bytes`, `num_rdma_bytes` (`Buffer(...)`): XLA allocates every buffer of the compiled
  program (checked as DeepEP asserts them: ints >= 0, multiples of 128).
- `low_latency_mode`, `num_qps_per_rank`, `allow_nvlink_for_low_latency_mode`, `allow_mnnvl`
  (`Buffer(...)`): both modes are always available; XLA picks the links (the flags must be
  bools; QPs an int, > 0 in low-latency mode).
- `explicitly_destroy` (`Buffer(...)`): nothing to release; `destroy()` does nothing, with or
  without it (DeepEP asserts it first).
- `is_intranode` (`Buffer(...)`): kept as an attribute; `UCCLBuffer` sets it from the group.
- `use_fabric` (`Buffer(...)`): XLA allocates the buffers (no fabric memory API to pick).
- `enable_shrink` (`Buffer(...)`): no rank is ever masked (every rank runs the compiled
  program); the mask methods require it, as in DeepEP.
- `comm` (`Buffer(...)`): DeepEP's MPI communicator for a missing `group`; `group` (the axis
  name) is required here.
- `config` (`dispatch`, `combine`): no SM / chunk tuning (`Config` is a plain record).
- `previous_event`, `async_finish`, `allocate_on_comm_stream` (normal-mode methods): XLA orders
  and schedules the collectives; results are `EventOverlap()`.
- `async_finish`, `return_recv_hook` (low-latency methods): as above; the hook is a callable
  returning None. Both set is a ValueError, as DeepEP asserts.
- `num_tokens_per_rdma_rank` (`dispatch`): recomputed from topk_idx by the two-hop dispatch (a
  (node, local) `group`).
- `dispatch_wait_recv_cost_stats`, `combine_wait_recv_cost_stats` (low-latency methods): no
  timers inside a compiled program; left untouched.
- `zero_copy` (`low_latency_combine`): `x` already is the combine buffer.
- `new_num_sms` (`set_num_sms`): no SM partitioning (it sets `Buffer.num_sms`, which the
  recommended configs carry).

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

import jax
import jax.numpy as jnp

from jax_ep import deepep, low_latency, ops, transport as tp
from jax_ep._checks import (check_bool, check_experts, check_float, check_positive,
                            check_routing, check_shape, unroute_invalid_experts)
from jax_ep.all_to_all import all_to_all_single_equal

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "UCCLBuffer", "topk_idx_t"]

#: The dtype of topk_idx (DeepEP's `deep_ep.topk_idx_t`, torch.int64 there): int32 here, the
#: ids every dispatch works in and which needs no jax_enable_x64 (int64 ids are accepted too
#: and narrowed, ids outside [-1, E) staying invalid).
topk_idx_t = jnp.int32

# DeepEP's compile-time constants behind Config's size hints (csrc/legacy/config.hpp,
# csrc/kernels/legacy/compiled.cuh and internode.cu): ranks of one NVLink domain, the most
# top-k slots and scales a token carries, its SourceMeta bytes and sizeof(topk_idx_t).
_NUM_MAX_NVL_PEERS = 8
_NUM_MAX_TOPK = 128
_NUM_MAX_SCALES = 128
_SOURCE_META_BYTES = 8
_TOPK_IDX_BYTES = 8
# ... and behind the low-latency size hint (csrc/config.hpp's LowLatencyLayout).
_INT4_BYTES = 16
_BF16_BYTES = 2
_BUFFER_ALIGNMENT_BYTES = 128


@dataclasses.dataclass(frozen=True)
class Config:
    """DeepEP's performance-tuning record (`deep_ep.Config`); it has no effect under XLA. Its
    size hints give the bytes DeepEP's buffers would take for it (to pass as Buffer sizes).
    The fields are checked as DeepEP's constructor asserts them (ints; num_sms >= 0; each
    chunk > 0; NVLink send < receive; RDMA send < the receive rounded up to a multiple of
    it, and at most half of it) and stored as Python ints."""

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = check_positive(getattr(self, field.name), field.name,
                                   allow_zero=field.name == "num_sms")
            object.__setattr__(self, field.name, value)
        if self.num_max_nvl_chunked_send_tokens >= self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(f"num_max_nvl_chunked_send_tokens: expected fewer than "
                             f"num_max_nvl_chunked_recv_tokens="
                             f"{self.num_max_nvl_chunked_recv_tokens}, got "
                             f"{self.num_max_nvl_chunked_send_tokens}")
        send = self.num_max_rdma_chunked_send_tokens
        recv = _align_up(self.num_max_rdma_chunked_recv_tokens, send)
        if send > recv // 2:
            raise ValueError(f"num_max_rdma_chunked_send_tokens: expected at most half of "
                             f"num_max_rdma_chunked_recv_tokens rounded up to a multiple of it "
                             f"({recv}), got {send}")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVLink buffer bytes for this config (csrc/legacy/config.hpp, same formula):
        num_sms / 2 channels x min(P, 8) NVLink ranks, each num_max_nvl_chunked_recv_tokens
        tokens of hidden_bytes + 8 (source meta) + 128 * (8 + 4) (top-k ids and weights) +
        128 * 4 (scales) bytes, plus (2 * max(P / 8, 1) + 3) int counters, rounded up to 128.
        A value for `Buffer(num_nvl_bytes=...)`, which has no effect under XLA."""
        hidden_bytes = check_positive(hidden_bytes, "hidden_bytes", allow_zero=True)
        num_ranks = self._check_ranks(num_ranks)
        num_rdma_ranks = max(num_ranks // _NUM_MAX_NVL_PEERS, 1)
        slots = self.num_sms // 2 * min(num_ranks, _NUM_MAX_NVL_PEERS)
        counters = slots * (2 * num_rdma_ranks + 3) * 4
        tokens = slots * self.num_max_nvl_chunked_recv_tokens * _token_bytes(hidden_bytes)
        return _align_up(counters + tokens, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer bytes for this config (csrc/legacy/config.hpp, same formula):
        0 for P <= 8 (one NVLink domain), else num_sms / 2 channels x P / 8 RDMA ranks, each a
        send and a receive buffer of num_max_rdma_chunked_recv_tokens (rounded up to a
        multiple of num_max_rdma_chunked_send_tokens, as DeepEP's Config does) tokens of
        hidden_bytes + 8 + 128 * (8 + 4) + 128 * 4 + 16 bytes, plus 2 * (2 * 8 + 2) int
        counters, rounded up to 128. A value for `Buffer(num_rdma_bytes=...)` (no effect)."""
        hidden_bytes = check_positive(hidden_bytes, "hidden_bytes", allow_zero=True)
        num_ranks = self._check_ranks(num_ranks)
        if num_ranks <= _NUM_MAX_NVL_PEERS:
            return 0
        recv_tokens = _align_up(self.num_max_rdma_chunked_recv_tokens,
                                self.num_max_rdma_chunked_send_tokens)
        slots = self.num_sms // 2 * (num_ranks // _NUM_MAX_NVL_PEERS)
        counters = slots * (_NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        tokens = slots * recv_tokens * 2 * (_token_bytes(hidden_bytes) + 16)
        return _align_up(counters + tokens, 128)

    def _check_ranks(self, num_ranks):
        """num_ranks as DeepEP's size hints accept it: below 8 or a multiple of 8, and beyond 8
        ranks an even num_sms (DeepEP runs one channel per two SMs)."""
        num_ranks = check_positive(num_ranks, "num_ranks")
        if num_ranks >= _NUM_MAX_NVL_PEERS and num_ranks % _NUM_MAX_NVL_PEERS:
            raise ValueError(f"num_ranks: DeepEP's buffers take fewer than "
                             f"{_NUM_MAX_NVL_PEERS} ranks or a multiple of "
                             f"{_NUM_MAX_NVL_PEERS}, got {num_ranks}")
        if num_ranks > _NUM_MAX_NVL_PEERS and self.num_sms % 2:
            raise ValueError(f"num_sms: must be even with more than {_NUM_MAX_NVL_PEERS} ranks "
                             f"(DeepEP runs a channel per pair of SMs), got {self.num_sms}")
        return num_ranks


def _per_expert_list(counts, num_worst_tokens):
    """Buffer.dispatch's num_recv_tokens_per_expert_list: counts i32[L], or i32[0] when
    num_worst_tokens is set (DeepEP returns an empty list in that mode)."""
    return counts if num_worst_tokens is None else counts[:0]


def _align_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _token_bytes(hidden_bytes: int) -> int:
    """Bytes of one token slot of DeepEP's normal-mode buffers: its row (hidden_bytes), source
    meta, top-k ids (topk_idx_t, 8 bytes each) and weights, and scales, at their maxima."""
    return (hidden_bytes + _SOURCE_META_BYTES + _NUM_MAX_TOPK * (_TOPK_IDX_BYTES + 4)
            + _NUM_MAX_SCALES * 4)


@jax.tree_util.register_pytree_node_class
class EventHandle:
    """DeepEP's CUDA event handle; under XLA there is no event to hold. A pytree without
    leaves, so a method's whole result can leave `jit` or `shard_map`."""

    def tree_flatten(self):
        return (), None

    @classmethod
    def tree_unflatten(cls, aux_data, children):
        del aux_data, children
        return cls()


@jax.tree_util.register_pytree_node_class
class EventOverlap:
    """DeepEP's event wrapper. XLA orders every operation of the compiled program, so there is
    nothing to wait for: `current_stream_wait()` and the `with` block do nothing.

    A pytree whose leaves are those of `event` and `extra_tensors` (none by default), so the
    methods' results (which end in one) can be returned from `jit` and `shard_map` whole."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def tree_flatten(self):
        return (self.event, self.extra_tensors), None

    @classmethod
    def tree_unflatten(cls, aux_data, children):
        del aux_data
        return cls(*children)

    def current_stream_wait(self) -> None:
        """Does nothing (XLA already orders the program)."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.current_stream_wait()


def _no_hook():
    """The receive hook of a low-latency call: data has always arrived under XLA."""
    return None


# DeepEP's recommended chunk sizes by rank count (deep_ep Buffer.get_dispatch_config /
# get_combine_config): (nvl send, nvl recv, rdma send, rdma recv) tokens.
_DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128),
                     16: (36, 288, 20, 128), 24: (32, 288, 8, 128), 32: (32, 288, 8, 128),
                     48: (32, 288, 8, 128), 64: (32, 288, 8, 128), 96: (20, 480, 12, 128),
                     128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128),
                    16: (4, 288, 12, 128), 24: (1, 288, 8, 128), 32: (1, 288, 8, 128),
                    48: (1, 288, 8, 128), 64: (1, 288, 8, 128), 96: (1, 480, 8, 128),
                    128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}

# UCCL-EP's own tables (its Buffer, off EFA: on AWS EFA it uses 512 RDMA receive bytes at 16 and
# 32 ranks).
_UCCL_DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128),
                          16: (36, 288, 20, 128), 24: (8, 288, 32, 128), 32: (32, 288, 32, 128),
                          64: (20, 288, 28, 128), 128: (20, 560, 32, 128),
                          144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_UCCL_COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128),
                         16: (4, 288, 12, 128), 24: (1, 288, 8, 128), 32: (1, 288, 8, 128),
                         64: (1, 288, 20, 128), 128: (1, 560, 12, 128), 144: (2, 720, 8, 128),
                         160: (2, 720, 8, 128)}


def _recommended(table, num_ranks) -> Config:
    """The recommended Config for num_ranks from `table`; a rank count outside it (DeepEP and
    UCCL-EP assert there; jax_ep runs any P) gets Config's defaults with Buffer.num_sms."""
    num_ranks = check_positive(num_ranks, "num_ranks")
    if num_ranks not in table:
        return Config(Buffer.num_sms)
    return Config(Buffer.num_sms, *table[num_ranks])


def _check_buffer_bytes(value, name: str) -> int:
    """A Buffer byte size as DeepEP asserts it: an int >= 0, a multiple of 128."""
    value = check_positive(value, name, allow_zero=True)
    if value % _BUFFER_ALIGNMENT_BYTES:
        raise ValueError(f"{name}: expected a multiple of {_BUFFER_ALIGNMENT_BYTES} bytes "
                         f"(DeepEP's rule), got {value}")
    return value


def _check_group(group):
    """The expert axis: a name, or a (node_axis, local_axis) pair (DeepEP's internode mode:
    the normal-mode methods run the two-hop dispatch/combine)."""
    if isinstance(group, str):
        return group
    if isinstance(group, (tuple, list)) and len(group) == 2 and all(
            isinstance(a, str) for a in group) and group[0] != group[1]:
        return tuple(group)
    raise ValueError(f"group: expected the name (str) of the expert mesh axis or a "
                     f"(node_axis, local_axis) pair of two names, got {group!r}")


def _check_stream_flags(async_finish, allocate_on_comm_stream) -> None:
    """A normal-mode method's stream flags checked as bools (ValueError naming them): they
    change nothing here (XLA orders the work), but a string such as "False" is a caller's
    mistake that DeepEP's C++ binding would refuse too."""
    check_bool(async_finish, "async_finish")
    check_bool(allocate_on_comm_stream, "allocate_on_comm_stream")


def _check_hook_flags(async_finish, return_recv_hook) -> bool:
    """A low-latency method's async_finish and return_recv_hook as bools (ValueError naming
    either when not a bool, or both set: DeepEP asserts they are not) -> return_recv_hook."""
    hook = check_bool(return_recv_hook, "return_recv_hook")
    if check_bool(async_finish, "async_finish") and hook:
        raise ValueError("async_finish / return_recv_hook: DeepEP's low-latency methods do "
                         "not take both set; pass at most one")
    return hook


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
                 explicitly_destroy: bool = False, is_intranode: bool = False,
                 use_fabric: bool = False, enable_shrink: bool = False, comm=None):
        self.group = _check_group(group)
        self.use_fabric = check_bool(use_fabric, "use_fabric")
        self.enable_shrink = check_bool(enable_shrink, "enable_shrink")
        self.comm = comm
        self.num_nvl_bytes = _check_buffer_bytes(num_nvl_bytes, "num_nvl_bytes")
        self.num_rdma_bytes = _check_buffer_bytes(num_rdma_bytes, "num_rdma_bytes")
        self.low_latency_mode = check_bool(low_latency_mode, "low_latency_mode")
        self.num_qps_per_rank = check_positive(num_qps_per_rank, "num_qps_per_rank",
                                               allow_zero=not self.low_latency_mode)
        self.allow_nvlink_for_low_latency_mode = check_bool(
            allow_nvlink_for_low_latency_mode, "allow_nvlink_for_low_latency_mode")
        self.allow_mnnvl = check_bool(allow_mnnvl, "allow_mnnvl")
        self.explicitly_destroy = check_bool(explicitly_destroy, "explicitly_destroy")
        self.is_intranode = check_bool(is_intranode, "is_intranode")

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
        """Does nothing (the buffer holds no resources), whatever explicitly_destroy says: the
        contract's `destroy` does nothing, where DeepEP first asserts explicitly_destroy."""

    def reset_rdma_buffer(self) -> None:
        """Does nothing: every call's buffers are fresh arrays."""

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Does nothing: low-latency buffers are zero-initialised on every call."""

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """DeepEP's shrink mode masks (mask=True) or unmasks a failed rank out of the
        low-latency calls. Every rank runs the compiled program under XLA, so no rank is ever
        masked: unmasking does nothing and masking raises a ValueError naming `mask`.
        Requires enable_shrink=True, as in DeepEP; inside the shard_map rank_to_mask must be
        below the rank count, as DeepEP asserts."""
        self._require_shrink("low_latency_update_mask_buffer")
        check_positive(rank_to_mask, "rank_to_mask", allow_zero=True)
        num_ranks = self._bound_num_ranks()
        if num_ranks is not None and rank_to_mask >= num_ranks:
            raise ValueError(f"rank_to_mask: expected a rank below num_ranks={num_ranks}, got "
                             f"{rank_to_mask}")
        if check_bool(mask, "mask"):
            raise ValueError(f"mask: masking rank {rank_to_mask} is not supported under XLA "
                             "(every rank runs the compiled program, none can be skipped); "
                             "only mask=False, which does nothing, is accepted")

    def low_latency_query_mask_buffer(self, mask_status):
        """mask_status i32 of num_ranks elements (any shape, as DeepEP checks only numel) ->
        the mask status in its shape (1 = masked): all zero, no rank is ever masked under XLA.
        DeepEP writes it into mask_status; arrays are immutable, so it is returned instead.
        Requires enable_shrink=True, as in DeepEP; the element count is checked against the
        rank count inside the shard_map."""
        self._require_shrink("low_latency_query_mask_buffer")
        if not hasattr(mask_status, "dtype") or jnp.dtype(mask_status.dtype) != jnp.int32:
            raise ValueError(f"mask_status: expected int32, got "
                             f"{getattr(mask_status, 'dtype', type(mask_status).__name__)}")
        num_ranks = self._bound_num_ranks()
        if num_ranks is not None and mask_status.size != num_ranks:
            raise ValueError(f"mask_status: expected num_ranks={num_ranks} elements, got shape "
                             f"{mask_status.shape}")
        return jnp.zeros(mask_status.shape, jnp.int32)

    def low_latency_clean_mask_buffer(self) -> None:
        """Does nothing: no rank is ever masked under XLA. Requires enable_shrink=True, as in
        DeepEP."""
        self._require_shrink("low_latency_clean_mask_buffer")

    def _bound_num_ranks(self):
        """group_size (P) when called inside the shard_map that binds the group, else None."""
        try:
            return self.group_size
        except ValueError:  # the group's axes are not bound here
            return None

    def _require_shrink(self, method: str) -> None:
        if not self.enable_shrink:
            raise ValueError(f"enable_shrink: {method} needs Buffer(..., enable_shrink=True), "
                             "as in DeepEP")

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: DeepEP's tests ask this before testing the FP8 dispatch (SM90 builds only);
        jax_ep's FP8 dispatch and casts run on every platform (CPU handlers, CUDA sm_80 and
        sm_90). `jax_ep.WITH_CUDA` says whether the CUDA handlers were built."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets Buffer.num_sms, which the recommended configs carry (an even count, as DeepEP
        asserts); no effect on the exchanges: XLA does not partition SMs."""
        new_num_sms = check_positive(new_num_sms, "new_num_sms", allow_zero=True)
        if new_num_sms % 2:
            raise ValueError(f"new_num_sms: the SM count must be even (DeepEP's rule), got "
                             f"{new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An `EventOverlap` holding an `EventHandle`, as DeepEP's (nothing to record under
        XLA)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch `Config` for num_ranks (its table; no effect under
        XLA); a rank count outside the table gets `Config`'s defaults."""
        return _recommended(_DISPATCH_CONFIGS, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine `Config` for num_ranks (its table; no effect under
        XLA); a rank count outside the table gets `Config`'s defaults."""
        return _recommended(_COMBINE_CONFIGS, num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """The low-latency RDMA buffer bytes for these sizes, UCCL-EP's LowLatencyLayout (the
        seed's Buffer; DeepEP's before it added the LogFMT scales, H/128 * 4 bytes, to each
        combine message), BF16 sizing; a value for `Buffer(num_rdma_bytes=...)`, which has no
        effect under XLA: odd/even pairs of a send buffer of max(Tmax dispatch messages, E *
        Tmax combine messages), a receive buffer of E * Tmax of the larger message, and E i32
        counters rounded up to 128 bytes; a dispatch message is 16 + max(2 * hidden, hidden +
        hidden / 128 * 4) bytes (a control int4, then bf16 or FP8 + scales), a combine message
        2 * hidden; then DeepEP's alignment: the total + 128 rounded down to a multiple of
        128. It is at least what jax_ep's low-latency dispatch + combine exchanges move (P
        blocks of min(L*Tmax, T*min(K, L)) rows, sent and received, with the plan's counts
        and source tokens) without use_logfmt; a LogFMT combine row is 2 * hidden + hidden /
        32 bytes, which this BF16 sizing does not cover (DeepEP's current formula adds those
        scale bytes)."""
        tmax = check_positive(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
        hidden = check_positive(hidden, "hidden")
        check_positive(num_ranks, "num_ranks")
        num_experts = check_positive(num_experts, "num_experts")
        dispatch_msg = _INT4_BYTES + max(hidden * _BF16_BYTES, hidden + hidden // 128 * 4)
        combine_msg = hidden * _BF16_BYTES
        send = max(tmax * dispatch_msg, num_experts * tmax * combine_msg)
        recv = num_experts * tmax * max(dispatch_msg, combine_msg)
        signaling = _align_up(num_experts * 4, 128)
        total = 2 * (send + recv + signaling)
        return (total + _BUFFER_ALIGNMENT_BYTES) // _BUFFER_ALIGNMENT_BYTES * \
            _BUFFER_ALIGNMENT_BYTES

    # -- normal mode ---------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """topk_idx [T,K] int32/int64 global expert ids (-1 = unrouted) ->
        (num_tokens_per_rank i32[P], num_tokens_per_rdma_rank, num_tokens_per_expert
        i32[E], is_token_in_rank bool[T,P], event); num_tokens_per_rdma_rank is i32[N] (this
        rank's tokens going to each node, once per node) when `group` is a (node, local)
        pair of N x G ranks, else None. Ids outside [-1, E) count nowhere (on every platform,
        as the dispatch routes them: a CPU kernel's error on one rank would leave the other
        ranks waiting in the next collective); the dispatch counts them in its handle."""
        impl = tp.check_backend(self.backend)
        _check_stream_flags(async_finish, allocate_on_comm_stream)
        check_experts(num_experts, self.group_size)
        topk_idx = unroute_invalid_experts(check_routing(topk_idx, None, num_experts)[0],
                                           num_experts)[0]
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
        recv_topk_weights f32[R,K], num_recv_tokens_per_expert_list i32[L] (i32[0] with
        num_worst_tokens > 0, as DeepEP's list is empty then; the handle keeps the counts as
        handle.num_recv_tokens_per_expert), handle, event);
        with `handle=` (cached dispatch, the handle's routing; topk_idx and topk_weights must
        be None, as DeepEP asserts): (recv_x, None, None, None, None, event).
        """
        _check_stream_flags(async_finish, allocate_on_comm_stream)
        if num_worst_tokens != 0:
            check_positive(num_worst_tokens, "num_worst_tokens")
        worst = num_worst_tokens or None
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:  # DeepEP asserts both None
                raise ValueError("topk_idx / topk_weights: a cached dispatch (handle=) replays "
                                 "the handle's routing; pass neither, as DeepEP requires")
            recv_x, _, _, _ = deepep.dispatch(x, handle=handle, axis_name=self.group,
                                              backend=self.backend)
            return recv_x, None, None, None, None, EventOverlap()
        is_array = hasattr(num_tokens_per_expert, "dtype")
        if not is_array or jnp.ndim(num_tokens_per_expert) != 1:
            got = (f"shape {jnp.shape(num_tokens_per_expert)}" if is_array
                   else type(num_tokens_per_expert).__name__)
            raise ValueError("num_tokens_per_expert: expected the i32[E] counts of "
                             f"get_dispatch_layout without a handle (they give E), got {got}")
        num_experts = jnp.shape(num_tokens_per_expert)[0]
        if not jnp.issubdtype(jnp.result_type(num_tokens_per_expert), jnp.integer) or (
                num_experts == 0 or num_experts % self.group_size):
            raise ValueError(f"num_tokens_per_expert: expected get_dispatch_layout's i32[E] "
                             f"counts, E a positive multiple of the group's {self.group_size} "
                             f"ranks, got {jnp.result_type(num_tokens_per_expert)} of shape "
                             f"{jnp.shape(num_tokens_per_expert)}")
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
        return (recv_x, recv_idx, recv_w, _per_expert_list(handle.num_recv_tokens_per_expert,
                                                           worst), handle, EventOverlap())

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
        if jnp.result_type(is_token_in_rank) != jnp.bool_:
            raise ValueError(f"is_token_in_rank: expected bool[T,P], got "
                             f"{jnp.result_type(is_token_in_rank)}")
        first_expert = jnp.arange(num_ranks, dtype=jnp.int32) * (num_experts // num_ranks)
        topk_idx = jnp.where(is_token_in_rank, first_expert, -1)
        recv_x, _, _, handle = deepep.dispatch(
            x, topk_idx, None, num_experts=num_experts, axis_name=self.group,
            backend=self.backend, num_worst_tokens=worst, layout=layout)
        per_source = all_to_all_single_equal(jnp.asarray(num_tokens_per_expert, jnp.int32),
                                             axis_name=self.group)
        per_local = per_source.reshape(num_ranks, -1).sum(axis=0)
        per_local = ops.align_up(per_local, expert_alignment)
        return recv_x, None, None, _per_expert_list(per_local, worst), handle, EventOverlap()

    def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """DeepEP normal combine (`jax_ep.combine`): x [R,H] -> (combined_x [T,H],
        combined_topk_weights f32[T,K] or None, event). Unweighted sum of a token's copies in
        fp32; `bias` ([T,H], or a pair of them) starts that sum, before the copies and the
        one cast to x.dtype (DeepEP's order: `jax_ep.deepep.combine_with_bias`)."""
        _check_stream_flags(async_finish, allocate_on_comm_stream)
        if bias is not None:
            combined, combined_w = deepep.combine_with_bias(x, handle, bias,
                                                            topk_weights=topk_weights, name="x")
        else:
            deepep.check_combine_rows(x, handle, "x")
            combined, combined_w = deepep.combine(x, handle, topk_weights=topk_weights)
        return combined, combined_w, EventOverlap()

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None,
                           num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                           num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config=None,
                           previous_event=None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """DeepEP's internode dispatch, which its `dispatch` calls when the group spans
        nodes. `dispatch` here takes the two-hop path itself for a (node, local) `group` (one
        node for a single axis), so this is the same call: same arguments and results."""
        return self.dispatch(
            x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
            config, previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config=None,
                          previous_event=None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False):
        """DeepEP's internode combine: `combine` (see `internode_dispatch`)."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event,
                            async_finish, allocate_on_comm_stream)

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
        return_recv_hook = _check_hook_flags(async_finish, return_recv_hook)
        recv_x, recv_count, handle = low_latency.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            num_experts=num_experts, axis_name=self.group, use_fp8=use_fp8,
            round_scale=round_scale, use_ue8m0=use_ue8m0, backend=self.backend)
        if cumulative_local_expert_recv_stats is not None:
            check_shape(cumulative_local_expert_recv_stats, recv_count.shape,
                        "cumulative_local_expert_recv_stats")
            stats = jnp.asarray(cumulative_local_expert_recv_stats)
            if stats.dtype != jnp.int32:  # DeepEP's: a narrower type wraps, a float drifts
                raise ValueError(f"cumulative_local_expert_recv_stats: expected int32, got "
                                 f"{stats.dtype}")
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
        return_recv_hook = _check_hook_flags(async_finish, return_recv_hook)
        use_logfmt = check_bool(use_logfmt, "use_logfmt")
        if check_bool(zero_copy, "zero_copy") and use_logfmt:
            raise ValueError("use_logfmt: DeepEP's combine does not allow use_logfmt with "
                             "zero_copy=True")
        low_latency.check_combine_rows(x, handle, "x")
        if use_logfmt:
            low_latency.check_logfmt_rows(x, "x")
        combined = low_latency.low_latency_combine(x, topk_idx, topk_weights, handle,
                                                   use_logfmt=use_logfmt)
        if out is not None:
            check_shape(out, combined.shape, "out")
            check_float(out, "out")
            combined = combined.astype(out.dtype)
        return combined, EventOverlap(), _no_hook if return_recv_hook else None

    def get_next_low_latency_combine_buffer(self, handle):
        """A zero bf16 [L, P*Tmax, H] buffer for the next low_latency_combine's x."""
        if not isinstance(handle, low_latency.LowLatencyHandle):
            raise ValueError(f"handle: expected the LowLatencyHandle of a low_latency_dispatch, "
                             f"got {type(handle).__name__}")
        return jnp.zeros(handle.src_info.shape + (handle.hidden,), jnp.bfloat16)


class UCCLBuffer(Buffer):
    """UCCL-EP's DeepEP-compatible buffer (backend "uccl_ep") with NeMo's intranode detection:
    a single expert axis (every rank on one node) sets `is_intranode` True and
    `num_rdma_bytes` 0 (NVLink only); for a (node, local) pair both stay as given."""

    backend = "uccl_ep"

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, is_intranode: bool = False,
                 use_fabric: bool = False, enable_shrink: bool = False, comm=None):
        if isinstance(group, str):
            is_intranode, num_rdma_bytes = True, 0
        super().__init__(group=group, num_nvl_bytes=num_nvl_bytes,
                         num_rdma_bytes=num_rdma_bytes, low_latency_mode=low_latency_mode,
                         num_qps_per_rank=num_qps_per_rank,
                         allow_nvlink_for_low_latency_mode=allow_nvlink_for_low_latency_mode,
                         allow_mnnvl=allow_mnnvl, explicitly_destroy=explicitly_destroy,
                         is_intranode=is_intranode, use_fabric=use_fabric,
                         enable_shrink=enable_shrink, comm=comm)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out=None,
                            combine_wait_recv_cost_stats=None, overlap: bool = False,
                            packed_recv_count=None, comp_signal=None, block_m: int = 64,
                            threshold: int = 0, num_sms: int = 0, src_signals=None,
                            src_signal_expect_value: int = 0):
        """Buffer.low_latency_combine with UCCL-EP's overlap keywords: overlap=True (combine
        fused with the next GEMM by a GPU signal handshake) raises NotImplementedError, as
        UCCL-EP's does; packed_recv_count, comp_signal, block_m, threshold, num_sms,
        src_signals and src_signal_expect_value (that handshake's parameters) are accepted
        and, without overlap, have no effect, as in UCCL-EP."""
        if check_bool(overlap, "overlap"):
            raise NotImplementedError("overlap: the combine fused with the next GEMM (UCCL-EP's "
                                      "signal handshake) is not implemented, as in UCCL-EP; "
                                      "use overlap=False")
        return super().low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt,
                                           zero_copy, async_finish, return_recv_hook, out,
                                           combine_wait_recv_cost_stats)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """UCCL-EP's recommended dispatch `Config` for num_ranks (its own table, off EFA; no
        effect under XLA); a rank count outside the table gets `Config`'s defaults."""
        return _recommended(_UCCL_DISPATCH_CONFIGS, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """UCCL-EP's recommended combine `Config` for num_ranks (its own table, off EFA; no
        effect under XLA); a rank count outside the table gets `Config`'s defaults."""
        return _recommended(_UCCL_COMBINE_CONFIGS, num_ranks)
