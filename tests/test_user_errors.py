"""What a person sees when a run cannot start: a run dir that holds another run is refused before anything is written
(``trainer.overwrite=true`` replaces it), and a user error — an unknown key or option, a bad value, a missing path —
is one message without a traceback (with a suggestion for a misspelt key or option), while a bug keeps its traceback.
docs/reliability.md lists it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from flowgrpo import cli
from flowgrpo.config import ConfigError
from flowgrpo.errors import did_you_mean, mark_set_up, user_message
from flowgrpo.runlog import RUN_ENTRIES, RunDirInUse

from test_faults import BASE, CONF  # tests/test_faults.py: a tiny tiny_sd3 run writing into tmp_path

REPO = Path(__file__).resolve().parents[1]
QUICK = [*BASE, "trainer.iterations=1", "trainer.eval_at_end=false", "trainer.gallery_every=1"]


def _compose(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train", overrides=list(overrides))


def _earlier_run(run: Path) -> dict[str, str]:
    """A run dir as a finished run leaves it (its files' names, not their contents, are what a new run looks at);
    returns every file's sha256."""
    for rel, text in {"config.yaml": "trainer: {}\n", "train.log": "the earlier run's log\n",
                      "metrics.jsonl": '{"iteration": 1}\n', "summary.json": '{"iterations": 5}\n',
                      "curves.png": "png", ".hydra/config.yaml": "the earlier command\n",
                      ".hydra/overrides.yaml": "- trainer.iterations=5\n", "checkpoints/latest": "checkpoint-000005\n",
                      "checkpoints/checkpoint-000005/state.pt": "state", "gallery/train/step-000005.png": "grid",
                      "notes.txt": "the user's own notes\n"}.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    return _digests(run)


def _digests(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*"))
            if p.is_file()}


def test_a_fresh_run_refuses_a_hydra_run_dir_that_holds_a_run_and_leaves_it_byte_identical(tmp_path):
    """``python train.py hydra.run.dir=<a run>`` (no trainer.resume): one message naming the ways on, exit status 1,
    no traceback, and every file of the earlier run as it was (Hydra's own record of the command, .hydra/, too)."""
    work, run = tmp_path / "cwd", tmp_path / "run"
    work.mkdir()
    before = _earlier_run(run)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *QUICK, f"hydra.run.dir={run}"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"error: hydra.run.dir={run} already holds a run (config.yaml, train.log, metrics.jsonl" in proc.stderr
    assert "trainer.resume=auto" in proc.stderr and "trainer.overwrite=true" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("error:") == 1
    assert _digests(run) == before  # byte-identical, and nothing added
    assert list(work.iterdir()) == []  # no outputs/DATE/TIME either


def test_a_fresh_run_refuses_an_output_dir_that_holds_a_run(tmp_path):
    run = tmp_path / "run"
    before = _earlier_run(run)
    with pytest.raises(RunDirInUse, match=r"trainer\.output_dir=.*already holds a run") as info:
        cli.main(_compose(*QUICK, f"trainer.output_dir={run}"))
    assert "trainer.resume=auto" in str(info.value) and "trainer.overwrite=true" in str(info.value)
    assert _digests(run) == before
    # a dir holding only files of the user's is no run: tests/test_runlog.py sets a run up beside them


def test_overwrite_replaces_the_earlier_run_and_a_resume_continues_it(tmp_path):
    """``trainer.overwrite=true`` removes the earlier run's files first (the dir never mixes two runs: no gallery step
    or checkpoint of the earlier run is left) and nothing else; every entry a run writes is one it would remove; a
    resume into a dir holding a run is never refused."""
    run = tmp_path / "run"
    _earlier_run(run)
    summary = cli.main(_compose(*QUICK, f"trainer.output_dir={run}", "trainer.overwrite=true"))
    assert summary["iterations"] == 1
    assert (run / "notes.txt").read_text() == "the user's own notes\n"
    assert not (run / "gallery" / "train" / "step-000005.png").exists()
    assert [p.name for p in (run / "checkpoints").glob("checkpoint-*")] == ["checkpoint-000001"]
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    log = (run / "train.log").read_text()
    assert "the earlier run's log" not in log and "trainer.overwrite=true: removed the earlier run's" in log
    assert not (run / ".hydra").exists()  # the earlier command's record (a run started from Python writes none)
    assert {p.name for p in run.iterdir()} <= {*RUN_ENTRIES, ".hydra", "notes.txt"}
    resumed = cli.main(_compose(*QUICK, f"trainer.output_dir={run}", "trainer.resume=auto", "trainer.iterations=2"))
    assert resumed["iterations"] == 2


def _run_without_a_checkpoint(run: Path) -> dict[str, str]:
    """A run dir as a run that ended before its first checkpoint leaves it (killed during its first iteration, or run
    with trainer.checkpoint_every=0): its files, and in checkpoints/ only the temporary dir of a save that never
    finished; returns every file's sha256."""
    for rel, text in {"config.yaml": "trainer: {}\n", "train.log": "the earlier run's log\n",
                      "metrics.jsonl": '{"iteration": 1}\n', ".hydra/config.yaml": "the earlier command\n",
                      "gallery/train/step-000001.png": "grid",
                      "checkpoints/.tmp-checkpoint-000002.host.1.abc/state.pt": "half a state",
                      "notes.txt": "the user's own notes\n"}.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    return _digests(run)


def test_resume_auto_refuses_a_dir_whose_run_left_no_checkpoint_and_leaves_it_byte_identical(monkeypatch, capsys,
                                                                                                tmp_path):
    """``trainer.resume=auto`` pointed at a dir that holds a run but no checkpoint of it would start a second run
    among the first one's files: one message saying what was found and the ways on (trainer.overwrite=true, a new
    dir), exit status 1, and every file of the earlier run as it was."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("FLOWGRPO_DEBUG", raising=False)
    work, run = tmp_path / "cwd", tmp_path / "run"
    work.mkdir()
    monkeypatch.chdir(work)
    before = _run_without_a_checkpoint(run)
    code, err = _train_py(monkeypatch, capsys, *QUICK, f"hydra.run.dir={run}", "trainer.resume=auto")
    assert code == 1, err
    assert (f"error: trainer.resume=auto: hydra.run.dir={run} holds a run (config.yaml, train.log, metrics.jsonl, "
            f"checkpoints/, gallery/) but no checkpoint to continue from (none in {run / 'checkpoints'})") in err, err
    assert "start over there: trainer.overwrite=true" in err and "hydra.run.dir=<a new directory>" in err
    assert "Traceback" not in err and err.count("error:") == 1
    assert _digests(run) == before  # byte-identical, and nothing added
    assert list(work.iterdir()) == []
    with pytest.raises(RunDirInUse, match=r"trainer\.resume=auto: trainer\.output_dir=.* but no checkpoint"):
        cli.main(_compose(*QUICK, f"trainer.output_dir={run}", "trainer.resume=auto"))
    assert _digests(run) == before


def test_resume_auto_still_resumes_a_checkpoint_and_starts_fresh_in_a_new_dir(tmp_path):
    """What the refusal leaves alone: a dir with a checkpoint is claimed as it is (the resume continues it, whatever
    else is there), and so is a new or empty dir; trainer.overwrite=true with trainer.resume=auto clears a run that left
    no checkpoint (and nothing of the user's) so that the run starts over there; a fresh start no longer suggests
    trainer.resume=auto for such a run."""
    with_checkpoint, without, new = tmp_path / "with_checkpoint", tmp_path / "without", tmp_path / "new"
    before = _earlier_run(with_checkpoint)
    auto = ["trainer.resume=auto"]
    for overwrite in ([], ["trainer.overwrite=true"]):  # a resubmitted job may pass both: its checkpoint is kept
        cfg = _compose(*QUICK, *auto, *overwrite, f"trainer.output_dir={with_checkpoint}")
        assert cli._claim(with_checkpoint, cfg) == []
        assert _digests(with_checkpoint) == before
    assert cli._claim(new, _compose(*QUICK, *auto, f"trainer.output_dir={new}")) == []
    new.mkdir()
    assert cli._claim(new, _compose(*QUICK, *auto, f"trainer.output_dir={new}")) == []
    _run_without_a_checkpoint(without)
    with pytest.raises(RunDirInUse, match=r"\(it has no checkpoint to continue from\)") as fresh:
        cli._claim(without, _compose(*QUICK, f"trainer.output_dir={without}"))
    assert "trainer.resume=auto" not in str(fresh.value)
    removed = cli._claim(without, _compose(*QUICK, *auto, "trainer.overwrite=true", f"trainer.output_dir={without}"))
    assert set(removed) == {"config.yaml", "train.log", "metrics.jsonl", "checkpoints/", "gallery/", ".hydra/"}
    assert [p.name for p in without.iterdir()] == ["notes.txt"]


def test_the_run_dir_is_refused_on_every_process_by_the_main_process_decision(tmp_path, monkeypatch):
    """Under a multi-process launch only rank 0 looks at the dir; the others receive its decision and raise the same
    refusal (instead of waiting in a collective that rank 0 never reaches), writing nothing."""
    import accelerate.utils

    run = tmp_path / "run"
    before = _earlier_run(run)
    cfg = _compose(*QUICK, f"trainer.output_dir={run}")
    sent = {}

    def broadcast(objects, from_process=0):
        if sent:  # a process other than the main one receives what the main process sent
            objects[:] = sent["objects"]
        else:
            sent["objects"] = list(objects)
        return objects

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)
    main = SimpleNamespace(is_main_process=True, num_processes=2)
    with pytest.raises(RunDirInUse) as on_main:
        cli._shared_output_dir(cfg, main)
    other = SimpleNamespace(is_main_process=False, num_processes=2)
    with pytest.raises(RunDirInUse) as on_other:
        cli._shared_output_dir(cfg, other)
    assert str(on_other.value) == str(on_main.value)
    assert _digests(run) == before


# ------------------------------------------------------------------------------------------- errors for people


def _train_py(monkeypatch, capsys, *overrides) -> tuple[int | str | None, str]:
    """``python train.py OVERRIDES`` in this process (runpy: no second import of torch); its exit status and stderr."""
    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.setattr(sys, "argv", ["train.py", *overrides, "hydra/job_logging=none", "hydra/hydra_logging=none"])
    code = 0
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
    finally:
        GlobalHydra.instance().clear()
    return code, capsys.readouterr().err


@pytest.mark.parametrize("override, said", [
    ("trainer.iteration=5", "error: trainer.iteration=5: no key 'iteration' in trainer; did you mean "
                            "trainer.iterations=5?"),
    ("sampler=mixsde", "error: sampler=mixsde: no such option; did you mean sampler=mix_sde? (options: cps, dance, "
                       "mix_sde, mix_sde_flash, sde, stream)"),
    ("samplr=sde", "did you mean sampler=sde?"),
    ("algo.clip_rang=0.1", "did you mean algo.clip_range=0.1?"),
    ("trainer.group_size=abc", "error: trainer.group_size=abc: Value 'abc' of type 'str' could not be converted to "
                               "Integer"),
    ("trainer.lr_scheduler=cosin", "trainer.lr_scheduler='cosin' is not one of constant, cosine, linear; did you mean "
                                   "trainer.lr_scheduler=cosine?"),
], ids=["key", "option", "group", "algo_key", "type", "choice"])
def test_a_mistake_in_the_command_is_one_message_with_a_suggestion(monkeypatch, capsys, tmp_path, override, said):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("FLOWGRPO_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    code, err = _train_py(monkeypatch, capsys, override)
    assert code == 1 and said in err, err
    assert "Traceback" not in err and "base_sampler" not in err and "object_type" not in err
    assert "HYDRA_FULL_ERROR" not in os.environ  # lent to Hydra while it composed, then taken back
    assert list(tmp_path.iterdir()) == []


def test_reward_custom_without_a_target_stops_before_any_model_loads(monkeypatch, capsys, tmp_path):
    """``reward=custom`` is the user's own reward: without ``reward.target`` the run stops at start-up with one
    message naming the key (it never trains on the package's example reward in its place)."""
    import flowgrpo.trainer

    def no_model(*args, **kwargs):
        raise AssertionError("the trainer (and its model) was built")

    monkeypatch.setattr(flowgrpo.trainer, "Trainer", no_model)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("FLOWGRPO_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    code, err = _train_py(monkeypatch, capsys, *QUICK, "reward=custom")
    assert code == 1, err
    assert "reward=custom trains your own reward and reward.target is not set: set " \
           "reward.target=package.module:function" in err, err
    assert "Traceback" not in err and err.count("error:") == 1
    assert list(tmp_path.iterdir()) == []  # no run dir


def test_a_user_error_in_the_run_is_one_message_and_a_bug_keeps_its_traceback(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("FLOWGRPO_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    missing = [*QUICK, "data.train_file=missing.jsonl", f"trainer.output_dir={tmp_path / 'run'}"]
    code, err = _train_py(monkeypatch, capsys, *missing)
    assert code == 1 and "error: data.train_file='missing.jsonl': no such file" in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    monkeypatch.setenv("FLOWGRPO_DEBUG", "1")  # the traceback, as Hydra prints it
    code, err = _train_py(monkeypatch, capsys, *missing)
    assert code == 1 and "Traceback" in err and "FileNotFoundError: data.train_file='missing.jsonl'" in err
    monkeypatch.delenv("FLOWGRPO_DEBUG")

    def bug(cfg):
        raise KeyError("a bug, not the user's")

    monkeypatch.setattr(cli, "main", bug)
    code, err = _train_py(monkeypatch, capsys, *QUICK)
    assert code == 1 and "Traceback" in err and "KeyError: \"a bug, not the user's\"" in err
    assert "error: " not in err


def test_user_message_tells_user_errors_from_bugs():
    assert user_message(ConfigError("invalid config:\n  trainer.iteration: unknown key (not in TrainerConfig, "
                                    "flowgrpo.config)")).endswith("; did you mean trainer.iterations?")
    assert user_message(ModuleNotFoundError("No module named 'cv2'", name="cv2")).startswith(
        "No module named 'cv2': install the package")
    assert user_message(ModuleNotFoundError("No module named 'flowgrpo.x'", name="flowgrpo.x")) is None  # ours: a bug
    assert user_message(ImportError("logger=aim needs the 'aim' package: pip install aim")) == (
        "logger=aim needs the 'aim' package: pip install aim")
    refused = ValueError("data.train_file='a.jsonl': record 3 has no 'prompt'")
    assert user_message(refused) is None  # a ValueError anywhere may be a bug ...
    mark_set_up(refused)  # ... one the run's set-up raised is a value it refused
    assert user_message(refused).startswith("data.train_file='a.jsonl': record 3 has no 'prompt'")
    err = FileNotFoundError("model.pretrained='x': no such directory")
    err.add_note("a note that says more")
    assert user_message(err) == "model.pretrained='x': no such directory\na note that says more"
    assert did_you_mean("iteration", ["iterations", "seed"]) == "iterations" and did_you_mean("zzz", ["seed"]) is None


# ------------------------------------------------------------------------------------------- the start-up banner


def test_the_banner_says_when_the_sampler_option_samples_other_steps_than_the_models_grid():
    line = cli.steps_cost_line(_compose("sampler=mix_sde"))  # the embedded model's grid: 10 and 10
    assert line == ("steps: sampler=mix_sde samples 25 steps where the model's grid has 10 (model.num_steps): about "
                    "2.5x its velocity calls per rollout; sampler=mix_sde samples 25 steps where the model's grid has "
                    "10 (model.eval_num_steps): about 2.5x its velocity calls per held-out sample")
    assert "sampler.num_steps=20 samples 20 steps" in cli.steps_cost_line(_compose("sampler=mix_sde",
                                                                                   "sampler.num_steps=20"))
    assert cli.steps_cost_line(_compose("sampler=sde")) is None  # the model's grid


def test_library_info_lines_and_loading_bars_are_off_during_a_run(monkeypatch):
    from diffusers.utils import logging as diffusers_logging

    root, library = logging.getLogger(), logging.getLogger("matplotlib.font_manager")
    level = root.level
    root.setLevel(logging.INFO)  # as Hydra's job logging sets it: a library's INFO line reaches the console
    try:
        monkeypatch.delenv("FLOWGRPO_DEBUG", raising=False)
        with cli._quiet_libraries():
            assert not library.isEnabledFor(logging.INFO) and library.isEnabledFor(logging.WARNING)
            assert not diffusers_logging.is_progress_bar_enabled()
        assert library.isEnabledFor(logging.INFO) and diffusers_logging.is_progress_bar_enabled()
        monkeypatch.setenv("FLOWGRPO_DEBUG", "1")
        with cli._quiet_libraries():
            assert library.isEnabledFor(logging.INFO) and diffusers_logging.is_progress_bar_enabled()
    finally:
        root.setLevel(level)
