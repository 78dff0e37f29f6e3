"""Expert-parallel dispatch + combine on emulated CPU devices: jax_ep's modes vs the
per-(token, expert) all-to-all dispatchers JAX MoE codebases use.

    python -m benchmarks.bench_dispatch [--tokens 256 --hidden 512 --experts 256 --topk 8
                                         --ranks 8 --out benchmarks/out]

DeepSeek-V3-like routing scaled down (E=256, K=8, smaller H and T), for a uniform and a skewed
(Zipf expert popularity, hottest experts on rank 0) routing:

1. Bytes per step (dispatch + combine, rows that leave their rank; the self block stays put),
   computed exactly from the routing, and the bytes the padded buffers of the CPU transport
   really move. Row payload only; routing metadata is listed apart.
2. Time of one jitted dispatch -> identity "expert" (applies the gate weights) -> combine, for
   jax_ep deepep, alltoall, hybridep (compact routing, permute fused into dispatch),
   deepep + separate ops.permute/unpermute, and two baselines written here:
     sort_a2a - argsort of the slots' expert ids, gather, jax.lax.all_to_all of a padded
                [P, T*K, H] buffer, back, inverse-permutation gather and weighted sum;
     gshard   - one-hot dispatch mask [T,E,C] einsum, all_to_all of [E,C,H], einsum back.
   Every mode computes out[t] = x[t] * sum_k w[t,k]; the error against that is checked.
3. Low-latency mode bf16 vs FP8 (`use_fp8=True`) at a decode-sized batch (--ll-tokens per
   rank = num_max_dispatch_tokens_per_rank, uniform routing): bytes, dispatch time and
   dispatch + combine time (the FP8 "expert" casts its rows back with
   ops.per_token_cast_back, as a grouped GEMM reading FP8 would), and the wire before its
   blocks were bounded (every rank sending every rank its whole [L*Tmax] slot buffer,
   rebuilt here from ops.permute + all_to_all) as the in-process "before".
4. FP8 on the wire in the normal modes (--fp8-modes): deepep, alltoall and hybridep with rows
   in --dtype vs use_fp8=True (fp8_output="cast_back"), forward and forward+backward
   (jax.value_and_grad of a random projection of the output, as a training step): row bytes
   (the backward's two cotangent exchanges move --dtype rows) and time.
   Then the LogFMT combine (`use_logfmt=True`, H % 512 == 0) vs the bf16 combine after a bf16
   dispatch, on rows scaled by 0.1 (expert outputs below 1, where DeepEP's format packs): the
   combine's bytes as DeepEP's variable-length messages would send them (meta + each chunk
   packed or bf16, from the encoded rows), the padded buffers the static transport moves
   (whole 2H + H/32-byte slots), time and error (DeepEP's calc_diff, max rel err).
5. A probe of the emulated wire itself: one jax.lax.all_to_all of the deepep-sized padded
   buffer [P, C=T, H] per rank, in bf16, as the same bits in uint16, and in float32 (XLA:CPU
   widens 16-bit float collectives to f32, which the uint16 row avoids).
With --transport peer it runs only the transport comparison of benchmarks/bench_transport.py
(the padded all_to_all vs the peer transport, with a memcpy roof).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

from benchmarks import common

AXIS = "ep"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_ep_args(p)
    p.add_argument("--capacity-factor", type=common.positive_float, default=1.25,
                   help="gshard capacity factor")
    p.add_argument("--routings", default="uniform,skewed",
                   type=common.comma_list(choices=("uniform", "skewed")),
                   help="comma list of routings: uniform (every expert equally likely), "
                        "skewed (expert e picked ~ 1/(e+1)^zipf)")
    p.add_argument("--ll-tokens", type=common.non_negative_int, default=64,
                   help="tokens per rank = num_max_dispatch_tokens_per_rank of the "
                        "low-latency runs (0: skip them)")
    p.add_argument("--fp8-modes", default="deepep,alltoall,hybridep",
                   type=common.comma_list(choices=("deepep", "alltoall", "hybridep")),
                   help="comma list of the modes timed bf16 vs use_fp8=True (forward and "
                        "forward+backward, the first routing); '' skips")
    p.add_argument("--transport", choices=["peer", "all_to_all"], default=None,
                   help="run only the transport comparison (benchmarks/bench_transport.py): "
                        "deepep dispatch + combine on all_to_all and peer, with a memcpy roof")
    p.add_argument("--hiddens", default="7168,2048",
                   type=common.comma_list(common.positive_int),
                   help="comma list of hidden sizes of the --transport comparison")
    p.add_argument("--modes", default="all",
                   help="comma list of mode name prefixes (sort_a2a, gshard, deepep, "
                        "alltoall, hybridep) or 'all'")
    a = p.parse_args(argv)
    common.check_ep_args(p, a)
    if not a.routings:
        p.error("--routings: expected at least one routing")
    if a.transport and not a.hiddens:
        p.error("--hiddens: expected at least one hidden size")
    return a


def traffic(idx, a, tokens, ll=False):
    """Exact and padded rows and bytes per step (dispatch + combine) for every mode (the
    low-latency ones with ll=True). a: the parsed args; idx [P*tokens, K]. Rows a rank sends
    to itself are not counted (they never hit a wire). The FP8 low-latency step sends FP8
    codes + scales out and bf16 back (DeepEP's combine is bf16)."""
    import numpy as np
    P, T, K, E, H = a.ranks, tokens, a.topk, a.experts, a.hidden
    L = E // P
    item = 2 if a.dtype == "bfloat16" else 4
    row = H * item
    fp8_row = H + (H // 128) * 4  # e4m3 codes + f32 scale per 128 channels
    src = np.repeat(np.arange(P), T)[:, None]
    owner = np.where(idx >= 0, idx // L, -1)
    remote_slot = (owner >= 0) & (owner != src)
    slots = int(remote_slot.sum())
    in_rank = np.zeros((P * T, P), bool)
    np.put_along_axis(in_rank, np.where(owner >= 0, owner, 0), owner >= 0, axis=1)
    in_rank[np.arange(P * T), src[:, 0]] = False
    token_rank = int(in_rank.sum())
    cap = gshard_capacity(T, K, E, a.capacity_factor)
    kept, _ = gshard_kept(idx, P, T, E, cap)
    gshard_slots = int((kept & remote_slot).sum())
    per_rank_remote = P - 1  # remote blocks of a padded [P, C, ...] all_to_all buffer
    modes = {
        # name: (exact rows one way, padded rows one way, dispatch row bytes, combine row bytes,
        #        metadata bytes per exact row, what a row is)
        "sort_a2a (baseline)": (slots, P * per_rank_remote * T * K, row, row, 4,
                                "(token, expert)"),
        "deepep / alltoall": (token_rank, P * per_rank_remote * T, row, row, 8 * K,
                              "(token, rank)"),
        "hybridep": (token_rank, P * per_rank_remote * T, row, row, 8 * K, "(token, rank)"),
        "gshard": (gshard_slots, P * per_rank_remote * L * cap, row, row, 0,
                   "(token, expert) kept"),
    }
    if ll:  # Tmax = T here. The wire: P blocks of C = min(L*Tmax, T*min(K, L)) slots per
        # rank (all_to_all; ragged moves the exact rows); before: blocks of L*Tmax slots.
        block = min(L * T, T * min(K, L))
        modes = {
            "low_latency bf16": (slots, P * per_rank_remote * block, row, row, 4,
                                 "(token, expert)"),
            "low_latency fp8": (slots, P * per_rank_remote * block, fp8_row, row, 4,
                                "(token, expert)"),
            "low_latency bf16, L*Tmax blocks (before)": (slots, P * per_rank_remote * L * T,
                                                         row, row, 4, "(token, expert)"),
        }
    out = {}
    for name, (exact, padded, d_row, c_row, meta, unit) in modes.items():
        out[name] = dict(rows_exact=exact, rows_padded=padded, row_unit=unit,
                         bytes_exact=exact * (d_row + c_row),
                         bytes_padded=padded * (d_row + c_row), meta_bytes_exact=exact * meta)
    return out


def gshard_capacity(tokens, top_k, experts, factor):
    return max(1, math.ceil(tokens * top_k / experts * factor))


def gshard_kept(idx, ranks, tokens, experts, cap):
    """numpy twin of the gshard dispatcher's keep rule: per rank and expert, slots in
    (k, token) order, the first `cap` are kept. Returns (kept bool[N,K], dropped count)."""
    import numpy as np
    kept = np.zeros(idx.shape, bool)
    for p in range(ranks):
        block = idx[p * tokens:(p + 1) * tokens]
        seen = np.zeros(experts + 1, np.int64)
        for k in range(block.shape[1]):
            for t in range(tokens):
                e = block[t, k]
                if e < 0:
                    continue
                if seen[e] < cap:
                    kept[p * tokens + t, k] = True
                seen[e] += 1
    return kept, int(((idx >= 0) & ~kept).sum())


# ----------------------------------------------------------------------------- modes


def build_modes(a):
    """{name: per-rank body(x [T,H], idx [T,K], w [T,K]) -> out [T,H]} for jax.shard_map."""
    import jax
    import jax.numpy as jnp

    import jax_ep
    from jax_ep import ops

    P, T, K, E, H = a.ranks, a.tokens, a.topk, a.experts, a.hidden
    L = E // P
    f32 = jnp.float32
    cap = gshard_capacity(T, K, E, a.capacity_factor)

    def weighted(rows, weights):  # the identity expert applies its gate weight(s)
        return (rows.astype(f32) * weights[:, None]).astype(rows.dtype)

    def deepep(backend):
        def body(x, idx, w):
            rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                           backend=backend, transport="all_to_all")
            out, _ = jax_ep.combine(weighted(rx, rw.sum(axis=1)), h)
            return out
        return body

    def deepep_permute(x, idx, w):
        rx, ridx, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                          transport="all_to_all")
        rmap, rprobs = ops.indices_to_multihot(ridx, rw, num_experts=L)
        n = rx.shape[0] * min(K, L)
        px, pp, rows, _ = ops.permute(rx, rmap, rprobs, num_out_tokens=n)
        back = ops.unpermute(weighted(px, pp), rows, num_tokens=rx.shape[0])
        return jax_ep.combine(back, h)[0]

    def hybridep(x, idx, w):
        n = P * jax_ep.hybridep.equalized_num_tokens(T) * min(K, L)
        px, pp, _, h = jax_ep.hybridep_dispatch(x, topk_idx=idx, probs=w, num_experts=E,
                                                axis_name=AXIS, num_permuted_tokens=n,
                                                transport="all_to_all")
        return jax_ep.hybridep_combine(weighted(px, pp), h)


    def sort_a2a(x, idx, w):
        """Per-(token, expert) all-to-all with sort-based permutation (MaxText-style)."""
        slots = T * K
        key = jnp.where(idx >= 0, idx, E).reshape(slots)  # unrouted slots sort last
        order = jnp.argsort(key, stable=True)
        sorted_e = key[order]
        dest = sorted_e // L  # P for unrouted slots
        counts = jnp.zeros((P + 1,), jnp.int32).at[dest].add(1)[:P]
        pos = jnp.arange(slots) - (jnp.cumsum(counts) - counts)[jnp.minimum(dest, P - 1)]
        rows = jnp.take(x, order // K, axis=0)  # [T*K, H] grouped by expert
        send = jnp.zeros((P, slots, H), x.dtype).at[dest, pos].set(rows, mode="drop")
        send_e = jnp.full((P, slots), -1, jnp.int32).at[dest, pos].set(
            sorted_e - dest * L, mode="drop")
        recv = jax.lax.all_to_all(send, AXIS, 0, 0)
        recv_e = jax.lax.all_to_all(send_e, AXIS, 0, 0)
        y = jnp.where((recv_e >= 0)[..., None], recv, 0)  # identity expert on local ids
        back = jax.lax.all_to_all(y, AXIS, 0, 0)
        out_sorted = back[jnp.minimum(dest, P - 1), pos]
        out_sorted = jnp.where((dest < P)[:, None], out_sorted, 0)
        unsorted = jnp.take(out_sorted, jnp.argsort(order), axis=0).reshape(T, K, H)
        return jnp.einsum("tkh,tk->th", unsorted.astype(f32), w).astype(x.dtype)

    def gshard(x, idx, w):
        """GShard one-hot einsum dispatch with capacity C (slots in (k, token) priority)."""
        onehot = jax.nn.one_hot(idx.T, E, dtype=jnp.int32)  # [K,T,E]; -1 -> zeros
        pos = (jnp.cumsum(onehot.reshape(K * T, E), axis=0).reshape(K, T, E) - 1) * onehot
        pos = pos.sum(axis=-1)  # [K,T] position of each slot in its expert
        keep = (idx.T >= 0) & (pos < cap)
        pos_oh = jax.nn.one_hot(jnp.where(keep, pos, cap), cap, dtype=f32)  # [K,T,C]
        dispatch_mask = jnp.einsum("kte,ktc->tec", onehot.astype(f32), pos_oh)
        combine_w = jnp.einsum("kte,ktc,tk->tec", onehot.astype(f32), pos_oh, w)
        buf = jnp.einsum("tec,th->ech", dispatch_mask.astype(x.dtype), x)  # [E,C,H]
        recv = jax.lax.all_to_all(buf.reshape(P, L, cap, H), AXIS, 0, 0)
        back = jax.lax.all_to_all(recv, AXIS, 0, 0).reshape(E, cap, H)  # identity expert
        return jnp.einsum("tec,ech->th", combine_w.astype(x.dtype), back,
                          preferred_element_type=f32).astype(x.dtype)

    return {
        "sort_a2a (baseline)": sort_a2a,
        "gshard": gshard,
        "deepep": deepep("deepep"),
        "alltoall": deepep("alltoall"),
        "deepep + ops.permute": deepep_permute,
        "hybridep": hybridep,
    }


def build_fp8_modes(a):
    """{(mode, fp8): per-rank body(x, idx, w) -> out [T,H]}: dispatch (rows in x.dtype, or
    use_fp8=True with fp8_output="cast_back") -> identity expert -> combine."""
    import jax_ep

    P, T, K, E = a.ranks, a.tokens, a.topk, a.experts
    L = E // P

    def body(mode, fp8):
        kw = dict(use_fp8=True, fp8_output="cast_back") if fp8 else {}

        def run(x, idx, w):
            if mode == "hybridep":
                n = P * jax_ep.hybridep.equalized_num_tokens(T) * min(K, L)
                px, pp, _, h = jax_ep.hybridep_dispatch(
                    x, topk_idx=idx, probs=w, num_experts=E, axis_name=AXIS,
                    num_permuted_tokens=n, transport="all_to_all", **kw)
                return jax_ep.hybridep_combine((px * pp[:, None]).astype(x.dtype), h)
            rx, _, rw, h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS,
                                           backend=mode, transport="all_to_all", **kw)
            return jax_ep.combine((rx * rw.sum(axis=1)[:, None]).astype(x.dtype), h)[0]
        return run

    return {(m, fp8): body(m, fp8) for m in a.fp8_modes for fp8 in (False, True)}


def fp8_traffic(tr, a):
    """Row bytes per step of the FP8 runs from traffic()'s rows: forward = dispatch (FP8 codes
    + f32 scales, or rows in a.dtype) + combine (a.dtype); backward adds the two cotangent
    exchanges, both in a.dtype. Returns {(mode, fp8): (forward bytes, fwd+bwd bytes) exact and
    padded}."""
    item = 2 if a.dtype == "bfloat16" else 4
    row, fp8_row = a.hidden * item, a.hidden + (a.hidden // 128) * 4
    out = {}
    for (mode, fp8) in build_fp8_modes(a):
        t = tr["hybridep" if mode == "hybridep" else "deepep / alltoall"]
        d_row = fp8_row if fp8 else row
        out[(mode, fp8)] = {kind: (n * (d_row + row), n * (d_row + 3 * row))
                            for kind, n in (("exact", t["rows_exact"]),
                                            ("padded", t["rows_padded"]))}
    return out


def build_ll_modes(a):
    """{name: (body, returns_tokens)} of the low-latency runs; Tmax = a.ll_tokens."""
    import jax_ep
    from jax_ep import ops

    tmax, E, H = a.ll_tokens, a.experts, a.hidden

    def body(use_fp8, with_combine):
        def run(x, idx, w):
            recv, _, h = jax_ep.low_latency_dispatch(
                x, idx, num_max_dispatch_tokens_per_rank=tmax, num_experts=E, axis_name=AXIS,
                use_fp8=use_fp8)
            if not with_combine:
                return recv
            if use_fp8:  # the expert reads the FP8 codes back (a grouped GEMM would)
                xq, scales = recv
                y = ops.per_token_cast_back(xq.reshape(-1, H), scales.reshape(-1, H // 128),
                                            dtype=x.dtype).reshape(xq.shape)
            else:
                y = recv
            return jax_ep.low_latency_combine(y, idx, w, h)
        return run

    def full_buffer(with_combine):
        """The wire before the blocks were bounded (issue 20 item 3): every rank sends every
        rank its whole [L*Tmax] expert-major slot buffer, used or not."""
        def run(x, idx, w):
            import jax

            from jax_ep import transport as tp
            num_ranks = jax.lax.axis_size(AXIS)
            rmap, probs = ops.indices_to_multihot(idx, w, num_experts=E)
            px, pp, rows, _ = ops.permute(x, rmap, probs, num_out_tokens=E * tmax,
                                          drop_and_pad=True)
            wire = lambda b: tp.from_bits(jax.lax.all_to_all(  # noqa: E731
                tp.as_bits(b).reshape(num_ranks, -1, H), AXIS, 0, 0).reshape(b.shape), b.dtype)
            recv = wire(px)
            if not with_combine:
                return recv
            return ops.unpermute(wire(recv), rows, num_tokens=x.shape[0], probs=pp)
        return run

    return {
        "bf16 dispatch, L*Tmax blocks (before)": (full_buffer(False), False),
        "bf16 dispatch + combine, L*Tmax blocks (before)": (full_buffer(True), True),
        "bf16 dispatch": (body(False, False), False),
        "fp8 dispatch": (body(True, False), False),
        "bf16 dispatch + combine": (body(False, True), True),
        "fp8 dispatch + cast back + combine": (body(True, True), True),
    }


def logfmt_message_bytes(rows):
    """DeepEP's LogFMT combine message bytes of each row of rows (bf16 [N,H]): the
    (amax, amin) meta, then each chunk packed (10 bits a value) or raw bf16, as
    ops.logfmt_encode decides (its slot without the zero tail)."""
    import jax
    import numpy as np

    from jax_ep import ops
    n, h = rows.shape
    groups, chunk = h // 128, 1024 if h % 1024 == 0 else 512
    meta = np.asarray(jax.jit(ops.logfmt_encode)(rows))[:, :4 * groups].copy()
    amax, amin = np.moveaxis(meta.view("<u2").reshape(n, groups, 2), -1, 0).astype(np.int32)
    packed = ((amax < 0x3F80) & (amin < amax)).reshape(n, h // chunk, -1).all(-1)
    return 4 * groups + np.where(packed, chunk * 10 // 8, 2 * chunk).sum(1)


def _calc_diff(x, y):
    """DeepEP's calc_diff (deep_ep/utils/math.py): 1 - 2<x+1, y+1> / (|x+1|^2 + |y+1|^2)."""
    import numpy as np
    x, y = np.asarray(x, np.float64) + 1, np.asarray(y, np.float64) + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def logfmt_section(a, x, idx, w, jitted, shard_args, results):
    """bf16 dispatch + combine with and without use_logfmt: bytes, time, error (a table)."""
    import jax.numpy as jnp
    import numpy as np

    import jax_ep
    P_, T, H, L = a.ranks, a.ll_tokens, a.hidden, a.experts // a.ranks
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    want = x * w.sum(axis=1, keepdims=True)

    def body(use_logfmt):
        def run(x, idx, w):
            recv, _, h = jax_ep.low_latency_dispatch(
                x.astype(jnp.bfloat16), idx, num_max_dispatch_tokens_per_rank=T,
                num_experts=a.experts, axis_name=AXIS)
            return jax_ep.low_latency_combine(recv, idx, w, h, use_logfmt=use_logfmt)
        return run

    src = np.repeat(np.arange(P_), T)[:, None]
    remote = ((idx >= 0) & (idx // L != src)).sum(1)  # slots of each token leaving its rank
    messages = logfmt_message_bytes(jnp.asarray(x, jnp.bfloat16))
    padded_rows = P_ * (P_ - 1) * min(L * T, T * min(a.topk, L))
    wire = {False: (int(remote.sum()) * 2 * H, padded_rows * 2 * H),
            True: (int((remote * messages).sum()), padded_rows * (2 * H + H // 32))}
    rows, out = [], {}
    for use_logfmt in (False, True):
        t = _timed(jitted(body(use_logfmt)), shard_args(x, idx, w), a, want)
        out[use_logfmt] = t
        exact, padded = wire[use_logfmt]
        rows.append(["LogFMT" if use_logfmt else "bf16", common.fmt_bytes(exact),
                     exact / wire[False][0], common.fmt_bytes(padded), padded / wire[False][1],
                     t["median_s"] * 1e3, t["median_s"] / out[False]["median_s"],
                     t["calc_diff"], t["max_rel_err"]])
    results["low_latency_logfmt"] = dict(
        tokens=T, input_scale=0.1, time=out,
        combine_bytes={("logfmt" if k else "bf16"): dict(exact=v[0], padded=v[1])
                       for k, v in wire.items()})
    return common.print_table(
        f"Low-latency combine, bf16 vs LogFMT (use_logfmt=True), after a bf16 dispatch; rows "
        f"randn * 0.1, T = Tmax = {T}/rank, H = {H}, {P_} emulated CPU devices, median of "
        f"{a.iters}. Bytes: the combine only, exact = DeepEP's variable-length messages, "
        f"padded = the slots this transport moves",
        ["combine wire", "bytes exact", "vs bf16", "padded buffers", "vs bf16",
         "dispatch+combine ms", "vs bf16", "calc_diff", "max rel err"], rows)


# ----------------------------------------------------------------------------- run


def _timed(fn, args, a, want=None):
    """time_fn of a jitted shard_map'ed fn plus its max relative error against want."""
    import jax.numpy as jnp
    import numpy as np
    t, out = common.time_fn(fn, *args, warmup=a.warmup, iters=a.iters, jit=False,
                            keep_output=True)
    if want is not None:
        got = np.asarray(out.astype(jnp.float32))
        t["max_rel_err"] = float(np.abs(got - want).max() / np.abs(want).max())
        t["calc_diff"] = _calc_diff(got, want)
    return t


def main(argv=None):
    a = parse_args(argv)
    if a.transport:
        from benchmarks import bench_transport
        return bench_transport.run(a)
    if a.hidden % 128:
        sys.exit("--hidden must be a multiple of 128 (the FP8 low-latency mode needs it)")
    common.force_cpu_devices(a.ranks)
    print(f"host heap: {common.keep_host_heap(not a.glibc_heap_defaults)}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = common.cpu_mesh((a.ranks,), (AXIS,))
    sharding = NamedSharding(mesh, P(AXIS))
    dtype = jnp.dtype(a.dtype)
    modes = build_modes(a)
    if a.modes != "all":
        wanted = [m.strip() for m in a.modes.split(",") if m.strip()]
        unmatched = [m for m in wanted if not any(k.startswith(m) for k in modes)]
        if unmatched or not wanted:
            sys.exit(f"--modes: {unmatched or a.modes!r} names no mode, expected prefixes of "
                     f"{list(modes)} or 'all'")
        modes = {k: v for k, v in modes.items() if any(k.startswith(m) for m in wanted)}
    baseline = "sort_a2a (baseline)"
    print(f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind} "
          f"devices on {os.cpu_count()} cores; P={a.ranks} T={a.tokens}/rank H={a.hidden} "
          f"E={a.experts} K={a.topk} {a.dtype}")

    def shard_args(x, idx, w):
        return (jax.device_put(x.astype(dtype), sharding), jax.device_put(idx, sharding),
                jax.device_put(w, sharding))

    def jitted(body, out_specs=P(AXIS)):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3,
                                     out_specs=out_specs))

    results = {"config": vars(a), "routings": {}}
    markdown = []
    for r_i, kind in enumerate(a.routings):
        rng = np.random.default_rng(a.seed + r_i)
        idx, w = common.make_routing(rng, a.ranks * a.tokens, a.topk, a.experts, kind, a.zipf)
        x = rng.standard_normal((a.ranks * a.tokens, a.hidden)).astype(np.float32)
        want = x * w.sum(axis=1, keepdims=True)
        owner = idx // (a.experts // a.ranks)
        load = np.bincount(owner.reshape(-1), minlength=a.ranks) / (a.tokens * a.topk)
        cap = gshard_capacity(a.tokens, a.topk, a.experts, a.capacity_factor)
        dropped = gshard_kept(idx, a.ranks, a.tokens, a.experts, cap)[1]
        stats = dict(distinct_ranks_per_token=float(np.mean([len(set(r)) for r in
                                                             owner.tolist()])),
                     rank_load_max_over_mean=float(load.max()),
                     hottest_expert_share=float(np.bincount(idx.reshape(-1)).max() / idx.size),
                     gshard_capacity=cap, gshard_dropped_slots=dropped,
                     gshard_dropped_fraction=dropped / idx.size)
        print(f"\n== routing {kind}: " + ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()))

        # -- bytes
        tr = traffic(idx, a, a.tokens)
        base = tr[baseline]
        byte_rows = [[name, t["row_unit"], t["rows_exact"], common.fmt_bytes(t["bytes_exact"]),
                      common.fmt_bytes(t["bytes_padded"]),
                      t["bytes_padded"] / max(t["bytes_exact"], 1),
                      t["bytes_exact"] / base["bytes_exact"],
                      t["bytes_padded"] / base["bytes_padded"],
                      common.fmt_bytes(t["meta_bytes_exact"])] for name, t in tr.items()]
        markdown.append(common.print_table(
            f"Bytes per step on the wire, {kind} routing (dispatch + combine, all ranks)",
            ["mode", "row =", "rows/dir exact", "bytes exact", "padded buffers",
             "padded/exact", "exact vs baseline", "padded vs baseline", "metadata exact"],
            byte_rows))

        # -- time
        args = shard_args(x, idx, w)
        timings = {}
        for name, body in modes.items():
            t = timings[name] = _timed(jitted(body), args, a, want)
            print(f"  {name:24s} {t['median_s'] * 1e3:9.2f} ms  (first call "
                  f"{t['compile_s']:.1f} s, max rel err {t['max_rel_err']:.1e})", flush=True)
        base_t = timings.get(baseline, {}).get("median_s")
        time_rows = []
        for name, t in timings.items():
            note = f"gshard drops {100 * stats['gshard_dropped_fraction']:.1f}% of slots" \
                if name == "gshard" else ""
            time_rows.append([name, t["median_s"] * 1e3, t["min_s"] * 1e3,
                              t["median_s"] / base_t if base_t else "n/a",
                              base_t / t["median_s"] if base_t else "n/a",
                              t["max_rel_err"], note])
        markdown.append(common.print_table(
            f"Dispatch + combine time, {kind} routing ({a.ranks} emulated CPU devices, median "
            f"of {a.iters})", ["mode", "median ms", "min ms", "time / baseline",
                               "speedup vs baseline", "max rel err", "note"], time_rows))
        results["routings"][kind] = dict(stats=stats, bytes=tr, time=timings)

    # -- FP8 on the wire, normal modes: bf16 vs use_fp8=True, forward and forward+backward
    fp8_modes = build_fp8_modes(a)
    if fp8_modes:
        kind = a.routings[0]
        rng = np.random.default_rng(a.seed)
        idx, w = common.make_routing(rng, a.ranks * a.tokens, a.topk, a.experts, kind, a.zipf)
        x = rng.standard_normal((a.ranks * a.tokens, a.hidden)).astype(np.float32)
        cot = jax.device_put(rng.standard_normal(x.shape).astype(dtype), sharding)
        want = x * w.sum(axis=1, keepdims=True)
        args = shard_args(x, idx, w)
        fb = fp8_traffic(traffic(idx, a, a.tokens), a)
        fp8_t = {}
        for mode in dict.fromkeys(m for m, _ in fp8_modes):
            # bf16 and FP8, forward and forward+backward, timed round robin: a slow stretch of
            # the shared machine weighs on all four alike.
            calls = {}
            for fp8 in (False, True):
                mapped = jax.shard_map(fp8_modes[(mode, fp8)], mesh=mesh,
                                       in_specs=(P(AXIS),) * 3, out_specs=P(AXIS))
                # A training step's: the loss value (the forward combine runs) and d/dx.
                grad = jax.jit(jax.value_and_grad(lambda x, i, w, c, f=mapped: jnp.sum(
                    f(x, i, w).astype(jnp.float32) * c.astype(jnp.float32))))
                calls[(fp8, "forward")] = (jax.jit(mapped), args, contextlib.nullcontext)
                calls[(fp8, "backward")] = (grad, args + (cot,), contextlib.nullcontext)
            timed = common.time_round_robin(calls, warmup=a.warmup, iters=a.iters)
            for fp8 in (False, True):
                fwd, out = timed[(fp8, "forward")]
                got = np.asarray(out.astype(jnp.float32))
                fwd["max_rel_err"] = float(np.abs(got - want).max() / np.abs(want).max())
                both = timed[(fp8, "backward")][0]
                fp8_t[f"{mode} {'fp8' if fp8 else a.dtype}"] = dict(forward=fwd, backward=both)
                print(f"  {mode:9s} fp8={fp8!s:5s} forward {fwd['median_s'] * 1e3:8.2f} ms, "
                      f"forward+backward {both['median_s'] * 1e3:8.2f} ms "
                      f"(max rel err {fwd['max_rel_err']:.1e})", flush=True)
        rows = []
        for (mode, fp8) in fp8_modes:
            t, base = fp8_t[f"{mode} {'fp8' if fp8 else a.dtype}"], fp8_t[f"{mode} {a.dtype}"]
            b, b0 = fb[(mode, fp8)], fb[(mode, False)]
            rows.append([mode, "fp8" if fp8 else a.dtype,
                         common.fmt_bytes(b["exact"][0]), b["exact"][0] / b0["exact"][0],
                         t["forward"]["median_s"] * 1e3,
                         t["forward"]["median_s"] / base["forward"]["median_s"],
                         common.fmt_bytes(b["exact"][1]), b["exact"][1] / b0["exact"][1],
                         t["backward"]["median_s"] * 1e3,
                         t["backward"]["median_s"] / base["backward"]["median_s"],
                         t["forward"]["max_rel_err"]])
        markdown.append(common.print_table(
            f"FP8 on the wire, {kind} routing: dispatch + combine, bf16 vs use_fp8=True "
            f"(fp8_output=\"cast_back\"), {a.ranks} emulated CPU devices, median of {a.iters}",
            ["mode", "wire", "fwd bytes exact", "vs bf16", "fwd ms", "vs bf16",
             "fwd+bwd bytes exact", "vs bf16", "fwd+bwd ms", "vs bf16", "max rel err"], rows))
        results["fp8"] = dict(routing=kind, time=fp8_t, bytes={
            f"{m} {'fp8' if f else a.dtype}": v for (m, f), v in fb.items()})

    # -- low latency, bf16 vs FP8
    if a.ll_tokens:
        rng = np.random.default_rng(a.seed + 100)
        n = a.ranks * a.ll_tokens
        idx, w = common.make_routing(rng, n, a.topk, a.experts, "uniform")
        x = rng.standard_normal((n, a.hidden)).astype(np.float32)
        want = x * w.sum(axis=1, keepdims=True)
        tr = traffic(idx, a, a.ll_tokens, ll=True)
        args = shard_args(x, idx, w)
        ll = {}
        for name, (body, combines) in build_ll_modes(a).items():
            out_specs = P(AXIS) if combines or name.startswith("bf16") else (P(AXIS), P(AXIS))
            t = ll[name] = _timed(jitted(body, out_specs), args, a, want if combines else None)
            err = f", max rel err {t['max_rel_err']:.1e}" if combines else ""
            print(f"  low_latency {name:34s} {t['median_s'] * 1e3:9.2f} ms{err}", flush=True)
        rows = []
        for label, disp, full in (
                ("bf16", "bf16 dispatch", "bf16 dispatch + combine"),
                ("fp8", "fp8 dispatch", "fp8 dispatch + cast back + combine"),
                ("bf16, L*Tmax blocks (before)", "bf16 dispatch, L*Tmax blocks (before)",
                 "bf16 dispatch + combine, L*Tmax blocks (before)")):
            b = tr[f"low_latency {label}"]
            disp, full = ll[disp]["median_s"], ll[full]
            rows.append([f"low_latency {label}", common.fmt_bytes(b["bytes_exact"]),
                         common.fmt_bytes(b["bytes_padded"]),
                         b["bytes_padded"] / tr["low_latency bf16"]["bytes_padded"],
                         disp * 1e3, disp / ll["bf16 dispatch"]["median_s"],
                         full["median_s"] * 1e3,
                         full["median_s"] / ll["bf16 dispatch + combine"]["median_s"],
                         full["max_rel_err"]])
        markdown.append(common.print_table(
            f"Low-latency mode, bf16 vs FP8 (T = Tmax = {a.ll_tokens}/rank, uniform routing, "
            f"median of {a.iters})",
            ["mode", "bytes/step exact", "padded buffers", "padded vs bf16", "dispatch ms",
             "vs bf16", "dispatch+combine ms", "vs bf16", "max rel err"], rows))
        results["low_latency"] = dict(tokens=a.ll_tokens, bytes=tr, time=ll)
        if a.hidden % 512 == 0:
            markdown.append(logfmt_section(a, 0.1 * x, idx, w, jitted, shard_args, results))

    # -- the emulated wire: all_to_all of the deepep padded buffer by dtype
    probe = {}
    for name, dt in (("bfloat16", jnp.bfloat16), ("uint16 (bf16 bits)", jnp.uint16),
                     ("float32", jnp.float32)):
        buf = jax.device_put(jnp.zeros((a.ranks * a.ranks * a.tokens, a.hidden), dt),
                             sharding)

        def wire(b):
            blocks = b.reshape(a.ranks, a.tokens, a.hidden)
            return jax.lax.all_to_all(blocks, AXIS, 0, 0).reshape(b.shape)

        fn = jax.jit(jax.shard_map(wire, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
        probe[name] = common.time_fn(fn, buf, warmup=a.warmup, iters=a.iters, jit=False)
        probe[name]["bytes_per_rank"] = a.ranks * a.tokens * a.hidden * jnp.dtype(dt).itemsize
    ref_t = probe["bfloat16"]["median_s"]
    markdown.append(common.print_table(
        f"XLA:CPU all_to_all of one [P={a.ranks}, C={a.tokens}, H={a.hidden}] buffer per rank "
        f"(median of {a.iters})",
        ["dtype", "MiB per rank", "median ms", "time vs bfloat16"],
        [[n, t["bytes_per_rank"] / 2 ** 20, t["median_s"] * 1e3, t["median_s"] / ref_t]
         for n, t in probe.items()]))
    results["all_to_all_probe"] = probe

    # -- JSON, markdown and plots
    os.makedirs(a.out, exist_ok=True)
    path = common.write_json(os.path.join(a.out, "bench_dispatch.json"), results)
    with open(os.path.join(a.out, "bench_dispatch.md"), "w") as f:
        f.write("\n".join(markdown))
    kinds = list(results["routings"])
    names = list(modes)
    time_series = {k: [results["routings"][k]["time"][n]["median_s"] * 1e3 for n in names]
                   for k in kinds}
    labels = list(names)
    if a.ll_tokens:  # low-latency bars as extra labels (their own T, uniform routing only)
        for n, t in results["low_latency"]["time"].items():
            labels.append(f"LL {n} (T={a.ll_tokens})")
            for k in kinds:
                time_series[k].append(t["median_s"] * 1e3 if k == kinds[0] else None)
    common.bar_plot(os.path.join(a.out, "bench_dispatch_time.png"), labels, time_series,
                    ylabel="ms (median, log)", log=True,
                    title=f"dispatch + combine on {a.ranks} emulated CPU devices "
                          f"(T={a.tokens}/rank, H={a.hidden}, E={a.experts}, K={a.topk})")
    series = {}
    byte_names = list(results["routings"][kinds[0]]["bytes"])
    for k in kinds:
        b = results["routings"][k]["bytes"]
        series[f"{k} exact"] = [b[n]["bytes_exact"] / 2 ** 20 for n in byte_names]
        series[f"{k} padded buffers"] = [b[n]["bytes_padded"] / 2 ** 20 for n in byte_names]
    common.bar_plot(os.path.join(a.out, "bench_dispatch_bytes.png"), byte_names, series,
                    ylabel="MiB per step (log)", log=True,
                    title=f"bytes on the wire per step (T={a.tokens}/rank, H={a.hidden}, "
                          f"{a.dtype})")
    extra, fp8_plot = "", os.path.join(a.out, "bench_dispatch_fp8.png")
    if "fp8" not in results and os.path.exists(fp8_plot):
        os.remove(fp8_plot)  # an earlier run's: this one timed no FP8 mode
    if "fp8" in results:
        names = list(results["fp8"]["time"])
        common.bar_plot(fp8_plot, names,
                        {label: [results["fp8"]["time"][n][part]["median_s"] * 1e3
                                 for n in names]
                         for part, label in (("forward", "forward"),
                                             ("backward", "forward + backward"))},
                        ylabel="ms (median)", log=False,
                        title=f"dispatch + combine, {a.dtype} vs FP8 wire (T={a.tokens}/rank, "
                              f"H={a.hidden}, E={a.experts}, K={a.topk}, P={a.ranks})")
        extra = ", bench_dispatch_fp8.png"
    print(f"\nwrote {path}, bench_dispatch.md, bench_dispatch_time.png, "
          f"bench_dispatch_bytes.png{extra} under {a.out}")
    return results


if __name__ == "__main__":
    main()
