"""The DeepEP token exchange that the deepep and hybridep modes share: its plans and its row
paths, over one expert axis or as DeepEP's internode two hops over a (node, local) axis pair.

One hop (`routing_plan` -> DispatchHandle): the send layout of the top-k ids, one count
exchange, then every token goes once to each rank owning one of its experts; a receiver holds
its rows grouped by source rank ascending, source token ascending inside.

Two hops (`two_hop_plan` -> InternodeHandle), global rank r = n*G + g (N nodes of G ranks).
Hop 1 (the one-hop plan over the node axis) brings every token once to each node owning one
of its experts, to the rank with the sender's local index g: forwarder (n_d, g) holds the
tokens of the sources (n_s, g) for every n_s, grouped by n_s, token ascending. Hop 2
(`plan_local_hop`, over the local axis) sends each of those rows once to every rank of the
node owning one of its experts.

Receiver (n_d, g_d) gets from forwarder g the sub-blocks of sources (n_s, g) for every n_s,
so its hop-2 arrival order is (g, n_s, t); the flat contract wants (n_s*G + g, t). The one
count exchange of hop 2 all-gathers every forwarder's (source node, destination) counts over
the local axis, which gives every rank of the node the flat count matrix of its node's
destinations: the capacity / receive-budget drops of the flat exchange (first rows of each
(source, destination) block kept, each destination filled source by source in global rank
order) and the permutation arrival order -> flat order both follow from it, on device.

`send_tokens` moves rows along either plan, `reduce_back` returns and sums them.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ep import ops, transport as tp
from jax_ep._checks import MAX_INT32, check_experts, check_positive, unroute_invalid_experts
from jax_ep._index import segment_of

__all__ = [
    "DispatchHandle",
    "InternodeHandle",
    "LocalHop",
    "plan_local_hop",
    "reduce_back",
    "resolve_transports",
    "return_local",
    "routing_plan",
    "send_local",
    "send_tokens",
    "source_of_rows",
    "two_hop_axes",
    "two_hop_plan",
]


# The PyTorch systems whose handle tuples a handle reads as (its tuple_layout field).
TUPLE_LAYOUTS = {"deepep": "DeepEP", "uccl_ep": "UCCL-EP"}


class _DeepEPTupleView:
    """Reads a handle as DeepEP's or UCCL-EP's handle tuple (by its tuple_layout: "deepep" or
    "uccl_ep"), by int index or slice: a subclass lists each tuple's entries in _TUPLES; an
    entry named as one of the handle's fields reads that field, another _deepep_item(name),
    None for an entry it does not keep (handle[i] then raises a ValueError naming it and, by
    _KEPT, what is kept)."""

    def __post_init__(self):
        if self.tuple_layout not in TUPLE_LAYOUTS:
            raise ValueError(f"tuple_layout: expected one of {tuple(TUPLE_LAYOUTS)}, got "
                             f"{self.tuple_layout!r}")

    def __len__(self) -> int:
        return len(self._TUPLES[self.tuple_layout])

    def __getitem__(self, index):
        position = range(len(self))[index]
        if isinstance(position, range):
            return tuple(self[i] for i in position)
        name = self._TUPLES[self.tuple_layout][position]
        fields = {field.name for field in dataclasses.fields(self)}
        item = getattr(self, name) if name in fields else self._deepep_item(name)
        if item is None:
            raise ValueError(f"handle[{index}]: {TUPLE_LAYOUTS[self.tuple_layout]}'s {name} "
                             f"has no counterpart here (XLA's exchange has no channels or send "
                             f"buffers); {self._KEPT[self.tuple_layout]}, and the handle's "
                             f"fields carry the rest")
        return item


@partial(jax.tree_util.register_dataclass,
         data_fields=["plan", "send_token_idx", "send_row_idx", "recv_topk_idx",
                      "num_recv_tokens", "num_recv_tokens_per_expert", "num_dropped",
                      "num_invalid"],
         meta_fields=["num_tokens", "num_recv", "capacity", "num_experts", "axis_name",
                      "transport", "impl", "tuple_layout"])
@dataclasses.dataclass(frozen=True)
class DispatchHandle(_DeepEPTupleView):
    """What combine (and a cached dispatch) needs; a pytree of arrays plus static fields.

    plan: transport.ExchangePlan of this dispatch.
    send_token_idx i32[T*min(max(K,1),P)]: source token of each compact send row (-1:
      padding or dropped); a token has rows for at most min(K, P) ranks.
    send_row_idx i32[T*min(max(K,1),P)]: the compact send row itself (-1: padding or
      dropped).
    recv_topk_idx i32[R,K]: local expert ids of the received rows (-1 elsewhere / padding).
    num_recv_tokens i32[]: received rows (the rest of R is padding).
    num_recv_tokens_per_expert i32[L]: rows per local expert, aligned up to expert_alignment.
    num_dropped i32[]: (token, destination) rows this rank dropped to the capacity bound or
      to a destination's num_worst_tokens budget.
    num_invalid i32[]: expert ids outside [-1, E) seen; they are routed nowhere, on every
      platform (the layer-1 CPU kernels would raise, on one rank, mid-exchange).
    tuple_layout: "deepep" (default) or "uccl_ep" (a dispatch with backend="uccl_ep"): the
      handle tuple it reads as. handle[0] reads rank_prefix_matrix in both; UCCL-EP's tuple
      holds num_recv_tokens at [3] (see _deepep_item).
    """

    plan: tp.ExchangePlan
    send_token_idx: jax.Array
    send_row_idx: jax.Array
    recv_topk_idx: jax.Array
    num_recv_tokens: jax.Array
    num_recv_tokens_per_expert: jax.Array
    num_dropped: jax.Array
    num_invalid: jax.Array
    num_tokens: int
    num_recv: int
    capacity: int
    num_experts: int
    axis_name: str
    transport: str
    impl: str
    tuple_layout: str = "deepep"

    _TUPLES = {
        "deepep": ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                   "recv_src_idx", "is_token_in_rank", "send_head"),
        "uccl_ep": ("rank_prefix_matrix", "channel_prefix_matrix",
                    "recv_channel_prefix_matrix", "num_recv_tokens", "recv_src_idx",
                    "is_token_in_rank", "send_head"),
    }
    _KEPT = {"deepep": "handle[0] is rank_prefix_matrix and handle[4] is_token_in_rank",
             "uccl_ep": "handle[0] is rank_prefix_matrix, handle[3] num_recv_tokens and "
                        "handle[5] is_token_in_rank"}

    def _deepep_item(self, name):
        """handle[0], rank_prefix_matrix i32[P,P]: [i, j] = the rows rank j received from
        ranks 0..i (its received rows are grouped by source rank, so rows [M[i-1, j], M[i, j])
        came from rank i). It is gathered over the axis, so read it inside the shard_map.
        is_token_in_rank bool[T,P] (DeepEP's handle[4], UCCL-EP's handle[5]): the tokens this
        rank sent to each rank (get_dispatch_layout's, less any row a bounded buffer
        dropped). (UCCL-EP's handle[3] is the field num_recv_tokens.) The other entries of
        the intranode tuples describe channels and send buffers, which this exchange does not
        have."""
        if name == "is_token_in_rank":
            sent = self.send_token_idx >= 0
            rank = tp.send_row_ranks(self.plan, self.send_token_idx.shape[0])
            num_ranks = self.plan.send_counts.shape[0]
            return jnp.zeros((self.num_tokens, num_ranks), bool).at[
                jnp.where(sent, self.send_token_idx, self.num_tokens), rank].set(
                    True, mode="drop")
        if name != "rank_prefix_matrix":
            return None
        column = jnp.cumsum(self.plan.recv_counts).astype(jnp.int32)  # this rank's column
        return jax.lax.all_gather(column, self.axis_name).T


def _sizes(num_tokens, num_ranks, capacity, num_worst_tokens):
    """(C, R): rows per destination (None: T; never above T) and receive rows (None: P*C)."""
    capacity = num_tokens if capacity is None else check_positive(capacity, "capacity")
    capacity = min(capacity, num_tokens)
    if num_worst_tokens is None:
        return capacity, num_ranks * capacity
    return capacity, check_positive(num_worst_tokens, "num_worst_tokens", upper=MAX_INT32)


def _per_expert_counts(recv_idx, num_local, expert_alignment):
    """i32[L]: received rows per local expert (recv_idx i32[R,K]), aligned up."""
    per_expert = jnp.zeros((num_local,), jnp.int32).at[
        jnp.where(recv_idx >= 0, recv_idx, num_local)].add(1, mode="drop")
    return ops.align_up(per_expert, expert_alignment)


def routing_plan(topk_idx, num_experts, axis_name, *, transport, impl, capacity=None,
                 num_worst_tokens=None, expert_alignment=1, count_matrix=None,
                 send_counts=None):
    """Plans the one-hop exchange of this rank's tokens -> DispatchHandle.

    topk_idx i32[T,K]: global expert ids, -1 unrouted (ids outside [-1, E) are routed
      nowhere and counted in num_invalid); num_experts: E, a multiple of the axis size P.
    axis_name: the mesh axis (or tuple of axes) of the exchange; transport: a resolved
      name ("all_to_all" / "ragged" / "peer"); impl: "ffi" or "xla" kernels.
    capacity: C, rows per destination (None: T); num_worst_tokens: R, receive rows (None:
      P*C); expert_alignment: num_recv_tokens_per_expert is rounded up to a multiple of it.
    count_matrix i32[P_src,P_dst]: the exchanged counts, given to skip the count exchange;
      send_counts i32[P]: this rank's tokens per destination where the caller computed them
      from the same topk_idx (the two-hop plan's per-node counts), so the count exchange
      need not wait for the send layout kernel; they must equal the send layout's (a user's
      layout never comes here: rows would be misplaced).
    Runs one count all_gather (none with count_matrix) and sends the local ids (i32[R,K]).
    """
    rank, num_ranks = tp.axis_rank_and_size(axis_name)
    num_local = check_experts(num_experts, num_ranks)
    num_tokens, _ = topk_idx.shape
    topk_idx, num_invalid = unroute_invalid_experts(topk_idx, num_experts)
    capacity, num_recv = _sizes(num_tokens, num_ranks, capacity, num_worst_tokens)
    layout = ops.build_send_layout(topk_idx, jnp.zeros(topk_idx.shape, jnp.float32),
                                   num_ranks=num_ranks, num_local_experts=num_local, impl=impl)
    if count_matrix is None:
        counts = layout.send_counts if send_counts is None else send_counts
        count_matrix = tp.exchange_counts(counts, axis_name, transport)
    plan = tp.make_plan(count_matrix, rank, capacity, num_recv)
    # Compact rows past a destination's capacity are dropped (highest token index first).
    row = jnp.arange(num_tokens * num_ranks, dtype=jnp.int32)
    dest = jnp.clip(layout.rank, 0, num_ranks - 1)
    kept = (layout.rank >= 0) & (row - plan.send_offsets[dest] < plan.send_counts[dest])
    # A token has rows for at most min(K, P) ranks, so the layout's rows past T*min(K, P) are
    # padding on every rank: the send maps stop there, and with them the combine's return
    # buffer (one row per send row: [T*P, H] at P > K before, 8x the need at K 8, P 64).
    # K = 0 keeps T rows of padding (the padded transport gathers from the maps).
    num_send = num_tokens * min(max(topk_idx.shape[1], 1), num_ranks)
    send_row_idx = jnp.where(kept, row, -1)[:num_send]
    send_token_idx = jnp.where(kept, layout.token_idx, -1)[:num_send]

    recv_idx = tp.send_rows(layout.local_idx, send_row_idx, plan, num_recv=num_recv,
                            capacity=capacity, axis_name=axis_name, transport=transport,
                            impl=impl)
    num_recv_tokens = plan.recv_counts.sum()
    valid = jnp.arange(num_recv)[:, None] < num_recv_tokens
    recv_idx = jnp.where(valid, recv_idx, -1)
    return DispatchHandle(
        plan=plan, send_token_idx=send_token_idx, send_row_idx=send_row_idx,
        recv_topk_idx=recv_idx, num_recv_tokens=num_recv_tokens,
        num_recv_tokens_per_expert=_per_expert_counts(recv_idx, num_local, expert_alignment),
        num_dropped=(layout.send_counts.sum(dtype=jnp.int32)
                     - plan.send_counts.sum(dtype=jnp.int32)),
        num_invalid=num_invalid,
        num_tokens=num_tokens, num_recv=num_recv, capacity=capacity, num_experts=num_experts,
        axis_name=axis_name, transport=transport, impl=impl)


class LocalHop(NamedTuple):
    """The hop-2 exchange of one rank (all i32 arrays).

    plan: transport.ExchangePlan over the local axis (forwarder -> receiver), drops applied.
    send_row_idx i32[R1*G]: hop-1 receive row of each compact hop-2 send row (-1: none).
    flat_slot i32[R]: for each flat receive row, its row in the hop-2 compact receive
      buffer (-1: padding).
    arrival_row i32[R]: the inverse, the flat row of each hop-2 compact receive row.
    recv_topk_idx i32[R,K]: local expert ids of the flat receive rows (-1 elsewhere).
    num_dropped i32[]: (row, destination) pairs this forwarder dropped.
    flat_counts i32[N*G]: the flat receive rows from each global source rank n*G + g (the
      flat rows are grouped by it, ascending).
    """

    plan: tp.ExchangePlan
    send_row_idx: jax.Array
    flat_slot: jax.Array
    arrival_row: jax.Array
    recv_topk_idx: jax.Array
    num_dropped: jax.Array
    flat_counts: jax.Array


def source_of_rows(recv_counts, recv_offsets, num_rows):
    """i32[num_rows]: the source (block index) of each compact receive row, given the
    per-source counts / offsets i32[S] of an ExchangePlan (rows past the end: S)."""
    r = jnp.arange(num_rows, dtype=jnp.int32)
    s = segment_of(recv_offsets, r)
    return jnp.where(r < recv_counts.sum(), s, recv_counts.shape[0])


def hop_capacity(num_nodes, capacity, num_recv, num_forward):
    """Rows one forwarder sends one receiver at most: N sources of C rows each, within the
    receiver's budget R and the forwarder's R1 hop-1 rows."""
    return max(1, min(num_nodes * capacity, num_recv, num_forward))


def plan_local_hop(recv_idx, source_node, *, num_nodes, num_local_experts, local_axis,
                   capacity, num_recv, hop_cap, transport, impl):
    """Plans hop 2 of this forwarder.

    recv_idx i32[R1,K]: node-local expert ids [0, G*L) of the hop-1 receive rows (-1: not
      this node's, or padding). source_node i32[R1]: source node of each row (N: padding).
    capacity: C, rows per (global source, destination) block; num_recv: R, flat receive
      rows; hop_cap: the padded per-destination rows of the hop-2 all_to_all.
    """
    me, num_local = tp.axis_rank_and_size(local_axis)
    layout = ops.build_forward_layout(recv_idx, jnp.zeros(recv_idx.shape, jnp.float32),
                                      num_ranks=num_local, num_local_experts=num_local_experts,
                                      impl=impl)
    valid = layout.rank >= 0
    dest = jnp.clip(layout.rank, 0, num_local - 1)
    node = jnp.where(valid, source_node[jnp.clip(layout.token_idx, 0)], num_nodes)
    sub = jnp.where(valid & (node < num_nodes), node * num_local + dest, num_nodes * num_local)
    counts = jnp.zeros((num_nodes * num_local,), jnp.int32).at[sub].add(1, mode="drop")
    counts = counts.reshape(num_nodes, num_local)  # [N_src, G_dst] of this forwarder
    gathered = tp.exchange_counts(counts, local_axis, transport)  # [G_fwd, N_src, G_dst]
    # The flat count matrix of this node's destinations, sources in global rank order.
    flat = jnp.swapaxes(gathered, 0, 1).reshape(num_nodes * num_local, num_local)
    kept = jnp.minimum(flat, capacity)
    kept = jnp.clip(num_recv - tp.exclusive_cumsum(kept, axis=0), 0, kept)
    kept = kept.reshape(num_nodes, num_local, num_local)  # [N_src, G_fwd, G_dst]

    # Layout rows are destination-major, then hop-1 row ascending (source node ascending):
    # position j inside the (destination, source node) sub-block decides whether it is kept.
    row = jnp.arange(layout.rank.shape[0], dtype=jnp.int32)
    sub_off = tp.exclusive_cumsum(counts, axis=0)  # [N, G_dst] inside each destination block
    node_c = jnp.clip(node, 0, num_nodes - 1)
    j = row - tp.exclusive_cumsum(layout.send_counts)[dest] - sub_off[node_c, dest]
    mine = kept[:, me, :]  # [N_src, G_dst]
    keep = valid & (node < num_nodes) & (j < mine[node_c, dest])
    totals = kept.sum(axis=0)  # [G_fwd, G_dst]
    send_offsets = tp.exclusive_cumsum(totals[me])
    pos = send_offsets[dest] + tp.exclusive_cumsum(mine, axis=0)[node_c, dest] + j
    num_send = layout.rank.shape[0]
    pos = jnp.where(keep, pos, num_send)
    send_row_idx = jnp.full((num_send,), -1, jnp.int32).at[pos].set(layout.token_idx,
                                                                    mode="drop")
    send_layout_row = jnp.full((num_send,), -1, jnp.int32).at[pos].set(row, mode="drop")
    recv_counts = totals[:, me]
    recv_offsets = tp.exclusive_cumsum(recv_counts)
    plan = tp.ExchangePlan(totals[me], send_offsets, recv_counts, recv_offsets,
                           tp.exclusive_cumsum(totals, axis=0)[me],
                           tp.exclusive_cumsum(totals, axis=1)[:, me])

    # Arrival (g, n_s, t) -> flat (n_s*G + g, t) on this receiver.
    k = kept[:, :, me]  # [N_src, G_fwd]
    arrival_off = recv_offsets[None, :] + tp.exclusive_cumsum(k, axis=0)
    flat_counts = k.reshape(-1)
    flat_off = tp.exclusive_cumsum(flat_counts)
    r = jnp.arange(num_recv, dtype=jnp.int32)
    b = segment_of(flat_off, r)
    jr = r - flat_off[b]
    flat_slot = jnp.where(jr < flat_counts[b], arrival_off.reshape(-1)[b] + jr, -1)
    arrival_row = jnp.full((num_recv,), -1, jnp.int32).at[
        jnp.where(flat_slot >= 0, flat_slot, num_recv)].set(r, mode="drop")

    ids = tp.send_rows(layout.local_idx, send_layout_row, plan, num_recv=num_recv,
                       capacity=hop_cap, axis_name=local_axis, transport=transport, impl=impl)
    recv_topk_idx = jnp.where(flat_slot[:, None] >= 0,
                              ops.gather_rows(ids, flat_slot, impl=impl), -1)
    num_dropped = valid.sum(dtype=jnp.int32) - keep.sum(dtype=jnp.int32)
    return LocalHop(plan, send_row_idx, flat_slot.astype(jnp.int32), arrival_row,
                    recv_topk_idx.astype(jnp.int32), num_dropped, flat_counts.astype(jnp.int32))


def send_local(rows, hop, *, num_recv, hop_cap, local_axis, transport, impl):
    """Hop-1 receive rows [R1,...] -> the flat receive rows [R,...] of this receiver."""
    buffer, slot = tp.receive_buffer(rows, hop.send_row_idx, hop.plan, num_recv=num_recv,
                                     capacity=hop_cap, axis_name=local_axis,
                                     transport=transport, impl=impl)
    src = jnp.where(hop.flat_slot >= 0, slot[jnp.clip(hop.flat_slot, 0)], -1)
    return ops.gather_rows(buffer, src, impl=impl)


def return_local(y, hop, *, num_forward, hop_cap, local_axis, transport, impl):
    """Flat receive rows y [R,H] back to their forwarders, where the copies of each hop-1
    row are summed in fp32 and cast to y.dtype -> [R1,H]."""
    arrival = ops.gather_rows(y, hop.arrival_row, impl=impl)
    rows, owner, _ = tp.return_rows(arrival, hop.send_row_idx, hop.plan,
                                    num_send=hop.send_row_idx.shape[0], capacity=hop_cap,
                                    axis_name=local_axis, transport=transport, impl=impl)
    return ops.unpermute(rows, owner, num_tokens=num_forward, impl=impl)


@partial(jax.tree_util.register_dataclass,
         data_fields=["hop1", "hop2", "recv_topk_idx", "num_recv_tokens",
                      "num_recv_tokens_per_expert", "num_tokens_per_rdma_rank",
                      "num_rdma_recv_tokens", "is_token_in_rank", "num_dropped", "num_invalid"],
         meta_fields=["num_tokens", "num_recv", "num_rdma_recv", "capacity", "hop_capacity",
                      "num_experts", "axis_name", "transport", "impl", "tuple_layout"])
@dataclasses.dataclass(frozen=True)
class InternodeHandle(_DeepEPTupleView):
    """The handle of a two-hop dispatch over axis_name=(node_axis, local_axis), N x G ranks.

    hop1: the DispatchHandle of the node hop (one row per (token, destination node), to the
      rank with this rank's local index; its recv_topk_idx holds node-local expert ids).
    hop2: LocalHop, the local hop (one row per (token, owning rank) of the node).
    recv_topk_idx i32[R,K], num_recv_tokens i32[], num_recv_tokens_per_expert i32[L]: as
      DispatchHandle's (the flat contract over the N*G global ranks).
    num_tokens_per_rdma_rank i32[N]: this rank's tokens going to each node (once per node).
    num_rdma_recv_tokens i32[]: rows this rank received on hop 1 (as a forwarder).
    is_token_in_rank bool[T,N*G]: DeepEP's handle[0], the sender's layout
      (get_dispatch_layout's over the N*G ranks: token t has an expert on global rank
      n*G + g), as DeepEP keeps the is_token_in_rank its dispatch was given: no dropped row
      is taken out, on either hop (unlike the one-hop handle's is_token_in_rank).
    num_dropped i32[]: hop-1 rows this rank dropped as a source (num_worst_rdma_tokens) plus
      hop-2 rows it dropped as a forwarder (capacity, num_worst_tokens); summed over the
      ranks it equals the flat exchange's count when hop 1 drops nothing.
    num_invalid i32[]: expert ids outside [-1, E) seen (routed nowhere).
    tuple_layout: "deepep" (default) or "uccl_ep" (a dispatch with backend="uccl_ep"): the
      handle tuple it reads as. handle[0] reads is_token_in_rank, handle[4] and handle[6]
      recv_rdma_rank_prefix_sum and recv_gbl_rank_prefix_sum in both (DeepEP's 10 entries:
      handle[-4] is the latter; UCCL-EP's 12 add num_recv_tokens and num_rdma_recv_tokens at
      [7] and [8], so there it is handle[-6]); see _deepep_item.
    """

    hop1: DispatchHandle
    hop2: LocalHop
    recv_topk_idx: jax.Array
    num_recv_tokens: jax.Array
    num_recv_tokens_per_expert: jax.Array
    num_tokens_per_rdma_rank: jax.Array
    num_rdma_recv_tokens: jax.Array
    is_token_in_rank: jax.Array
    num_dropped: jax.Array
    num_invalid: jax.Array
    num_tokens: int
    num_recv: int
    num_rdma_recv: int
    capacity: int
    hop_capacity: int
    num_experts: int
    axis_name: tuple
    transport: tuple
    impl: str
    tuple_layout: str = "deepep"

    _TUPLES = {
        "deepep": ("is_token_in_rank", "rdma_channel_prefix_matrix",
                   "gbl_channel_prefix_matrix", "recv_rdma_channel_prefix_matrix",
                   "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                   "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head",
                   "send_nvl_head"),
        "uccl_ep": ("is_token_in_rank", "rdma_channel_prefix_matrix",
                    "gbl_channel_prefix_matrix", "recv_rdma_channel_prefix_matrix",
                    "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                    "recv_gbl_rank_prefix_sum", "num_recv_tokens", "num_rdma_recv_tokens",
                    "recv_src_meta", "send_rdma_head", "send_nvl_head"),
    }
    _KEPT = {"deepep": "handle[0] is is_token_in_rank, handle[4] and handle[6] the receive "
                       "prefix sums",
             "uccl_ep": "handle[0] is is_token_in_rank, handle[4] and handle[6] the receive "
                        "prefix sums, handle[7] and handle[8] the received row counts"}

    def _deepep_item(self, name):
        """handle[4], recv_rdma_rank_prefix_sum i32[N]: the inclusive prefix of the hop-1 rows
        this rank received from each node; handle[6] (DeepEP's handle[-4], UCCL-EP's
        handle[-6]), recv_gbl_rank_prefix_sum i32[N*G]: that of the rows it finally received
        from each global rank n*G + g (rows [S[i-1], S[i]) came from rank i). (handle[0] is
        the field is_token_in_rank; UCCL-EP's handle[7] and handle[8] the fields
        num_recv_tokens and num_rdma_recv_tokens.) The other entries describe channels and
        send buffers."""
        if name == "recv_rdma_rank_prefix_sum":
            return jnp.cumsum(self.hop1.plan.recv_counts).astype(jnp.int32)
        if name == "recv_gbl_rank_prefix_sum":
            return jnp.cumsum(self.hop2.flat_counts).astype(jnp.int32)
        return None


def two_hop_axes(axis_name, hierarchical=None):
    """(node_axis, local_axis) when the dispatch over axis_name runs two hops, else None.

    hierarchical=None: two hops whenever axis_name is a pair with N > 1 and G > 1; False:
    the flat exchange over the (possibly paired) axis; True: two hops (requires a pair).
    Any other value, or True with one axis, is a ValueError naming hierarchical."""
    if hierarchical not in (None, True, False):
        raise ValueError(f"hierarchical: expected None, True or False, got {hierarchical!r}")
    is_pair = isinstance(axis_name, (tuple, list)) and len(axis_name) == 2
    tp.check_distinct_axes(axis_name)
    if hierarchical and not is_pair:
        raise ValueError(f"hierarchical: True needs axis_name=(node_axis, local_axis), got "
                         f"{axis_name!r}")
    if not is_pair or hierarchical is False:
        return None
    node_axis, local_axis = axis_name
    sizes = [tp.axis_rank_and_size(a)[1] for a in (node_axis, local_axis)]
    if hierarchical is None and min(sizes) == 1:
        return None
    return node_axis, local_axis


def resolve_transports(transport, two_hop, impl):
    """transport (one name, or a (node hop, local hop) pair) -> (node, local) resolved names
    for two hops, or one name for a flat exchange (a pair's node-hop name); impl: the
    backend's kernels (the "alltoall" backend's "xla" keeps every hop on XLA collectives).

    The node hop of two hops stays on XLA collectives: one name "peer" (or "auto") serves the
    local hop with "peer" and the node hop with "auto"'s XLA choice; a pair naming "peer" for
    the node hop is refused."""
    is_pair = isinstance(transport, (tuple, list))
    pair = transport if is_pair else (transport, transport)
    if len(pair) != 2:
        raise ValueError(f"transport: expected a name or a (node hop, local hop) pair, got "
                         f"{transport!r}")
    no_peer = tp.xla_only(impl)
    if not two_hop:
        return tp.resolve_transport(pair[0], no_peer)
    if is_pair and pair[0] == "peer":
        raise ValueError("transport: the node hop of a two-hop exchange stays on XLA "
                         "collectives ('all_to_all', 'ragged' or 'auto'); 'peer' may serve the "
                         "local hop, e.g. transport=('auto', 'peer')")
    node = tp.resolve_transport("auto" if pair[0] == "peer" else pair[0], tp.NODE_HOP)
    return node, tp.resolve_transport(pair[1], no_peer)


def two_hop_plan(topk_idx, num_experts, axes, *, transports, impl, capacity=None,
                 num_worst_tokens=None, num_worst_rdma_tokens=None, expert_alignment=1):
    """Plans both hops of this rank's tokens over axes=(node_axis, local_axis) ->
    InternodeHandle; one count all_gather per hop.

    topk_idx i32[T,K]: global expert ids over the N*G ranks, -1 unrouted (ids outside
      [-1, E) are routed nowhere and counted); transports: the (node hop, local hop)
      resolved names; impl: "ffi" or "xla" kernels.
    capacity, num_worst_tokens, expert_alignment: as routing_plan's, for the flat exchange
      over the N*G ranks whose result the two hops give; num_worst_rdma_tokens: R1, the
      hop-1 receive rows of each forwarder (None: N*T, no drop).
    """
    node_axis, local_axis = axes
    _, num_nodes = tp.axis_rank_and_size(node_axis)
    _, num_local_ranks = tp.axis_rank_and_size(local_axis)
    num_local = check_experts(num_experts, num_nodes * num_local_ranks)
    num_tokens, _ = topk_idx.shape
    topk_idx, num_invalid = unroute_invalid_experts(topk_idx, num_experts)
    capacity, num_recv = _sizes(num_tokens, num_nodes * num_local_ranks, capacity,
                                num_worst_tokens)
    num_rdma_recv = max(1, num_nodes * num_tokens) if num_worst_rdma_tokens is None else \
        check_positive(num_worst_rdma_tokens, "num_worst_rdma_tokens")
    in_rank = ops.get_dispatch_layout(topk_idx, num_experts=num_experts,
                                      num_ranks=num_nodes * num_local_ranks, impl=impl)[1]
    per_node = in_rank.reshape(num_tokens, num_nodes, num_local_ranks).any(-1).sum(
        0, dtype=jnp.int32)
    hop1 = routing_plan(topk_idx, num_experts, node_axis, transport=transports[0], impl=impl,
                        num_worst_tokens=num_rdma_recv, send_counts=per_node)
    source_node = source_of_rows(hop1.plan.recv_counts, hop1.plan.recv_offsets, num_rdma_recv)
    hop_cap = hop_capacity(num_nodes, capacity, num_recv, num_rdma_recv)
    hop2 = plan_local_hop(
        hop1.recv_topk_idx, source_node, num_nodes=num_nodes, num_local_experts=num_local,
        local_axis=local_axis, capacity=capacity, num_recv=num_recv, hop_cap=hop_cap,
        transport=transports[1], impl=impl)
    return InternodeHandle(
        hop1=hop1, hop2=hop2, recv_topk_idx=hop2.recv_topk_idx,
        num_recv_tokens=hop2.plan.recv_counts.sum(),
        num_recv_tokens_per_expert=_per_expert_counts(hop2.recv_topk_idx, num_local,
                                                      expert_alignment),
        num_tokens_per_rdma_rank=per_node,
        num_rdma_recv_tokens=hop1.num_recv_tokens, is_token_in_rank=in_rank,
        num_dropped=hop1.num_dropped + hop2.num_dropped, num_invalid=num_invalid,
        num_tokens=num_tokens, num_recv=num_recv, num_rdma_recv=num_rdma_recv,
        capacity=capacity, hop_capacity=hop_cap, num_experts=num_experts,
        axis_name=tuple(axes), transport=tuple(transports), impl=impl)


def send_tokens(x, handle):
    """x [T,...] rows (any dtype) -> [R,...] in x.dtype: each token's row on every rank that
    owns one of its experts, in the receive order of handle (a DispatchHandle, or an
    InternodeHandle: both hops); zero rows past the received ones. Linear in x, the
    transpose of reduce_back."""
    if isinstance(handle, InternodeHandle):
        rows = send_tokens(x, handle.hop1)
        return send_local(rows, handle.hop2, num_recv=handle.num_recv,
                          hop_cap=handle.hop_capacity, local_axis=handle.axis_name[1],
                          transport=handle.transport[1], impl=handle.impl)
    return tp.send_rows(x, handle.send_token_idx, handle.plan, num_recv=handle.num_recv,
                        capacity=handle.capacity, axis_name=handle.axis_name,
                        transport=handle.transport, impl=handle.impl)


def reduce_back(y, handle, bias=None, dtype=None):
    """y [R,...] float rows in handle's receive order -> [T,...] in `dtype` (default y.dtype):
    every row summed onto its source token in fp32 (padding rows add nothing, unrouted tokens
    get 0) and cast once. Two hops: each forwarder sums the copies of a (token, node) in fp32,
    the partial sums cross the node axis in y.dtype and the source sums them in fp32. The
    transpose of send_tokens. bias: optional f32 [T,...], the start of each token's fp32 sum
    (DeepEP's combine adds its biases first, then the copies in source-rank order)."""
    out_dtype = y.dtype if dtype is None else jnp.dtype(dtype)
    flat = y.reshape(y.shape[0], math.prod(y.shape[1:]))
    if isinstance(handle, InternodeHandle):
        partial_sums = return_local(
            flat, handle.hop2, num_forward=handle.num_rdma_recv, hop_cap=handle.hop_capacity,
            local_axis=handle.axis_name[1], transport=handle.transport[1], impl=handle.impl)
        out = reduce_back(partial_sums, handle.hop1, bias, out_dtype)
        return out.reshape((handle.num_tokens,) + y.shape[1:])
    rows, owner, _ = tp.return_rows(flat, handle.send_token_idx, handle.plan,
                                    num_send=handle.send_token_idx.shape[0],
                                    capacity=handle.capacity, axis_name=handle.axis_name,
                                    transport=handle.transport, impl=handle.impl)
    if bias is not None or out_dtype != y.dtype:  # sum in fp32, cast once below
        rows = rows.astype(jnp.float32)
    if bias is not None:  # the bias rows first: unpermute sums in ascending row order
        tokens = jnp.arange(handle.num_tokens, dtype=jnp.int32)
        rows = jnp.concatenate([bias.reshape(handle.num_tokens, flat.shape[1]).astype(
            jnp.float32), rows])
        owner = jnp.concatenate([tokens, owner])
    out = ops.unpermute(rows, owner, num_tokens=handle.num_tokens, impl=handle.impl)
    return out.astype(out_dtype).reshape((handle.num_tokens,) + y.shape[1:])
