"""Validate before compute: a bad prompt file or metadata record, a reward that cannot score what the model makes,
and an output directory that cannot take a checkpoint all fail while the trainer is set up -- before the model
loads and before any rollout -- with the file and line, ``reward=`` / ``model=``, or the directory in the message.
docs/reliability.md lists them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
import flowgrpo.trainer as trainer_module
from flowgrpo.builders import check_output_dir, check_reward_model, reward_modality
from flowgrpo.trainer import Trainer

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train", overrides=["debug=default", *overrides])


@pytest.fixture
def no_model(monkeypatch):
    """Record (and refuse) any attempt to load the model: the checks under test must fail before it."""
    calls = []

    def build_adapter(*args, **kwargs):
        calls.append(args)
        raise AssertionError("the model was loaded before the set-up checks failed")

    monkeypatch.setattr(trainer_module, "build_adapter", build_adapter)
    return calls


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in records))
    return path


def test_a_bad_metadata_line_fails_at_set_up_naming_file_and_line(tmp_path, no_model):
    good = {"tag": "single_object", "include": [{"class": "circle", "count": 1}], "prompt": "a photo of a circle"}
    bad = {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"}
    path = _jsonl(tmp_path / "prompts.jsonl", [good, "", good, bad, good])  # the bad record is on line 4
    cfg = compose_cfg("data=geneval_shapes", "reward=geneval", f"data.train_file={path}",
                      f"trainer.output_dir={tmp_path / 'run'}")
    with pytest.raises(ValueError, match=rf"{path}:4: record\.include\[0\]\.class: .*'cat'"):
        Trainer(cfg, tmp_path / "run")
    # a misspelt key inside a clause is refused with its line and the nearest known key, not judged without it
    misspelt = {"tag": "colors", "include": [{"class": "circle", "count": 1, "colour": "red"}], "prompt": "a red circle"}
    _jsonl(path, [good, misspelt])
    with pytest.raises(ValueError, match=rf"{path}:2: record\.include\[0\]: unknown key 'colour' \(did you mean 'color'\?\)"):
        Trainer(cfg, tmp_path / "run")
    assert no_model == []


def test_a_metadata_reward_on_a_plain_prompt_list_fails_at_set_up(tmp_path, no_model):
    path = tmp_path / "prompts.txt"
    path.write_text("a photo of a circle\n")
    cfg = compose_cfg("data=text_prompts", "reward=geneval", f"data.train_file={path}")
    with pytest.raises(ValueError, match=r"reward=geneval needs a metadata record per prompt.*data\.format=text"):
        Trainer(cfg, tmp_path / "run")
    assert no_model == []


def test_an_unparseable_or_empty_prompt_file_fails_at_set_up(tmp_path, no_model):
    path = _jsonl(tmp_path / "prompts.jsonl", ['{"prompt": "a circle", "tag": "single_object"', ])
    cfg = compose_cfg("data=geneval_shapes", f"data.train_file={path}")
    with pytest.raises(ValueError, match=rf"{path}:1: not JSON"):
        Trainer(cfg, tmp_path / "run")
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        Trainer(cfg, tmp_path / "run")
    assert no_model == []


@pytest.mark.parametrize("reward,model", [("video_flicker", "tiny_sd3"), ("video_geneval", "tiny_sd3"),
                                          ("jpeg_compressibility", "tiny_wan"), ("geneval", "tiny_wan")])
def test_a_reward_for_the_other_modality_fails_before_the_model_loads(tmp_path, no_model, reward, model):
    cfg = compose_cfg(f"model={model}", f"reward={reward}")
    with pytest.raises(ValueError, match=rf"reward={reward} .*model=wan|reward={reward} .*model=sd3"):
        Trainer(cfg, tmp_path / "run")
    assert no_model == []


def test_reward_modalities_from_the_config_alone():
    cfg = compose_cfg()
    for name, want in [("video_clip", "video"), ("video_consistency", "video"), ("video_motion", "video"),
                       ("video_geneval", "video"), ("geneval", "image"), ("pickscore", "image"), ("remote", "any")]:
        assert reward_modality(compose_cfg(f"reward={name}").reward) == want, name
    check_reward_model(compose_cfg("reward=multi").reward, cfg.model)  # geneval + jpeg on an image model: fine


def test_an_unwritable_output_dir_fails_at_set_up_naming_it(tmp_path, no_model):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "run"  # under a regular file: cannot be created, whoever runs the test
    cfg = compose_cfg(f"trainer.output_dir={out}")
    with pytest.raises(OSError, match=rf"output directory '{out}' is not writable"):
        Trainer(cfg, out)
    assert no_model == []


def test_too_little_free_space_for_a_checkpoint_fails_naming_the_dir(tmp_path, monkeypatch):
    import collections
    import flowgrpo.builders.checks as build

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(build.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 2**20, 2**20))
    with pytest.raises(OSError, match=rf"output directory '{tmp_path}' has 1 MiB free"):
        check_output_dir(tmp_path)


@pytest.mark.parametrize("model, override, message", [
    ("sd3_shapes", "model.height=63", r"model\.height=63: sd3 .* divisible by 8 .*; try model\.height=56 or 64"),
    ("wan_shapes", "model.width=60", r"model\.width=60: wan .* divisible by 8 .*; try model\.width=56 or 64"),
    ("wan_shapes", "model.num_frames=12", r"model\.num_frames=12: wan .* 4·k \+ 1 frames; try model\.num_frames=9 or 13"),
])
def test_a_size_the_pipeline_cannot_generate_fails_before_the_model_loads(tmp_path, no_model, model, override, message):
    cfg = compose_cfg(f"model={model}", *(["reward=video_geneval", "data=motion_shapes"] if "wan" in model else []),
                      override)
    with pytest.raises(ValueError, match=message):
        Trainer(cfg, tmp_path / "run")
    assert no_model == []
    assert not (tmp_path / "run" / "checkpoints").exists()  # no checkpoint, no resume advice: nothing ran


def test_every_shipped_pipeline_accepts_its_own_sizes():
    from flowgrpo.builders import check_sizes, size_multiples

    for model in ("sd3_shapes", "wan_shapes", "causal_wan_shapes"):
        cfg = compose_cfg(f"model={model}")
        assert size_multiples(cfg.model) is not None, model  # read from the local pipeline's configs
        check_sizes(cfg.model)


def test_a_batch_whose_rollouts_cannot_fit_is_refused_with_the_numbers_before_the_first_rollout(tmp_path):
    """One iteration keeps every state of every trajectory and the decoded samples (rollout_bytes), and runs forwards
    whose activations dwarf them on a small latent (forward_bytes: a rollout chunk's velocity call, or the decode of
    every sample); more than 80% of the memory left is refused naming the keys (trainer.group_size=100000 used to
    fill 10 GB in 40 s before anything said so)."""
    import math

    trainer = Trainer(compose_cfg(), tmp_path / "run")
    c, m = trainer.cfg.model, trainer.batch.rollouts_per_process
    latent = math.prod(trainer.adapter._latent_shape(1, c.height, c.width, None)[1:])
    states = (trainer.cfg.sampler.num_steps + 1) * (2 if trainer.algorithm.needs.record_means else 1)
    assert trainer.rollout_bytes() == 4 * m * (states * latent + 3 * c.height * c.width)
    forward = trainer.forward_bytes()
    # a forward keeps at least its input and output, and on the tiny model far more: the stored rollouts alone are
    # not an honest estimate
    assert forward > trainer.rollout_bytes()
    need = trainer.rollout_bytes() + forward
    trainer._check_rollout_memory(available=2 * need)  # fits: nothing said
    with pytest.raises(MemoryError, match=r"trainer\.prompts_per_iteration=\d+ x trainer\.group_size=\d+.*largest "
                                          r"forward takes .* GiB more.*GiB is available on cpu\. Lower trainer\.group_size"):
        trainer._check_rollout_memory(available=need)  # the stored rollouts alone would have fitted
    assert trainer.rollout_bytes() <= 0.8 * need


def test_the_rollout_memory_estimate_is_linear_in_the_batch_and_refuses_a_huge_group_before_any_rollout(
        tmp_path, monkeypatch):
    """The forward fitted from fake runs at 2 and 4 samples predicts the fake run at 6 (activations grow linearly
    with the batch). With 16 GiB free, trainer.group_size=100000 keeps 6 GiB of trajectories — under the
    80% line — but a rollout forward of all its samples needs far more: refused while the trainer is set up, before
    any rollout; the normal config is accepted."""
    import flowgrpo.guards as guards

    trainer = Trainer(compose_cfg(), tmp_path / "a")
    (v0, v1), (d0, d1) = guards._forward_fit(trainer)
    assert v1 > 0 and d1 > 0
    guards.forward_peaks(trainer, 1)  # this trainer's first decode (the fit is cached from another's) converts its VAE
    velocity, decode = guards.forward_peaks(trainer, 6)
    assert velocity == pytest.approx(v0 + 6 * v1, rel=0.01) and decode == pytest.approx(d0 + 6 * d1, rel=0.01)
    monkeypatch.setattr(guards, "available_memory", lambda device: 16 * 2**30)
    Trainer(compose_cfg(), tmp_path / "b")  # the normal config fits
    rolled = []
    monkeypatch.setattr(Trainer, "rollout", lambda self, *a, **k: rolled.append(a))
    huge = compose_cfg("trainer.group_size=100000", "trainer.train_batch_size=100000")
    with pytest.raises(MemoryError, match=r"trainer\.group_size=100000.*largest forward takes") as info:
        Trainer(huge, tmp_path / "c")
    assert rolled == []
    kept = float(str(info.value).split("rollouts keep ")[1].split(" GiB")[0])
    assert kept < 0.8 * 16  # the stored rollouts alone would have been let through
