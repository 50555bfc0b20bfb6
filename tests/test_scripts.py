"""The benchmark scripts run end to end at a tiny size and report what they promise (no timing assertions)."""

import importlib.util
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_iteration_reports_every_algorithm_side_by_side(tmp_path):
    bench = load_script("bench_iteration")
    out = tmp_path / "bench.json"
    report = bench.main([
        "--model", "tiny_sd3", "--reward", "jpeg_compressibility",
        "--iterations", "1", "--warmup", "0", "--algorithms", "flow_grpo,mix_grpo,flash_grpo,flash_grpo_fast,mix_grpo_late,slas,cgpo,flow_opd",
        "--threads", "1",
        "--out", str(out), "--set", "sampler.num_steps=4", "--set", "mix_grpo:algo.window.size=2",
        "--set", "mix_grpo:algo.window.start=1", "--set", "trainer.prompts_per_iteration=2", "--set", "trainer.group_size=2",
        "--set", "trainer.train_batch_size=4", "--set", "trainer.gradient_accumulation_steps=1",
    ])
    assert out.is_file()
    algos = report["algorithms"]
    assert set(algos) == {"flow_grpo", "mix_grpo", "flash_grpo", "flash_grpo_fast", "mix_grpo_late", "slas", "cgpo",
                          "flow_opd"}
    # window frozen at start T − w = 2 of 4: the 2-step prefix and the window's first velocity run once per prompt
    # (2 prompts) instead of per sample
    assert algos["mix_grpo_late"]["rollout_nfe"] == 2 * (2 + 1) + 4 * 1
    assert algos["mix_grpo_late"]["prefix_reuse_nfe_saving"] == 1 - 10 / 16 and algos["flow_grpo"]["prefix_reuse_nfe_saving"] == 0
    assert report["ratios"]["flow_grpo"] == 1.0
    for name, row in algos.items():
        assert row["seconds_per_iteration"] > 0 and set(row["phases"]) >= {"rollout", "update"}
        assert 0 <= row["outside_transformer_and_reward"] < 1 and row["decode_seconds"] > 0
        assert row["overhead_excluding_decode"] < row["outside_transformer_and_reward"]
        assert (row["backward_seconds"] > 0) == (row["trained_transitions"] > 0)
    # NFE bookkeeping: Flow-GRPO 4 rows × 4 steps; MixGRPO with shared noise runs its 1-step prefix and the
    # window's first velocity once per prompt
    assert algos["flow_grpo"]["rollout_nfe"] == 16
    assert algos["mix_grpo"]["rollout_nfe"] == 2 * (1 + 1) + 4 * 2
    # trained transitions: every step vs the window vs one step per sample
    assert [algos[k]["trained_transitions"] for k in ("flow_grpo", "mix_grpo", "flash_grpo")] == [16, 8, 4]
    # Flash-GRPO's cheaper rollout: per group the k_p prefix steps and the velocity at k_p once, then a 1-step tail
    # per member (k_p in {0, 1} of 4 steps: 3 or 4 per group instead of 8), the same single trained transition
    assert algos["flash_grpo"]["rollout_nfe"] == 16 and 6 <= algos["flash_grpo_fast"]["rollout_nfe"] <= 8
    assert algos["flash_grpo_fast"]["trained_transitions"] == 4
    assert report["pipeline"]["nfe"] == 4 and report["pipeline"]["rollout_over_pipeline"] > 0
    # SLAS (advantages) and CGPO (which prompts) leave MixGRPO's rollout and update as they are
    for name in ("slas", "cgpo"):
        assert (algos[name]["rollout_nfe"], algos[name]["trained_transitions"]) == (12, 8)
        assert algos[name]["algorithm"].startswith("mix_grpo")
    assert "SLAS, gamma=0.5" in algos["slas"]["algorithm"] and "SLAS" not in algos["cgpo"]["algorithm"]
    # Flow-OPD distils two teachers the row makes itself: Flow-GRPO's rollout, int(4 · 0.9) = 3 trained steps per row
    assert algos["flow_opd"]["rollout_nfe"] == 16 and algos["flow_opd"]["trained_transitions"] == 12
    assert algos["flow_opd"]["transformer_calls"] > algos["flow_grpo"]["transformer_calls"] * 12 / 16



def test_gpu_check_replays_the_iteration_calls_for_its_floor(tmp_path):
    check = load_script("gpu_check")
    report = check.main(["--tiny", "--models", "sd35_medium", "--algorithms", "flow_grpo,flash_grpo",
                         "--iterations", "1", "--warmup", "0", "--out", str(tmp_path / "gpu.json")])
    rows = report["models"]["sd35_medium"]
    # tiny preset: 2 prompts × 2 = 4 rows in one micro-batch, 4 steps. Flow-GRPO: 4 rollout forwards, 4 trained
    # steps (forward+backward) each with one reference forward for its KL term (algo=grpo has kl_beta > 0).
    assert (rows["flow_grpo"]["velocity_calls_forward"], rows["flow_grpo"]["velocity_calls_forward_backward"]) == (8, 4)
    # Flash-GRPO: one trained step per sample, all 4 samples in one micro-batch → a single forward+backward.
    assert rows["flash_grpo"]["velocity_calls_forward_backward"] == 1
    for row in rows.values():
        assert row["floor_seconds"] > 0 and row["iteration_over_floor"] > 0
        # the plan of the same configuration beside it (no GPU here: nothing measured to divide by)
        assert row["plan_peak_gib"] > 0 and row["plan_tflop_per_iteration"] > 0 and row["achieved_tflops"] > 0
        assert set(row["plan_phases_gib"]) == {"rollout", "update"} and "measured_over_plan" not in row
    # Flash-GRPO trains one step of four: its planned update costs less than Flow-GRPO's
    assert rows["flash_grpo"]["plan_tflop_per_iteration"] < rows["flow_grpo"]["plan_tflop_per_iteration"]
    assert rows["flow_grpo"]["ratio_to_flow_grpo"] == 1.0 and (tmp_path / "gpu.json").is_file()


def test_gpu_check_reports_a_row_that_ran_out_of_memory_and_goes_on(tmp_path, monkeypatch):
    """A row that runs out of GPU memory is a result (that configuration does not fit): it says so, the rows after it
    run, the report is written, and the script exits non-zero naming the row."""
    check = load_script("gpu_check")
    measured = []

    def measure(cfg, out_dir, stream, iterations, warmup):
        measured.append(cfg.algo.name)
        if cfg.algo.name == "flash_grpo":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail")
        return 2.0, {"floor_seconds": 1.0, "iteration_over_floor": 2.0}, cfg.algo.name

    monkeypatch.setattr(check, "measure", measure)
    out = tmp_path / "gpu.json"
    with pytest.raises(SystemExit, match="out of GPU memory: sd35_medium flash_grpo"):
        check.main(["--tiny", "--no-plan", "--models", "sd35_medium", "--algorithms", "flash_grpo,flow_grpo,mix_grpo",
                    "--out", str(out)])
    assert measured == ["flash_grpo", "grpo", "mix_grpo"]
    rows = json.loads(out.read_text())["models"]["sd35_medium"]
    assert rows["flash_grpo"]["error"] == "out of memory: CUDA out of memory. Tried to allocate 20.00 GiB"
    assert rows["flash_grpo"]["seconds_per_iteration"] is None and "ratio_to_flow_grpo" not in rows["flash_grpo"]
    assert rows["mix_grpo"]["ratio_to_flow_grpo"] == 1.0 and "error" not in rows["flow_grpo"]


@pytest.mark.slow  # most of a minute on 2 cores: pytest -m slow
@pytest.mark.usefixtures("one_thread")  # tests/conftest.py
def test_gpu_check_measures_the_streaming_model_with_its_own_algorithms(tmp_path):
    check = load_script("gpu_check")
    # each model has its own algorithms; a name another model trains with is refused before anything runs
    assert check.chosen("sd35_medium,self_forcing_wan", None) == {
        "sd35_medium": list(check.ALGORITHMS), "self_forcing_wan": ["stream_grpo", "stream_awm", "kvpo"]}
    with pytest.raises(SystemExit, match=r"--algorithms: flow_grpo cannot train self_forcing_wan \(a streaming "
                                         r"model\); its algorithms are stream_grpo, stream_awm, kvpo"):
        check.main(["--tiny", "--models", "self_forcing_wan", "--algorithms", "stream_grpo,flow_grpo"])
    with pytest.raises(SystemExit, match=r"--algorithms: kvpo cannot train sd35_medium \(a model\)"):
        check.main(["--tiny", "--models", "sd35_medium,self_forcing_wan", "--algorithms", "kvpo"])
    report = check.main(["--tiny", "--models", "self_forcing_wan", "--algorithms", "stream_grpo", "--iterations", "1",
                         "--warmup", "0", "--out", str(tmp_path / "gpu.json")])
    row = report["models"]["self_forcing_wan"]["stream_grpo"]
    assert row["seconds_per_iteration"] > 0 and row["algorithm"].startswith("stream_grpo (streaming GRPO)")
    # no floor, and the note says why (a replay of batch sizes would not reproduce the cached calls)
    assert row["floor_seconds"] is None and row["iteration_over_floor"] is None and "no floor" in row["floor_note"]
    # 1 prompt × 2 streams of 9 blocks rolled out together: 9 × 4 steps, each finished block but the last written
    # into the cache. The update trains 2 re-noise transitions per stream (0.1 of 9 × 3, rounded down): each of the 2
    # takes one call per block it falls in across the 2 streams (blocks attend different caches), so 2 to 4 calls.
    # No teacher-forced forward: that is streaming AWM's update.
    assert (row["velocity_calls_forward"], row["commit_calls"]) == (9 * 4, 8)
    assert 2 <= row["velocity_calls_forward_backward"] <= 2 * 2 and "2 transitions per stream" in row["algorithm"]
    assert row["teacher_forced_calls_forward"] == row["teacher_forced_calls_forward_backward"] == 0
    # the plan of the same configuration beside it (its streams read from the prompt file the row wrote)
    assert row["plan_peak_gib"] > 0 and row["plan_tflop_per_iteration"] > 0 and row["achieved_tflops"] > 0
    assert set(row["plan_phases_gib"]) == {"rollout", "update"} and row["plan_peak_phase"] in row["plan_phases_gib"]
    assert row["ratio_to_stream_grpo"] == 1.0 and json.loads((tmp_path / "gpu.json").read_text()) == report


def test_bench_time_to_reward_writes_curves_per_seed(tmp_path, monkeypatch):
    bench = load_script("bench_time_to_reward")
    out = tmp_path / "ttr.json"
    # a target the baseline already meets (every run stops at its first evaluation) and one it cannot reach
    first = [
        "--model", "tiny_sd3", "--reward", "jpeg_compressibility", "--metric", "eval/reward", "--target", "-100",
        "--seeds", "0,1", "--algorithms", "mix_grpo", "--max-iterations", "1", "--out", str(out), "--threads", "1",
        "--set", "trainer.eval_num_prompts=2", "--set", "trainer.eval_samples_per_tag=null", "--set", "sampler.num_steps=3", "--set", "sampler.eval_num_steps=3",
        "--set", "mix_grpo:algo.window.size=1", "--set", "trainer.prompts_per_iteration=2", "--set", "trainer.group_size=2",
        "--set", "trainer.train_batch_size=4", "--set", "trainer.gradient_accumulation_steps=1",
    ]
    report = bench.main(first)
    row = report["algorithms"]["mix_grpo"]
    assert row["reached"] == "2/2" and row["median_iterations"] == 0
    # an override scoped to one algorithm is recorded with that algorithm's row, the others for the whole report
    assert row["overrides"] == ["algo.window.size=1"] and "mix_grpo:algo.window.size=1" not in report["overrides"]
    assert "sampler.num_steps=3" in report["overrides"]
    assert out.is_file() and out.with_suffix(".png").is_file()
    # the seeds start from the same held-out value (computed once: fixed evaluation seeds, the same weights)
    assert sorted(r["seed"] for r in row["runs"]) == [0, 1]
    assert row["runs"][0]["curve"][0]["value"] == row["runs"][1]["curve"][0]["value"]
    (start,) = report["starting_values"].values()
    assert start == {"value": row["runs"][0]["curve"][0]["value"], "algorithms": ["mix_grpo"]}
    # --merge with the same settings resumes a benchmark stopped part-way: the finished seed is kept, the other runs
    data = json.loads(out.read_text())
    data["algorithms"]["mix_grpo"]["runs"] = [r for r in row["runs"] if r["seed"] == 0]
    out.write_text(json.dumps(data))
    made = []
    monkeypatch.setattr(bench, "run", lambda name, seed, *a: made.append((name, seed, a[-1])) or {
        "seed": seed, "reached": True, "iterations": 0, "seconds": 0.0, "curve": [{"iteration": 0, "seconds": 0.0, "value": 0.0}]})
    from flowgrpo.trainer import Trainer

    # the starting value is kept in the report: a resumed benchmark does not evaluate the untrained model again
    monkeypatch.setattr(Trainer, "evaluate", lambda self, *a, **k: pytest.fail("evaluated the untrained model again"))
    resumed = bench.main([*first, "--merge"])["algorithms"]["mix_grpo"]
    assert made == [("mix_grpo", 1, start["value"])] and resumed["reached"] == "2/2"
    assert [r["seed"] for r in resumed["runs"]] == [0, 1] and resumed["runs"][0] == data["algorithms"]["mix_grpo"]["runs"][0]
    monkeypatch.undo()
    report = bench.main([
        "--model", "tiny_sd3", "--reward", "jpeg_compressibility", "--metric", "eval/reward", "--target", "100",
        "--seeds", "0", "--algorithms", "flash_grpo", "--max-iterations", "1", "--out", str(out), "--threads", "1",
        "--set", "trainer.eval_num_prompts=2", "--set", "trainer.eval_samples_per_tag=null", "--set", "sampler.num_steps=3", "--set", "sampler.eval_num_steps=3", "--set", "mix_grpo:algo.window.size=1",
        "--set", "trainer.prompts_per_iteration=2", "--set", "trainer.group_size=2",
        "--set", "trainer.train_batch_size=4", "--set", "trainer.gradient_accumulation_steps=1",
    ])
    run = report["algorithms"]["flash_grpo"]["runs"][0]
    assert not run["reached"] and [p["iteration"] for p in run["curve"]] == [0, 1] and run["seconds"] > 0
    assert report["ratios"] == {} and "mix_grpo_late" not in bench.TRAINING
    # merging a measurement made with another override for every row is refused before any run, naming the override
    with pytest.raises(SystemExit, match=r"sampler\.num_steps=4"):
        bench.main(["--model", "tiny_sd3", "--reward", "jpeg_compressibility", "--metric", "eval/reward", "--target",
                    "100", "--seeds", "0", "--algorithms", "mix_grpo", "--max-iterations", "1", "--out", str(out),
                    "--threads", "1", "--merge", "--set", "sampler.num_steps=4"])
    # on the embedded world the iteration bench's Flow-GRPO trains every step (the papers' cost, the ratios'
    # denominator); time to reward runs Flow-GRPO's embedded recipe (the noisiest 3 of 10: experiment=flow_grpo_shapes)
    assert bench.compose(bench.ALGORITHMS["flow_grpo"]).algo.timestep_fraction == 1.0
    assert bench.compose(bench.RECIPES["flow_grpo"]).algo.timestep_fraction == 0.3
    guard = bench.compose(bench.RECIPES["grpo_guard"]).algo  # experiment=grpo_guard_shapes's algorithm
    assert (guard.name, guard.timestep_fraction, guard.timestep_selection) == ("grpo_guard", 0.3, "first")
    opd = bench.compose(bench.RECIPES["flow_opd"]).algo  # experiment=flow_opd_shapes's update
    assert (opd.name, opd.timestep_fraction, opd.timestep_selection) == ("flow_opd", 0.3, "first")
    assert list(bench.compose(bench.RECIPES["pref_grpo"]).algo.judge) == ["strict", "partial"]
    # Flow-OPD distils teacher runs the benchmark does not train: not a default row, and without teachers it stops
    # before any run, naming the flag
    assert "flow_opd" in bench.RECIPES and "flow_opd" not in bench.TRAINING and {"slas", "cgpo"} <= set(bench.TRAINING)
    with pytest.raises(SystemExit, match=r"flow_opd:\+algo\.teachers\.NAME=RUN_DIR"):
        bench.main(["--algorithms", "flow_opd", "--out", str(tmp_path / "opd.json")])
    assert not (tmp_path / "opd.json").exists()

    def row(reached, seconds):
        return bench.summarise([{"reached": r, "seconds": seconds, "iterations": 5} for r in reached], 3)

    rows = {"flow_grpo": row([True] * 3, 200.0), "mix_grpo": row([True] * 3, 50.0),
            "flash_grpo": row([True, True, False], 40.0), "dance_grpo": row([True, True], 30.0)}  # fmt: skip
    # a partly reached row and one with a seed still running have no ratio
    assert bench.ratios(rows, 3) == {"flow_grpo": 1.0, "mix_grpo": 0.25}
    with pytest.raises(SystemExit, match="--algorithms: unknown \\['grpo'\\]"):
        bench.main(["--algorithms", "grpo", "--out", str(out)])


def test_bench_multireward_trains_each_aggregator_on_the_same_budget(tmp_path):
    bench = load_script("bench_multireward")
    out = tmp_path / "mr.json"
    report = bench.main([
        "--model", "tiny_sd3", "--iterations", "2", "--eval-every", "1", "--seeds", "0,1", "--eval-num-prompts", "2",
        "--threads", "1", "--out", str(out), "--set", "sampler.num_steps=4", "--set", "sampler.eval_num_steps=2",
        "--set", "trainer.prompts_per_iteration=2", "--set", "trainer.group_size=2",
        "--set", "trainer.train_batch_size=4", "--set", "trainer.gradient_accumulation_steps=1",
        "--set", "trainer.eval_samples_per_prompt=1", "--set", "trainer.eval_samples_per_tag=null",
    ])
    assert out.is_file() and out.with_suffix(".png").is_file()
    assert set(report["summary"]) == {"sum", "taros"} and len(report["runs"]) == 4
    for run in report["runs"]:
        assert [p["iteration"] for p in run["curve"]] == [0, 1, 2] and len(run["train"]) == 2
        assert run["curve"][0]["jpeg"] < 0  # −kB
        assert 0 <= run["train"][0]["jpeg_compressibility/zero_std_group_fraction"] <= 1
    assert report["weights"] == {"geneval": 1.0, "jpeg_compressibility": 0.1}
    sat = report["summary"]["sum"]["saturation"]
    assert set(sat) == {f"{t}/{s}" for t in ("geneval", "jpeg_compressibility")
                        for s in ("zero_std_group_fraction", "group_std_mean")}
    assert sat["jpeg_compressibility/group_std_mean"]["last_quarter"]["mean"] > 0  # file sizes always differ a little
    with pytest.raises(SystemExit, match="--weight 'clip=1': expected TERM=W with TERM one of"):
        bench.main(["--weight", "clip=1", "--out", str(out)])
    # fixed evaluation seeds: both aggregators start from the same held-out numbers for a given seed
    by = {(r["aggregator"], r["seed"]): r for r in report["runs"]}
    assert by[("sum", 1)]["curve"][0] == by[("taros", 1)]["curve"][0]
    row = report["summary"]["taros"]["geneval"]
    assert row["change"]["mean"] == round(row["after"]["mean"] - row["before"]["mean"], 4) or \
        abs(row["change"]["mean"] - (row["after"]["mean"] - row["before"]["mean"])) < 1e-3


@pytest.mark.usefixtures("one_thread")
def test_bench_multireward_video_composite_reports_each_terms_saturation(tmp_path):
    """``--composite video`` on the random Wan twin at the world's size: video GenEval + consistency + sharpness."""
    bench = load_script("bench_multireward")
    report = bench.main([
        "--composite", "video", "--model", "tiny_wan", "--iterations", "1", "--eval-every", "1", "--seeds", "0",
        "--eval-num-prompts", "2", "--threads", "1", "--out", str(tmp_path / "v.json"), "--weight", "video_sharpness=0.25",
        "--set", "model.height=64", "--set", "model.width=64", "--set", "model.num_frames=13",
        "--set", "sampler.num_steps=2", "--set", "sampler.eval_num_steps=2", "--set", "trainer.prompts_per_iteration=1",
        "--set", "trainer.group_size=2", "--set", "trainer.train_batch_size=2",
        "--set", "trainer.gradient_accumulation_steps=1", "--set", "trainer.eval_samples_per_tag=null",
    ])
    assert report["weights"] == {"video_geneval": 1.0, "video_consistency": 0.5, "video_sharpness": 0.25}
    assert "reward=video_composite" in report["overrides"] and (tmp_path / "v.png").is_file()
    for run in report["runs"]:
        first = run["curve"][0]
        assert set(first) == {"iteration", "geneval", "geneval_partial", "still_strict", "consistency", "sharpness"}
        assert 0 <= first["consistency"] <= 1 and 0 <= first["sharpness"] <= 1
        assert first["still_strict"] is None  # the two held-out prompts hold no static one
        assert set(run["train"][0]) >= {f"{t}/group_std_mean" for t in ("video_geneval", "video_consistency", "video_sharpness")}
    assert set(report["summary"]) == {"sum", "taros"}


def test_gradient_snr_compares_independent_policy_gradients(tmp_path):
    snr = load_script("gradient_snr")
    overrides = ["model=tiny_sd3", "reward=jpeg_compressibility", "sampler.num_steps=4", "algo.window.size=2",
                 "trainer.prompts_per_iteration=2", "trainer.group_size=2", "trainer.train_batch_size=4",
                 "trainer.gradient_accumulation_steps=1"]
    report = snr.main(["--batches", "3", "--threads", "1", "--out", str(tmp_path / "snr.json"),
                       *[a for o in overrides for a in ("--set", o)]])
    assert (tmp_path / "snr.json").is_file() and report["rollouts_per_batch"] == 4 and report["trained_steps"] == 2
    assert report["standard_error"] >= 0
    assert -1 <= report["min_pairwise_cosine"] <= report["mean_pairwise_cosine"] <= report["max_pairwise_cosine"] < 1
    assert all(n > 0 for n in report["gradient_norms"])
    # the estimate is a deterministic function of the noise streams: the same noise gives the same gradient
    trainer, _scratch = snr.scratch_trainer(overrides, "gradient-snr-test-")
    assert torch.equal(snr.policy_gradient(trainer, 7), snr.policy_gradient(trainer, 7))


def test_probe_update_compares_an_update_with_its_negation_on_the_same_noise(tmp_path):
    """lr 0 after lr 1e-3, on two batches: every change at lr 0 is exactly 0, which holds only if each probe and
    each batch's own rollout start from the untrained weights and optimizer; at lr 1e-3 the weights move."""
    probe = load_script("probe_update")
    overrides = ["model=tiny_sd3", "reward=jpeg_compressibility", "sampler.num_steps=4", "algo.window.size=2",
                 "trainer.prompts_per_iteration=2", "trainer.group_size=2", "trainer.train_batch_size=4",
                 "trainer.gradient_accumulation_steps=1"]
    report = probe.main(["--lrs", "1e-3", "0", "--batches", "2", "--fresh", "--other", "--threads", "1",
                         "--out", str(tmp_path / "probe.json"), *[a for o in overrides for a in ("--set", o)]])
    assert json.loads((tmp_path / "probe.json").read_text()) == report
    assert len(report["probes"]) == 2 * 2 * 2 and report["rollouts_per_batch"] == 4
    assert [r["batch"] for r in report["rolled"]] == [0, 1]
    for r in report["rolled"]:  # groups of 2: std = |a - b| / sqrt(2), > 0 unless the pair ties
        assert r["group_std"] >= 0 and 0 <= r["tied_groups"] <= 1 and (r["group_std"] > 0) == (r["tied_groups"] < 1)
        assert r["reward"] == pytest.approx(report["probes"][0]["same/all/before"] if r["batch"] == 0 else
                                            report["probes"][-1]["same/all/before"], abs=1e-4)
    for p in report["probes"]:
        if p["lr"] == 0:
            assert p["weight_change_norm"] == 0 and p["same/all/change"] == 0 and p["fresh/all/change"] == 0
            assert p["other/all/change"] == 0
        else:
            assert p["weight_change_norm"] > 0 and "train/loss" in p["train"]
    zero = report["summary"]["0"]["same/all"]
    assert zero["signal"]["mean"] == 0 and zero["sign_independent"]["mean"] == 0
    assert zero["with_advantages"]["n"] == 4 and len(report["probes"][0]["same/all/group_changes"]) == 2  # 2 groups × 2 batches
    assert set(report["summary"]["0.001"]) == {f"{kind}/{name}" for kind in ("same", "fresh", "other")
                                               for name in ("all", "component:jpeg_kb")}
    # the other batch's prompts are not the probed batch's
    assert report["probes"][0]["other/all/before"] != report["probes"][0]["same/all/before"]
    assert report["summary"]["0"]["same/component:jpeg_kb"]["sign_independent"]["mean"] == 0
    moved = report["summary"]["0.001"]["same/component:jpeg_kb"]["with_advantages"]
    assert moved["n"] == 4 and moved["mean"] != 0  # the compressed size moves with the weights
    # a component a prompt does not define (NaN on its rows, as video GenEval's per-tag parts) is left out, per row and
    # per group, rather than poisoning the statistics
    nan = float("nan")
    assert probe.group_means(torch.tensor([1.0, nan, nan, nan, 2.0, 4.0]), torch.ones(6, dtype=torch.bool), 2) == [
        1.0, pytest.approx(nan, nan_ok=True), 3.0]
    changes = {(1.0, 1, "component:c", "same"): [1.0, nan, 3.0], (1.0, -1, "component:c", "same"): [0.0, nan, 1.0],
               (1.0, 1, "component:none", "same"): [nan], (1.0, -1, "component:none", "same"): [nan]}
    row = probe.summarise(changes, [1.0], {}, False)["1"]
    assert set(row) == {"same/component:c"} and row["same/component:c"]["signal"] == {"mean": 1.5, "se": 0.5, "n": 2}
    # advantages an algorithm keeps in the batch's extras (streaming AWM's per-segment ones) are negated too
    extras = {"segment_advantages": torch.tensor([[1.0, -2.0]]), "pi": torch.tensor([0.5]), "plan": "kept"}
    flipped = probe.negated_extras(extras, -1)
    assert torch.equal(flipped["segment_advantages"], -extras["segment_advantages"])
    assert flipped["pi"] is extras["pi"] and flipped["plan"] == "kept"


TINY_VIDEO = ["--set", "model=tiny_wan", "--set", "model.height=64", "--set", "model.width=64",
              "--set", "model.num_frames=13"]  # the random Wan twin at the moving-shapes world's size


@pytest.mark.usefixtures("one_thread")
def test_eval_geneval_scores_videos_and_draws_a_labelled_sample_sheet(tmp_path):
    """``--video`` on the tiny random Wan twin: three held-out prompts of three video tags, a 2-step ODE. The JSON
    has the video tags; the sheet is one labelled strip of 13 frames (64 px shown at 128 px) per clip."""
    import json

    import numpy as np
    from PIL import Image

    ev = load_script("eval_geneval")
    rows = [json.loads(line) for line in (SCRIPTS.parent / "assets/prompts/motion_held_out.jsonl").read_text().splitlines()]
    picked = [next(m for m in rows if m["tag"] == tag) for tag in ("speed", "two_object_motion", "counting")]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(m) + "\n" for m in picked))
    sheet = tmp_path / "sheet.png"
    common = ["--prompts", str(prompts), "--samples", "1", "--samples-per-tag", "none", "--steps", "2",
              "--device", "cpu"]
    result = ev.main(["--video", *TINY_VIDEO, *common, "--grid", str(sheet)])
    assert list(result["per_tag"]) == ["speed", "two_object_motion", "counting"] and result["images"] == 3
    assert all(v["n"] == 1 and 0 <= v["strict"] <= v["partial"] <= 1 for v in result["per_tag"].values())
    assert result["grid"] == str(sheet)
    # the same run spelled with --set (what --video stands for, the twin for the model)
    spelled = ev.main(["--set", "reward=video_geneval", "--set", "data=motion_shapes", *TINY_VIDEO, *common])
    assert spelled["per_tag"] == result["per_tag"] and "grid" not in spelled

    grid = np.asarray(Image.open(sheet).convert("RGB"))
    pad, frame, band = 2, 128, 6 + 13 * 2  # label: the prompt on one line, the verdict on another
    cell_h = band + 1 + frame
    assert grid.shape == (pad + 3 * (cell_h + pad), pad + 13 * (frame + pad) - pad + pad, 3)
    grey = np.array([128, 128, 128], dtype=np.uint8)
    assert (grid[:, :pad] == grey).all() and (grid[:pad] == grey).all()  # framed in grey
    for i in range(3):
        y = pad + i * (cell_h + pad)
        label = grid[y:y + band, pad:-pad]
        assert (label.max(axis=-1) < 64).sum() > 100, i  # dark text on the white band
        assert (grid[y + band] == grey).all()  # the line between label and strip
        for k in range(1, 13):  # 13 frames, 2 grey pixels apart
            x = pad + k * (frame + pad)
            assert (grid[y + band + 1:y + cell_h, x - pad:x] == grey).all(), (i, k)

    # the verdict a label carries: strict, partial, and the checks at 0 (NaN: not applicable)
    nan = float("nan")
    comps = {"strict": torch.tensor([1.0, 0.0]), "partial": torch.tensor([1.0, 0.5]),
             "check/motion": torch.tensor([1.0, 0.0]), "check/count": torch.tensor([nan, nan]),
             "check/identity": torch.tensor([1.0, 0.0])}
    assert ev.verdict_notes(comps, "", 0) == ["strict PASS", "partial 1.00"]
    assert ev.verdict_notes(comps, "", 1) == ["strict FAIL", "partial 0.50", "motion x", "identity x"]


def test_compare_presets_reads_finished_runs_and_reports_mean_std_and_curves(tmp_path):
    """Finished runs under --runs are read back, not run again: per arm the mean ± std over seeds of each metric at
    the last evaluation, its change from iteration 0, the curve, the wall clock; a table column it does not report
    is refused."""
    compare = load_script("compare_presets")
    runs = tmp_path / "runs"
    finals = {("a", 0): 0.5, ("a", 1): 0.7, ("b", 0): 0.3, ("b", 1): 0.3}
    for (arm, seed), final in finals.items():
        d = runs / f"{arm}_seed{seed}"
        d.mkdir(parents=True)
        # the run's own record of its CPU kernels (b's runs predate it: the kernels this process runs on)
        (d / "summary.json").write_text(json.dumps({"cpu_kernels": "AVX512"} if arm == "a" else {}))
        (d / "wall_clock.json").write_text(json.dumps({"seconds": 60.0 * (seed + 1)}))
        rows = [{"iteration": 0, "eval/strict": 0.2}, {"iteration": 1, "reward/mean": 0.1 + seed},
                {"iteration": 2, "reward/mean": final}, {"iteration": 2, "eval/strict": final}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = compare.main(["--arms", "a,b", "--seeds", "0,1", "--runs", str(runs), "--out", str(tmp_path / "cmp"),
                           "--metrics", "eval/strict", "--columns", "eval/strict=strict",
                           "--train-metrics", "reward/mean", "--plot-train", "reward/mean"])
    a = report["arms"]["a"]
    # a training value at every iteration, mean ± std over the seeds, and each run's own series
    assert a["reward/mean"]["curve"] == [{"iteration": 1, "mean": 0.6, "std": round(math.sqrt(0.5), 4), "n": 2},
                                         {"iteration": 2, "mean": 0.6, "std": round(math.sqrt(0.02), 4), "n": 2}]
    assert a["reward/mean"]["first_quarter"]["mean"] == 0.6
    assert report["runs"][0]["train"]["reward/mean"]["series"] == [[1, 0.1], [2, 0.5]]
    import torch

    assert {(r["arm"], r["cpu"]) for r in report["runs"]} == {("a", "AVX512"),
                                                              ("b", torch.backends.cpu.get_cpu_capability())}
    assert a["eval/strict"]["final"] == {"mean": 0.6, "std": round(math.sqrt(0.02), 4), "n": 2}
    assert a["eval/strict"]["gain"]["mean"] == 0.4 and a["seconds"]["mean"] == 90.0 and a["iterations"] == 2
    assert [p["mean"] for p in a["curve"]["eval/strict"]] == [0.2, 0.6]
    assert report["arms"]["b"]["eval/strict"]["final"]["std"] == 0.0
    assert "| a | 2 | 2 | 1.5 | 0.600 ± 0.141 (+0.400) |" in (tmp_path / "cmp.md").read_text()
    assert (tmp_path / "cmp.png").is_file() and json.loads((tmp_path / "cmp.json").read_text())["arms"] == report["arms"]
    with pytest.raises(SystemExit, match="eval/partial"):
        compare.main(["--arms", "a", "--seeds", "0", "--runs", str(runs), "--out", str(tmp_path / "x"),
                      "--metrics", "eval/strict", "--columns", "eval/partial=partial"])
    with pytest.raises(SystemExit, match="plot-train.*reward/std"):
        compare.main(["--arms", "a", "--seeds", "0", "--runs", str(runs), "--out", str(tmp_path / "x"),
                      "--metrics", "eval/strict", "--train-metrics", "reward/mean", "--plot-train", "reward/std"])


def test_compare_presets_arm_without_a_preset_runs_the_defaults_and_the_report_names_commands_and_commit(tmp_path):
    """``name=`` is an arm of ``python train.py`` itself (no ``experiment=``), with its own overrides; the report
    records each arm's command and the commit of the code that ran."""
    compare = load_script("compare_presets")
    assert compare.command_overrides("default", "", ["trainer.lr=1e-4"]) == ["trainer.lr=1e-4"]
    assert compare.command_overrides("flow", None, []) == ["experiment=flow"]
    runs = tmp_path / "runs"
    for arm in ("default", "flash"):
        d = runs / f"{arm}_seed0"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"code": {"commit": "abc1234", "changes": arm == "flash"}}))
        (d / "wall_clock.json").write_text(json.dumps({"seconds": 60.0}))
        (d / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "eval/strict": 0.2}) + "\n")
    report = compare.main(["--arms", "default=,flash=", "--arm-set", "flash", "algo=flash_grpo", "--seeds", "0",
                           "--runs", str(runs), "--out", str(tmp_path / "cmp"), "--metrics", "eval/strict"])
    assert report["arm_commands"] == {"default": "python train.py", "flash": "python train.py algo=flash_grpo"}
    assert report["command"].startswith("python scripts/compare_presets.py --arms default=,flash=")
    assert report["commit"] == ["abc1234", "abc1234+changes"]  # what each run says it ran
    assert [r["commit"] for r in report["runs"]] == ["abc1234", "abc1234+changes"]
    with pytest.raises(SystemExit, match="empty arm"):
        compare.main(["--arms", "a,", "--runs", str(runs), "--out", str(tmp_path / "x")])
    # an arm on fewer seeds: its seed 1 is neither run nor read (there is none), the other arm's is read
    d = runs / "default_seed1"
    d.mkdir()
    for name in ("summary.json", "wall_clock.json", "metrics.jsonl"):
        (d / name).write_text((runs / "default_seed0" / name).read_text())
    report = compare.main(["--arms", "default=,flash=", "--seeds", "0,1", "--arm-seeds", "flash", "0", "--runs",
                           str(runs), "--out", str(tmp_path / "cmp"), "--metrics", "eval/strict"])
    assert report["arm_seeds"] == {"flash": [0]}
    assert [(r["arm"], r["seed"]) for r in report["runs"]] == [("default", 0), ("flash", 0), ("default", 1)]
    assert report["arms"]["flash"]["seeds"] == [0] and report["arms"]["default"]["seeds"] == [0, 1]
    with pytest.raises(SystemExit, match="seeds \\[2\\] are not among --seeds 0"):
        compare.main(["--arms", "default=,flash=", "--seeds", "0", "--arm-seeds", "flash", "0,2", "--runs",
                      str(runs), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--arm-seeds names the arm 'other'"):
        compare.main(["--arms", "default=", "--arm-seeds", "other", "0", "--runs", str(runs), "--out", str(tmp_path / "x")])


def _stopped_run(tmp_path):
    """A run dir as a SIGTERM leaves it: a checkpoint, a summary that says it stopped, 100 s on its clock."""
    runs = tmp_path / "runs"
    d = runs / "a_seed0"
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints" / "latest").write_text("checkpoint-000050")
    (d / "summary.json").write_text(json.dumps({"stopped": "stop requested; finished the iteration"}))
    (d / "wall_clock.json").write_text(json.dumps({"seconds": 100.0}))
    return runs, d


def test_compare_presets_continues_a_stopped_run_from_its_checkpoint(tmp_path, monkeypatch):
    """A run whose summary says it stopped early (SIGTERM) is run again with ``trainer.resume=<its dir>``, its wall
    clock adding to the time already spent; a finished run is not run again; a run that stops again ends the
    comparison with the command to continue."""
    compare = load_script("compare_presets")
    runs, d = _stopped_run(tmp_path)
    rows = [{"iteration": 0, "eval/strict": 0.2}, {"iteration": 100, "eval/strict": 0.4}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = []

    class FakeRun:
        """Stands in for the train.py process: ``effect`` is what the run leaves behind."""

        effect = staticmethod(lambda: (d / "summary.json").write_text(json.dumps({"stopped": None})))

        def __init__(self, cmd, **kwargs):
            calls.append(cmd)
            FakeRun.effect()

        def wait(self):
            return 0

    monkeypatch.setattr(compare.subprocess, "Popen", FakeRun)
    report = compare.main(["--arms", "a", "--seeds", "0", "--runs", str(runs), "--out", str(tmp_path / "cmp"),
                           "--metrics", "eval/strict"])
    assert len(calls) == 1 and f"trainer.resume={d}" in calls[0] and "experiment=a" in calls[0]
    assert report["runs"][0]["seconds"] >= 100.0
    compare.main(["--arms", "a", "--seeds", "0", "--runs", str(runs), "--out", str(tmp_path / "cmp"),
                  "--metrics", "eval/strict"])
    assert len(calls) == 1  # finished: read back

    (d / "summary.json").write_text(json.dumps({"stopped": "killed"}))
    FakeRun.effect = staticmethod(
        lambda: (d / "summary.json").write_text(json.dumps({"stopped": "stop requested; finished"})))
    with pytest.raises(SystemExit, match="run the same command again"):
        compare.main(["--arms", "a", "--seeds", "0", "--runs", str(runs), "--out", str(tmp_path / "cmp"),
                      "--metrics", "eval/strict"])


def test_compare_presets_keeps_the_clock_of_a_run_a_signal_stopped(tmp_path, monkeypatch):
    """A signal that stops a run part-way still leaves its wall clock (the time already spent plus this attempt's), so
    the resumed run reports the time of both attempts, not of the last one alone."""
    compare = load_script("compare_presets")
    runs, d = _stopped_run(tmp_path)

    def stopped_by_a_signal(cmd, log):
        time.sleep(0.2)
        raise SystemExit("stopped by signal 15: the run checkpointed (exit 0); run the same command again")

    monkeypatch.setattr(compare, "_run_forwarding_signals", stopped_by_a_signal)
    with pytest.raises(SystemExit, match="run the same command again"):
        compare.main(["--arms", "a", "--seeds", "0", "--runs", str(runs), "--out", str(tmp_path / "cmp"),
                      "--metrics", "eval/strict"])
    assert json.loads((d / "wall_clock.json").read_text())["seconds"] >= 100.2


def test_compare_presets_arms_share_a_preset_with_their_own_overrides_and_report_training_quarters(tmp_path, monkeypatch):
    """``name=preset`` arms run the preset with ``--set`` and their own ``--arm-set`` overrides; training keys are
    reported as first- and last-quarter means; an ``--arm-set`` for an unknown arm is refused."""
    compare = load_script("compare_presets")
    runs, calls = tmp_path / "runs", []

    class FakeRun:
        def __init__(self, cmd, **kwargs):
            calls.append(cmd)
            out = Path(next(c for c in cmd if c.startswith("hydra.run.dir=")).split("=", 1)[1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "summary.json").write_text(json.dumps({"stopped": None}))
            sat = [0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0] if "reward.aggregate.name=sum" in cmd else [0.0] * 8
            rows = [{"iteration": 0, "eval/partial": 0.4}] + [
                {"iteration": i + 1, "groups/c/zero_std_group_fraction": v} for i, v in enumerate(sat)] + [
                {"iteration": 8, "eval/partial": 0.5}]
            (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

        def wait(self):
            return 0

    monkeypatch.setattr(compare.subprocess, "Popen", FakeRun)
    argv = ["--arms", "sum=video_shapes,taros=video_shapes", "--seeds", "0", "--runs", str(runs),
            "--out", str(tmp_path / "cmp"), "--metrics", "eval/partial", "--set", "reward=video_composite",
            "--arm-set", "sum", "reward.aggregate.name=sum", "--arm-set", "taros", "reward.aggregate.name=taros",
            "--train-metrics", "groups/c/zero_std_group_fraction"]
    report = compare.main(argv)
    assert [c[2] for c in calls] == ["experiment=video_shapes"] * 2
    assert all("reward=video_composite" in c for c in calls)
    assert "reward.aggregate.name=sum" in calls[0] and "reward.aggregate.name=taros" in calls[1]
    assert (runs / "sum_seed0").is_dir() and (runs / "taros_seed0").is_dir()
    sat = report["arms"]["sum"]["groups/c/zero_std_group_fraction"]
    assert sat["first_quarter"]["mean"] == 0.0 and sat["last_quarter"]["mean"] == 1.0
    assert report["arms"]["taros"]["groups/c/zero_std_group_fraction"]["last_quarter"]["mean"] == 0.0
    with pytest.raises(SystemExit, match="'guard'"):
        compare.main(argv + ["--arm-set", "guard", "algo=grpo_guard"])


def test_compare_presets_passes_sigterm_to_the_run_and_waits_for_it(tmp_path):
    """A SIGTERM to the comparison reaches the running train.py (which checkpoints on it); the script waits for the
    run to end and then stops with the command to continue."""
    compare = load_script("compare_presets")
    ready, got = tmp_path / "ready", tmp_path / "got"
    child = (f"import signal, sys, time, pathlib\n"
             f"def stop(*a):\n    pathlib.Path({str(got)!r}).write_text('term'); sys.exit(0)\n"
             f"signal.signal(signal.SIGTERM, stop)\npathlib.Path({str(ready)!r}).write_text('')\ntime.sleep(60)\n")

    def send_when_ready():
        deadline = time.time() + 30
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=send_when_ready, daemon=True).start()
    start = time.time()
    with open(tmp_path / "log", "w") as log, pytest.raises(SystemExit, match="run the same command again"):
        compare._run_forwarding_signals([sys.executable, "-c", child], log)
    assert got.read_text() == "term" and time.time() - start < 30
    assert signal.getsignal(signal.SIGTERM) == before  # our handler removed again


def test_bench_streaming_times_the_cache_against_recomputing_and_checks_they_agree(tmp_path):
    """Both ways generate the same stream (the JSON's agreement), the per-frame costs and their ratio are reported per
    length, and the flatness and the ratio at the longest length are summarised; the PNG is written beside."""
    bench = load_script("bench_streaming")
    out = tmp_path / "stream.json"
    report = bench.main(["--frames", "2,4", "--batch", "1", "--steps", "2", "--repeats", "1", "--threads", "1",
                         "--out", str(out)])
    rows = report["lengths"]
    assert [r["latent_frames"] for r in rows] == [2, 4] and [r["pixel_frames"] for r in rows] == [5, 13]
    for r in rows:
        assert r["max_relative_difference"] < 1e-3
        assert r["recompute_over_cached"] == pytest.approx(r["recompute_s_per_frame"] / r["cached_s_per_frame"])
        assert r["cache_mb"] > 0
    assert report["recompute_over_cached_at_longest"] == rows[-1]["recompute_over_cached"]
    assert report["cached_flatness_longest_over_shortest"] == pytest.approx(
        rows[-1]["cached_s_per_frame"] / rows[0]["cached_s_per_frame"])
    assert json.loads(out.read_text()) == report and out.with_suffix(".png").is_file()
    with pytest.raises(SystemExit, match="multiple of the block"):
        bench.main(["--frames", "4", "--batch", "1", "--size", "wan21_1_3b", "--device", "cpu"])


def test_paired_eval_scores_base_and_checkpoint_on_the_trainers_held_out_jobs(tmp_path):
    """A run's checkpoint and its base model score exactly what the trainer's own evaluation scores, sample by sample
    on the same noise; the change, its standard error and the shares follow from the per-sample pairs. A run that
    keeps an EMA is read through it, as its evaluations are; ``--raw`` reads its trained weights."""
    from omegaconf import OmegaConf

    from flowgrpo.trainer import Trainer

    paired_eval = load_script("paired_eval")
    bench = load_script("bench_iteration")
    run = tmp_path / "run"
    cfg = bench.compose(["model=tiny_sd3", "reward=jpeg_compressibility", "logger=none", "trainer.iterations=1",
                         "trainer.eval_num_prompts=3", "trainer.eval_samples_per_prompt=1",
                         "trainer.eval_samples_per_tag=null", "sampler.num_steps=3", "sampler.eval_num_steps=3",
                         "algo.window.size=1", "trainer.prompts_per_iteration=2", "trainer.group_size=2",
                         "trainer.train_batch_size=4", "trainer.gradient_accumulation_steps=1",
                         "trainer.lr=0.05", "trainer.ema.enabled=true", "trainer.ema.decay=0.5",
                         f"trainer.output_dir={run}"])
    trainer = Trainer(cfg, run)
    before = trainer.evaluate()["eval/reward"]  # the EMA starts at the initial weights
    trainer.step()
    trainer.save_checkpoint()
    after = trainer.evaluate()["eval/reward"]  # through the EMA, half-way between the two weights
    trainer.ema = None
    raw = trainer.evaluate()["eval/reward"]
    OmegaConf.save(cfg, run / "config.yaml", resolve=True)
    report = paired_eval.main([str(run), "--out", str(tmp_path / "paired.json")])
    r = report["runs"][0]["metrics"]["reward"]
    assert r["n"] == 3 and report["runs"][0]["iteration"] == 1 and report["runs"][0]["weights"] == "ema (decay 0.5)"
    assert r["base"] == pytest.approx(before, abs=1e-5) and r["trained"] == pytest.approx(after, abs=1e-5)
    assert before != after != raw and r["change"] == pytest.approx(after - before, abs=1e-5)
    assert json.loads((tmp_path / "paired.json").read_text())["runs"][0]["metrics"]["reward"]["n"] == 3
    trained = paired_eval.main([str(run), "--raw"])["runs"][0]
    assert trained["weights"] == "raw" and trained["metrics"]["reward"]["trained"] == pytest.approx(raw, abs=1e-5)
    assert trained["metrics"]["reward"]["base"] == r["base"]
    # the test set: the same held-out prompts here (the shapes world has no others), under noise of its own
    test = paired_eval.main([str(run), "--split", "test"])
    t = test["runs"][0]
    assert test["split"] == t["split"] == "test" and t["metrics"]["reward"]["n"] == 3
    assert t["prompts_file"] == report["runs"][0]["prompts_file"]
    assert t["samples"]["base"]["reward"] != report["runs"][0]["samples"]["base"]["reward"]
    OmegaConf.save(OmegaConf.merge(cfg, {"data": {"test_file": None}}), run / "config.yaml", resolve=True)
    with pytest.raises(SystemExit, match=r"data\.test_file is null: no test prompts"):
        paired_eval.main([str(run), "--split", "test"])
    # the statistics of the pairs; a sample a component does not define (NaN) is left out of both
    s = paired_eval.paired([0.0, 1.0, 2.0, float("nan")], [1.0, 1.0, 4.0, 3.0])
    assert (s["n"], s["change"], s["improved"], s["worse"]) == (3, 1.0, 2 / 3, 0.0)
    assert s["stderr"] == pytest.approx(1 / math.sqrt(3)) and s["base"] == 1.0 and s["trained"] == 2.0
    with pytest.raises(SystemExit, match="config.yaml"):
        paired_eval.main([str(tmp_path)])


def test_paired_report_puts_methods_seeds_and_tags_side_by_side(tmp_path):
    """scripts/paired_report.py: per run its seed and wall clock (from the run directory), its paired metrics as
    paired_eval wrote them, per arm the mean change over runs, the per-tag evaluation apart, and a PNG."""
    report = load_script("paired_report")

    def run_dir(name, seed, minutes):
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text(f"trainer:\n  seed: {seed}\n  iterations: 36\n")
        (d / "train.log").write_text(f"2026-12-06 04:00:00,000 INFO flowgrpo: code\n2026-12-06 04:{minutes:02d}:30,500 "
                                     "INFO flowgrpo: summary\n")
        return str(d)

    def metric(change, se=0.01):
        return {"n": 200, "base": 0.39, "trained": 0.39 + change, "change": change, "stderr": se, "improved": 0.5,
                "worse": 0.4}

    runs = [{"run": run_dir(f"s{s}", s, 14 + s), "iteration": 36,
             "metrics": {"reward": metric(c), "direction": metric(2 * c), "segment1/speed": metric(c),
                         "segments_strict": metric(0.0), "recovery": {"n": 0},
                         "by_tag/one_object_stream/reward": metric(c), "by_tag/two_object_stream/reward": metric(-c)},
             "samples": {"base": {}, "trained": {}}} for s, c in ((0, 0.02), (1, 0.04))]
    (tmp_path / "arm.json").write_text(json.dumps({"prompts": 100, "samples": 2, "runs": runs}))
    # 8 iterations logged by the first run: its training metrics' first and last quarters (2 iterations each)
    (tmp_path / "s0" / "metrics.jsonl").write_text("".join(
        json.dumps({"iteration": i, "taros/speed/saturation": i / 10, "adv/x": float("nan")}) + "\n"
        for i in range(1, 9)) + json.dumps({"iteration": 8, "eval/reward": 0.4}) + "\n")
    out = report.main(["--arm", f"AWM={tmp_path / 'arm.json'}", "--apart", f"AWM={tmp_path / 'arm.json'}",
                       "--train-metrics", "taros/speed/saturation,adv/x", "--out", str(tmp_path / "report")])
    arm = out["arms"]["AWM"]
    assert [(r["seed"], r["seconds"]) for r in arm["runs"]] == [(0, 870.5), (1, 930.5)]
    assert arm["mean"]["reward"]["change"] == pytest.approx(0.03) and arm["mean"]["direction"]["change"] == pytest.approx(0.06)
    assert "recovery" not in arm["runs"][0]["metrics"]                    # a metric no sample had is left out
    assert arm["runs"][0]["training"] == {"taros/speed/saturation": {
        "first_quarter": pytest.approx(0.15), "last_quarter": pytest.approx(0.75), "iterations": 8}}
    assert "training" not in arm["runs"][1]                               # no metrics.jsonl
    assert set(out["apart"]["AWM"]["runs"][1]["by_tag"]) == {"by_tag/one_object_stream/reward",
                                                            "by_tag/two_object_stream/reward"}
    assert json.loads((tmp_path / "report.json").read_text()) == out and (tmp_path / "report.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        report.main(["--arm", "no-label", "--out", str(tmp_path / "x")])
    # an arm of that published report beside a new one, as published (its runs are gone)
    again = report.main(["--arm", f"AWM then={tmp_path / 'report.json'}#AWM", "--arm", f"new={tmp_path / 'arm.json'}",
                         "--out", str(tmp_path / "again")])
    assert {k: v for k, v in again["arms"]["AWM then"].items() if k != "source"} == {
        k: v for k, v in arm.items() if k != "source"}
    assert again["arms"]["AWM then"]["source"] == "report.json#AWM" and again["arms"]["new"]["source"] == "arm.json"
    with pytest.raises(SystemExit, match="has no arm 'GRPO'; its arms: AWM"):
        report.main(["--arm", f"x={tmp_path / 'report.json'}#GRPO", "--out", str(tmp_path / "y")])


def test_branch_spread_summarises_each_runs_group_spread_over_iterations(tmp_path):
    """scripts/branch_spread.py: per run the mean over iterations of the within-group reward std and of the share of
    tied groups, each with its standard error over iterations; per component too; a null (NaN) row is left out."""
    spread = load_script("branch_spread")
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"iteration": 1, "adv/reward_group_std_mean": 0.01, "adv/zero_std_group_fraction": 0.5,
             "groups/direction/group_std_mean": 0.1},
            {"iteration": 2, "adv/reward_group_std_mean": 0.03, "adv/zero_std_group_fraction": None,
             "groups/direction/group_std_mean": 0.3},
            {"iteration": 2, "eval/reward": 0.4}]  # an evaluation row: no group statistics
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = spread.main([f"routed={run}", "--out", str(tmp_path / "s.json")])
    arm = report["arms"]["routed"]
    assert arm["iterations"] == 2 and arm["group_std"]["mean"] == pytest.approx(0.02)
    assert arm["group_std"]["se"] == pytest.approx(0.01)
    assert (arm["tied_groups"]["mean"], arm["tied_groups"]["n"]) == (0.5, 1) and math.isnan(arm["tied_groups"]["se"])
    assert arm["components"]["direction"]["mean"] == pytest.approx(0.2)
    assert json.loads((tmp_path / "s.json").read_text())["arms"]["routed"]["tied_groups"]["se"] is None
    with pytest.raises(SystemExit, match="LABEL=RUN_DIR"):
        spread.main([str(run)])
