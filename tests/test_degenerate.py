"""Degenerate samples never earn reward: every reward buildable offline (learned ones on tiny random twins) x every
degenerate kind (all black, all white, one flat palette colour, Gaussian noise, NaN), on images and on clips.

The behaviour asserted is the one documented in :mod:`rewards.base`: rule-based rewards (GenEval, video_geneval,
OCR, flicker, motion, consistency, and multi over them) score degenerate samples exactly 0, on every component of
their score's scale; learned preference / alignment models and the JPEG size score them as their model does (finite);
NaN input raises ``ValueError`` naming the reward and the batch indices, under every reward. Real content in the same
batch keeps its score, and :func:`rewards.images.degenerate` never flags a sparse scene (a single small shape).
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

import rewards
from flowgrpo.world import (
    CLASSES,
    PALETTE,
    Shape,
    all_metadata,
    draw,
    metadata_for,
    motion_metadata_for,
    render_array,
    render_clip,
)
from rewards.geneval import ShapesDetector
from rewards.images import degenerate
from twins import save_tiny_clip  # tests/twins.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

H = 64
T = 13  # the moving-shapes world's clip length
KINDS = ("black", "white", "colour", "noise", "nan")
BLUE = torch.tensor(PALETTE["blue"], dtype=torch.float32) / 255.0  # a palette colour: the worst case for `shapes`


def degenerate_image(kind: str, seed: int = 0) -> torch.Tensor:
    """float ``[3, H, W]`` in [0, 1] (or NaN) of one degenerate kind."""
    if kind == "black":
        return torch.zeros(3, H, H)
    if kind == "white":
        return torch.ones(3, H, H)
    if kind == "colour":
        return BLUE.view(3, 1, 1).expand(3, H, H).clone()
    if kind == "noise":
        return (0.5 + 0.5 * torch.randn(3, H, H, generator=torch.Generator().manual_seed(seed))).clamp(0, 1)
    if kind == "nan":
        return torch.full((3, H, H), math.nan)
    raise ValueError(kind)


def degenerate_clip(kind: str) -> torch.Tensor:
    """float ``[T, 3, H, W]``: every frame of the kind (noise drawn afresh per frame)."""
    return torch.stack([degenerate_image(kind, seed=t) for t in range(T)])


# ---------------------------------------------------------------------------------------------- the rewards

GENEVAL_METAS = [
    metadata_for("single_object", "square"),
    metadata_for("two_object", ("square", "circle")),
    metadata_for("counting", "square", count=2),
    metadata_for("colors", "square", colors="blue"),
    metadata_for("position", ("circle", "square"), relation="left of"),
    metadata_for("color_attr", ("square", "circle"), colors=("blue", "black")),
]
VIDEO_METAS = [
    motion_metadata_for("motion", "square", "blue", "right"),
    motion_metadata_for("two_object_motion", ("square", "circle"), ("blue", "red"), ("left", "right")),
    motion_metadata_for("counting", "square", "blue", count=2),
    motion_metadata_for("colors", "circle", "blue"),
    motion_metadata_for("speed", "square", "black", "up", "quickly"),
    motion_metadata_for("static", "triangle", "blue", "still"),
]
OCR_PROMPT = 'a sign that says "OPEN"'

# reward -> (expected on degenerate samples: "zero" or "model", the components on the score's scale: names, or
# prefixes ending in "/"; measurement components such as motion_px or flicker_mad keep what was measured)
IMAGE_REWARDS = {
    "geneval": ("zero", ("partial", "strict", "exact", "strict/", "partial/")),
    "geneval_clipped": ("zero", ("partial", "strict", "exact")),
    "ocr": ("zero", ("ocr", "ocr_exact")),
    "multi": ("zero", ("geneval", "geneval_strict", "geneval/", "geneval_strict/")),
    "clipscore": ("model", ()),
    "pickscore": ("model", ()),
    "hpsv21": ("model", ()),
    "aesthetic": ("model", ()),
    "imagereward": ("model", ()),
    "jpeg_compressibility": ("model", ()),
    "jpeg_incompressibility": ("model", ()),
}
VIDEO_REWARDS = {
    "video_geneval": ("zero", ("strict", "partial", "check/")),
    "video_flicker": ("zero", ("flicker",)),
    "video_motion": ("zero", ("motion",)),
    "video_motion_frame_diff": ("zero", ("motion",)),
    "video_sharpness": ("zero", ("sharpness", "sharpness_min")),
    "video_consistency_pixels": ("zero", ("consistency", "consistency_prev", "consistency_first")),
    "video_consistency_dino": ("zero", ("consistency", "consistency_prev", "consistency_first")),
    "video_consistency_clip": ("zero", ("consistency", "consistency_prev", "consistency_first")),
    "video_clip": ("model", ()),
}
ERROR_NAME = {"geneval_clipped": "geneval", "multi": "geneval", "video_motion_frame_diff": "video_motion",
              **{f"video_consistency_{b}": "video_consistency" for b in ("pixels", "dino", "clip")}}


def _imagereward_twin(root):
    """A tiny ImageReward checkpoint in the reference ``ImageReward.pt`` key layout, and its BERT tokenizer."""
    from transformers import BertTokenizer

    from rewards.image_reward import ImageRewardModel, imagereward_configs

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdefghijklmnopqrstuvwxyz")
    vocab += [f"filler{i}" for i in range(300 - len(vocab))]  # the reward refuses a near-empty tokenizer
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(root / "vocab.txt")).save_pretrained(root / "tokenizer")
    config = {"vision_config": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=32, patch_size=8),
              "text_config": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  max_position_embeddings=40, vocab_size=len(vocab) + 2)}  # + [DEC], [ENC]
    model = ImageRewardModel(*imagereward_configs(config))
    to_reference = [  # rewards.image_reward.KEY_RULES, the other way round
        (r"^vision_model\.embeddings\.class_embedding$", "blip.visual_encoder.cls_token"),
        (r"^vision_model\.embeddings\.position_embedding$", "blip.visual_encoder.pos_embed"),
        (r"^vision_model\.embeddings\.patch_embedding\.", "blip.visual_encoder.patch_embed.proj."),
        (r"^vision_model\.encoder\.layers\.(\d+)\.layer_norm([12])\.", r"blip.visual_encoder.blocks.\1.norm\2."),
        (r"^vision_model\.encoder\.layers\.(\d+)\.self_attn\.qkv\.", r"blip.visual_encoder.blocks.\1.attn.qkv."),
        (r"^vision_model\.encoder\.layers\.(\d+)\.self_attn\.projection\.",
         r"blip.visual_encoder.blocks.\1.attn.proj."),
        (r"^vision_model\.encoder\.layers\.(\d+)\.mlp\.", r"blip.visual_encoder.blocks.\1.mlp."),
        (r"^vision_model\.post_layernorm\.", "blip.visual_encoder.norm."),
        (r"^text_encoder\.", "blip.text_encoder."),
    ]
    state = {}
    for key, value in model.state_dict().items():
        for pattern, repl in to_reference:
            key = re.sub(pattern, repl, key)
        state[key] = value
    torch.save(state, root / "ImageReward.pt")
    return dict(checkpoint=str(root / "ImageReward.pt"), tokenizer=str(root / "tokenizer"), config=config)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``build(name)``: the reward, built once per module (learned ones from tiny twins saved as checkpoints)."""
    root = tmp_path_factory.mktemp("degenerate_twins")
    built: dict[str, object] = {}

    def twins() -> dict:
        if "twins" not in built:
            import open_clip
            from transformers import ViTConfig, ViTModel

            from rewards.clip.aesthetic import AestheticMLP

            torch.manual_seed(0)
            clip = save_tiny_clip(root / "clip")
            ViTModel(ViTConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2), add_pooling_layer=False).save_pretrained(root / "dino")
            torch.save(AestheticMLP(16).state_dict(), root / "aesthetic.pth")  # 16: the tiny CLIP's projection
            name = "flowgrpo-degenerate-vit"
            cfg = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16,
                                                   "patch_size": 8},
                   "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
            (root / f"{name}.json").write_text(json.dumps(cfg))
            open_clip.add_model_config(root / f"{name}.json")
            torch.save({"state_dict": open_clip.create_model(name, pretrained=None).state_dict()}, root / "hps.pt")
            built["twins"] = dict(clip=str(clip), dino=str(root / "dino"), hps_name=name,
                                  imagereward=_imagereward_twin(root))
        return built["twins"]

    def make(name: str):
        if name in built:
            return built[name]
        cpu = dict(device="cpu")
        if name == "geneval_clipped":
            reward = rewards.load("geneval", partial_credit="clipped")
        elif name == "ocr":
            reward = rewards.load("ocr", det_limit_side_len=128, num_threads=1)
        elif name == "multi":
            reward = rewards.load("multi", components=[
                {"name": "geneval"}, {"name": "geneval", "prefix": "geneval_strict", "kwargs": {"score": "strict"}}])
        elif name in ("clipscore", "video_clip"):
            reward = rewards.load(name, clip_path=twins()["clip"], **cpu)
        elif name == "pickscore":
            reward = rewards.load(name, model_path=twins()["clip"], processor_path=twins()["clip"], **cpu)
        elif name == "hpsv21":
            reward = rewards.load(name, checkpoint=str(root / "hps.pt"), model_name=twins()["hps_name"], **cpu)
        elif name == "aesthetic":
            twins()
            reward = rewards.load(name, checkpoint=str(root / "aesthetic.pth"), clip_path=twins()["clip"], **cpu)
        elif name == "imagereward":
            reward = rewards.load(name, **twins()["imagereward"], **cpu)
        elif name == "video_motion_frame_diff":
            reward = rewards.load("video_motion", method="frame_diff")
        elif name.startswith("video_consistency_"):
            backbone = name.removeprefix("video_consistency_")
            path = None if backbone == "pixels" else twins()[backbone]
            reward = rewards.load("video_consistency", backbone=backbone, model_path=path, image_size=32,
                                  **({} if backbone == "pixels" else cpu))
        else:
            reward = rewards.load(name)
        built[name] = reward
        return reward

    return make


def _score_images(name, reward, images: torch.Tensor):
    """Score a batch of six images, each with the GenEval metadata / prompt of one tag (OCR: a quoted text)."""
    prompts = [OCR_PROMPT] * len(images) if name == "ocr" else [m["prompt"] for m in GENEVAL_METAS[: len(images)]]
    return reward(images, prompts, GENEVAL_METAS[: len(images)])


def _score_clips(reward, clips: torch.Tensor):
    return reward(clips, [m["prompt"] for m in VIDEO_METAS[: len(clips)]], VIDEO_METAS[: len(clips)])


def _check(name, table, out, batch):
    expected, scale = table[name]
    assert out.scores.shape == (batch,) and bool(torch.isfinite(out.scores).all()), (name, out.scores)
    if expected == "zero":
        assert out.scores.tolist() == [0.0] * batch, (name, out.scores)
        prefixes = tuple(p for p in scale if p.endswith("/"))
        checked = [key for key in out.components if key in scale or key.startswith(prefixes)]
        assert len(checked) >= len(scale), (name, sorted(out.components))
        for key in checked:
            value = out.components[key]
            if True:
                applicable = value[~torch.isnan(value)]
                assert applicable.numel() and (applicable == 0).all(), (name, key, value)


# --------------------------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(IMAGE_REWARDS))
def test_image_rewards_never_pay_for_degenerate_images(build, name, kind):
    reward = build(name)
    if kind == "nan":  # a real image first: the error names only the bad index
        real = torch.from_numpy(render_array(GENEVAL_METAS[0], seed=0)).permute(2, 0, 1).float() / 255
        with pytest.raises(ValueError, match=rf"^{ERROR_NAME.get(name, name)}: images at batch indices \[1\] hold NaN"):
            _score_images(name, reward, torch.stack([real, degenerate_image("nan")]))
        return
    images = degenerate_image(kind)[None].expand(len(GENEVAL_METAS), -1, -1, -1).contiguous()
    out = _score_images(name, reward, images)
    _check(name, IMAGE_REWARDS, out, len(images))
    if IMAGE_REWARDS[name][0] == "model":  # as the model scores them: the same on every form of the input
        uint8 = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
        again = _score_images(name, reward, [np.asarray(a) for a in uint8])
        torch.testing.assert_close(again.scores, out.scores)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(VIDEO_REWARDS))
def test_video_rewards_never_pay_for_degenerate_clips(build, name, kind):
    reward = build(name)
    if kind == "nan":
        real = torch.from_numpy(render_clip(VIDEO_METAS[0], seed=0)).permute(0, 3, 1, 2).float() / 255
        with pytest.raises(ValueError, match=rf"^{ERROR_NAME.get(name, name)}: clips at batch indices \[1\] hold NaN"):
            _score_clips(reward, torch.stack([real, degenerate_clip("nan")]))
        return
    clips = degenerate_clip(kind)[None].expand(len(VIDEO_METAS), -1, -1, -1, -1).contiguous()
    _check(name, VIDEO_REWARDS, _score_clips(reward, clips), len(clips))


# ------------------------------------------------------------------------------- content keeps its score


def test_real_content_in_the_same_batch_keeps_its_score(build):
    scene = torch.from_numpy(render_array(GENEVAL_METAS[3], seed=1)).permute(2, 0, 1).float() / 255
    images = torch.stack([scene, degenerate_image("black"), degenerate_image("colour"), degenerate_image("noise")])
    meta = [GENEVAL_METAS[3]] * 4
    for score in ("partial", "strict", "exact"):
        out = rewards.load("geneval", score=score)(images, None, meta)
        assert out.scores.tolist() == [1.0, 0.0, 0.0, 0.0], score
    verdicts = rewards.load("geneval").judge(images, meta)
    assert "degenerate" not in verdicts[0].reason
    assert [v.reason for v in verdicts[1:]] == [f"degenerate image ({k}): no content, scored 0"
                                                for k in ("uniform", "uniform", "noise")]
    # clips: a moving world clip keeps its verdict, flicker, motion and consistency next to degenerate ones
    moving = torch.from_numpy(render_clip(VIDEO_METAS[0], seed=0)).permute(0, 3, 1, 2).float() / 255
    clips = torch.stack([moving, degenerate_clip("white"), degenerate_clip("noise")])
    metas = [VIDEO_METAS[0]] * 3
    assert build("video_geneval")(clips, None, metas).scores.tolist() == [1.0, 0.0, 0.0]
    for name in ("video_flicker", "video_motion", "video_motion_frame_diff", "video_sharpness", "video_consistency_pixels"):
        s = build(name)(clips).scores
        assert s[0] > 0 and s[1:].tolist() == [0.0, 0.0], (name, s)
    # a static flat clip used to be the best possible under flicker and consistency
    static = degenerate_clip("colour")[None]
    assert build("video_flicker")(static).components["flicker_mad"].item() == 0.0  # measured, not zeroed
    assert build("video_flicker")(static).scores.item() == 0.0


def test_the_shapes_detector_sees_no_object_in_a_flat_image():
    """The cause of all-black images earning GenEval partial credit: the whole frame was one confident square."""
    detector = ShapesDetector()
    for colour in [(0, 0, 0), *PALETTE.values()]:
        flat = np.empty((H, H, 3), np.uint8)
        flat[:] = colour
        assert detector([flat]) == [{}], colour
    # a big but object-sized square is still found; one covering half the frame is background
    img = np.full((H, H, 3), 255, np.uint8)
    img[10:30, 10:30] = PALETTE["black"]
    assert [d.box for d in detector([img])[0]["square"]] == [(10.0, 10.0, 30.0, 30.0)]
    img[:, :32] = PALETTE["black"]
    assert detector([img]) == [{}]
    with pytest.raises(ValueError, match="max_area"):
        ShapesDetector(max_area=20)


def test_nan_and_inf_raise_in_every_input_form():
    reward = rewards.load("geneval")
    good = np.full((H, H, 3), 1.0, np.float32)
    bad = good.copy()
    bad[5, 7, 1] = np.inf  # one pixel is enough
    meta = [GENEVAL_METAS[0]] * 3
    for images in (np.stack([good, good, bad]), [good, good, bad], [torch.from_numpy(x) for x in (good, good, bad)]):
        with pytest.raises(ValueError, match=r"geneval: images at batch indices \[2\]"):
            reward(images, None, meta)
    clip = np.ones((2, T, H, H, 3), np.float32)
    clip[0, 4, 1, 1, 0] = np.nan
    for clips in (clip, list(clip)):
        with pytest.raises(ValueError, match=r"video_geneval: clips at batch indices \[0\]"):
            rewards.load("video_geneval")(clips, None, VIDEO_METAS[:2])
    assert degenerate(np.stack([good, bad])) == ["uniform", "non-finite"]


# ------------------------------------------------------------------------------ the degenerate flag itself


def test_degenerate_flags_uniform_noise_and_nonfinite():
    g = torch.Generator().manual_seed(0)
    flat_mild = (0.7 + 2 / 255 * torch.randn(3, H, H, generator=g)).clamp(0, 1)  # a flat colour, mild noise
    grey_noise = (0.5 + 0.05 * torch.randn(3, H, H, generator=g)).clamp(0, 1)
    uniform_noise = torch.rand(3, H, H, generator=g)
    images = torch.stack([degenerate_image(k) for k in KINDS] + [flat_mild, grey_noise, uniform_noise])
    assert degenerate(images) == ["uniform", "uniform", "uniform", "noise", "non-finite", "uniform", "noise", "noise"]
    # clips: degenerate when every frame is; one frame with content is content
    mixed = torch.stack([degenerate_image("black"), degenerate_image("noise")] * 3)
    world = torch.from_numpy(render_clip(VIDEO_METAS[3], seed=0)).permute(0, 3, 1, 2)[:6]
    one_frame = mixed.clone()
    one_frame[4] = world[4].float() / 255
    assert degenerate(torch.stack([mixed, one_frame, world.float() / 255])) == ["noise+uniform", None, None]
    assert degenerate(world[None].permute(0, 1, 3, 4, 2).numpy()) == [None]  # uint8 [B, T, H, W, 3]
    # frames under 16 px on a side are too small to judge: never flagged
    assert degenerate(torch.zeros(2, 3, 8, 8)) == [None, None]


def test_a_sparse_scene_is_never_degenerate():
    rng = np.random.default_rng(0)
    scenes = []
    for cls in CLASSES:  # the smallest object of the world, every class and colour, a few sub-pixel offsets
        for colour in PALETTE:
            for dx in (0.0, 0.5, 0.3):
                scenes.append(draw([Shape(cls, colour, 20.0 + dx, 31.7, 6.0)]))
    noisy = [np.clip(s + rng.normal(0, 4, s.shape), 0, 255).round().astype(np.uint8) for s in scenes]
    blurred = [np.asarray(Image.fromarray(s).filter(ImageFilter.GaussianBlur(1.5))) for s in scenes[::3]]
    world = [render_array(m, seed=i) for i, m in enumerate(all_metadata()[::4])]
    for batch in (scenes, noisy, blurred, world):
        flags = degenerate(batch)
        assert flags == [None] * len(batch), [i for i, f in enumerate(flags) if f is not None]
    # the smallest square on white under heavy pixel noise (std 0.25) still has structure
    heavy = np.clip(scenes[3] + rng.normal(0, 64, scenes[3].shape), 0, 255).round().astype(np.uint8)
    assert degenerate([heavy]) == [None]
