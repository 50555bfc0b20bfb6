"""The run log: what a run reports (banner, batch plan, evaluations, warnings, the final summary, the traceback of a
crash) is in ``<run dir>/train.log`` as well as on the console, and ``train.py`` with ``trainer.output_dir`` leaves
no stray Hydra run dir behind. docs/reliability.md lists it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from flowgrpo import cli

from test_faults import BASE, CONF, make  # tests/test_faults.py: a tiny tiny_sd3 trainer writing into tmp_path

REPO = Path(__file__).resolve().parents[1]


def test_train_log_holds_the_banner_evaluations_and_summary_and_no_stray_outputs_dir(tmp_path):
    work, run = tmp_path / "cwd", tmp_path / "run"
    work.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "debug=default", "reward=jpeg_compressibility",
         "trainer.eval_before=true", "trainer.iterations=1", "trainer.gallery_every=0", "sampler.eval_num_steps=2",
         f"trainer.output_dir={run}"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (run / "train.log").read_text()
    for line in ("batch plan: ", "algorithm: ", "trainable: ", "eval @ 0: ", "eval @ 1: ", "done: 1 iterations",
                 f"summary: {run / 'summary.json'}"):
        assert line in log, f"{line!r} not in train.log:\n{log}"
        assert line in proc.stdout  # the console shows the same
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "summary.json").is_file()
    assert list(work.iterdir()) == []  # no outputs/<date>/<time> beside it


@pytest.mark.parametrize("override, message", [
    ("trainer.output_dir={tmp}/file/run", "trainer.output_dir"),  # under a file: cannot be created
    ("trainer.iterations=0", "trainer.iterations=0 must be >= 1"),  # a config error, in Hydra's own run dir
    # a size the local pipeline cannot generate, found from its config files before a run dir or the model
    ("model=sd3_shapes model.height=63", "model.height=63: sd3 at assets/tiny-sd3-shapes generates sizes divisible"),
], ids=["output_dir_under_a_file", "config_error", "size"])
def test_a_run_that_fails_before_it_has_a_run_dir_leaves_no_stray_outputs_dir(tmp_path, override, message):
    work = tmp_path / "cwd"
    work.mkdir()
    (tmp_path / "file").write_text("not a dir")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "debug=default", *override.format(tmp=tmp_path).split()],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and message in proc.stdout + proc.stderr
    assert list(work.iterdir()) == []  # no outputs/<date>/<time>/.hydra left behind


BAD_RECORD = {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"}


def test_a_set_up_failure_after_the_run_dir_was_made_leaves_no_run_dir(tmp_path):
    """A prompt file the reward cannot judge fails while the trainer is set up, after train.py made the run dir (and
    wrote its config and log there): a dir this run made is removed, one that held a run before is left as it was."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(BAD_RECORD) + "\n")
    fresh, used = tmp_path / "fresh" / "run", tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("an earlier run's file")
    for out in (fresh, used):
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose("train", overrides=["debug=default", "logger=none", f"data.train_file={bad}",
                                              f"trainer.output_dir={out}"])
        with pytest.raises(ValueError, match=r"bad\.jsonl:1: record\.include\[0\]\.class"):
            cli.main(cfg)
    assert not fresh.exists()
    assert (used / "notes.txt").read_text() == "an earlier run's file" and (used / "train.log").is_file()


def test_a_set_up_failure_in_hydras_own_run_dir_leaves_no_stray_outputs_dir(tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(BAD_RECORD) + "\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "debug=default", "logger=none",
                           f"data.train_file={bad}"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "bad.jsonl:1: record.include[0].class" in proc.stdout + proc.stderr
    assert list(work.iterdir()) == []  # no outputs/<date>/<time>/ with a config, a log and .hydra/ left behind


def test_a_crash_writes_its_traceback_to_train_log_and_raises(tmp_path):
    trainer = make(tmp_path, "trainer.iterations=2", "trainer.checkpoint_every=0")
    real = trainer.reward

    def reward(images, prompts, metadata=None):
        if trainer.iteration == 1:
            raise ConnectionError("reward server down")
        return real(images, prompts, metadata)

    trainer.reward = reward
    with pytest.raises(ConnectionError, match="reward server down"):
        trainer.fit()
    log = (tmp_path / "train.log").read_text()
    assert "Traceback (most recent call last)" in log
    assert "ConnectionError: reward server down" in log
    assert "error in iteration 2 (score)" in log  # iteration 1 completed, 2 failed  # the crash report that names the checkpoint and how to resume
    assert log.count("Traceback (most recent call last)") == 1


def test_a_warning_in_the_run_lands_in_train_log_and_is_still_shown(tmp_path):
    trainer = make(tmp_path, "trainer.iterations=1", "trainer.checkpoint_every=0")
    real = trainer.reward

    def reward(images, prompts, metadata=None):
        warnings.warn("the reward model is uncalibrated", UserWarning)
        return real(images, prompts, metadata)

    trainer.reward = reward
    with pytest.warns(UserWarning, match="uncalibrated"):  # shown as before: a recorder still sees it
        trainer.fit()
    log = (tmp_path / "train.log").read_text()
    assert "UserWarning: the reward model is uncalibrated" in log
    assert warnings.showwarning is not None and "flowgrpo" not in getattr(warnings.showwarning, "__module__", "")


def test_an_output_dir_that_cannot_be_created_names_the_path_and_the_cause(tmp_path):
    (tmp_path / "file").write_text("")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[*BASE, f"trainer.output_dir={tmp_path / 'file' / 'run'}"])
    with pytest.raises(OSError, match=r"cannot create the output directory .*file/run: Not a directory"):
        cli.resolve_output_dir(cfg)


def test_curves_that_cannot_be_written_are_a_logged_warning_and_the_summary_is_written(tmp_path, monkeypatch):
    def broken(history, evals, path):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(cli, "plot_curves", broken)
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[*BASE, f"trainer.output_dir={tmp_path}", "trainer.iterations=1",
                                          "trainer.checkpoint_every=0"])
    with pytest.warns(RuntimeWarning, match=r"could not write .*curves\.png: No space left on device"):
        summary = cli.main(cfg)
    assert summary["curves"] is None and (tmp_path / "summary.json").is_file()
    log = (tmp_path / "train.log").read_text()
    assert "curves.png: No space left on device" in log and f"summary: {tmp_path / 'summary.json'}" in log


def test_two_processes_share_one_run_dir_and_one_train_log(tmp_path):
    """``torchrun --nproc_per_node 2 train.py`` (2 gloo processes, no GPU): one run dir chosen by rank 0, one
    ``train.log`` written by the main process only (each line once), the batch plan split over both processes, and
    the ``metrics.jsonl`` rows of a one-process run, each once."""
    work = tmp_path / "cwd"
    work.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
         str(REPO / "train.py"), "debug=default", "reward=jpeg_compressibility", "trainer.iterations=2",
         "trainer.gallery_every=0", "trainer.eval_every=0", "trainer.checkpoint_every=0"],
        cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [p.parent for p in work.rglob("train.log")]
    assert len(runs) == 1, runs                               # rank 1 did not pick a run dir of its own
    log = (runs[0] / "train.log").read_text()
    assert log.count("batch plan: ") == 1 and log.count("done: 2 iterations") == 1, log
    assert "over 2 processes" in log, log
    rows = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    # as one process writes them: the evaluations before and after (debug=default) and one row per iteration, once
    assert [(r["iteration"], "eval/reward" in r) for r in rows] == [(0, True), (1, False), (2, False), (2, True)]


def test_the_final_summary_reports_a_change_only_where_both_ends_are_defined(monkeypatch):
    """An evaluation component undefined on every sample (NaN, e.g. the long-video reward's largest jump when nothing
    moved) is shown as it is, without a made-up '+nan' change; defined ones get their signed change."""
    from types import SimpleNamespace

    import flowgrpo.trainer as trainer_module
    from flowgrpo.trainer import Trainer

    said = []
    monkeypatch.setattr(trainer_module.log, "info", lambda message, *args: said.append(message % args if args else message))

    run = SimpleNamespace(iteration=4, updates=4, skipped_updates=0, acc=SimpleNamespace(is_main_process=True),
                          evals=[{"eval/reward": 0.25, "eval/max_jump_px": float("nan")},
                                 {"eval/reward": 0.5, "eval/max_jump_px": 3.0}])
    summary = Trainer.summary(run, None, None)
    text = "\n".join(said)
    assert "eval/reward: 0.250 → 0.500 (+0.250)" in text
    assert "eval/max_jump_px: nan → 3.000\n" in text + "\n" and "+nan" not in text
    assert summary["eval_last"]["eval/max_jump_px"] == 3.0


def test_code_version_names_the_commit_of_the_code_and_nothing_outside_git(tmp_path):
    from flowgrpo.runlog import code_label, code_version

    repo = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=repo, capture_output=True, text=True)
    version = code_version(repo)
    assert version["commit"] == head.stdout.strip() and isinstance(version["changes"], bool)
    assert code_version() == version  # the package's own checkout
    assert code_version(tmp_path) is None  # an installed package: no git work tree, no guess
    assert code_label({"commit": "abc1234", "changes": True}) == "abc1234+changes"
    assert code_label({"commit": "abc1234", "changes": False}) == "abc1234" and code_label(None) is None


# ------------------------------------------------------------------------------------------- progress a person follows


class _Bar:
    """Records what a progress bar was asked to show (stands in for tqdm)."""

    made: list = []

    def __init__(self, *args, **kwargs):
        self.kwargs, self.n, self.closed = kwargs, 0, False
        _Bar.made.append(self)

    def update(self, n=1):
        self.n += n

    def close(self):
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_the_held_out_evaluation_counts_its_samples_on_a_progress_bar(tmp_path, monkeypatch):
    import flowgrpo.held_out

    trainer = make(tmp_path, "trainer.iterations=1", "trainer.checkpoint_every=0", "trainer.eval_num_prompts=3")
    monkeypatch.setattr(flowgrpo.held_out, "tqdm", _Bar)
    _Bar.made = []
    result = trainer.evaluate()
    [bar] = _Bar.made
    assert bar.kwargs["total"] == len(trainer.eval_jobs()) == 3 and bar.n == 3 and bar.closed
    assert bar.kwargs["disable"] is None and bar.kwargs["leave"] is False  # off when not a terminal; then it goes
    assert set(result) >= {"eval/reward"}


def test_the_iteration_bar_leaves_evaluations_out_of_its_time(tmp_path, monkeypatch):
    """The iteration bar's elapsed time and s/it count the iterations, not the held-out evaluations between them (its
    clock is moved on by each evaluation's time); ``time/iteration`` never counted them."""
    import time

    import tqdm.auto

    trainer = make(tmp_path, "trainer.iterations=2", "trainer.checkpoint_every=0", "trainer.eval_every=1")
    wait = 1.5

    def slow_evaluation(tag="eval"):
        time.sleep(wait)
        return {}

    trainer.evaluate = slow_evaluation
    seen = {}

    class Bar(tqdm.auto.tqdm):
        def close(self):
            if not self.disable and "elapsed" not in seen:
                seen["elapsed"] = self.format_dict["elapsed"]
            super().close()

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    trainer.fit()
    iterations = sum(h["time/iteration"] for h in trainer.history)
    assert seen["elapsed"] < iterations + 1.0 < iterations + 2 * wait  # two evaluations (after 1, and at the end)


def test_the_reward_curves_are_a_grid_of_at_most_four_panels_a_row(tmp_path):
    from PIL import Image

    history = [{"iteration": i, "reward/mean": 0.1 * i} for i in range(1, 4)]
    keys = ["reward", "partial", "strict", "exact", "geneval", "geneval_partial"]
    evals = [{"iteration": i, **{f"eval/{k}": 0.5 + 0.01 * i for k in keys}} for i in (0, 3)]
    with Image.open(cli.plot_curves(history, evals, tmp_path / "curves.png")) as png:
        width, height = png.size
    assert (width, height) == (1600, 600)  # 7 panels: 4 + 3 in two rows of 400 x 300 pixels (was 2800 x 300)
    with Image.open(cli.plot_curves(history, evals[:1] and [{"iteration": 0, "eval/reward": 0.5}],
                                    tmp_path / "two.png")) as png:
        assert png.size == (800, 300)  # 2 panels: one row
