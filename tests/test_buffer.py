"""DeepEP-compatible API (jax_ep.Buffer, UCCLBuffer, all_to_all_single) on emulated CPU ranks:
signatures as DeepEP's, results equal to the functional API."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_utils import AXIS, deepep_layout, ep_mesh, nested_eqns, random_routing, run_ep
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import ops

_EMPTY = inspect.Parameter.empty

# (method, parameters after self as (name, default)) from DeepEP's / UCCL-EP's Buffer docs.
_INIT = [("group", _EMPTY), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
         ("low_latency_mode", False), ("num_qps_per_rank", 24),
         ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
         ("explicitly_destroy", False), ("is_intranode", False),
         # DeepEP's newer keywords, after the SPEC's nine (is_intranode stays the 9th).
         ("use_fabric", False), ("enable_shrink", False), ("comm", None)]
_STREAM = [("previous_event", None), ("async_finish", False),
           ("allocate_on_comm_stream", False)]
SIGNATURES = {
    "__init__": _INIT,
    "get_dispatch_layout": [("topk_idx", _EMPTY), ("num_experts", _EMPTY)] + _STREAM,
    "dispatch": [("x", _EMPTY), ("handle", None), ("num_tokens_per_rank", None),
                 ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                 ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
                 ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None)] + _STREAM,
    "combine": [("x", _EMPTY), ("handle", _EMPTY), ("topk_weights", None), ("bias", None),
                ("config", None)] + _STREAM,
    "low_latency_dispatch": [
        ("x", _EMPTY), ("topk_idx", _EMPTY), ("num_max_dispatch_tokens_per_rank", _EMPTY),
        ("num_experts", _EMPTY), ("cumulative_local_expert_recv_stats", None),
        ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True), ("round_scale", False),
        ("use_ue8m0", False), ("async_finish", False), ("return_recv_hook", False)],
    "low_latency_combine": [
        ("x", _EMPTY), ("topk_idx", _EMPTY), ("topk_weights", _EMPTY), ("handle", _EMPTY),
        ("use_logfmt", False), ("zero_copy", False), ("async_finish", False),
        ("return_recv_hook", False), ("out", None), ("combine_wait_recv_cost_stats", None)],
    "get_next_low_latency_combine_buffer": [("handle", _EMPTY)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", _EMPTY),
                                 ("hidden", _EMPTY), ("num_experts", _EMPTY)],
    "reset_rdma_buffer": [],
    "destroy": [],
    "low_latency_update_mask_buffer": [("rank_to_mask", _EMPTY), ("mask", False)],
    "low_latency_query_mask_buffer": [("mask_status", _EMPTY)],
    "low_latency_clean_mask_buffer": [],
}
SIGNATURES["internode_dispatch"] = SIGNATURES["dispatch"]
SIGNATURES["internode_combine"] = SIGNATURES["combine"]
STATIC_SIGNATURES = {
    "is_sm90_compiled": [],
    "capture": [],
    "set_num_sms": [("new_num_sms", _EMPTY)],
    "get_dispatch_config": [("num_ranks", _EMPTY)],
    "get_combine_config": [("num_ranks", _EMPTY)],
    "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", _EMPTY),
                                       ("hidden", _EMPTY), ("num_ranks", _EMPTY),
                                       ("num_experts", _EMPTY)],
}


def _params(fn, skip_self):
    params = list(inspect.signature(fn).parameters.values())[1 if skip_self else 0:]
    for p in params:
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, (fn, p)
    return [(p.name, p.default) for p in params]


# UCCL-EP's low_latency_combine adds the overlap keywords (after DeepEP's, by name).
UCCL_COMBINE_OVERLAP = [("overlap", False), ("packed_recv_count", None), ("comp_signal", None),
                        ("block_m", 64), ("threshold", 0), ("num_sms", 0),
                        ("src_signals", None), ("src_signal_expect_value", 0)]


@pytest.mark.parametrize("cls", [jax_ep.Buffer, jax_ep.UCCLBuffer])
def test_signatures_match_deepep(cls):
    for name, want in SIGNATURES.items():
        if cls is jax_ep.UCCLBuffer and name == "low_latency_combine":
            want = want + UCCL_COMBINE_OVERLAP
        assert _params(getattr(cls, name), skip_self=True) == want, name
    for name, want in STATIC_SIGNATURES.items():
        assert isinstance(inspect.getattr_static(jax_ep.Buffer, name), staticmethod), name
        assert _params(getattr(cls, name), skip_self=False) == want, name
    assert issubclass(jax_ep.UCCLBuffer, jax_ep.Buffer)
    assert _params(jax_ep.EventOverlap.__init__, skip_self=True) == [
        ("event", None), ("extra_tensors", None)]


def test_all_to_all_signatures_match_spec():
    sig = inspect.signature(jax_ep.all_to_all_single)
    assert [(p.name, p.kind, p.default) for p in sig.parameters.values()] == [
        ("x", inspect.Parameter.POSITIONAL_OR_KEYWORD, _EMPTY),
        ("output_splits", inspect.Parameter.POSITIONAL_OR_KEYWORD, _EMPTY),
        ("input_splits", inspect.Parameter.POSITIONAL_OR_KEYWORD, _EMPTY),
        ("axis_name", inspect.Parameter.KEYWORD_ONLY, _EMPTY),
        ("num_recv", inspect.Parameter.KEYWORD_ONLY, None)]
    sig = inspect.signature(jax_ep.all_to_all_single_equal)
    assert [(p.name, p.kind) for p in sig.parameters.values()] == [
        ("x", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("axis_name", inspect.Parameter.KEYWORD_ONLY)]


def test_inert_pieces():
    buf = jax_ep.Buffer(AXIS, num_nvl_bytes=1 << 30, low_latency_mode=True)
    assert buf.group == AXIS and not buf.is_intranode
    assert jax_ep.UCCLBuffer(AXIS).is_intranode and jax_ep.UCCLBuffer(AXIS).backend == "uccl_ep"
    assert jax_ep.Buffer.is_sm90_compiled() is True  # the FP8 dispatch runs everywhere
    event = buf.capture()
    assert isinstance(event, jax_ep.EventOverlap)
    assert jax_ep.EventOverlap(jax_ep.buffer.EventHandle()).event is not None
    with event as entered:
        assert entered is event
    assert event.current_stream_wait() is None
    assert buf.get_dispatch_config(8) == jax_ep.Config(20, 6, 256, 6, 128)  # DeepEP's table
    assert jax_ep.Buffer.get_combine_config(16) == jax_ep.Config(20, 4, 288, 12, 128)
    # outside DeepEP's table (which asserts): Config's defaults, any P runs here
    assert jax_ep.Buffer.get_dispatch_config(7) == jax_ep.Config(20)
    # UCCL-EP's own tables differ from DeepEP's at 24, 32, 64 and 128 ranks and stop at 48/96
    assert jax_ep.UCCLBuffer.get_dispatch_config(64) == jax_ep.Config(20, 20, 288, 28, 128)
    assert jax_ep.Buffer.get_dispatch_config(64) == jax_ep.Config(20, 32, 288, 8, 128)
    assert jax_ep.UCCLBuffer.get_combine_config(128) == jax_ep.Config(20, 1, 560, 12, 128)
    assert jax_ep.UCCLBuffer.get_dispatch_config(8) == buf.get_dispatch_config(8)
    assert jax_ep.UCCLBuffer.get_dispatch_config(48) == jax_ep.Config(20)
    with pytest.raises(ValueError, match="num_ranks"):
        jax_ep.Buffer.get_dispatch_config(0)
    assert buf.reset_rdma_buffer() is None
    # the contract: destroy does nothing, with or without explicitly_destroy (DeepEP's assert)
    assert jax_ep.Buffer(AXIS, explicitly_destroy=True).destroy() is None
    assert buf.destroy() is None
    assert buf.clean_low_latency_buffer(128, 256, 16) is None
    try:
        assert jax_ep.Buffer.set_num_sms(24) is None and jax_ep.Buffer.num_sms == 24
        assert jax_ep.Buffer.get_combine_config(2).num_sms == 24
        with pytest.raises(ValueError, match="new_num_sms"):
            jax_ep.Buffer.set_num_sms(23)
    finally:
        jax_ep.Buffer.set_num_sms(20)
    with pytest.raises(ValueError, match="group: .*pair"):
        jax_ep.Buffer(("data", "node", "local"))
    assert jax_ep.Buffer(("node", "local")).group == ("node", "local")
    assert not jax_ep.UCCLBuffer(("node", "local")).is_intranode


def test_uccl_buffer_detects_intranode_as_nemo(monkeypatch):
    """NeMo's UCCLBuffer: every rank on one node (a single expert axis) -> is_intranode True
    and num_rdma_bytes 0 (NVLink only); a (node, local) pair keeps what the caller gave. The
    arguments reach Buffer.__init__ by keyword (NeMo's test patches it with **kwargs)."""
    one = jax_ep.UCCLBuffer(AXIS, num_nvl_bytes=1024, num_rdma_bytes=2048)
    assert (one.is_intranode, one.num_nvl_bytes, one.num_rdma_bytes) == (True, 1024, 0)
    pair = jax_ep.UCCLBuffer(("node", "local"), num_rdma_bytes=2048)
    assert (pair.is_intranode, pair.num_rdma_bytes) == (False, 2048)
    assert jax_ep.UCCLBuffer(("node", "local"), is_intranode=True).is_intranode
    seen = {}
    monkeypatch.setattr(jax_ep.Buffer, "__init__",
                        lambda self, **kwargs: seen.update(kwargs))
    jax_ep.UCCLBuffer(AXIS, 1024, 2048)
    assert (seen["group"], seen["num_nvl_bytes"], seen["num_rdma_bytes"],
            seen["is_intranode"]) == (AXIS, 1024, 0, True)


def test_deepep_init_keywords_and_positional_order():
    """use_fabric / enable_shrink / comm (DeepEP's tests and newest Buffer) are accepted after
    the SPEC's nine parameters and kept as attributes; the 9th positional is is_intranode."""
    comm = object()
    buf = jax_ep.Buffer(AXIS, 0, 0, False, 24, True, False, False, True, True, True, comm)
    assert (buf.is_intranode, buf.use_fabric, buf.enable_shrink, buf.comm) == (
        True, True, True, comm)
    buf = jax_ep.Buffer(AXIS, num_rdma_bytes=1 << 20, low_latency_mode=True,
                        num_qps_per_rank=4, use_fabric=True, enable_shrink=True)
    assert (buf.use_fabric, buf.enable_shrink, buf.comm, buf.is_intranode) == (
        True, True, None, False)
    default = jax_ep.Buffer(AXIS)
    assert (default.use_fabric, default.enable_shrink, default.comm) == (False, False, None)
    uccl = jax_ep.UCCLBuffer(AXIS, use_fabric=True, enable_shrink=True, comm=comm)
    assert (uccl.is_intranode, uccl.use_fabric, uccl.enable_shrink, uccl.comm) == (
        True, True, True, comm)
    assert not jax_ep.UCCLBuffer(("node", "local"), enable_shrink=True).is_intranode
    with pytest.raises(ValueError, match="^use_fabric: expected a bool, got 1$"):
        jax_ep.Buffer(AXIS, use_fabric=1)
    with pytest.raises(ValueError, match="^enable_shrink: expected a bool, got 'yes'$"):
        jax_ep.UCCLBuffer(AXIS, enable_shrink="yes")
    assert jax_ep.Buffer(AXIS, is_intranode=np.True_).is_intranode is True


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_nvl_bytes=-1), "^num_nvl_bytes: expected an int >= 0, got -1"),
    (dict(num_nvl_bytes=100), "^num_nvl_bytes: expected a multiple of 128 bytes"),
    (dict(num_nvl_bytes="1GB"), "^num_nvl_bytes: expected an int, got '1GB'"),
    (dict(num_rdma_bytes=1.5), "^num_rdma_bytes: expected an int, got 1.5"),
    (dict(num_qps_per_rank=-3), "^num_qps_per_rank: expected an int >= 0, got -3"),
    (dict(low_latency_mode=True, num_qps_per_rank=0), "^num_qps_per_rank: expected an int > 0"),
    (dict(low_latency_mode="no"), "^low_latency_mode: expected a bool, got 'no'"),
    (dict(allow_nvlink_for_low_latency_mode=None),
     "^allow_nvlink_for_low_latency_mode: expected a bool, got None"),
    (dict(allow_mnnvl="x"), "^allow_mnnvl: expected a bool"),
    (dict(explicitly_destroy=1), "^explicitly_destroy: expected a bool, got 1"),
    (dict(is_intranode="no"), "^is_intranode: expected a bool, got 'no'"),
    (dict(group=("ep", "ep")), "^group: expected the name"),
])
def test_buffer_arguments_are_checked_as_deepep_asserts_them(kwargs, match):
    """DeepEP asserts its byte sizes are multiples of 128 and QPs > 0 in low-latency mode, and
    takes its flags as bools: here each is a ValueError naming the argument (a string flag
    was stored and read as true; a pair naming one axis twice routed to the wrong experts)."""
    kwargs = dict(dict(group=AXIS), **kwargs)
    with pytest.raises(ValueError, match=match):
        jax_ep.Buffer(**kwargs)
    assert jax_ep.Buffer(AXIS, int(2e9), 1 << 20).num_nvl_bytes == int(2e9)


def test_config_is_checked_as_deepeps_constructor_asserts():
    """jax_ep.Config takes what DeepEP's Config asserts (ints, num_sms >= 0, chunks > 0, NVLink
    send < receive, RDMA send <= half the receive rounded up to a multiple of it) and stores
    Python ints: a numpy-int Config's size hints wrapped at int32 before, and a negative field
    gave negative hints."""
    big = jax_ep.Config(*np.int32([48, 32, 720, 12, 128]))  # DeepEP's 144-rank row, 48 SMs
    assert type(big.num_sms) is int
    assert big.get_nvl_buffer_size_hint(7168 * 2, 8) == 2266033920  # > 2^31: no int32 wrap
    assert jax_ep.Config(0).num_sms == 0
    for args, match in (((-2,), "^num_sms: expected an int >= 0"),
                        ((21.5,), "^num_sms: expected an int, got 21.5"),
                        (("20",), "^num_sms: expected an int"),
                        ((20, 0), "^num_max_nvl_chunked_send_tokens: expected an int > 0"),
                        ((20, 6, -256), "^num_max_nvl_chunked_recv_tokens: expected an int > 0"),
                        ((20, 256, 256), "^num_max_nvl_chunked_send_tokens: expected fewer"),
                        ((20, 6, 256, 6, -128),
                         "^num_max_rdma_chunked_recv_tokens: expected an int > 0"),
                        ((20, 6, 256, 128, 100),
                         "^num_max_rdma_chunked_send_tokens: expected at most half")):
        with pytest.raises(ValueError, match=match):
            jax_ep.Config(*args)
    for table in (jax_ep.buffer._DISPATCH_CONFIGS, jax_ep.buffer._COMBINE_CONFIGS,
                  jax_ep.buffer._UCCL_DISPATCH_CONFIGS, jax_ep.buffer._UCCL_COMBINE_CONFIGS):
        for row in table.values():  # the recommended configs all pass
            assert jax_ep.Config(20, *row).num_max_nvl_chunked_send_tokens == row[0]


def test_top_level_deepep_names():
    assert jax_ep.EventHandle is jax_ep.buffer.EventHandle
    assert jax_ep.EventOverlap(jax_ep.EventHandle()).event is not None
    assert jnp.dtype(jax_ep.topk_idx_t) == jnp.int32
    assert {"EventHandle", "topk_idx_t"} <= set(jax_ep.__all__)
    # DeepEP's `topk_idx.to(deep_ep.topk_idx_t)`: ids of that dtype go through the layout and
    # the dispatch.
    num_ranks, T, K, E = 2, 4, 2, 8
    rng = np.random.default_rng(21)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    idx = idx.astype(np.int64).astype(jax_ep.topk_idx_t)
    x = rng.standard_normal((num_ranks * T, 8)).astype(np.float32)
    buf = jax_ep.Buffer(AXIS)

    def body(x, idx, w):
        per_rank, _, per_expert, _, _ = buf.get_dispatch_layout(idx, E)
        _, ri, _, _, _, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                         num_tokens_per_expert=per_expert)
        return per_rank, ri

    per_rank, ri = run_ep(body, ep_mesh(num_ranks), x, idx, w)
    assert ri.dtype == jnp.int32
    want = [[((row >= 0) & (row // (E // num_ranks) == p)).any() for p in range(num_ranks)]
            for row in idx]
    want = np.asarray(want).reshape(num_ranks, T, num_ranks).sum(axis=1).reshape(-1)
    np.testing.assert_array_equal(np.asarray(per_rank), want)


def _deepep_nvl_hint(cfg, hidden_bytes, num_ranks):
    """csrc/legacy/config.hpp get_nvl_buffer_size_hint, term by term (topk_idx_t int64,
    SourceMeta 8 bytes, at most 8 NVLink peers)."""
    num_rdma_ranks, num_nvl_ranks = max(num_ranks // 8, 1), min(num_ranks, 8)
    ch, recv = cfg.num_sms // 2, cfg.num_max_nvl_chunked_recv_tokens
    n = ch * num_nvl_ranks * (2 * num_rdma_ranks + 3) * 4
    n += ch * num_nvl_ranks * recv * hidden_bytes
    n += ch * num_nvl_ranks * recv * 8
    n += ch * num_nvl_ranks * recv * 128 * 8
    n += ch * num_nvl_ranks * recv * 128 * 4
    n += ch * num_nvl_ranks * recv * 128 * 4
    return (n + 127) // 128 * 128


def _deepep_rdma_hint(cfg, hidden_bytes, num_ranks):
    """csrc/legacy/config.hpp get_rdma_buffer_size_hint, term by term (the receive chunk
    rounded up to a multiple of the send chunk, as DeepEP's Config constructor does)."""
    if num_ranks <= 8:
        return 0
    send = cfg.num_max_rdma_chunked_send_tokens
    recv = (cfg.num_max_rdma_chunked_recv_tokens + send - 1) // send * send
    rdma, ch = num_ranks // 8, cfg.num_sms // 2
    n = ch * rdma * (8 * 2 + 2) * 2 * 4
    n += ch * rdma * recv * hidden_bytes * 2
    n += ch * rdma * recv * 8 * 2
    n += ch * rdma * recv * 128 * 8 * 2
    n += ch * rdma * recv * 128 * 4 * 2
    n += ch * rdma * recv * 128 * 4 * 2
    n += ch * rdma * recv * 16 * 2
    return (n + 127) // 128 * 128


def test_config_buffer_size_hints_are_deepeps():
    # By hand: Config() (20 SMs -> 10 channels), hidden 7168 bf16 = 14336 bytes, a token slot
    # 14336 + 8 + 128 * 12 + 128 * 4 = 16392 bytes. NVL, 8 ranks: 10 * 8 * 5 * 4 = 1600 counter
    # bytes + 10 * 8 * 256 * 16392 = 335708160, rounded up to 128: 335709824.
    # RDMA, 16 ranks: 2 RDMA ranks, receive chunk 256 -> 258 (a multiple of 6); 10 * 2 * 18 *
    # 2 * 4 = 2880 + 10 * 2 * 258 * 2 * (16392 + 16) = 169330560, rounded up: 169333504.
    cfg = jax_ep.Config()
    assert cfg.get_nvl_buffer_size_hint(14336, 8) == 335709824
    assert cfg.get_rdma_buffer_size_hint(14336, 16) == 169333504
    assert cfg.get_rdma_buffer_size_hint(14336, 8) == 0   # one NVLink domain: no RDMA buffer
    configs = [jax_ep.Config(), jax_ep.Config(24, 8, 256), jax_ep.Config(24, 36, 288, 20, 128),
               jax_ep.Config(20, 20, 560, 12, 128), jax_ep.Config(16, 6, 256, 7, 100)]
    for cfg in configs:
        for hidden_bytes in (0, 2 * 7168, 2 * 4096 + 4, 7168 + 7168 // 128 * 4):
            for num_ranks in (1, 2, 4, 7, 8, 16, 24, 64, 160):
                assert cfg.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) == \
                    _deepep_nvl_hint(cfg, hidden_bytes, num_ranks), (cfg, hidden_bytes, num_ranks)
                assert cfg.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) == \
                    _deepep_rdma_hint(cfg, hidden_bytes, num_ranks), (cfg, hidden_bytes, num_ranks)
    cfg = jax_ep.Config()
    for hint in (cfg.get_nvl_buffer_size_hint, cfg.get_rdma_buffer_size_hint):
        with pytest.raises(ValueError, match="^num_ranks: DeepEP's buffers take fewer than 8 "
                                             "ranks or a multiple of 8, got 12$"):
            hint(14336, 12)
        with pytest.raises(ValueError, match="^num_ranks: expected an int > 0, got 0$"):
            hint(14336, 0)
        with pytest.raises(ValueError, match="^hidden_bytes: expected an int >= 0, got -2$"):
            hint(-2, 8)
        with pytest.raises(ValueError, match="^num_sms: must be even with more than 8 ranks"):
            getattr(jax_ep.Config(num_sms=21), hint.__name__)(14336, 16)
    assert jax_ep.Config(num_sms=21).get_nvl_buffer_size_hint(14336, 8) == _deepep_nvl_hint(
        jax_ep.Config(num_sms=21), 14336, 8)   # an odd num_sms is fine within one domain
    with pytest.raises(ValueError, match="^num_max_rdma_chunked_send_tokens: expected an int "
                                         "> 0, got 0$"):
        jax_ep.Config(20, 6, 256, 0, 256).get_rdma_buffer_size_hint(14336, 16)


def test_shrink_mask_api():
    """DeepEP's shrink mode masks failed ranks; every rank runs an XLA program, so none is ever
    masked: the query returns zeros, unmasking and cleaning do nothing, masking raises. All
    three need enable_shrink=True, as DeepEP asserts."""
    buf = jax_ep.Buffer(AXIS, low_latency_mode=True, enable_shrink=True)
    status = buf.low_latency_query_mask_buffer(jnp.ones((4,), jnp.int32))
    assert status.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(status), [0, 0, 0, 0])
    assert buf.low_latency_update_mask_buffer(3) is None
    assert buf.low_latency_update_mask_buffer(0, mask=False) is None
    assert buf.low_latency_clean_mask_buffer() is None
    with pytest.raises(ValueError, match="^mask: masking rank 2 is not supported under XLA"):
        buf.low_latency_update_mask_buffer(2, mask=True)
    with pytest.raises(ValueError, match="^mask: expected a bool, got 1$"):
        buf.low_latency_update_mask_buffer(2, 1)
    with pytest.raises(ValueError, match="^rank_to_mask: expected an int >= 0, got -1$"):
        buf.low_latency_update_mask_buffer(-1)
    with pytest.raises(ValueError, match="^mask_status: expected int32, got float32$"):
        buf.low_latency_query_mask_buffer(jnp.zeros((4,), jnp.float32))
    plain = jax_ep.Buffer(AXIS, low_latency_mode=True)
    for call in (lambda: plain.low_latency_update_mask_buffer(0),
                 lambda: plain.low_latency_query_mask_buffer(jnp.zeros((4,), jnp.int32)),
                 plain.low_latency_clean_mask_buffer):
        with pytest.raises(ValueError, match=r"^enable_shrink: low_latency_\w+_mask_buffer needs "
                                             r"Buffer\(\.\.\., enable_shrink=True\)"):
            call()

    # Inside shard_map (where DeepEP's test queries it between calls): zeros on every rank, in
    # mask_status's shape (DeepEP checks only its element count, against the ranks there).
    def body(x):
        with pytest.raises(ValueError, match=r"^mask_status: expected num_ranks=4 elements, "
                                             r"got shape \(5,\)"):
            buf.low_latency_query_mask_buffer(jnp.zeros((5,), jnp.int32))
        with pytest.raises(ValueError, match="^rank_to_mask: expected a rank below "
                                             "num_ranks=4, got 4$"):
            buf.low_latency_update_mask_buffer(4)
        assert buf.low_latency_update_mask_buffer(3) is None
        square = buf.low_latency_query_mask_buffer(jnp.ones((2, 2), jnp.int32))
        return buf.low_latency_query_mask_buffer(jnp.zeros((4,), jnp.int32))[None] + x, square

    got, square = run_ep(body, ep_mesh(4), np.zeros((4, 4), np.int32))
    np.testing.assert_array_equal(np.asarray(got), np.zeros((4, 4), np.int32))
    np.testing.assert_array_equal(np.asarray(square), np.zeros((8, 2), np.int32))


def test_normal_mode_equals_functional_api():
    num_ranks, T, H, K, E = 4, 6, 16, 3, 16
    L = E // num_ranks
    rng = np.random.default_rng(0)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    y = rng.standard_normal((num_ranks * num_ranks * T, H)).astype(np.float32)
    b0 = rng.standard_normal(x.shape).astype(np.float32)
    b1 = rng.standard_normal(x.shape).astype(np.float32)
    buf = jax_ep.Buffer(AXIS)
    kinds = {}

    def body(x, idx, w, y, b0, b1):
        layout = buf.get_dispatch_layout(idx, E)
        per_rank, per_rdma, per_expert, in_rank, event = layout
        kinds["layout"] = (len(layout), per_rdma, type(event))
        out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        rx, ri, rw, per_local, handle, event = out
        kinds["dispatch"] = (len(out), type(event), type(handle))
        cached = buf.dispatch(x * 2, handle=handle)
        kinds["cached"] = (len(cached),) + cached[1:5] + (type(cached[5]),)
        c, cw, event = buf.combine(y, handle, topk_weights=rw)
        c1, _, _ = buf.combine(y, handle, bias=b0)
        c2, _, _ = buf.combine(y, handle, bias=(b0, b1))
        kinds["combine"] = type(event)
        f_layout = ops.get_dispatch_layout(idx, num_experts=E, num_ranks=num_ranks)
        f_rx, f_ri, f_rw, f_h = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS)
        f_c, f_cw = jax_ep.combine(y, f_h, topk_weights=f_rw)
        return (per_rank, per_expert, in_rank, rx, ri, rw, per_local, cached[0], c, cw, c1, c2,
                *f_layout, f_rx, f_ri, f_rw, f_h.num_recv_tokens_per_expert, f_c, f_cw)

    got = [np.asarray(a) for a in run_ep(body, ep_mesh(num_ranks), x, idx, w, y, b0, b1)]
    (per_rank, per_expert, in_rank, rx, ri, rw, per_local, cached, c, cw, c1, c2,
     f_per_rank, f_in_rank, f_per_expert, f_rx, f_ri, f_rw, f_per_local, f_c, f_cw) = got
    assert kinds["layout"] == (5, None, jax_ep.EventOverlap)
    assert kinds["dispatch"] == (6, jax_ep.EventOverlap, jax_ep.DispatchHandle)
    assert kinds["cached"] == (6, None, None, None, None, jax_ep.EventOverlap)
    assert kinds["combine"] is jax_ep.EventOverlap
    for a, b in [(per_rank, f_per_rank), (per_expert, f_per_expert), (in_rank, f_in_rank),
                 (rx, f_rx), (ri, f_ri), (rw, f_rw), (per_local, f_per_local), (c, f_c),
                 (cw, f_cw)]:
        np.testing.assert_array_equal(a, b)
    assert per_local.shape == (num_ranks * L,) and per_local.dtype == np.int32
    np.testing.assert_array_equal(cached, 2 * f_rx)
    np.testing.assert_allclose(c1, f_c + b0, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(c2, f_c + b0 + b1, rtol=1e-6, atol=1e-6)


def test_deepep_style_body_through_buffer():
    """DeepEP's test_intranode pattern: x holds the source rank's value, every received row
    holds its source rank (rows grouped by source ascending), and combine returns each token
    times the number of ranks it went to."""
    num_ranks, T, H, K, E = 8, 5, 128, 4, 32
    rng = np.random.default_rng(1)
    idx, w = random_routing(rng, num_ranks * T, K, E, unrouted=0.2)
    x = np.repeat(np.arange(num_ranks, dtype=np.float32), T)[:, None] * np.ones((1, H))
    x = jnp.asarray(x, jnp.bfloat16)
    buf = jax_ep.Buffer(AXIS, int(1e9), 0)

    def body(x, idx, w):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        rx, ri, rw, per_local, handle, _ = buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            num_worst_tokens=num_ranks * T)
        assert len(per_local) == 0  # DeepEP: with num_worst_tokens the list is empty
        assert handle.num_recv_tokens_per_expert.shape == (E // num_ranks,)
        c, _, _ = buf.combine(rx, handle)
        assert len(handle) == 6
        with pytest.raises(ValueError, match=r"handle\[3\]: DeepEP's recv_src_idx"):
            handle[3]
        # handle[4], is_token_in_rank: the tokens sent to each rank, get_dispatch_layout's
        same = jnp.all(handle[4] == in_rank)[None]
        # a slice is the tuple of its entries (DeepEP's handle is a Python tuple)
        first, fifth = handle[::4]
        same = same & jnp.all(first == handle[0]) & jnp.all(fifth == in_rank)
        with pytest.raises(ValueError, match=r"handle\[3\]: DeepEP's recv_src_idx"):
            handle[3:5]
        return rx, ri, handle.num_recv_tokens[None], per_rank, in_rank.sum(1), c, handle[0], same

    rx, ri, n, per_rank, owners, c, prefix, same = [
        np.asarray(a, np.float32) for a in run_ep(body, ep_mesh(num_ranks), x, idx, w)]
    assert same.all()
    R = num_ranks * T
    per_rank = per_rank.reshape(num_ranks, num_ranks)  # [src, dst]
    for d in range(num_ranks):
        rows = rx[d * R:(d + 1) * R]
        m = int(n[d])
        assert m == per_rank[:, d].sum()
        # handle[0], rank_prefix_matrix: the same [P, P] inclusive prefix on every rank
        rank_prefix = prefix[d * num_ranks:(d + 1) * num_ranks]
        np.testing.assert_array_equal(rank_prefix, np.cumsum(per_rank, axis=0))
        # check_data, as DeepEP's test reads it: rows [M[s-1, d], M[s, d]) hold s.
        start = 0
        for s in range(num_ranks):
            end = int(rank_prefix[s, d])
            np.testing.assert_array_equal(rows[start:end], s)
            start = end
        assert start == m
        assert not rows[m:].any() and (ri[d * R + m:(d + 1) * R] == -1).all()
    np.testing.assert_array_equal(c, np.asarray(x, np.float32) * owners[:, None])


def _deepep_bias_combine(x, idx, num_nodes, local, num_experts, bias, scale):
    """numpy model of DeepEP's combine of the copies y = bf16(x * scale(rank)) with a bias:
    per token acc = f32(b0) + f32(b1), then each destination node's partial sum (its ranks'
    copies summed in f32 in ascending order and rounded to bf16 on the node hop; one node:
    no hop, no rounding) in node order, then one cast to bf16."""
    bf16 = jnp.bfloat16
    num_ranks = num_nodes * local
    owner = idx // (num_experts // num_ranks)
    out = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        acc = bias[0][t].astype(np.float32) + bias[1][t].astype(np.float32)
        for node in range(num_nodes):
            ranks = [d for d in range(node * local, (node + 1) * local) if (owner[t] == d).any()]
            if not ranks:
                continue
            part = np.zeros(x.shape[1], np.float32)
            for d in ranks:
                part = part + np.asarray(x[t].astype(np.float32) * scale(d), bf16).astype(
                    np.float32)
            acc = acc + (np.asarray(part, bf16).astype(np.float32) if num_nodes > 1 else part)
        out[t] = acc
    return np.asarray(out, bf16)


@pytest.mark.parametrize("nodes,local", [(1, 4), (2, 2)])
def test_combine_bias_starts_the_sum_and_rounds_once(nodes, local):
    # DeepEP's combine(bias=(b0, b1)): acc = b0 + b1 in fp32, then the copies in source-rank
    # order, one cast. Adding the biases to the already-rounded bf16 combine rounds twice and
    # moves about 1 element in 10 by one ulp here (asserted, so the check can fail).
    num_ranks, T, H, K, E = nodes * local, 6, 32, 3, 16
    rng = np.random.default_rng(8)
    x = np.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)
    idx, _ = random_routing(rng, num_ranks * T, K, E)
    b0, b1 = (np.asarray(rng.standard_normal(x.shape) * 0.3, jnp.bfloat16) for _ in range(2))
    group = AXIS if nodes == 1 else ("node", "local")
    buf = jax_ep.Buffer(group)
    mesh = ep_mesh(num_ranks) if nodes == 1 else jax.make_mesh(
        (nodes, local), ("node", "local"), devices=jax.devices()[:num_ranks])
    cot = rng.standard_normal(x.shape).astype(np.float32)

    def scale(rank):
        return 1.0 + 0.375 * rank

    def body(x, idx, b0, b1, cot):
        per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        rx, _, _, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx)
        rank = jax.lax.axis_index(group)
        y = (rx.astype(jnp.float32) * scale(rank)).astype(jnp.bfloat16)
        c, _, _ = buf.combine(y, handle, bias=(b0, b1))
        plain, _, _ = buf.combine(y, handle)

        def loss(y, b0, b1):
            return jnp.sum(buf.combine(y, handle, bias=(b0, b1))[0].astype(jnp.float32) * cot)
        dy, db0, db1 = jax.grad(loss, argnums=(0, 1, 2))(y, b0, b1)
        dy_plain = jax.grad(lambda y: jnp.sum(buf.combine(y, handle)[0].astype(jnp.float32)
                                              * cot))(y)
        # a bias that does not vary over the ranks (a constant here) differentiates too
        dy_const = jax.grad(lambda y: jnp.sum(buf.combine(
            y, handle, bias=jnp.full(b0.shape, 0.5, jnp.bfloat16))[0].astype(jnp.float32)
            * cot))(y)
        return c, plain, db0, db1, dy, dy_plain, dy_const

    spec = P(group)
    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec))
    sharded = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, idx, b0, b1, cot)]
    c, plain, db0, db1, dy, dy_plain, dy_const = (np.asarray(a) for a in mapped(*sharded))
    np.testing.assert_array_equal(dy_const, dy_plain)
    want = _deepep_bias_combine(np.asarray(x, np.float32), idx, nodes, local, E, (b0, b1),
                                scale)
    np.testing.assert_array_equal(c.view(np.uint16), want.view(np.uint16))
    twice = np.asarray(plain.astype(np.float32) + b0.astype(np.float32)
                       + b1.astype(np.float32), jnp.bfloat16)
    assert (twice.view(np.uint16) != want.view(np.uint16)).mean() > 0.02
    # linear in y and the biases: d bias = the cotangent (in the bias's dtype), d y as without
    np.testing.assert_array_equal(db0, np.asarray(np.asarray(cot, jnp.bfloat16)))
    np.testing.assert_array_equal(db1, db0)
    np.testing.assert_array_equal(dy, dy_plain)


@pytest.mark.parametrize("nodes,local", [(1, 4), (2, 2)])
def test_internode_methods_and_whole_results_leave_shard_map(nodes, local):
    """DeepEP's internode_dispatch / internode_combine are its dispatch / combine for a group
    over nodes: the same results here, flat or (node, local). Every method's whole result,
    EventOverlap included, goes through jax.tree.map and leaves shard_map and jit."""
    num_ranks, T, H, K, E = nodes * local, 5, 16, 2, 8
    rng = np.random.default_rng(31)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    group = AXIS if nodes == 1 else ("node", "local")
    buf = jax_ep.Buffer(group)
    mesh = ep_mesh(num_ranks) if nodes == 1 else jax.make_mesh(
        (nodes, local), ("node", "local"), devices=jax.devices()[:num_ranks])

    def body(x, idx, w):
        layout = buf.get_dispatch_layout(idx, E)
        per_rank, per_node, per_expert, in_rank, _ = layout
        args = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                    is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
                    topk_weights=w)
        plain = buf.dispatch(x, **args)
        inter = buf.internode_dispatch(x, **args)
        y = plain[0] * 2.0
        out = (layout, plain, inter, buf.combine(y, plain[4], topk_weights=plain[2]),
               buf.internode_combine(y, inter[4], inter[2]), buf.capture())
        return jax.tree.map(lambda a: a[None], out)  # the handles' scalars get a rank axis

    spec = P(group)
    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    sharded = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, idx, w)]
    layout, plain, inter, combined, inter_combined, event = mapped(*sharded)
    for out in (layout, plain, inter, combined, inter_combined):
        assert type(out[-1]) is jax_ep.EventOverlap
    assert type(event) is jax_ep.EventOverlap and type(event.event) is jax_ep.EventHandle
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(inter), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(combined[:2], inter_combined[:2], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a token is sent once per rank that owns one of its experts; the copies come back
    # doubled and summed
    idx = np.asarray(idx)
    owner = np.where(idx >= 0, idx // (E // num_ranks), -1)
    copies = np.array([[len(set(row) - {-1})] for row in owner])
    np.testing.assert_allclose(np.asarray(combined[0]).reshape(x.shape), 2 * copies * x,
                               rtol=1e-6, atol=1e-6)
    # an event with extra tensors carries them as leaves
    extra = jax.jit(lambda a: jax_ep.EventOverlap(jax_ep.EventHandle(), (a, a + 1)))(
        jnp.arange(3))
    assert type(extra.event) is jax_ep.EventHandle
    np.testing.assert_array_equal(np.asarray(extra.extra_tensors[1]), [1, 2, 3])


def test_dispatch_without_topk_and_fp8_pair():
    """DeepEP's with_topk=False dispatch (is_token_in_rank only) and the FP8 pair as x."""
    num_ranks, T, H, K, E = 4, 6, 128, 3, 16
    L = E // num_ranks
    rng = np.random.default_rng(4)
    x = rng.standard_normal((num_ranks * T, H)).astype(np.float32)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    buf = jax_ep.UCCLBuffer(AXIS)
    kinds = {}

    def body(x, idx, w):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        rx, ri, rw, per_local, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, expert_alignment=4)
        kinds["no_topk"] = (ri, rw)
        c, cw, _ = buf.combine(rx, handle)
        kinds["combine"] = cw
        pair = ops.per_token_cast_to_fp8(x)
        (q, s), _, _, _, _, _ = buf.dispatch(pair, topk_idx=idx, topk_weights=w,
                                             num_tokens_per_expert=per_expert)
        (f_q, f_s), f_ri, _, f_h = jax_ep.dispatch(pair, idx, w, num_experts=E, axis_name=AXIS,
                                                  backend="uccl_ep")
        rank = jnp.broadcast_to(buf.rank, (1,))
        # UCCL-EP's intranode handle tuple: DeepEP's six with num_recv_tokens at [3].
        assert len(handle) == 7 and handle.tuple_layout == "uccl_ep"
        with pytest.raises(ValueError, match="tuple_layout: expected one of"):
            dataclasses.replace(handle, tuple_layout="nccl_ep")
        with pytest.raises(ValueError, match=r"handle\[4\]: UCCL-EP's recv_src_idx"):
            handle[4]
        return (rx, per_local, c, in_rank.sum(1), q.view(jnp.uint8), s, f_q.view(jnp.uint8), f_s,
                rank, jnp.full((1,), buf.group_size), handle[3][None],
                handle[0][-1, buf.rank][None], jnp.all(handle[5] == in_rank)[None])

    rx, per_local, c, owners, q, s, f_q, f_s, rank, size, n, prefix_last, same = [
        np.asarray(a) for a in run_ep(body, ep_mesh(num_ranks), x, idx, w)]
    assert same.all()  # handle[5], UCCL-EP's is_token_in_rank
    # handle[3] (num_recv_tokens) is the rows each rank received: rank_prefix_matrix's last row
    np.testing.assert_array_equal(n, prefix_last)
    np.testing.assert_array_equal(n, [len(deepep_layout(x, idx, w, num_ranks, E)[d]["src"])
                                      for d in range(num_ranks)])
    assert kinds["no_topk"] == (None, None) and kinds["combine"] is None
    want = deepep_layout(x, idx, w, num_ranks, E)
    R = num_ranks * T
    for d in range(num_ranks):
        m = len(want[d]["src"])
        np.testing.assert_array_equal(rx[d * R:d * R + m], want[d]["x"])
        assert not rx[d * R + m:(d + 1) * R].any()
        counts = np.bincount(idx[idx >= 0], minlength=E)[d * L:(d + 1) * L]
        np.testing.assert_array_equal(per_local[d * L:(d + 1) * L], -(-counts // 4) * 4)
    np.testing.assert_allclose(c, x * owners[:, None], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(q, f_q)
    np.testing.assert_array_equal(s, f_s)
    np.testing.assert_array_equal(rank, np.arange(num_ranks))
    np.testing.assert_array_equal(size, num_ranks)


def _ll_mesh_run(body, num_ranks, *arrays):
    return [np.asarray(a) for a in run_ep(body, ep_mesh(num_ranks), *arrays)]


def test_low_latency_equals_functional_api():
    num_ranks, T, tmax, H, K, E = 4, 5, 8, 128, 3, 16
    L = E // num_ranks
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    stats0 = rng.integers(0, 100, (num_ranks * L,)).astype(np.int32)
    buf = jax_ep.Buffer(AXIS, low_latency_mode=True)
    kinds = {}

    def body(x, idx, w, stats):
        out = buf.low_latency_dispatch(x, idx, tmax, E, cumulative_local_expert_recv_stats=stats)
        (q, s), count, handle, event, hook = out
        kinds["dispatch"] = (len(out), type(event), hook)
        _, _, handle2, _, hook2 = buf.low_latency_dispatch(
            x, idx, tmax, E,
            cumulative_local_expert_recv_stats=handle.cumulative_local_expert_recv_stats,
            return_recv_hook=True)
        kinds["hook"] = hook2()
        (f_q, f_s), f_count, f_h = jax_ep.low_latency_dispatch(
            x, idx, num_max_dispatch_tokens_per_rank=tmax, num_experts=E, axis_name=AXIS,
            use_fp8=True)
        y = ops.per_token_cast_back(q.reshape(-1, H), s.reshape(-1, H // 128)).reshape(q.shape)
        zero = buf.get_next_low_latency_combine_buffer(handle)
        kinds["zero"] = (zero.shape, zero.dtype)
        combined, event, hook = buf.low_latency_combine(y, idx, w, handle)
        kinds["combine"] = (type(event), hook)
        into, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True,
                                                out=jnp.zeros(x.shape, jnp.float32))
        kinds["out"] = (into.shape, into.dtype, hook())
        f_combined = jax_ep.low_latency_combine(y, idx, w, f_h)
        return (q.view(jnp.uint8), s, count, handle2.cumulative_local_expert_recv_stats,
                combined, f_q.view(jnp.uint8), f_s, f_count, f_combined)

    q, s, count, stats2, combined, f_q, f_s, f_count, f_combined = _ll_mesh_run(
        body, num_ranks, x, idx, w, stats0)
    assert kinds["dispatch"] == (5, jax_ep.EventOverlap, None)
    assert kinds["hook"] is None
    assert kinds["zero"] == ((L, num_ranks * tmax, H), jnp.bfloat16)
    assert kinds["combine"] == (jax_ep.EventOverlap, None)
    assert kinds["out"] == ((T, H), jnp.float32, None)
    np.testing.assert_array_equal(q, f_q)
    np.testing.assert_array_equal(s, f_s)
    np.testing.assert_array_equal(count, f_count)
    np.testing.assert_array_equal(stats2, stats0 + 2 * f_count)
    np.testing.assert_array_equal(combined.astype(np.float32), f_combined.astype(np.float32))


def test_uccl_low_latency_combine_takes_the_overlap_keywords():
    # UCCL-EP's SGLang-facing keywords: accepted and without effect when overlap is off (the
    # same combined rows), overlap=True refused as UCCL-EP refuses it.
    num_ranks, T, tmax, H, K, E = 4, 3, 4, 128, 2, 8
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)), jnp.bfloat16)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    buf = jax_ep.UCCLBuffer(AXIS, low_latency_mode=True)

    def body(x, idx, w):
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, tmax, E, use_fp8=False)
        plain, _, _ = buf.low_latency_combine(recv, idx, w, handle)
        signals = jnp.zeros((E // num_ranks,), jnp.int32)
        tuned, _, _ = buf.low_latency_combine(
            recv, idx, w, handle, overlap=False, packed_recv_count=count, comp_signal=signals,
            block_m=128, threshold=4, num_sms=3, src_signals=signals,
            src_signal_expect_value=1)
        with pytest.raises(NotImplementedError, match="overlap"):
            buf.low_latency_combine(recv, idx, w, handle, overlap=True)
        return plain, tuned

    plain, tuned = _ll_mesh_run(body, num_ranks, x, idx, w)
    assert np.abs(plain.astype(np.float32)).max() > 0
    np.testing.assert_array_equal(plain, tuned)


def test_low_latency_logfmt_combine_equals_functional_api():
    num_ranks, T, tmax, H, K, E = 4, 5, 8, 1024, 3, 16
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((num_ranks * T, H)) * 0.1, jnp.bfloat16)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    buf = jax_ep.Buffer(AXIS, low_latency_mode=True)

    def body(x, idx, w):
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, tmax, E, use_fp8=False)
        combined, _, _ = buf.low_latency_combine(recv, idx, w, handle, use_logfmt=True)
        f_combined = jax_ep.low_latency_combine(recv, idx, w, handle, use_logfmt=True)
        plain, _, _ = buf.low_latency_combine(recv, idx, w, handle)
        return combined, f_combined, plain

    combined, f_combined, plain = (a.astype(np.float32) for a in _ll_mesh_run(
        body, num_ranks, x, idx, w))
    np.testing.assert_array_equal(combined, f_combined)
    assert (combined != plain).any()  # the LogFMT rows are lossy: the flag reached the wire


def _all_to_all_bytes(jaxpr):
    """Bytes of the operands and results of every all_to_all in a (nested) jaxpr."""
    return sum(v.aval.size * v.aval.dtype.itemsize for _, eqn in nested_eqns(jaxpr)
               if eqn.primitive.name == "all_to_all" for v in [*eqn.invars, *eqn.outvars])


def test_low_latency_rdma_size_hint_is_deepeps():
    # DeepEP's / UCCL-EP's LowLatencyLayout, hand-computed. Tmax = 128, H = 7168, E = 256:
    # dispatch message 16 + max(14336, 7168 + 56 * 4) = 14352 bytes, combine 14336; send
    # max(128 * 14352, 256 * 128 * 14336) = 469762048; receive 256 * 128 * 14352 = 470286336;
    # counters 1024; 2 * (send + receive + counters) = 1880098816, + 128 rounded down to 128
    hint = jax_ep.Buffer.get_low_latency_rdma_size_hint
    assert hint(128, 7168, 8, 256) == 1880098944
    # Tmax = 4, H = 256, E = 8: messages 528 and 512; send max(2112, 16384); receive 16896;
    # counters 32 -> 128; 2 * 33408 + 128
    assert hint(4, 256, 4, 8) == 66944
    # H = 128, one expert, one token: 2 * (272 + 272 + 128) = 1344, + 128 = 1472 rounded down
    # to 1408; num_ranks is not used
    assert hint(1, 128, 1, 1) == hint(1, 128, 64, 1) == 1408


@pytest.mark.parametrize("T", [4, 3])
def test_low_latency_rdma_size_hint_holds_the_exchanged_bytes(T, padded_auto):
    # The wire moves blocks of min(L*Tmax, T*min(K, L)) rows: at T = Tmax, K >= L exactly
    # E*Tmax rows of bf16 dispatch and combine each way, plus the plan's counts and source
    # tokens, which DeepEP's buffer (16-byte message headers, 128-byte aligned counters) holds
    num_ranks, tmax, H, K, E = 4, 4, 256, 2, 8
    mesh = ep_mesh(num_ranks)
    buf = jax_ep.Buffer(AXIS)

    def body(x, idx, w):
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, tmax, E, use_fp8=False)
        combined, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
        return combined, recv_x

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS))
    sharding = NamedSharding(mesh, P(AXIS))
    args = (jax.ShapeDtypeStruct((num_ranks * T, H), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((num_ranks * T, K), jnp.int32, sharding=sharding),
            jax.ShapeDtypeStruct((num_ranks * T, K), jnp.float32, sharding=sharding))
    closed = jax.make_jaxpr(fn)(*args)
    hint = jax_ep.Buffer.get_low_latency_rdma_size_hint(tmax, H, num_ranks, E)
    moved = _all_to_all_bytes(closed.jaxpr)
    rows = 2 * 2 * E * tmax * H * 2  # dispatch + combine, sent + received, bf16
    plan = 2 * (E * 4 + E * tmax * 4)  # counts [P, L] and source tokens [E*Tmax], i32
    assert moved == rows + plan if T == tmax else moved < rows + plan
    assert hint >= rows + plan
    recv_x = jax.eval_shape(fn, *args)[1]  # [P*L, P*Tmax, H] over all ranks
    assert recv_x.size * recv_x.dtype.itemsize // num_ranks == E * tmax * H * 2


def test_bad_inputs_name_the_argument():
    num_ranks, T, tmax, K, E = 2, 3, 4, 2, 4
    rng = np.random.default_rng(3)
    idx, w = random_routing(rng, num_ranks * T, K, E)
    buf = jax_ep.Buffer(AXIS)

    def run(body, H=128):
        x = np.ones((num_ranks * T, H), np.float32)
        return run_ep(body, ep_mesh(num_ranks), x, idx, w)

    def logfmt(x, i, w, **kw):
        recv, _, h, _, _ = buf.low_latency_dispatch(x, i, tmax, E, use_fp8=False)
        return buf.low_latency_combine(recv, i, w, h, use_logfmt=True, **kw)[0]

    with pytest.raises(ValueError, match="x: use_logfmt needs bfloat16 rows"):
        run(logfmt, H=512)  # f32 rows
    with pytest.raises(ValueError, match="x: use_logfmt needs a hidden size that is a "
                                         "multiple of 512"):
        run(lambda x, i, w: logfmt(x.astype(jnp.bfloat16), i, w))
    with pytest.raises(ValueError, match="use_logfmt: DeepEP's combine does not allow"):
        run(lambda x, i, w: logfmt(x.astype(jnp.bfloat16), i, w, zero_copy=True), H=512)
    with pytest.raises(ValueError, match="x: hidden size 96"):
        run(lambda x, i, w: buf.low_latency_dispatch(x, i, tmax, E)[1], H=96)

    def normal_handle_to_ll(x, i, w):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(i, E)
        rx, _, _, _, h, _ = buf.dispatch(x, topk_idx=i, topk_weights=w,
                                         num_tokens_per_expert=per_expert)
        y = jnp.zeros((E // num_ranks, num_ranks * tmax, x.shape[1]), jnp.bfloat16)
        return buf.low_latency_combine(y, i, w, h)[0]

    with pytest.raises(ValueError, match="handle: expected a LowLatencyHandle"):
        run(normal_handle_to_ll)

    def ll_handle_to_normal(x, i, w):
        _, _, h, _, _ = buf.low_latency_dispatch(x, i, tmax, E, use_fp8=False)
        return buf.combine(x, h)[0]

    with pytest.raises(ValueError, match="handle: expected the DispatchHandle"):
        run(ll_handle_to_normal)

    # Integer rows dispatch but cannot be combined: the error names Buffer's argument x
    # (jax_ep.combine's y), in both modes (issue 22).
    def int_rows_combined(x, i, w):
        rx, _, _, _, h, _ = buf.dispatch(x.astype(jnp.int32), topk_idx=i, topk_weights=w,
                                         num_tokens_per_expert=buf.get_dispatch_layout(i, E)[2])
        return buf.combine(rx, h)[0]

    with pytest.raises(ValueError, match="^x: expected float32, bfloat16 or float16, got int32"):
        run(int_rows_combined)

    def int_rows_ll_combined(x, i, w):
        recv, _, h, _, _ = buf.low_latency_dispatch(x, i, tmax, E, use_fp8=False)
        return buf.low_latency_combine(recv.astype(jnp.int32), i, w, h)[0]

    with pytest.raises(ValueError, match="^x: expected float32, bfloat16 or float16, got int32"):
        run(int_rows_ll_combined)
    with pytest.raises(ValueError, match="^y: expected float32, bfloat16 or float16, got int32"):
        run(lambda x, i, w: jax_ep.combine(*_int_dispatch(x, i, E)))
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        run(lambda x, i, w: buf.dispatch(x, topk_idx=i, topk_weights=w)[0])


def _int_dispatch(x, i, E):
    """(integer received rows, handle) of a functional dispatch of x cast to int32."""
    rx, _, _, h = jax_ep.dispatch(x.astype(jnp.int32), i, None, num_experts=E, axis_name=AXIS)
    return rx, h


def _splits(rng, num_ranks, S):
    """send[p, q]: rows rank p sends to rank q; each rank sends at most S rows, some splits 0."""
    send = np.stack([rng.multinomial(rng.integers(0, S + 1), np.ones(num_ranks) / num_ranks)
                     for _ in range(num_ranks)]).astype(np.int32)
    send[rng.random(send.shape) < 0.25] = 0
    return send


def _a2a_oracle(x, send, S, num_recv):
    """Numpy all_to_all_single for every rank: x [P*S, H] -> [P*num_recv, H]."""
    num_ranks = send.shape[0]
    out = np.zeros((num_ranks, num_recv) + x.shape[1:], x.dtype)
    for d in range(num_ranks):
        rows = []
        for s in range(num_ranks):
            start = s * S + send[s, :d].sum()
            rows.extend(x[start:start + send[s, d]])
        rows = rows[:num_recv]
        if rows:
            out[d, :len(rows)] = np.stack(rows)
    return out.reshape((num_ranks * num_recv,) + x.shape[1:])


@pytest.mark.parametrize("transport", ["peer", "all_to_all"])
@pytest.mark.parametrize("num_ranks,num_recv", [(1, None), (4, None), (8, None), (4, 7),
                                                (4, 2), (8, 3), (2, 1), (1, 2)])
def test_all_to_all_single_values_and_vjp(num_ranks, num_recv, transport, monkeypatch):
    """Values and VJP against numpy; num_recv below the rows a rank receives drops the last
    sources' rows, whose cotangent is zero (the backward sent the uncut blocks back before,
    which the peer handler refused). "auto" takes the peer transport in this shard_map; the
    all_to_all one where peer is made unavailable."""
    if transport == "all_to_all":
        monkeypatch.setattr(jax_ep.transport, "peer_unavailable", lambda: "test")
    S, H = 6, 3
    rng = np.random.default_rng(num_ranks)
    send = _splits(rng, num_ranks, S)
    if num_recv is not None:  # ranks 0 and 1 receive more than num_recv rows
        send = np.zeros_like(send)
        send[:, 0] = S - 1
        if num_ranks > 1:
            send[:, 1] = 1
    x = rng.standard_normal((num_ranks * S, H)).astype(np.float32)
    R = num_ranks * S if num_recv is None else num_recv
    cot = rng.standard_normal((num_ranks * R, H)).astype(np.float32)

    def body(x, out_splits, in_splits, cot):
        out, vjp = jax.vjp(lambda x: jax_ep.all_to_all_single(
            x, out_splits, in_splits, axis_name=AXIS, num_recv=num_recv), x)
        return out, vjp(cot)[0]

    out, dx = run_ep(body, ep_mesh(num_ranks), x, send.T.reshape(-1), send.reshape(-1), cot)
    np.testing.assert_array_equal(np.asarray(out), _a2a_oracle(x, send, S, R))
    # VJP: <out, cot> = <x, dx>; numerically the adjoint of the exchange.
    want = np.zeros_like(x)
    for d in range(num_ranks):
        row = 0
        for s in range(num_ranks):
            start = s * S + send[s, :d].sum()
            for j in range(send[s, d]):
                if row < R:
                    want[start + j] = cot[d * R + row]
                row += 1
    np.testing.assert_array_equal(np.asarray(dx), want)


def test_all_to_all_single_vjp_of_complex_rows():
    """The backward moves cotangent rows of any dtype (it reduced through a float-only
    unpermute for a moment): complex64 rows, num_recv cutting rank 0's rows."""
    num_ranks, S = 4, 3
    send = np.zeros((num_ranks, num_ranks), np.int32)
    send[:, 0] = 2
    x = (np.arange(num_ranks * S * 2) * (1 + 1j)).astype(np.complex64).reshape(-1, 2)

    def body(x, out_splits, in_splits):
        out, vjp = jax.vjp(lambda x: jax_ep.all_to_all_single(
            x, out_splits, in_splits, axis_name=AXIS, num_recv=5), x)
        return out, vjp(jnp.ones_like(out))[0]

    out, dx = run_ep(body, ep_mesh(num_ranks), x, send.T.reshape(-1), send.reshape(-1))
    # rank 0 keeps its first 5 rows: sources 0, 1 whole, source 2's first row
    want = np.zeros(num_ranks * S, bool)
    want[[0, 1, 3, 4, 6]] = True
    np.testing.assert_array_equal(np.asarray(dx)[:, 0], want.astype(np.complex64))
    np.testing.assert_array_equal(np.asarray(out)[:5], x[[0, 1, 3, 4, 6]])


@pytest.mark.parametrize("num_ranks", [1, 4])
def test_all_to_all_single_equal(num_ranks):
    S, H = 8, 2
    rng = np.random.default_rng(5)
    x = rng.standard_normal((num_ranks * S, H)).astype(np.float32)
    send = np.full((num_ranks, num_ranks), S // num_ranks, np.int32)

    def body(x):
        out, vjp = jax.vjp(lambda x: jax_ep.all_to_all_single_equal(x, axis_name=AXIS), x)
        return out, vjp(out)[0]

    out, back = run_ep(body, ep_mesh(num_ranks), x)
    np.testing.assert_array_equal(np.asarray(out), _a2a_oracle(x, send, S, S))
    np.testing.assert_array_equal(np.asarray(back), x)  # the exchange is its own inverse
