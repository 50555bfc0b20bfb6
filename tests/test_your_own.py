"""``docs/your-own.md`` as a user follows it: its prompts file and reward module written into a folder of their own,
its command line and its Python script run on the embedded model (cut to one tiny iteration), and the run's logs
checked against what the reward function returned. Also: a run whose metrics hold a NaN writes strict JSON."""

from __future__ import annotations

import functools
import json
import math
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "your-own.md"
# how much is run, nothing about what: one iteration of 2 prompts × 2 samples, no evaluation or gallery
FAST = ["trainer.iterations=1", "trainer.eval_every=0", "trainer.group_size=2", "trainer.prompts_per_iteration=2",
        "trainer.train_batch_size=2", "trainer.gallery_every=0", "trainer.checkpoint_every=0"]


def block(after: str, lang: str) -> str:
    """The first ```lang block of the page after the text ``after``."""
    page = PAGE.read_text()
    assert after in page, f"docs/your-own.md no longer says {after!r}"
    return re.search(rf"```{lang}\n(.*?)```", page.split(after, 1)[1], re.S).group(1)


def strict_json(text: str):
    """``json.loads`` that refuses NaN / Infinity (what strict parsers do)."""
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def metrics(run: Path) -> list[dict]:
    return [strict_json(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The user's folder: the page's prompts.txt and my_rewards.py, the working directory and on the import path."""
    (tmp_path / "prompts.txt").write_text(block("`prompts.txt`, one prompt a line", "text"))
    (tmp_path / "my_rewards.py").write_text(block("`my_rewards.py`:", "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    yield tmp_path
    sys.modules.pop("my_rewards", None)


@pytest.fixture
def calls(project, monkeypatch):
    """What ``my_rewards.redness`` returned, call by call: it is replaced by a spy that records its results."""
    import my_rewards

    plain, seen = my_rewards.redness, []

    @functools.wraps(plain)  # the same name and module: the run records my_rewards:redness
    def redness(images, prompts, metadata):
        out = plain(images, prompts, metadata)
        seen.append(out.detach().cpu().clone())
        return out

    monkeypatch.setattr(my_rewards, "redness", redness)
    return seen


def test_the_prompts_and_the_reward_as_written(project):
    prompts = [line for line in (project / "prompts.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert len(prompts) == 4
    scope = runpy.run_path(str(_write(project, "try_it.py", block("Try it alone:", "python"))))
    assert scope["out"].scores.shape == (4,) and torch.isfinite(scope["out"].scores).all()
    import my_rewards

    red, grey = torch.zeros(1, 3, 8, 8), torch.full((1, 3, 8, 8), 0.5)
    red[:, 0] = 1.0
    assert my_rewards.redness(torch.cat([red, grey]), ["", ""], None).tolist() == [1.0, 0.0]
    assert my_rewards.Redness(gain=2)(red, [""], None).tolist() == [2.0]


@pytest.mark.usefixtures("one_thread")
def test_the_command_line_trains_on_the_users_reward(project, calls, monkeypatch, capsys):
    """The page's command, run in this process (``PYTHONPATH=.`` is the project folder on ``sys.path``, as the fixture
    sets it), without a second 5-s import of torch and diffusers in a subprocess."""
    from hydra.core.global_hydra import GlobalHydra

    command = block("## 3. Train from the command line", "bash").replace("\\\n", " ").strip()
    prefix, sep, args = command.partition(" python $FLOWGRPO/train.py ")
    assert prefix == "PYTHONPATH=." and sep and "reward=custom reward.target=my_rewards:redness" in args, command
    monkeypatch.setattr(sys, "argv", ["train.py", *shlex.split(args), *FAST, "trainer.output_dir=run",
                                      "hydra/job_logging=none", "hydra/hydra_logging=none"])
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    finally:
        GlobalHydra.instance().clear()  # leave no Hydra state behind for other tests
    out = capsys.readouterr().out
    assert "reward: my_rewards:redness;" in out and "done: 1 iterations" in out, out[-3000:]
    (row,) = metrics(project / "run")
    assert len(calls) == 1 and row["iteration"] == 1  # one iteration of 4 samples, scored once
    assert row["reward/mean"] == pytest.approx(float(calls[0].mean()), rel=1e-6, abs=1e-9)


@pytest.mark.usefixtures("one_thread")
def test_the_python_script_calls_the_function_and_logs_what_it_returned(project, calls, monkeypatch):
    script = _write(project, "train_redness.py", block("`train_redness.py`:", "python"))
    monkeypatch.setattr(sys, "argv", [str(script), *FAST, "trainer.output_dir=api"])
    summary = runpy.run_path(str(script), run_name="__main__")["summary"]
    assert summary["iterations"] == 1 and summary["output_dir"] == "api"
    assert len(calls) == 1 and calls[0].shape == (4,)  # one iteration: 2 prompts × 2 samples, scored once
    (row,) = metrics(project / "api")
    assert row["reward/mean"] == pytest.approx(float(calls[0].mean()), rel=1e-6, abs=1e-9)
    assert row["reward/std"] == pytest.approx(float(calls[0].std()), rel=1e-5, abs=1e-9)
    config = (project / "api" / "config.yaml").read_text()
    assert "name: custom" in config and "target: my_rewards:redness" in config  # the run records whose reward it was


@pytest.mark.usefixtures("one_thread")
def test_several_rewards_with_the_users_own(project, calls, monkeypatch):
    """The page's ``reward=multi`` command composes and builds (its training is the command above's); its Python
    ``MultiReward`` trains under TaRoS (the paper's: it logs its softmax weights) and logs each term."""
    import flowgrpo
    import flowgrpo.api
    from flowgrpo.builders import build_aggregator, build_reward
    from flowgrpo.config import validate

    command = block("**With other rewards.**", "bash")
    overrides = [o.strip("'") for o in re.findall(r"'[^']*'|\S+", command.split("train.py", 1)[1])]
    cfg = validate(flowgrpo.compose(overrides))
    reward = build_reward(cfg.reward)
    assert reward.weights == {"geneval": 1.0, "redness": 0.5} and build_aggregator(cfg, reward) is not None

    train = flowgrpo.api.train
    monkeypatch.setattr(flowgrpo.api, "train", lambda config, **kw: train([*config, *FAST, "trainer.output_dir=multi"],
                                                                          **kw))
    runpy.run_path(str(_write(project, "both.py", block("Several rewards from Python:", "python"))))
    (row,) = metrics(project / "multi")
    assert len(calls) == 1 and row["reward/redness"] == pytest.approx(float(calls[0].mean()), rel=1e-6, abs=1e-9)
    assert "reward/jpeg_compressibility" in row and "taros/redness/weight" in row


def test_a_bad_import_path_fails_before_any_model_loads(project):
    import flowgrpo

    for target, expected in (("my_rewards:rednes", "did you mean 'redness'"),
                             ("my_reward:redness", "no module named 'my_reward' (did you mean 'my_rewards'")):
        with pytest.raises((ImportError, AttributeError), match=re.escape(f"reward.target={target!r}")) as err:
            flowgrpo.train(["reward=custom", f"reward.target={target}", "trainer.output_dir=bad"])
        assert expected in str(err.value)
    assert not (project / "bad").exists()  # refused before a run dir was kept (or a model loaded)


def test_each_call_gets_a_run_dir_of_its_own(tmp_path, monkeypatch):
    """Calls without ``trainer.output_dir`` in the same second each get their own ``outputs/DATE/TIME`` (the second
    ``TIME_2``; it was the first's, and refused), made before the run starts; ``trainer.output_dir`` is used as given;
    a call that fails before its run wrote anything leaves no dir. The run is replaced by one that takes the dir it is
    handed (the real one refuses a dir that holds a run: tests/test_user_errors.py)."""
    from types import SimpleNamespace

    import flowgrpo
    from flowgrpo import api, cli

    def run(cfg):
        out = Path(cfg.trainer.output_dir)
        if cfg.trainer.iterations == 0:  # a set-up failure, before anything is written
            raise ValueError("refused")
        made = out.is_dir()
        assert not made or not any(out.iterdir())  # made for this call: empty
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text("{}")  # a run's file: a later call must not get this dir
        return {"output_dir": str(out), "made": made}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "main", run)
    monkeypatch.setattr(api, "time", SimpleNamespace(strftime=lambda fmt: "2026-01-01/12-00-00"))  # one second
    assert flowgrpo.train([]) == {"output_dir": "outputs/2026-01-01/12-00-00", "made": True}
    assert flowgrpo.train([]) == {"output_dir": "outputs/2026-01-01/12-00-00_2", "made": True}
    with pytest.raises(ValueError, match="refused"):
        flowgrpo.train(["trainer.iterations=0"])
    assert sorted(p.name for p in (tmp_path / "outputs" / "2026-01-01").iterdir()) == ["12-00-00", "12-00-00_2"]
    assert flowgrpo.train(["trainer.output_dir=mine"]) == {"output_dir": "mine", "made": False}  # the run's to claim
    from flowgrpo.run_state import _RUN_TIME  # trainer.resume=auto in a TIME_2 dir still searches outputs/

    assert _RUN_TIME.fullmatch("12-00-00_2") and not _RUN_TIME.fullmatch("12-00-00-2")


@pytest.mark.usefixtures("one_thread")
def test_metrics_and_summary_are_strict_json_when_a_value_is_nan(project):
    """A component undefined on every sample is NaN in the run's means: written as null, never as a bare NaN."""
    import flowgrpo
    import rewards

    def partly_defined(images, prompts, metadata):
        score = images.mean(dim=(1, 2, 3))
        return rewards.RewardOutput(score, {"undefined": torch.full_like(score, math.nan)})

    summary = flowgrpo.train(["data=text_prompts", "data.train_file=prompts.txt", "data.val_file=prompts.txt",
                              "trainer.eval_before=true", "trainer.eval_at_end=false", "trainer.eval_num_prompts=2",
                              "trainer.eval_samples_per_tag=null", *FAST, "trainer.output_dir=nan"],
                             reward=partly_defined)
    rows = metrics(project / "nan")
    assert {"reward/undefined", "eval/undefined"} <= {k for r in rows for k in r}
    assert all(r[k] is None for r in rows for k in ("reward/undefined", "eval/undefined") if k in r)
    written = strict_json((project / "nan" / "summary.json").read_text())
    assert written["eval_first"]["eval/undefined"] is None and math.isnan(summary["eval_first"]["eval/undefined"])


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path
