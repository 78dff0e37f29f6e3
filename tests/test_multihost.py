"""The training step across 2 processes x 4 CPU devices (jax.distributed + gloo on 127.0.0.1)
gives the same losses as one process with 8 devices, and a two-hop dispatch + combine with
each process one node gives bitwise the single-process results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_moe.py"
SMALL = ["--steps", "3", "--batch", "16", "--seq", "32", "--d-model", "32", "--ffn", "64",
         "--layers", "1", "--no-progress"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(out_dir):
    records = json.loads((Path(out_dir) / "train_moe.json").read_text())["records"]
    return [r["loss"] for r in records]


def _env():
    env = dict(os.environ)
    # The script sets its own device count; other flags (conftest's compile flags) stay.
    env["XLA_FLAGS"] = " ".join(flag for flag in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in flag)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_two_processes(command, timeout=600):
    """Runs command(process_id, coordinator) for process ids 0 and 1 at once; returns their
    logs (stdout + stderr), asserting both exit 0."""
    port = _free_port()
    procs = [subprocess.Popen(command(i, f"127.0.0.1:{port}"), env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        logs.append(out)
        assert p.returncode == 0, out[-3000:]
    return logs


@pytest.mark.slow
@pytest.mark.parametrize("backend, extra", [
    ("deepep", []),
    # each process one node of a ("node", "local") = (2, 4) expert axis: two-hop dispatch
    ("deepep", ["--nodes", "2", "--data-parallel", "1"]),
])
def test_two_processes_match_one(tmp_path, backend, extra):
    single = tmp_path / "single"
    subprocess.run([sys.executable, str(SCRIPT), *SMALL, *extra, "--backend", backend,
                    "--devices", "8", "--out", str(single)], check=True, env=_env(),
                   timeout=600)
    multi = tmp_path / "multi"
    logs = _run_two_processes(lambda i, coordinator: [
        sys.executable, str(SCRIPT), *SMALL, *extra, "--backend", backend,
        "--local-devices", "4", "--num-processes", "2", "--process-id", str(i),
        "--coordinator", coordinator, "--out", str(multi)])
    assert "2 process(es)" in logs[0]
    single_losses, multi_losses = _losses(single), _losses(multi)
    assert len(multi_losses) == 3
    for a, b in zip(single_losses, multi_losses):
        assert abs(a - b) <= 1e-5 * abs(a), (single_losses, multi_losses)
    if extra:
        assert "'node': 2, 'local': 4" in logs[0]
        crossed = [[(r["rows_across_nodes"], r["flat_rows_across_nodes"]) for r in json.loads(
            (Path(d) / "train_moe.json").read_text())["records"]] for d in (single, multi)]
        assert crossed[0] == crossed[1] and all(0 < a < b for a, b in crossed[0]), crossed


DISPATCH_SCRIPT = ROOT / "tests" / "multihost_dispatch.py"


@pytest.mark.slow
def test_two_hop_dispatch_combine_across_processes_match_one_process(tmp_path):
    """Two-hop dispatch + combine with each of 2 processes one node of a (2, 4) expert axis:
    every rank's received rows, ids, weights, counts and combined rows are bitwise those of
    the 8-device single-process run (tests/multihost_dispatch.py); the peer transport is
    refused by name in both processes."""

    single = tmp_path / "single.npz"
    subprocess.run([sys.executable, str(DISPATCH_SCRIPT), "--out", str(single)], check=True,
                   env=_env(), timeout=300)
    multi = tmp_path / "multi.npz"
    logs = _run_two_processes(lambda i, coordinator: [
        sys.executable, str(DISPATCH_SCRIPT), "--out", str(multi), "--num-processes", "2",
        "--process-id", str(i), "--coordinator", coordinator], timeout=300)
    # "peer" across processes: refused at trace time in both, naming what runs on XLA:CPU
    for log in logs:
        refusal = next(line for line in log.splitlines() if line.startswith("peer refused"))
        assert "inside one process only" in refusal and "use 'all_to_all'" in refusal
        assert "ragged" not in refusal, refusal
    a, b = np.load(single), np.load(multi)
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # Not a vacuous equality: rows moved, some crossed nodes, combine produced values.
    assert a["num_recv_tokens"].sum() > 0 and a["num_rdma_recv_tokens"].sum() > 0
    assert np.abs(a["combined"]).sum() > 0
    assert a["num_tokens_per_rdma_rank"].shape == (8, 2)
