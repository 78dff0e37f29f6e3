"""The local hop of DeepEP's internode (two-hop) dispatch over a (node, local) expert axis.

Global rank r = n*G + g (N nodes of G ranks). Hop 1 (the flat exchange of `jax_ep.deepep`
over the node axis) brings every token once to each node owning one of its experts, to the
rank with the sender's local index g: forwarder (n_d, g) holds the tokens of the sources
(n_s, g) for every n_s, grouped by n_s, token ascending. Hop 2 (this module, over the local
axis) sends each of those rows once to every rank of the node owning one of its experts.

Receiver (n_d, g_d) gets from forwarder g the sub-blocks of sources (n_s, g) for every n_s,
so its hop-2 arrival order is (g, n_s, t); the flat contract wants (n_s*G + g, t). The one
count exchange of hop 2 all-gathers every forwarder's (source node, destination) counts over
the local axis, which gives every rank of the node the flat count matrix of its node's
destinations: the capacity / receive-budget drops of the flat exchange (first rows of each
(source, destination) block kept, each destination filled source by source in global rank
order) and the permutation arrival order -> flat order both follow from it, on device.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ep import ops, transport as tp

__all__ = ["LocalHop", "plan_local_hop", "send_local", "return_local", "source_of_rows"]


class LocalHop(NamedTuple):
    """The hop-2 exchange of one rank (all i32 arrays).

    plan: transport.ExchangePlan over the local axis (forwarder -> receiver), drops applied.
    send_row_idx i32[R1*G]: hop-1 receive row of each compact hop-2 send row (-1: none).
    flat_slot i32[R]: for each flat receive row, its row in the hop-2 compact receive
      buffer (-1: padding).
    arrival_row i32[R]: the inverse, the flat row of each hop-2 compact receive row.
    recv_topk_idx i32[R,K]: local expert ids of the flat receive rows (-1 elsewhere).
    num_dropped i32[]: (row, destination) pairs this forwarder dropped.
    """

    plan: tp.ExchangePlan
    send_row_idx: jax.Array
    flat_slot: jax.Array
    arrival_row: jax.Array
    recv_topk_idx: jax.Array
    num_dropped: jax.Array



def source_of_rows(recv_counts, recv_offsets, num_rows):
    """i32[num_rows]: the source (block index) of each compact receive row, given the
    per-source counts / offsets i32[S] of an ExchangePlan (rows past the end: S)."""
    r = jnp.arange(num_rows, dtype=jnp.int32)
    s = jnp.clip(jnp.searchsorted(recv_offsets, r, side="right") - 1, 0,
                 recv_counts.shape[0] - 1)
    return jnp.where(r < recv_counts.sum(), s, recv_counts.shape[0]).astype(jnp.int32)


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
    layout = ops.build_send_layout(recv_idx, jnp.zeros(recv_idx.shape, jnp.float32),
                                   num_ranks=num_local, num_local_experts=num_local_experts,
                                   impl=impl)
    valid = layout.rank >= 0
    dest = jnp.clip(layout.rank, 0, num_local - 1)
    node = jnp.where(valid, source_node[jnp.clip(layout.token_idx, 0)], num_nodes)
    sub = jnp.where(valid & (node < num_nodes), node * num_local + dest, num_nodes * num_local)
    counts = jnp.zeros((num_nodes * num_local,), jnp.int32).at[sub].add(1, mode="drop")
    counts = counts.reshape(num_nodes, num_local)  # [N_src, G_dst] of this forwarder
    gathered = tp.exchange_counts(counts, local_axis)  # [G_fwd, N_src, G_dst]
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
    b = jnp.clip(jnp.searchsorted(flat_off, r, side="right") - 1, 0, flat_counts.shape[0] - 1)
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
                    recv_topk_idx.astype(jnp.int32), num_dropped)


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
