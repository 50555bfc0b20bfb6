"""Weight-free rewards: JPEG compressibility ordering and the reward contract; every registered reward's input rules
(an empty batch, float pixels outside [0, 1]); your own reward as a function or an import path; strict JSON."""

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from rewards.images import RANGE_TOLERANCE


def test_jpeg_rewards_order_smooth_above_noisy():
    gen = torch.Generator().manual_seed(0)
    smooth = torch.linspace(0, 1, 64).view(1, 1, 1, 64).expand(2, 3, 64, 64).clone()
    noisy = torch.rand(2, 3, 64, 64, generator=gen)
    images = torch.cat([smooth, noisy])
    comp = rewards.load("jpeg_compressibility")(images, [""] * 4)
    incomp = rewards.load("jpeg_incompressibility")(images, [""] * 4)
    assert comp.scores.shape == (4,) and set(comp.components) == {"jpeg_kb"}
    assert comp.scores[:2].min() > comp.scores[2:].max()
    torch.testing.assert_close(incomp.scores, -comp.scores)
    # uint8 and PIL inputs give the same sizes as float input
    as_uint8 = (images * 255).round().to(torch.uint8)
    torch.testing.assert_close(rewards.load("jpeg_compressibility")(as_uint8, [""] * 4).scores, comp.scores)


# ------------------------------------------------------------------------- every reward: its inputs and an empty batch

PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "prompts"


def _records(name: str, n: int = 2) -> list[dict]:
    return [json.loads(line) for line in (PROMPTS / name).read_text().splitlines()[:n]]


def _clip_twin(root: Path) -> Path:
    from twins import save_tiny_clip  # tests/twins.py

    if not (root / "config.json").exists():
        torch.manual_seed(0)
        save_tiny_clip(root)
    return root


def _aesthetic_mlp(root: Path) -> Path:
    from rewards.clip.aesthetic import AestheticMLP

    path = root / "aesthetic.pth"
    if not path.exists():
        torch.manual_seed(0)
        torch.save(AestheticMLP(16).state_dict(), path)  # 16: the twin's projection_dim
    return path


# name -> (kwargs given the twins' folder, "image" | "video" | "stream", metadata file or None). Every registered
# reward is here or in NOT_BUILT, so a new reward is held to both rules by being registered.
OFFLINE = {
    "geneval": (lambda d: {"detector": "shapes"}, "image", "shapes_held_out.jsonl"),
    "jpeg_compressibility": (lambda d: {}, "image", None),
    "jpeg_incompressibility": (lambda d: {}, "image", None),
    "ocr": (lambda d: {"num_threads": 1}, "image", None),
    "custom": (lambda d: {"target": "rewards.examples:redness"}, "image", None),
    "multi": (lambda d: {"components": [{"name": "geneval", "kwargs": {"detector": "shapes"}},
                                        {"name": "jpeg_compressibility", "weight": 0.1},
                                        {"target": "rewards.examples:redness", "weight": 0.5}]}, "image",
              "shapes_held_out.jsonl"),
    "remote": (lambda d: {"url": "http://127.0.0.1:9/score", "retries": 0, "retry_window": 0.0}, "image", None),
    "pickscore": (lambda d: {"model_path": str(_clip_twin(d / "clip")), "processor_path": str(d / "clip"),
                             "device": "cpu"}, "image", None),
    "clipscore": (lambda d: {"clip_path": str(_clip_twin(d / "clip")), "device": "cpu"}, "image", None),
    "aesthetic": (lambda d: {"checkpoint": str(_aesthetic_mlp(d)), "clip_path": str(_clip_twin(d / "clip")),
                             "device": "cpu"}, "image", None),
    "video_geneval": (lambda d: {}, "video", "motion_held_out.jsonl"),
    "video_clip": (lambda d: {"clip_path": str(_clip_twin(d / "clip")), "num_frames": 2}, "video", None),
    "video_consistency": (lambda d: {"backbone": "pixels", "model_path": None}, "video", None),
    "video_flicker": (lambda d: {}, "video", None),
    "video_motion": (lambda d: {"method": "frame_diff"}, "video", None),
    "video_sharpness": (lambda d: {}, "video", None),
    "long_video": (lambda d: {}, "stream", "streams_val.jsonl"),
    "segments": (lambda d: {"reward": "video_flicker"}, "stream", "streams_val.jsonl"),
}
#: rewards whose weights have no cheap twin here (their conversions are the shared ones; tests/test_learned_rewards.py)
NOT_BUILT = {"hpsv21": "an open_clip ViT twin", "imagereward": "a BLIP twin in ImageReward.pt's layout"}


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    return tmp_path_factory.mktemp("reward_twins")


def _batch(kind: str, metadata_file: str | None, n: int = 2):
    """``n`` samples of ``kind`` in [0, 1], their prompts and metadata."""
    g = torch.Generator().manual_seed(0)
    metadata = _records(metadata_file, n) if metadata_file else None
    if kind == "image":
        x = torch.rand(n, 3, 32, 32, generator=g)
    else:
        frames = int(metadata[0]["num_frames"]) if kind == "stream" else 5
        x = torch.rand(n, frames, 3, 32, 32, generator=g)
    prompts = [m["prompt"] for m in metadata] if metadata else ['a sign that says "hi"'] * n
    return x, prompts, metadata


def test_every_registered_reward_is_held_to_the_input_rules():
    assert set(OFFLINE) | set(NOT_BUILT) == set(rewards.available())


@pytest.mark.parametrize("name", sorted(OFFLINE))
def test_an_empty_batch_gets_an_empty_result_and_pixels_off_range_are_refused(name, twins):
    make, kind, metadata_file = OFFLINE[name]
    reward = rewards.load(name, **make(twins))
    x, prompts, metadata = _batch(kind, metadata_file)
    empty = reward(x[:0], [], None if metadata is None else [])
    assert empty.scores.shape == (0,) and all(v.shape == (0,) for v in empty.components.values())
    for bad, cause in ((x * 255, "x / 255"), (x * 2 - 1, "(x + 1) / 2")):
        with pytest.raises(ValueError, match=re.escape(cause)) as err:
            reward(bad, prompts, metadata)
        assert "outside [0, 1]" in str(err.value) and "batch indices [0" in str(err.value)  # segments: per clip



def test_the_range_rule_accepts_rounding_uint8_and_pil():
    reward = rewards.load("jpeg_compressibility")
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 32, 32, generator=g)
    reference = reward(x, ["", ""]).scores
    # within the tolerance: clipped as before (a decoder's rounding), the same score
    nudged = x.clone()
    nudged[0, 0, 0, 0], nudged[1, 0, 0, 0] = 1 + RANGE_TOLERANCE / 2, -RANGE_TOLERANCE / 2
    torch.testing.assert_close(reward(nudged.clamp(0, 1), ["", ""]).scores, reward(nudged, ["", ""]).scores)
    as_uint8 = (x * 255).round().to(torch.uint8)
    torch.testing.assert_close(reward(as_uint8, ["", ""]).scores, reference)
    pils = [Image.fromarray(a.permute(1, 2, 0).numpy()) for a in as_uint8]
    torch.testing.assert_close(reward(pils, ["", ""]).scores, reference)
    # a list whose second image is in [0, 255]: refused, naming that one
    with pytest.raises(ValueError, match=r"batch indices \[1\].*x / 255"):
        reward([x[0], x[1] * 255], ["", ""])
    with pytest.raises(ValueError, match=r"x / 255"):  # numpy too
        reward(x.numpy() * 255, ["", ""])
    with pytest.raises(ValueError, match=r"NaN or inf"):  # non-finite still says so first
        reward(torch.full((1, 3, 8, 8), math.nan), [""])


# ------------------------------------------------------------------------------------------ your own reward


def brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))


def test_a_plain_function_becomes_a_reward_whose_output_is_checked():
    x = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    out = rewards.wrap(brightness)(x, ["a", "b", "c"])
    torch.testing.assert_close(out.scores, x.mean(dim=(1, 2, 3)))
    for returned in ([0.1, 0.2, 0.3], np.array([0.1, 0.2, 0.3]), torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64),
                     rewards.RewardOutput(torch.tensor([0.1, 0.2, 0.3]), {"part": torch.tensor([1.0, math.nan, 2.0])})):
        got = rewards.wrap(lambda images, prompts, metadata, r=returned: r, name="fixed")(x, ["a", "b", "c"])
        torch.testing.assert_close(got.scores, torch.tensor([0.1, 0.2, 0.3]))
    for returned, error, message in (
            ([0.1, 0.2], ValueError, "fixed returned 2 scores for a batch of 3 samples"),
            ([0.1, math.nan, 0.3], ValueError, r"fixed returned nan at rows \[1\]"),
            ([0.1, None, 0.3], TypeError, r"fixed returned a non-number at rows \[1\] \(None\)"),
            (torch.zeros(3, 1), ValueError, r"scores of shape \(3, 1\)"),
            (0.5, TypeError, "fixed returned float"),
            ({"scores": [1, 2, 3]}, TypeError, "fixed returned dict")):
        with pytest.raises(error, match=message):
            rewards.wrap(lambda images, prompts, metadata, r=returned: r, name="fixed")(x, ["a", "b", "c"])
    called = []
    empty = rewards.wrap(lambda images, prompts, metadata: called.append(1))(x[:0], [])
    assert empty.scores.shape == (0,) and not called  # an empty batch never reaches the function
    with pytest.raises(TypeError, match=r"cannot be called as fn\(images, prompts, metadata\)"):
        rewards.wrap(lambda images, prompts: [0.0])


def test_an_import_path_names_what_is_missing(tmp_path, monkeypatch):
    (tmp_path / "my_scores.py").write_text(
        "def sharpness(images, prompts, metadata, scale=1.0):\n    return scale * images.std(dim=(1, 2, 3))\n\n"
        "class Gain:\n    def __init__(self, gain):\n        self.gain = gain\n\n"
        "    def __call__(self, images, prompts, metadata):\n        return self.gain * images.mean(dim=(1, 2, 3))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_scores", raising=False)
    x = torch.full((2, 3, 8, 8), 0.5)
    assert rewards.load("custom", target="my_scores:Gain", gain=2.0)(x, ["", ""]).scores.tolist() == [1.0, 1.0]
    assert rewards.load("custom", target="my_scores.sharpness", scale=2.0)(x, ["", ""]).scores.tolist() == [0.0, 0.0]
    for target, error, message in (
            ("my_scores:sharpnes", AttributeError, r"'my_scores' has no attribute 'sharpnes' \(did you mean 'sharpness'"),
            ("my_score:sharpness", ImportError, r"no module named 'my_score' \(did you mean 'my_scores'"),
            ("sharpness", ValueError, r"is not an import path: write package.module:name"),
            ("rewards.jpeg:RANGE", AttributeError, r"'rewards.jpeg' has no attribute 'RANGE'")):
        with pytest.raises(error, match=re.escape(f"target={target!r}") + ".*" + message):
            rewards.load("custom", target=target)
    with pytest.raises(TypeError, match=r"kwargs=\{'gian': 2\} rejected by my_scores:Gain"):
        rewards.load("custom", target="my_scores:Gain", gian=2)


def test_multi_takes_your_reward_by_path_or_as_a_callable():
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    multi = rewards.load("multi", components=[{"name": "jpeg_compressibility", "weight": 0.1},
                                              {"target": "rewards.examples:redness", "weight": 1.0},
                                              {"reward": brightness, "weight": 0.5}])
    assert multi.weights == {"jpeg_compressibility": 0.1, "redness": 1.0, "brightness": 0.5}
    out = multi(x, ["", ""])
    from rewards.examples import redness

    torch.testing.assert_close(out.components["brightness"], brightness(x, None, None))
    expected = 0.1 * out.components["jpeg_compressibility"] + redness(x, None, None) + 0.5 * brightness(x, None, None)
    torch.testing.assert_close(out.scores, expected)
    with pytest.raises(ValueError, match="one of 'name'"):
        rewards.load("multi", components=[{"name": "geneval", "target": "rewards.examples:redness"}])


# ------------------------------------------------------------------------------------------ strict JSON


def test_json_writers_write_nan_and_inf_as_null():
    from flowgrpo.jsonio import dumps
    from rewards._json import dumps as rewards_dumps

    def refuse(constant):
        raise ValueError(constant)

    row = {"a": math.nan, "b": [1.5, math.inf, (2, -math.inf)], "c": np.float32("nan"), "d": 3, "e": {"f": math.nan}}
    for write in (dumps, rewards_dumps):
        assert json.loads(write(row), parse_constant=refuse) == {"a": None, "b": [1.5, None, [2, None]], "c": None,
                                                                  "d": 3, "e": {"f": None}}
