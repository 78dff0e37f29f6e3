"""The wire alone: deepep dispatch and combine on the padded all_to_all transport vs the peer
transport (xla_ffi/peer.cc), with a plain copy of the same bytes as the roof, on emulated CPU
devices. Run through bench_dispatch:

    python -m benchmarks.bench_dispatch --transport peer [--tokens 512 --hiddens 7168,2048
                                                          --experts 256 --topk 8 --ranks 8]

For each hidden size H (bf16 rows by default), uniform DeepSeek-V3-like routing (E=256, K=8):
- time of one jitted dispatch, and of dispatch + combine (combine = the difference), per
  transport, all candidates timed round-robin in one process;
- bytes: the routed rows (one row per (token, destination rank), both directions, the row
  payload only) and what each transport moves for them (padded: every [P, C, H] block whole;
  peer: exactly the routed rows), and GB/s of routed rows;
- the roof: every device copying its routed rows (dispatch + combine) with ops.gather_rows
  (an identity row map: one memcpy per row, XLA's thread pool), in one program on the same
  devices.
Writes bench_transport.json / .md and bench_transport.png under --out.
"""

from __future__ import annotations

import contextlib
import os

from benchmarks import common

AXIS = "ep"
TRANSPORTS = ("all_to_all", "peer")


def _routed_rows(idx, ranks, experts):
    """Rows one way: (token, destination rank) pairs over all ranks, and per receiving rank."""
    import numpy as np
    owner = idx // (experts // ranks)
    hit = np.zeros((idx.shape[0], ranks), bool)
    np.put_along_axis(hit, owner, True, axis=1)
    return int(hit.sum()), hit.sum(axis=0)


def run(a):
    """The transport comparison for bench_dispatch's parsed args `a` (a.transport set)."""
    common.force_cpu_devices(a.ranks)
    print(f"host heap: {common.keep_host_heap(not a.glibc_heap_defaults)}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from jax_ep import ops

    mesh = common.cpu_mesh((a.ranks,), (AXIS,))
    sharding = NamedSharding(mesh, P(AXIS))
    dtype = jnp.dtype(a.dtype)
    transports = sorted(set(TRANSPORTS) | {a.transport}, key=TRANSPORTS.index)
    hiddens = a.hiddens
    T, E, K, R = a.tokens, a.experts, a.topk, a.ranks
    print(f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind} "
          f"devices on {os.cpu_count()} cores; P={R} T={T}/rank H={hiddens} E={E} K={K} "
          f"{a.dtype}, uniform routing")
    rng = np.random.default_rng(a.seed)
    idx, w = common.make_routing(rng, R * T, K, E, "uniform")
    routed, per_rank = _routed_rows(idx, R, E)

    def mapped(body, n_in):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * n_in,
                                     out_specs=P(AXIS)))

    def dispatch_fn(t):
        def body(x, i, w):
            return jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS, transport=t)[0]
        return mapped(body, 3)

    def round_trip_fn(t):
        def body(x, i, w):
            rx, _, _, h = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS, transport=t)
            return jax_ep.combine(rx, h)[0]
        return mapped(body, 3)

    rows_per_rank = int(per_rank.max())

    def roof(buf):  # each device copies its routed rows twice (there and back)
        ids = jnp.arange(rows_per_rank, dtype=jnp.int32)
        there = ops.gather_rows(buf, ids)
        return ops.gather_rows(there, ids)

    results, table, plot = {}, [], {t: [] for t in transports}
    plot["memcpy roof"] = []
    for H in hiddens:
        x = rng.standard_normal((R * T, H)).astype(np.float32)
        args = tuple(jax.device_put(v, sharding) for v in (x.astype(dtype), idx, w))
        buf = jax.device_put(np.zeros((R * rows_per_rank, H), dtype), sharding)
        calls = {}
        for t in transports:
            calls[f"{t} dispatch"] = (dispatch_fn(t), args, contextlib.nullcontext)
            calls[f"{t} dispatch+combine"] = (round_trip_fn(t), args, contextlib.nullcontext)
        calls["memcpy roof"] = (mapped(roof, 1), (buf,), contextlib.nullcontext)
        timed = common.time_round_robin(calls, warmup=a.warmup, iters=a.iters)
        outs = {t: np.asarray(timed[f"{t} dispatch+combine"][1], np.float32) for t in transports}
        for t in transports[1:]:
            np.testing.assert_array_equal(outs[t], outs[transports[0]])
        row_bytes = H * dtype.itemsize
        routed_bytes = 2 * routed * row_bytes  # dispatch + combine
        roof_s = timed["memcpy roof"][0]["median_s"]
        entry = {"routed_rows_one_way": routed, "routed_bytes": routed_bytes,
                 "roof_s": roof_s, "transports": {}}
        for t in transports:
            d = timed[f"{t} dispatch"][0]["median_s"]
            dc = timed[f"{t} dispatch+combine"][0]["median_s"]
            moved = routed_bytes if t == "peer" else 2 * R * R * T * row_bytes
            entry["transports"][t] = dict(dispatch_s=d, combine_s=dc - d, round_trip_s=dc,
                                          bytes_moved=moved, gbps=routed_bytes / dc / 1e9)
        base = entry["transports"]["all_to_all"]["round_trip_s"]
        for t, e in entry["transports"].items():
            table.append([H, t, e["dispatch_s"] * 1e3, e["combine_s"] * 1e3,
                          e["round_trip_s"] * 1e3, base / e["round_trip_s"],
                          common.fmt_bytes(e["bytes_moved"]), e["gbps"],
                          roof_s / e["round_trip_s"]])
            plot[t].append(e["round_trip_s"] * 1e3)
        table.append([H, "memcpy roof", None, None, roof_s * 1e3, base / roof_s,
                      common.fmt_bytes(routed_bytes), routed_bytes / roof_s / 1e9, 1.0])
        plot["memcpy roof"].append(roof_s * 1e3)
        results[str(H)] = entry

    markdown = common.print_table(
        f"deepep dispatch + combine by transport, {R} CPU devices, T={T}/rank, E={E}, K={K}, "
        f"{a.dtype} (median of {a.iters}, round-robin)",
        ["H", "transport", "dispatch ms", "combine ms", "dispatch+combine ms",
         "speed-up vs all_to_all", "bytes moved", "GB/s of routed rows", "fraction of roof"],
        table)
    os.makedirs(a.out, exist_ok=True)
    path = common.write_json(os.path.join(a.out, "bench_transport.json"),
                             {"config": vars(a), "hidden": results})
    with open(os.path.join(a.out, "bench_transport.md"), "w") as f:
        f.write(markdown)
    common.bar_plot(os.path.join(a.out, "bench_transport.png"), [f"H={h}" for h in hiddens],
                    plot, ylabel="dispatch + combine, ms (median)", log=False,
                    title=f"transports on {R} CPU devices (T={T}/rank, E={E}, K={K}, "
                          f"{a.dtype})")
    print(f"\nwrote {path}, bench_transport.md, bench_transport.png under {a.out}")
    return results

