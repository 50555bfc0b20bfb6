"""What a person sees when a run cannot start: a user error — an unknown key or option, a bad value, a missing path —
is one message without a traceback (with a suggestion for a misspelt key or option), while a bug keeps its traceback.
docs/reliability.md lists it."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import pytest

from flowgrpo import cli
from flowgrpo.config import ConfigError
from flowgrpo.errors import did_you_mean, mark_set_up, user_message

from test_faults import BASE  # tests/test_faults.py: a tiny tiny_sd3 run writing into tmp_path

REPO = Path(__file__).resolve().parents[1]
QUICK = [*BASE, "trainer.iterations=1", "trainer.eval_at_end=false", "trainer.gallery_every=1"]


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

