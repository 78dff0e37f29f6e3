"""Internode dispatch on emulated CPU devices: DeepEP's two-hop dispatch over a
("node", "local") = (N, P/N) expert axis vs the flat deepep exchange over the same pair vs the
per-(token, expert) rows of bench_dispatch's sort_a2a baseline.

    python -m benchmarks.bench_internode [--nodes 2 --ranks 8 --tokens 256 --hidden 512
                                          --experts 256 --topk 8 --out benchmarks/out]

1. Rows and bytes that cross the node axis per step (dispatch + combine, row payload), exact
   counts read from the dispatch handles (two-hop: num_tokens_per_rdma_rank minus the own
   node; flat: the plan's send counts to ranks of other nodes) and checked against a numpy
   count of the routing; the same numpy counter gives the rows on the intra-node links.
2. dispatch -> identity expert -> combine time, two-hop vs flat, in one process (round robin).
3. A cost model on paper at EP16/32/64 (8 GPUs per node, DeepSeek-V3 sizes): per GPU the
   bytes on RDMA and NVLink from the numpy counter, with DeepEP's published links.
"""

from __future__ import annotations

import argparse
import os

from benchmarks import common

AXES = ("node", "local")
NVLINK_BPS, RDMA_BPS = 160e9, 50e9  # DeepEP V1's intranode / per-GPU RDMA figures


def parse_args(argv=None):
    """The shared problem options (common.add_ep_args) plus --nodes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_ep_args(p)
    p.add_argument("--nodes", type=common.positive_int, default=2,
                   help="N: the ranks as a ('node', 'local') = (N, P/N) pair")
    a = p.parse_args(argv)
    common.check_ep_args(p, a)
    if a.ranks % a.nodes:
        p.error(f"--nodes: expected a divisor of --ranks {a.ranks}, got {a.nodes}")
    return a


def node_limited_routing(rng, num_tokens, top_k, num_experts, num_groups, group_topk):
    """DeepSeek-V3's rule on random scores: a group scores the sum of its top
    (top_k / group_topk) expert scores, the best group_topk groups stay, then top-k inside."""
    import numpy as np
    scores = rng.gumbel(size=(num_tokens, num_experts))
    grouped = scores.reshape(num_tokens, num_groups, -1)
    per = max(1, top_k // group_topk)
    group_score = -np.sort(-grouped, axis=2)[:, :, :per].sum(axis=2)
    best = np.argsort(-group_score, axis=1)[:, :group_topk]
    keep = np.zeros((num_tokens, num_groups), bool)
    np.put_along_axis(keep, best, True, axis=1)
    masked = np.where(np.repeat(keep, num_experts // num_groups, axis=1), scores, -np.inf)
    idx = np.argsort(-masked, axis=1)[:, :top_k].astype(np.int32)
    w = rng.uniform(0.1, 1.0, idx.shape)
    return idx, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def link_rows(idx, num_nodes, local, num_experts):
    """Numpy count of the rows each GPU sends per direction, [P] each:
    {mode: (rdma rows, nvlink rows)} for "two-hop", "flat" and "per (token, expert)".
    Two-hop: a source sends one row per other node (RDMA); the forwarder (n_d, g_src) sends
    one row per owning rank of n_d other than itself (NVLink), the own node's included."""
    import numpy as np
    P = num_nodes * local
    T = idx.shape[0] // P
    L = num_experts // P
    src = np.repeat(np.arange(P), T)
    src_node, src_g = src // local, src % local
    owner = np.where(idx >= 0, idx // L, -1)
    in_rank = np.zeros((idx.shape[0], P), bool)
    rows = np.arange(idx.shape[0])[:, None]
    in_rank[rows, np.where(owner >= 0, owner, 0)] = owner >= 0
    in_node = in_rank.reshape(-1, num_nodes, local)
    node_any = in_node.any(axis=2)  # [PT, N]
    other_node = np.arange(num_nodes)[None, :] != src_node[:, None]
    out = {}
    rdma = np.bincount(src, weights=(node_any & other_node).sum(axis=1), minlength=P)
    # forwarder (n, g_src) sends to every owning rank (n, g) with g != g_src
    fwd_sends = in_node & (np.arange(local)[None, None, :] != src_g[:, None, None])
    fwd = np.arange(num_nodes)[None, :] * local + src_g[:, None]  # [PT, N]
    nvl = np.bincount(fwd.reshape(-1), weights=fwd_sends.sum(axis=2).reshape(-1), minlength=P)
    out["two-hop"] = (rdma, nvl)
    rank_node = np.arange(P) // local
    remote = rank_node[None, :] != src_node[:, None]
    not_self = np.arange(P)[None, :] != src[:, None]
    out["flat"] = (np.bincount(src, weights=(in_rank & remote).sum(axis=1), minlength=P),
                   np.bincount(src, weights=(in_rank & ~remote & not_self).sum(axis=1),
                               minlength=P))
    slot_node = np.where(owner >= 0, owner // local, -1)
    slot_remote = (owner >= 0) & (slot_node != src_node[:, None])
    slot_local = (owner >= 0) & ~slot_remote & (owner != src[:, None])
    out["per (token, expert)"] = (np.bincount(src, weights=slot_remote.sum(axis=1), minlength=P),
                                  np.bincount(src, weights=slot_local.sum(axis=1), minlength=P))
    return {k: (r.astype(np.int64), n.astype(np.int64)) for k, (r, n) in out.items()}


def routings(a, num_nodes, rng_seed):
    """name -> (idx, w) for uniform, skewed and (N > 1) node-limited routing."""
    import numpy as np
    P = a.ranks
    out = {}
    for i, kind in enumerate(("uniform", "skewed")):
        rng = np.random.default_rng(rng_seed + i)
        out[kind] = common.make_routing(rng, P * a.tokens, a.topk, a.experts, kind, a.zipf)
    group_topk = min(4, num_nodes // 2)
    if group_topk >= 1:
        rng = np.random.default_rng(rng_seed + 7)
        out[f"node-limited {group_topk}/{num_nodes}"] = node_limited_routing(
            rng, P * a.tokens, a.topk, a.experts, num_nodes, group_topk)
    return out


def run(a):
    """The benchmark; a: parse_args()'s namespace (a.nodes divides a.ranks)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep
    N, G = a.nodes, a.ranks // a.nodes
    mesh = common.cpu_mesh((N, G), AXES)
    spec = P(AXES)
    dtype = jnp.dtype(a.dtype)
    item = dtype.itemsize
    row_bytes = a.hidden * item
    print(f"jax {jax.__version__}: mesh (node, local) = ({N}, {G}), T={a.tokens}/rank "
          f"H={a.hidden} E={a.experts} K={a.topk} {a.dtype}")

    def body(hierarchical):
        def f(x, idx, w):
            rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=a.experts, axis_name=AXES,
                                           hierarchical=hierarchical)
            y = (rx.astype(jnp.float32) * rw.sum(axis=1, keepdims=True)).astype(rx.dtype)
            out = jax_ep.combine(y, h)[0]
            node = jax.lax.axis_index(AXES[0])
            if hierarchical:
                per_node = h.num_tokens_per_rdma_rank
                crossed = per_node.sum() - per_node[node]
            else:
                sent = h.plan.send_counts.reshape(N, G)
                crossed = sent.sum() - sent[node].sum()
            return out, crossed[None]
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3,
                                     out_specs=(spec, spec)))

    fns = {"two-hop": body(True), "flat deepep": body(False)}
    results, markdown = {"config": vars(a), "routings": {}}, []
    for r_i, (kind, (idx, w)) in enumerate(routings(a, N, a.seed).items()):
        rng = np.random.default_rng(a.seed + 100 + r_i)
        x = rng.standard_normal((a.ranks * a.tokens, a.hidden)).astype(np.float32)
        want = x * w.sum(axis=1, keepdims=True)
        sharded = [jax.device_put(v, NamedSharding(mesh, spec))
                   for v in (x.astype(dtype), idx, w)]
        calls = {name: (fn, sharded, lambda: mesh) for name, fn in fns.items()}
        timed = common.time_round_robin(calls, warmup=a.warmup, iters=a.iters)
        counts = link_rows(idx, N, G, a.experts)
        rows = []
        flat_t = timed["flat deepep"][0]["median_s"]
        flat_rdma = counts["flat"][0].sum()
        for name, mode in (("two-hop", "two-hop"), ("flat deepep", "flat"),
                           ("per (token, expert)", "per (token, expert)")):
            rdma, nvl = counts[mode]
            if name in timed:
                stats, (out, crossed) = timed[name]
                handle_rows = int(np.asarray(crossed).sum())
                assert handle_rows == rdma.sum(), (name, handle_rows, rdma.sum())
                err = float(np.abs(np.asarray(out.astype(jnp.float32)) - want).max()
                            / np.abs(want).max())
                t_ms, ratio = stats["median_s"] * 1e3, stats["median_s"] / flat_t
            else:
                t_ms = ratio = err = None
            rows.append([name, int(rdma.sum()), common.fmt_bytes(2 * rdma.sum() * row_bytes),
                         rdma.sum() / flat_rdma, int(nvl.sum()), t_ms, ratio, err])
            results["routings"].setdefault(kind, {})[name] = dict(
                rdma_rows=int(rdma.sum()), nvlink_rows=int(nvl.sum()),
                node_bytes_per_step=int(2 * rdma.sum() * row_bytes), time_ms=t_ms,
                time_vs_flat=ratio, max_rel_err=err)
        markdown.append(common.print_table(
            f"routing {kind}, ({N}, {G}): rows crossing the node axis per step (one way; "
            f"bytes = dispatch + combine)",
            ["mode", "node rows", "node bytes", "vs flat", "intra-node rows",
             "dispatch+combine ms", "time vs flat", "max rel err"], rows))

    model = cost_model(a)
    markdown.append(model["table"])
    results["cost_model"] = model["rows"]
    path = common.write_json(os.path.join(a.out, f"bench_internode_{N}x{G}.json"), results)
    labels = list(results["routings"])
    series = {m: [results["routings"][k][m]["node_bytes_per_step"] / 1e6 for k in labels]
              for m in ("two-hop", "flat deepep", "per (token, expert)")}
    png = common.bar_plot(os.path.join(a.out, f"bench_internode_{N}x{G}.png"), labels, series,
                          ylabel="MB across the node axis per step",
                          title=f"bytes crossing the node axis, ({N}, {G}) x T={a.tokens}")
    md = os.path.join(a.out, f"bench_internode_{N}x{G}.md")
    with open(md, "w") as f:
        f.write("\n\n".join(markdown) + "\n")
    print(f"wrote {path}, {png}, {md}")
    return results


def cost_model(a, tokens=4096, hidden=7168, local=8):
    """Time per dispatch + combine on paper at EP16/32/64 (8 GPUs per node), bf16 rows,
    DeepSeek-V3 sizes, uniform and node-limited (4 of N) routing: per GPU the most RDMA and
    NVLink bytes of any rank, t = max(RDMA / 50 GB/s, NVLink / 160 GB/s) per direction
    (the two links overlap; DeepEP pipelines its hops), times 2 (dispatch + combine)."""
    import numpy as np
    row = hidden * 2
    rows, table = [], []
    for ep in (16, 32, 64):
        nodes = ep // local
        for kind in ("uniform", f"node-limited {min(4, nodes // 2)}/{nodes}"):
            rng = np.random.default_rng(ep)
            if kind == "uniform":
                idx, _ = common.make_routing(rng, ep * tokens, a.topk, a.experts, "uniform")
            else:
                idx, _ = node_limited_routing(rng, ep * tokens, a.topk, a.experts, nodes,
                                              min(4, nodes // 2))
            counts = link_rows(idx, nodes, local, a.experts)
            times = {}
            for mode, (rdma, nvl) in counts.items():
                t = 2 * max(rdma.max() * row / RDMA_BPS, nvl.max() * row / NVLINK_BPS)
                times[mode] = t
                rows.append(dict(ep=ep, routing=kind, mode=mode,
                                 rdma_bytes_per_gpu=int(rdma.max() * row),
                                 nvlink_bytes_per_gpu=int(nvl.max() * row), time_us=t * 1e6))
            table.append([f"EP{ep}", kind] + [f"{times[m] * 1e6:.0f}" for m in counts] +
                         [times["flat"] / times["two-hop"]])
    text = common.print_table(
        f"cost model: us per dispatch + combine, T={tokens}/GPU H={hidden} bf16 E={a.experts} "
        f"K={a.topk}, 8 GPUs/node, RDMA 50 GB/s, NVLink 160 GB/s per GPU (busiest GPU)",
        ["EP", "routing", "two-hop", "flat", "per (token, expert)", "flat / two-hop"], table)
    return dict(rows=rows, table=text)


def main(argv=None):
    """Checks the shape options, emulates a.ranks CPU devices and runs the benchmark."""
    a = parse_args(argv)
    common.force_cpu_devices(a.ranks)
    print(f"host heap: {common.keep_host_heap(not a.glibc_heap_defaults)}")
    return run(a)


if __name__ == "__main__":
    main()
