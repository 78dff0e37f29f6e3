"""examples/train_moe.py's training loop: checkpoint and resume (orbax: 6 steps straight vs
3 + save + resume + 3 give bitwise-identical losses and state), gradient accumulation, the
presets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The small runs' training text: fixed here, so editing the example's docs changes no test.
CORPUS = (b"Mixture-of-experts layers route each token to a few experts; expert parallelism "
          b"places the experts on different devices and exchanges the tokens between them. "
          b"The router learns which expert suits a token, and a balancing loss keeps the "
          b"load even, so that no device waits for another. ") * 24
SMALL = ["--batch", "8", "--seq", "16", "--d-model", "16", "--layers", "1", "--heads", "2",
         "--experts", "8", "--ffn", "16", "--no-progress"]


@pytest.fixture
def train_moe(monkeypatch, tmp_path):
    """The example's module, on a small corpus (parsing the stdlib's takes seconds), with the
    environment variables its set-up writes restored afterwards. Its runs share a persistent
    compilation cache (a resumed run compiles the same program), restored afterwards too."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
    import train_moe
    monkeypatch.setattr(train_moe, "stdlib_corpus", lambda: CORPUS)
    cache = {"jax_compilation_cache_dir": str(tmp_path / "xla_cache"),
             "jax_persistent_cache_min_compile_time_secs": 0.0,
             "jax_persistent_cache_min_entry_size_bytes": 0}
    previous = {name: getattr(jax.config, name) for name in cache}
    for name, value in cache.items():
        jax.config.update(name, value)
    yield train_moe
    for name, value in previous.items():
        jax.config.update(name, value)


def _state(directory, step):
    """Every array of the checkpoint of `step` in `directory`, by path."""
    with ocp.CheckpointManager(directory, item_names=("state", "data")) as manager:
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    flat = jax.tree_util.tree_flatten_with_path(restored.state)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def test_resume_continues_bitwise(train_moe, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"

    def run(steps, directory, *extra):
        out = tmp_path / f"out_{directory.name}_{steps}"
        records = train_moe.train(train_moe.parse_args(
            SMALL + ["--steps", str(steps), "--checkpoint-dir", str(directory), "--out",
                     str(out), *extra]))
        return records, json.loads((out / "train_moe.json").read_text())["records"]

    records, _ = run(6, straight)
    first, _ = run(3, split)  # saves after its last step
    rest, logged = run(6, split, "--resume")
    assert sorted(int(p.name) for p in split.iterdir() if p.name.isdigit()) == [3, 6]
    assert [r["step"] for r in rest] == [r["step"] for r in logged] == [3, 4, 5]
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in records]  # bitwise
    assert [r["load"] for r in first + rest] == [r["load"] for r in records]
    want, got = _state(straight, 6), _state(split, 6)
    assert got.keys() == want.keys() and any("optimizer" in k for k in got)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    # The state moved: step 3's is not step 6's (the comparison above is not vacuous).
    assert any((_state(split, 3)[k] != want[k]).any() for k in want)


def test_resume_on_another_mesh_reshards_the_state(train_moe, tmp_path):
    """A checkpoint restores onto another mesh of the same devices, each array resharded as it
    loads (the expert axis 4 -> 8 -> 2 ranks: --data-parallel 2, 1, 4), and the run goes on
    as the straight one does, within fp32 rounding (the reductions' order follows the mesh)."""
    def run(steps, name, *extra):
        records = train_moe.train(train_moe.parse_args(
            SMALL + ["--steps", str(steps), "--out", str(tmp_path / name), *extra]))
        return [r["loss"] for r in records]

    straight = run(6, "straight")
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    resumed = (run(2, "a", *ck) + run(4, "b", *ck, "--resume", "--data-parallel", "1")
               + run(6, "c", *ck, "--resume", "--data-parallel", "4"))
    assert len(resumed) == 6
    np.testing.assert_allclose(resumed, straight, rtol=2e-5)


def test_checkpoint_flags_are_checked(train_moe, tmp_path, capsys):
    for argv in (["--resume"], ["--save-every", "2"],
                 ["--save-every", "-1", "--checkpoint-dir", str(tmp_path)]):
        with pytest.raises(SystemExit):
            train_moe.parse_args(argv)
        assert "--" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="--resume: no checkpoint in"):
        train_moe.train(train_moe.parse_args(
            SMALL + ["--steps", "1", "--checkpoint-dir", str(tmp_path / "empty"), "--resume"]))
    with pytest.raises(SystemExit, match="--resume: no checkpoint directory"):
        train_moe.train(train_moe.parse_args(
            SMALL + ["--steps", "1", "--checkpoint-dir", str(tmp_path / "none"), "--resume"]))
    assert not (tmp_path / "none").exists()


def test_bad_flags_end_in_a_usage_error_naming_them(train_moe, tmp_path, capsys):
    """Flags that trained silently (--lr nan / -1), hung at exit after a failed save (a file as
    --checkpoint-dir), lost the run at the end (--out) or ended in a traceback at trace time."""
    (tmp_path / "file").write_text("")
    cases = [(["--lr", "nan"], "--lr: expected a finite float > 0"),
             (["--lr", "-1"], "--lr: expected a finite float > 0"),
             (["--topk", "9"], "--topk: expected at most --experts 8"),
             (["--fp8-dispatch"], "--fp8-dispatch: needs --d-model"),
             (["--transport", "ragged"], "--transport ragged: XLA's ragged_all_to_all"),
             (["--transport", "peer", "--backend", "alltoall"], "--transport peer: --backend"),
             (["--num-processes", "0"], "--num-processes / --process-id"),
             (["--num-processes", "2", "--process-id", "2"], "--num-processes / --process-id"),
             (["--checkpoint-dir", str(tmp_path / "file")], "--checkpoint-dir: expected a dir"),
             (["--out", str(tmp_path / "file")], "--out: expected a directory")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            train_moe.parse_args(SMALL + argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv
    # the layers' refusals are one line too (only MoEConfig's were): an expert axis of 4
    with pytest.raises(SystemExit, match=r"^train_moe.py: num_moe_experts \(6\) must be"):
        train_moe.train(train_moe.parse_args(
            SMALL + ["--experts", "6", "--steps", "1", "--devices", "8"]))


def test_resume_refuses_another_model_and_a_fresh_run_a_used_directory(train_moe, tmp_path):
    """A checkpoint records the flags its model depends on: --resume with a different one is
    refused by name, before any array is read (a different ETP layout or GLU interleave has
    the same shapes and restored as scrambled weights; other flags failed deep in orbax). A
    run without --resume into a directory holding checkpoints is refused (orbax skipped every
    save up to the old latest step, silently), and so is --resume with --steps already done."""
    directory = str(tmp_path / "ck")

    def run(steps, *extra):
        return train_moe.train(train_moe.parse_args(
            SMALL + ["--steps", str(steps), "--checkpoint-dir", directory, "--out",
                     str(tmp_path / "out"), *extra]))
    run(2)
    for extra, message in (
            (["--etp", "2"], "saved with --etp 1; this run has --etp 2"),
            (["--glu-interleave-size", "4"],
             "saved with --glu-interleave-size None; this run has --glu-interleave-size 4"),
            (["--experts", "16", "--layers", "2"],
             "saved with --experts 8 --layers 1; this run has --experts 16 --layers 2")):
        with pytest.raises(SystemExit, match=message):
            run(3, "--resume", *extra)
    with pytest.raises(SystemExit, match="saved with --input-jitter-eps None; this run has "
                                         "--input-jitter-eps 0.01"):
        run(3, "--resume", "--input-jitter-eps", "0.01")
    with pytest.raises(SystemExit, match="holds an earlier run's checkpoints .up to step 2."):
        run(3)
    with pytest.raises(SystemExit, match="--steps 2: the checkpoint .* is at step 2 already"):
        run(2, "--resume")
    assert [r["step"] for r in run(3, "--resume", "--lr", "1e-3")] == [2]  # same model


def test_resume_refuses_other_state_arrays_and_reads_unrecorded_checkpoints(train_moe,
                                                                           tmp_path):
    """No flag names every state array: global_aux_loss keeps a tracker only while its weight
    is above 0, so a resume with --aux-loss-coeff 0 is refused by the recorded layout (it
    failed inside orbax). A checkpoint written before flags and layout were recorded is
    restored unchecked."""
    directory = tmp_path / "ck"

    def run(steps, *extra):
        return train_moe.train(train_moe.parse_args(
            SMALL + ["--steps", str(steps), "--checkpoint-dir", str(directory), "--out",
                     str(tmp_path / "out"), "--load-balancing", "global_aux_loss", *extra]))
    run(2)
    with pytest.raises(SystemExit, match="holds other state arrays than this run's model "
                                         r"\(\d+ differ: .*absent now"):
        run(3, "--resume", "--aux-loss-coeff", "0")
    # the JSON of a checkpoint from before: no model_flags, no state_layout
    def data_record(path):  # orbax's file for the JSON item (its name is orbax's choice)
        try:
            return "steps_done" in json.loads(path.read_text())
        except (UnicodeDecodeError, ValueError):
            return False
    data = next(p for p in (directory / "2").rglob("*") if p.is_file() and data_record(p))
    record = json.loads(data.read_text())
    del record["model_flags"], record["state_layout"]
    data.write_text(json.dumps(record))
    assert [r["step"] for r in run(3, "--resume")] == [2]


def test_preset_switches_turn_off_and_refused_combinations_are_named(train_moe, tmp_path):
    # A preset's on/off flags can be turned off; flags MoEConfig refuses together end the run
    # with its message (naming the field), as does a --data-parallel not dividing the devices.
    args = train_moe.parse_args(["--preset", "llama4-scout-tiny", "--topk", "2",
                                 "--no-apply-probs-on-input"])
    assert not args.apply_probs_on_input and args.topk == 2
    assert not train_moe.parse_args(["--preset", "deepseek-v3-tiny", "--no-expert-bias"]
                                    ).expert_bias
    out = ["--steps", "1", "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="moe_router_enable_expert_bias"):
        train_moe.train(train_moe.parse_args(SMALL + out + ["--expert-bias"]))
    with pytest.raises(SystemExit, match="--data-parallel 3 does not divide the 8 devices"):
        train_moe.train(train_moe.parse_args(SMALL + out + ["--data-parallel", "3"]))


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "--batch: expected an int >= 1, got 0"),
    (["--seq", "0"], "--seq: expected an int >= 1, got 0"),
    (["--steps", "-1"], "--steps: expected an int >= 1, got -1"),
    (["--devices", "0"], "--devices: expected an int >= 1, got 0"),
    (["--local-devices", "0"], "--local-devices: expected an int >= 1, got 0"),
    (["--heads", "3"], "--heads: expected a divisor of --d-model 64, got 3"),
    (["--data-parallel", "0"], "--data-parallel: expected an int >= 1, got 0"),
    (["--nodes", "-1"], "--nodes: expected an int >= 0 (0: one node), got -1")])
def test_size_flags_are_checked(train_moe, capsys, argv, message):
    with pytest.raises(SystemExit):
        train_moe.parse_args(argv)
    assert message in capsys.readouterr().err


def test_checkpoints_keep_non_trainable_state_rng_and_shardings(train_moe, tmp_path):
    """Checkpoints saves all nnx state, not only nnx.Param: a non-trainable variable (as an
    expert bias is), an nnx.Rngs key and the sampler's RNG come back, on their shardings."""
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_ep.flax import shard_state

    class Tiny(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.arange(8.0).reshape(4, 2), eager_sharding=False,
                               out_sharding=("expert", None))
            self.bias = nnx.Variable(jnp.full((4,), 0.5))
            self.rngs = nnx.Rngs(dropout=7)

    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    model = Tiny()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    shard_state(model, optimizer, mesh)
    rng = np.random.default_rng(5)
    rng.integers(0, 10, 3)
    saved = {k: np.asarray(jax.random.key_data(v[...]) if k[-1] == "key" else v[...])
             for k, v in nnx.to_flat_state(nnx.state(model))}
    ckpt = train_moe.Checkpoints(tmp_path / "ck")
    ckpt.save(4, model, optimizer, rng)
    ckpt.close()
    want_draw = rng.integers(0, 1 << 30, 4)
    model.bias[...] = model.bias[...] * 0 - 1
    model.w[...] = model.w[...] + 1
    model.rngs.dropout()  # advances the key's count
    optimizer.step[...] = optimizer.step[...] + 3
    fresh = np.random.default_rng(0)
    assert train_moe.Checkpoints(tmp_path / "ck", resume=True).restore(model, optimizer,
                                                                       fresh) == 4
    for k, v in nnx.to_flat_state(nnx.state(model)):
        got = np.asarray(jax.random.key_data(v[...]) if k[-1] == "key" else v[...])
        np.testing.assert_array_equal(got, saved[k], err_msg=str(k))
    assert int(optimizer.step[...]) == 0
    np.testing.assert_array_equal(fresh.integers(0, 1 << 30, 4), want_draw)
    assert model.w[...].sharding == NamedSharding(mesh, P("expert", None))


def _losses(train_moe, tmp_path, name, *extra):
    records = train_moe.train(train_moe.parse_args(
        SMALL + ["--steps", "3", "--out", str(tmp_path / name), *extra]))
    return [r["loss"] for r in records]


def test_grad_accum_gives_the_big_batch_losses(train_moe, tmp_path):
    # Dropless routing, token-mean losses only (cross-entropy and the z-loss): 4 micro-batches
    # of 8 sequences make the same steps as one batch of 32, within fp32 rounding.
    common = ["--batch", "32", "--load-balancing", "none", "--z-loss-coeff", "1e-3"]
    big = _losses(train_moe, tmp_path, "big", *common)
    accumulated = _losses(train_moe, tmp_path, "accum", *common, "--grad-accum", "4")
    np.testing.assert_allclose(accumulated, big, rtol=3e-6)
    assert big[0] != big[-1]  # the steps moved the model
    with pytest.raises(SystemExit):
        train_moe.parse_args(SMALL + ["--batch", "32", "--grad-accum", "3"])


def test_pad_to_capacity_trains_as_the_capacity_drop_does(train_moe, tmp_path):
    # Drop-and-pad (the experts one batched GEMM over equal blocks) changes no value: the same
    # losses and drops as dropping at that capacity without padding; factor 0.5 drops slots.
    def run(name, *extra):
        return [(r["loss"], r["dropped"]) for r in train_moe.train(train_moe.parse_args(
            SMALL + ["--steps", "3", "--capacity-factor", "0.5", "--out", str(tmp_path / name),
                     *extra]))]
    plain, padded = run("plain"), run("padded", "--pad-to-capacity")
    np.testing.assert_allclose([p[0] for p in padded], [p[0] for p in plain], rtol=1e-5)
    assert [p[1] for p in padded] == [p[1] for p in plain] and all(p[1] > 0 for p in plain)
    with pytest.raises(SystemExit):
        train_moe.parse_args(SMALL + ["--pad-to-capacity"])


def test_dropless_buffer_factor_trains_as_the_worst_case_buffers(train_moe, tmp_path):
    # Bounded buffers where the routing fits them, the chunked fallback where it does not: the
    # same losses and nothing dropped either way. T = 16 tokens per device, K = 2, P = 4: at
    # factor 1 the permuted buffer holds exactly the balanced 32 slots per rank, which this
    # router's imbalance overflows in every step; factor 3's 96 (the worst case: 128) fit.
    def run(name, *extra):
        return train_moe.train(train_moe.parse_args(
            SMALL + ["--steps", "3", "--out", str(tmp_path / name), *extra]))
    plain = [r["loss"] for r in run("plain")]
    for factor, fell_back in (("1.0", 1), ("3.0", 0)):
        records = run(factor, "--dropless-buffer-factor", factor)
        np.testing.assert_allclose([r["loss"] for r in records], plain, rtol=1e-5)
        assert all(r["dropped"] == 0 for r in records)
        assert [r["fell_back_per_layer"] for r in records] == [[fell_back]] * 3
    with pytest.raises(SystemExit):
        train_moe.parse_args(SMALL + ["--dropless-buffer-factor", "1.5", "--capacity-factor",
                                      "1.0"])


def test_grad_accum_resets_the_global_aux_loss_tracker_each_step(train_moe, tmp_path):
    records = train_moe.train(train_moe.parse_args(
        SMALL + ["--batch", "16", "--steps", "2", "--grad-accum", "2", "--load-balancing",
                 "global_aux_loss", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out",
                 str(tmp_path / "out")]))
    state = _state(tmp_path / "ckpt", 2)
    steps = [k for k in state if "ga_steps" in k]
    tracked = [k for k in state if "global_tokens_per_expert" in k]
    assert len(steps) == len(tracked) == 1  # one MoE layer
    assert float(state[steps[0]]) == 0 and not state[tracked[0]].any()
    assert all(r["balance_loss"][0] > 0 for r in records)


def test_presets_set_the_recipes_routing_and_flags_override_them(train_moe, tmp_path):
    args = train_moe.parse_args(["--preset", "deepseek-v3-tiny", "--steps", "7"])
    assert (args.experts, args.topk, args.router_num_groups, args.router_group_topk,
            args.score_function, args.expert_bias, args.topk_scaling_factor, args.nodes,
            args.devices, args.data_parallel, args.steps) == (
        256, 8, 8, 4, "sigmoid", True, 2.5, 8, 16, 1, 7)
    qwen = train_moe.parse_args(["--preset", "qwen3-moe-tiny"])
    assert (qwen.experts, qwen.topk, qwen.shared_ffn, qwen.load_balancing) == (
        128, 8, 0, "global_aux_loss")
    oss = train_moe.parse_args(["--preset", "gpt-oss-tiny", "--activation-clamp", "5"])
    assert (oss.experts, oss.topk, oss.shared_ffn, oss.activation, oss.glu_linear_offset,
            oss.activation_clamp) == (32, 4, 0, "quick_gelu", 1.0, 5.0)

    def run(*flags):
        return train_moe.train(train_moe.parse_args(
            ["--preset", "deepseek-v3-tiny", "--steps", "2", "--batch", "16", "--seq", "16",
             "--layers", "1", "--devices", "8", "--no-progress", "--out", str(tmp_path / "ds"),
             *flags]))[-1]
    # This session's 8 devices: the preset's 8 nodes of one device each. One group per node,
    # 4 groups per token: at most 4 nodes per token (DeepSeek-V3's node limit), 3.5 on average
    # here against 4.6 with every group eligible (--router-group-topk 8, checked once).
    last = run()
    assert len(last["load"][0]) == 256 and sum(last["load"][0]) == 16 * 16 * 8
    assert np.isfinite(last["loss"])
    assert last["rows_across_nodes"] == last["flat_rows_across_nodes"] <= 16 * 16 * 4
    # 4 nodes of 2 devices: the two-hop dispatch sends one row per (token, other node)
    last = run("--nodes", "4")
    assert last["rows_across_nodes"] < last["flat_rows_across_nodes"]
