"""The benchmarks' command lines: a bad value ends in argparse's usage error naming the flag
(before any device work), not a traceback or a run that times nothing. Parsing only: the
benchmarks themselves are measured by hand (benchmarks/RESULTS.md), not in CI."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def benchmarks(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import bench_dispatch, bench_internode, bench_moe, run
    return dict(bench_dispatch=bench_dispatch.parse_args,
                bench_internode=bench_internode.parse_args, bench_moe=bench_moe.parse_args,
                run=run.main)


BAD = [
    ("bench_dispatch", ["--tokens", "0"], "--tokens: expected an int >= 1, got 0"),
    ("bench_dispatch", ["--tokens", "-4"], "--tokens: expected an int >= 1, got -4"),
    ("bench_dispatch", ["--ranks", "0"], "--ranks: expected an int >= 1, got 0"),
    ("bench_dispatch", ["--warmup", "-1"], "--warmup: expected an int >= 0, got -1"),
    ("bench_dispatch", ["--ll-tokens", "-2"], "--ll-tokens: expected an int >= 0, got -2"),
    ("bench_dispatch", ["--topk", "9", "--experts", "8"], "--topk: expected at most --experts 8"),
    ("bench_dispatch", ["--experts", "10", "--transport", "peer"],
     "--experts: expected a multiple of --ranks 8, got 10"),
    ("bench_dispatch", ["--routings", "foo"], "--routings: unknown ['foo']"),
    ("bench_dispatch", ["--routings", ""], "--routings: expected at least one routing"),
    ("bench_dispatch", ["--fp8-modes", "foo"], "--fp8-modes: unknown ['foo']"),
    ("bench_dispatch", ["--hiddens", "abc"], "--hiddens: invalid"),
    ("bench_dispatch", ["--hiddens", "2048,0"], "--hiddens: expected an int >= 1, got 0"),
    ("bench_internode", ["--nodes", "3"], "--nodes: expected a divisor of --ranks 8, got 3"),
    ("bench_internode", ["--nodes", "0"], "--nodes: expected an int >= 1, got 0"),
    ("bench_moe", ["--tokens", "0"], "--tokens: expected an int >= 1, got 0"),
    ("bench_moe", ["--data", "0"], "--data: expected an int >= 1, got 0"),
    ("bench_moe", ["--experts", "10"], "--experts: expected a multiple of --expert-parallel 4"),
    ("bench_moe", ["--backends", "foo"], "--backends: 'foo': expected gshard or NAME"),
    ("bench_moe", ["--backends", "deepep@capped"], "--backends: 'deepep@capped': expected"),
    ("bench_moe", ["--backends", "gshard:tiled"], "--backends: 'gshard:tiled': expected"),
    ("bench_moe", ["--tile-rows", "x"], "--tile-rows: invalid"),
    ("bench_moe", ["--routers", "aux,nope"], "--routers: unknown ['nope']"),
    ("bench_moe", ["--parts", "hybridep"], "--parts: invalid choice: 'hybridep'"),
    # a negative factor ran: gshard kept 1 row an expert, deepep@cap dropped nothing; nan was
    # a traceback naming no flag
    ("bench_moe", ["--capacity-factor", "-1"], "--capacity-factor: expected a finite float > 0"),
    ("bench_moe", ["--capacity-factor", "nan"], "--capacity-factor: expected a finite float"),
    ("bench_moe", ["--buffer-factor", "0"], "--buffer-factor: expected a finite float > 0"),
    ("bench_moe", ["--backends", "", "--no-experts-only"],
     "--backends: expected at least one row"),
    ("bench_dispatch", ["--capacity-factor", "inf"], "--capacity-factor: expected a finite"),
    ("run", ["--only", "bench_transport,nosuch"], "--only: expected some of"),
    ("run", ["--only", ","], "--only: expected some of"),
]


@pytest.mark.parametrize("module, argv, message", BAD,
                         ids=[f"{m} {' '.join(a)}" for m, a, _ in BAD])
def test_bad_flags_are_usage_errors(benchmarks, capsys, module, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        benchmarks[module](argv)
    assert exit_info.value.code == 2  # argparse's usage error
    assert message in capsys.readouterr().err


def test_good_flags_parse_to_lists(benchmarks):
    a = benchmarks["bench_dispatch"](["--routings", "skewed", "--fp8-modes", "", "--hiddens",
                                      "7168, 2048", "--transport", "peer"])
    assert (a.routings, a.fp8_modes, a.hiddens) == (["skewed"], [], [7168, 2048])
    a = benchmarks["bench_moe"](["--backends", "hybridep@bounded,deepep@cap+pad:tiled,gshard",
                                 "--tile-rows", "32,128", "--routers", "aux"])
    assert a.backends == ["hybridep@bounded", "deepep@cap+pad:tiled", "gshard"]
    assert (a.tile_rows, a.routers) == ([32, 128], ["aux"])
    defaults = benchmarks["bench_moe"]([])
    assert "gshard" in defaults.backends and defaults.routers == []
    assert defaults.parts is None and benchmarks["bench_moe"](["--parts"]).parts == "deepep"
    assert benchmarks["bench_moe"](["--parts", "deepep@bounded"]).parts == "deepep@bounded"
    assert benchmarks["bench_internode"](["--nodes", "4"]).nodes == 4
