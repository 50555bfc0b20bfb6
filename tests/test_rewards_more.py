"""OCR (real bundled weights), video rewards, the remote client, multi-reward, the aggregators (saturation_weighted;
the paper's TaRoS: tests/test_taros_paper.py) and the ``score`` CLI. CPU, offline, tiny twins built here."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import rewards
from rewards.aggregate import SaturationWeighted, per_reward_group_advantages, weighted_sum
from twins import save_tiny_clip  # tests/twins.py

REPO_ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------------------------------------------- OCR


def _font(size: int):
    import matplotlib

    path = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"  # ships with matplotlib
    return ImageFont.truetype(str(path), size) if path.is_file() else ImageFont.load_default(size=size)


def _text_image(text: str, size=(256, 64)) -> Image.Image:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((10, 16), text, fill="black", font=_font(26))
    return img


def test_edit_distance_and_targets():
    from rewards.ocr import levenshtein, normalized_edit_score, quoted_text

    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert normalized_edit_score("Hello World", "HELLOWORLD") == 1.0  # case and spaces ignored
    assert normalized_edit_score("OPEN", "a sign: open now") == 1.0  # target inside the text: distance 0
    assert normalized_edit_score("Hello", "Helo") == pytest.approx(0.8)
    assert normalized_edit_score("ab", "xyzxyzxyz") == 0.0  # distance clipped at len(target)
    assert quoted_text('a neon sign that says "Open 24h" at night') == "Open 24h"
    assert quoted_text("a sign that says “SALE”") == "SALE" and quoted_text("no quotes") is None


@pytest.fixture(scope="module")
def ocr():
    return rewards.load("ocr", det_limit_side_len=128, num_threads=1)  # the real PP-OCRv4 weights in the wheel


def test_ocr_with_real_bundled_weights(ocr):
    images = [_text_image("FLOW GRPO"), _text_image("FLOW GRPX"), _text_image("FLW GPO"), Image.new("RGB", (256, 64), "white")]
    prompts = ['a poster with the words "FLOW GRPO"'] * 4
    out = ocr(images, prompts)
    assert set(out.components) == {"ocr", "ocr_exact"} and out.scores.shape == (4,)
    exact, typo, missing, blank = out.scores.tolist()
    assert exact == 1.0 and out.components["ocr_exact"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert exact > typo > 0 and exact > missing > 0, out.scores
    assert blank == 0.0
    # metadata["text"] overrides the prompt; a float tensor scores like the PIL images
    tensor = torch.stack([torch.from_numpy(np.array(images[0])).permute(2, 0, 1).float() / 255])
    meta = ocr(tensor, ["no quotes here"], [{"text": "FLOW GRPO"}])
    assert meta.scores.tolist() == [1.0]
    assert ocr([images[0]], ['the word "FLOW GRPO"']).scores.tolist() == [1.0]


def test_ocr_without_target_raises(ocr):
    with pytest.raises(ValueError, match="quotes no text"):
        ocr([_text_image("hi")], ["a sign"])


# ------------------------------------------------------------------------------------------------- video


def _square_clip(T=6, H=64, step=2, size=12):
    """A red square moving ``step`` px/frame to the right on a light background, float [T, 3, H, W]."""
    v = torch.full((T, 3, H, H), 0.9)
    for t in range(T):
        x = 10 + step * t
        v[t, :, 20 : 20 + size, x : x + size] = torch.tensor([0.8, 0.1, 0.1]).view(3, 1, 1)
    return v


@pytest.fixture(scope="module")
def clips():
    g = torch.Generator().manual_seed(0)
    natural = _square_clip(step=2)
    static = _square_clip(step=0)
    shuffled = natural[torch.randperm(6, generator=g)]
    noisy = (static + 0.25 * torch.randn(static.shape, generator=g)).clamp(0, 1)
    return {"static": static, "natural": natural, "shuffled": shuffled, "noisy": noisy}


def test_video_input_forms_and_errors(clips):
    from rewards.video import to_video

    v = torch.stack([clips["static"], clips["natural"]])
    u8 = to_video(v)
    assert u8.dtype == torch.uint8 and u8.shape == (2, 6, 3, 64, 64)
    assert torch.equal(to_video(u8.permute(0, 1, 3, 4, 2).numpy()), u8)  # [B, T, H, W, 3] numpy
    pil = [[Image.fromarray(f.permute(1, 2, 0).numpy()) for f in clip] for clip in u8]
    assert torch.equal(to_video(pil), u8)
    with pytest.raises(ValueError, match=r"video rewards score clips \[B, T, 3, H, W\]"):
        rewards.load("video_flicker")(v[:, 0], ["", ""])


def test_flicker_hand_value_and_ordering(clips):
    v = torch.zeros(1, 3, 3, 2, 2, dtype=torch.uint8)
    v[0, 1] = 10  # |Δ| = 10 then 10 → MAD 10
    out = rewards.load("video_flicker")(v)
    assert out.components["flicker_mad"].item() == pytest.approx(10.0)
    assert out.scores.item() == pytest.approx(245 / 255)
    batch = torch.stack([clips["static"], clips["natural"], clips["shuffled"], clips["noisy"]])
    s = rewards.load("video_flicker")(batch, [""] * 4).scores
    assert s[0] == 1.0 and s[0] > s[1] > s[2] and s[1] > s[3]


def test_motion_orders_moving_above_static_and_recovers_displacement(clips):
    batch = torch.stack([clips["static"], _square_clip(step=2), _square_clip(step=4)])
    flow = rewards.load("video_motion", method="flow")(batch, [""] * 3)
    assert set(flow.components) == {"motion", "motion_px", "motion_top5_px"}
    assert flow.scores[0] == 0 and flow.scores[0] < flow.scores[1] < flow.scores[2]
    torch.testing.assert_close(flow.components["motion_top5_px"], torch.tensor([0.0, 2.0, 4.0]), atol=0.3, rtol=0)
    diff = rewards.load("video_motion", method="frame_diff")(batch, [""] * 3).scores
    assert diff[0] == 0 and diff[0] < diff[1] < diff[2]


def test_sharpness_hand_value_and_blur_ordering():
    # black square on white, crisp: the strongest neighbour differences are full-contrast steps (255/255)
    crisp = torch.ones(1, 2, 3, 32, 32)
    crisp[..., 8:24, 8:24] = 0.0
    edges = 4 * 16 * 2  # each of the square's 4 sides has 16 full steps; 2 frames
    top = edges / 2 / (2 * 32 * 31)  # the frame's full-contrast share of its 2·32·31 neighbour pairs
    out = rewards.load("video_sharpness", top=top)(crisp)
    assert out.scores.item() == pytest.approx(1.0) and out.components["sharpness_min"].item() == pytest.approx(1.0)
    # twice as many pairs averaged: half of them zero → 0.5
    assert rewards.load("video_sharpness", top=2 * top)(crisp).scores.item() == pytest.approx(0.5, abs=1e-3)
    # a box blur spreads each step over 3 pixels: the strongest differences drop to about a third
    blurred = torch.nn.functional.avg_pool2d(crisp.flatten(0, 2), 3, stride=1, padding=1, count_include_pad=False)
    blurred = blurred.view_as(crisp)
    s = rewards.load("video_sharpness", top=top)(blurred).scores.item()
    assert 0.25 < s < 0.45, s
    # a grey-on-white square: contrast 0.5 → about half the score
    grey = torch.where(crisp < 1, torch.full_like(crisp, 0.5), crisp)
    assert rewards.load("video_sharpness", top=top)(grey).scores.item() == pytest.approx(0.5, abs=0.01)
    with pytest.raises(ValueError, match="top must be in"):
        rewards.load("video_sharpness", top=0)


def test_pixel_consistency_is_explicit_and_orders_clips(clips):
    batch = torch.stack([clips["static"], clips["natural"], clips["shuffled"], clips["noisy"]])
    out = rewards.load("video_consistency", backbone="pixels")(batch, [""] * 4)
    assert set(out.components) == {"consistency", "consistency_prev", "consistency_first"}
    s = out.scores
    assert s[0] == pytest.approx(1.0) and s[0] > s[1] > s[2] and s[0] > s[3]
    # hand check of the VBench formula on 3 frames with known features
    r = rewards.load("video_consistency", backbone="pixels")
    r.features = lambda frames: torch.tensor([[1.0, 0.0], [0.6, 0.8], [-1.0, 0.0]])
    out = r(torch.zeros(1, 3, 3, 4, 4))
    prev, first = (0.6 + 0.0) / 2, (0.6 + 0.0) / 2  # cos(f1,f0)=0.6, cos(f2,f1)=-0.6→0, cos(f2,f0)=-1→0
    assert out.components["consistency_prev"].item() == pytest.approx(prev)
    assert out.scores.item() == pytest.approx((prev + first) / 2)


def test_model_backbones_fail_clearly_without_weights(clips):
    batch = clips["static"][None]
    with pytest.raises(OSError, match=r"/no/such/dino.*model_path="):
        rewards.load("video_consistency", model_path="/no/such/dino", device="cpu")(batch)
    with pytest.raises(OSError, match=r"/no/such/clip.*clip_path="):
        rewards.load("video_clip", clip_path="/no/such/clip", device="cpu")(batch, ["a square"])
    with pytest.raises(ValueError, match="pixels"):
        rewards.load("video_consistency", backbone="nope")


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """Random-initialised CLIP and DINO-style ViT twins saved like hub checkpoints."""
    from transformers import ViTConfig, ViTModel

    root = tmp_path_factory.mktemp("video_twins")
    torch.manual_seed(0)
    save_tiny_clip(root / "clip")
    ViTModel(ViTConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2), add_pooling_layer=False).save_pretrained(root / "dino")
    return root


def test_video_clip_on_a_tiny_twin_matches_reference_preprocessing(tiny_checkpoints, clips):
    from transformers import CLIPImageProcessor, CLIPModel, CLIPTokenizer

    path = tiny_checkpoints / "clip"
    batch = torch.stack([clips["natural"][:, :, :48, :], clips["shuffled"][:, :, :48, :]])  # non-square frames
    prompts = ["a red square", "a photo of a dog"]
    reward = rewards.load("video_clip", clip_path=str(path), num_frames=3, device="cpu")
    out = reward(batch, prompts)
    assert out.scores.shape == (2,) and set(out.components) == {"clip_frame_mean", "clip_frame_min"}
    assert (out.components["clip_frame_min"] <= out.scores + 1e-6).all()
    # reference: CLIP's own processor on PIL frames 0, 2(.5→2), 5; cosine to the text, mean over frames
    model = CLIPModel.from_pretrained(path).eval()
    processor, tok = CLIPImageProcessor.from_pretrained(path), CLIPTokenizer.from_pretrained(path)
    expected = []
    for clip, prompt in zip(batch, prompts):
        frames = [Image.fromarray((clip[t].permute(1, 2, 0) * 255).round().byte().numpy()) for t in (0, 2, 5)]
        pixels = processor(images=frames, return_tensors="pt")["pixel_values"]
        assert pixels.shape == (3, 3, 32, 32)  # shorter side 32, centre crop 32
        with torch.no_grad():
            f = torch.nn.functional.normalize(model.get_image_features(pixel_values=pixels).pooler_output, dim=-1)
            t = torch.nn.functional.normalize(model.get_text_features(**tok([prompt], return_tensors="pt")).pooler_output, dim=-1)
        expected.append((f @ t.T).mean())
    torch.testing.assert_close(out.scores, torch.stack(expected).float(), atol=1e-5, rtol=0)


def test_video_consistency_with_model_backbones(tiny_checkpoints, clips):
    import torchvision.transforms.functional as TF
    from transformers import ViTModel

    batch = torch.stack([clips["static"], clips["shuffled"]])
    for backbone, path in (("dino", tiny_checkpoints / "dino"), ("clip", tiny_checkpoints / "clip")):
        r = rewards.load("video_consistency", backbone=backbone, model_path=str(path), image_size=32, device="cpu")
        s = r(batch).scores
        assert s[0] == pytest.approx(1.0, abs=1e-5) and s[1] < s[0], (backbone, s)
    # dino features use VBench's transform: Resize(shorter side) of uint8 frames, antialias off, ImageNet norm, CLS
    r = rewards.load("video_consistency", model_path=str(tiny_checkpoints / "dino"), image_size=32, device="cpu")
    frames = (clips["natural"][:2, :, :48, :] * 255).round().to(torch.uint8)
    x = TF.normalize(TF.resize(frames, [32], antialias=False).float() / 255, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    assert x.shape[-2:] == (32, 42)
    with torch.no_grad():
        ref = ViTModel.from_pretrained(tiny_checkpoints / "dino")(pixel_values=x, interpolate_pos_encoding=True)
    torch.testing.assert_close(r.features(frames), torch.nn.functional.normalize(ref.last_hidden_state[:, 0], dim=-1))


# ------------------------------------------------------------------------------------------------ remote


class _Handler(BaseHTTPRequestHandler):
    """Scores each image by its mean brightness; a few paths misbehave on purpose."""

    calls: list = []

    def log_message(self, *args):  # keep test output clean
        pass

    def _send(self, code: int, body: bytes):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append((self.path, request))
        if self.path == "/boom":
            return self._send(500, b'{"error": "model crashed"}')
        if self.path == "/garbage":
            return self._send(200, b"<html>not json</html>")
        media = request["media"]
        if media["format"] == "npz":
            arrays = np.load(io.BytesIO(base64.b64decode(media["data"])))["media"]
        elif media["kind"] == "videos":
            arrays = [np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(f)))) for f in clip]) for clip in media["data"]]
        else:
            arrays = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d)))) for d in media["data"]]
        brightness = [float(np.asarray(a).mean() / 255) for a in arrays]
        answer = {"scores": brightness, "components": {"brightness": brightness, "tagged": [None] * len(brightness)}}
        if self.path == "/short":
            answer["scores"] = brightness[:-1]
        if self.path == "/nan":
            answer["scores"] = [float("nan")] * len(brightness)
        self._send(200, json.dumps(answer).encode())


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)  # loopback only
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_remote_round_trip_png_npz_and_videos(server):
    images = torch.stack([torch.full((3, 16, 16), v) for v in (0.2, 0.6, 1.0)])
    meta = [{"tag": "a"}, None, {"tag": "c"}]
    for fmt in ("png", "npz"):
        r = rewards.load("remote", url=f"{server}/score", timeout=5, format=fmt, batch_size=2, extra={"reward": "brightness"})
        out = r(images, ["x", "y", "z"], meta)
        torch.testing.assert_close(out.scores, torch.tensor([0.2, 0.6, 1.0]), atol=1 / 255, rtol=0)
        assert set(out.components) == {"brightness", "tagged"} and torch.isnan(out.components["tagged"]).all()
    path, request = _Handler.calls[-1]
    assert path == "/score" and request["reward"] == "brightness" and request["prompts"] == ["z"]
    assert request["metadata"] == [{"tag": "c"}]
    videos = torch.stack([torch.full((4, 3, 8, 8), 0.5), torch.zeros(4, 3, 8, 8)])
    for fmt in ("png", "npz"):
        out = rewards.load("remote", url=f"{server}/score", format=fmt)(videos, ["a", "b"])
        torch.testing.assert_close(out.scores, torch.tensor([128 / 255, 0.0]))
    assert _Handler.calls[-1][1]["media"]["kind"] == "videos"


@pytest.mark.parametrize("path,message", [
    ("/boom", r"/boom: HTTP 500.*model crashed.*after 2 attempts"),
    ("/garbage", r"/garbage: the answer is not JSON"),
    ("/short", r"/short: expected 2 scores, got 1"),
    ("/nan", r"/nan: scores at \[0, 1\] are not finite"),
])
def test_remote_errors_name_the_url_and_never_make_up_scores(server, path, message):
    from rewards.remote import RemoteRewardError

    r = rewards.load("remote", url=f"{server}{path}", timeout=5, retries=1, backoff=0)
    with pytest.raises(RemoteRewardError, match=message):
        r(torch.rand(2, 3, 8, 8), ["a", "b"])


def test_remote_unreachable_server_names_the_url():
    import socket

    from rewards.remote import RemoteRewardError

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = rewards.load("remote", url=f"http://127.0.0.1:{port}/score", timeout=2, retries=0)
    with pytest.raises(RemoteRewardError, match=rf"127\.0\.0\.1:{port}/score: no answer"):
        r(torch.rand(1, 3, 8, 8), ["a"])
    with pytest.raises(ValueError, match="http://"):
        rewards.load("remote", url="localhost:8000")


# ------------------------------------------------------------------------------------------------- multi


def test_multi_reward_components_and_weighted_sum():
    images = torch.cat([torch.full((1, 3, 32, 32), 0.5), torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))])
    meta = [{"tag": "single_object", "prompt": "a photo of a circle", "include": [{"class": "circle", "count": 1}]}] * 2
    r = rewards.load("multi", components=[
        {"name": "geneval", "weight": 1.0, "kwargs": {"detector": "shapes"}},
        {"name": "jpeg_compressibility", "weight": 0.1, "kwargs": {"quality": 90}},
        {"name": "jpeg_compressibility", "prefix": "jpeg_logged", "weight": 0.0},
    ])
    out = r(images, ["a photo of a circle"] * 2, meta)
    geneval = rewards.load("geneval")(images, ["a photo of a circle"] * 2, meta)
    jpeg = rewards.load("jpeg_compressibility", quality=90)(images, ["", ""])
    assert r.weights == {"geneval": 1.0, "jpeg_compressibility": 0.1, "jpeg_logged": 0.0}
    torch.testing.assert_close(out.components["geneval"], geneval.scores)
    torch.testing.assert_close(out.components["jpeg_compressibility/jpeg_kb"], jpeg.components["jpeg_kb"])
    assert {f"geneval/{k}" for k in geneval.components} <= set(out.components) and "jpeg_logged/jpeg_kb" in out.components
    torch.testing.assert_close(out.scores, geneval.scores + 0.1 * jpeg.scores)
    torch.testing.assert_close(out.scores, weighted_sum(out.components, r.weights))
    with pytest.raises(ValueError, match="prefix 'jpeg_compressibility'"):
        rewards.load("multi", components=[{"name": "jpeg_compressibility"}, {"name": "jpeg_compressibility"}])
    with pytest.raises(ValueError, match="unknown keys"):
        rewards.load("multi", components=[{"name": "jpeg_compressibility", "wieght": 1}])


# ------------------------------------------------------------------------------------------- aggregators


def test_weighted_sum_and_per_reward_advantages_by_hand():
    comps = {"a": torch.tensor([0.0, 2.0, 1.0, 1.0]), "b": torch.tensor([3.0, 1.0, 0.0, 4.0]),
             "log": torch.tensor([math.nan] * 4)}
    torch.testing.assert_close(weighted_sum(comps, {"a": 2.0, "b": 1.0}), torch.tensor([3.0, 5.0, 2.0, 6.0]))
    # groups of 2: A_a = [-1, 1 | 0, 0]; A_b = [1, -1 | -1, 1]; weights 3:1 → ¾·A_a + ¼·A_b
    adv = per_reward_group_advantages(comps, {"a": 3.0, "b": 1.0}, 2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -0.25, 0.25]))
    with pytest.raises(KeyError, match="'c'"):
        per_reward_group_advantages(comps, {"c": 1.0}, 2)
    with pytest.raises(ValueError, match="not finite"):
        weighted_sum(comps, {"log": 1.0})


def test_per_reward_advantages_equal_the_trainers():
    from flowgrpo.advantages import weighted_advantages

    g = torch.Generator().manual_seed(0)
    comps = {"a": torch.rand(12, generator=g), "b": torch.randn(12, generator=g) * 5, "c": torch.ones(12)}
    weights = {"a": 1.0, "b": 0.3, "c": 2.0}
    for kw in ({}, {"global_std": True}, {"clip": 0.5}):
        torch.testing.assert_close(per_reward_group_advantages(comps, weights, 4, **kw),
                                   weighted_advantages(comps, weights, 4, **kw))


def test_saturation_weighted_by_hand():
    R = torch.tensor([[0.0, 10.0], [2.0, 10.0], [1.0, 10.2], [1.0, 9.8]])  # one group of 4, K = 2
    t = SaturationWeighted({"a": 3.0, "b": 1.0}, tau=0.5, kappa=0.5, eps=0.0, clip=None)
    adv = t(R, group_size=4)
    # σ_a = sqrt(0.5), σ_b = sqrt(0.02); first call: σ̄ = σ, so max(σ, τσ̄) = σ
    a_a = torch.tensor([-1.0, 1.0, 0.0, 0.0]) / math.sqrt(0.5)
    a_b = torch.tensor([0.0, 0.0, 0.2, -0.2]) / math.sqrt(0.02)
    soft = lambda x: x.sign() * (x.abs() - 0.5).clamp_min(0)  # noqa: E731
    expected = 0.75 * soft(a_a) + 0.25 * soft(a_b)
    torch.testing.assert_close(adv, expected.float())
    d = t.diagnostics()
    assert d["a/zeroed"] == 0.5 and d["b/zeroed"] == 0.5 and d["a/saturation"] == pytest.approx(1.0)
    # ranking by A: rows 1, 2 | 3, 0 → gap_a = (2 + 1)/2 − (1 + 0)/2, gap_b = (10 + 10.2)/2 − (9.8 + 10)/2
    assert d["a/gap"] == pytest.approx(1.0) and d["b/gap"] == pytest.approx(0.2, rel=1e-5)
    # second call, b's spread collapsed to a tenth: floored at τ·σ̄_b (σ̄ updated first, β = 0.9)
    R2 = torch.tensor([[0.0, 10.0], [2.0, 10.0], [1.0, 10.02], [1.0, 9.98]])
    adv2 = t(R2, group_size=4)
    sb_bar = 0.9 * math.sqrt(0.02) + 0.1 * math.sqrt(0.0002)
    a_b2 = torch.tensor([0.0, 0.0, 0.02, -0.02]) / max(math.sqrt(0.0002), 0.5 * sb_bar)
    torch.testing.assert_close(adv2, (0.75 * soft(a_a) + 0.25 * soft(a_b2)).float())
    assert t.diagnostics()["b/saturation"] == pytest.approx(math.sqrt(0.0002) / sb_bar, rel=1e-3)
    assert t.diagnostics()["b/zeroed"] == 1.0  # |ã_b| < κ everywhere: b is sparse in this group


def test_saturation_weighted_down_weights_a_saturating_component():
    g = torch.Generator().manual_seed(0)
    P, G = 16, 8
    task = torch.randint(0, 2, (P * G,), generator=g).float()  # healthy, 0/1 rewards with spread
    history = torch.randn(P * G, generator=g)  # the jpeg-like term while it still had spread
    weights = {"task": 1.0, "hack": 1.0}
    sw = SaturationWeighted(weights, kappa=0.0, tau=0.5)
    sw({"task": task, "hack": history}, G)
    saturated = 1e-3 * torch.randn(P * G, generator=g)  # spread collapsed 1000×
    comps = {"task": task, "hack": saturated}
    plain = per_reward_group_advantages(comps, weights, G)
    ours = sw(comps, G)
    task_adv = per_reward_group_advantages(comps, {"task": 1.0}, G)
    hack_adv = per_reward_group_advantages(comps, {"hack": 1.0}, G)  # unit variance: the blown-up noise
    corr = lambda x, y: float(torch.corrcoef(torch.stack([x, y]))[0, 1])  # noqa: E731
    # plain normalisation gives the collapsed term as much say as the task; saturation_weighted does not
    assert corr(plain, hack_adv) > 0.5 and abs(corr(ours, hack_adv)) < 0.05
    assert corr(ours, task_adv) > 0.99 and corr(plain, task_adv) < 0.9
    assert sw.diagnostics()["hack/saturation"] < 0.01


def test_saturation_weighted_single_component_preserves_ranking_and_matches_grpo():
    from flowgrpo.advantages import group_advantages

    g = torch.Generator().manual_seed(1)
    r = torch.randn(24, generator=g)
    plain = group_advantages(r, 6, clip=None)
    adv = SaturationWeighted({"r": 1.0}, kappa=0.0, tau=0.0)(r[:, None], 6)
    torch.testing.assert_close(adv, plain)  # κ = 0, no floor: exactly the GRPO advantage
    sparse = SaturationWeighted({"r": 1.0}, kappa=0.3, tau=0.0)(r[:, None], 6).view(4, 6)
    for rg, ag in zip(r.double().view(4, 6), sparse):
        order = rg.argsort()
        assert (ag[order].diff() >= 0).all()  # monotone in the reward: ranking preserved (ties only at 0)
        assert ((ag == 0) == ((rg - rg.mean()).abs() / (rg.std(correction=0) + 1e-4) <= 0.3)).all()
    floored = SaturationWeighted({"r": 1.0}, kappa=0.3)(r[:, None], 6).view(4, 6)  # with the saturation floor too
    for rg, ag in zip(r.view(4, 6), floored):
        assert (ag[rg.argsort()].diff() >= 0).all()


def test_saturation_weighted_collapse_gate_renorm_and_state_round_trip():
    R = torch.tensor([[1.0, 0.95], [1.0, 0.97], [0.0, 0.2], [1.0, 0.8]])  # group 0: a collapsed; group 1: both spread
    t = SaturationWeighted({"a": 1.0, "b": 1.0}, kappa=0.0, bounds={"b": (0.0, 1.0)}, headroom_min=0.1)
    adv = t(R, group_size=2).view(2, 2)
    # group 0: a has no spread (0) and b is gated (headroom (1 − 0.96)/1 < 0.1): the group contributes 0
    assert adv[0].tolist() == [0.0, 0.0] and t.diagnostics()["b/gated"] == 0.5
    assert t.diagnostics()["zero_group_fraction"] == 0.5
    assert adv[1, 0] < 0 < adv[1, 1]
    literal = SaturationWeighted({"a": 1.0}, kappa=0.0, renorm="std")(torch.tensor([[0.0], [1e-3]]), 2)
    torch.testing.assert_close(literal, torch.tensor([-1.0, 1.0]), atol=1e-3, rtol=0)  # re-amplified (the literal reading)
    state = t.state_dict()
    fresh = SaturationWeighted({"a": 1.0, "b": 1.0}, kappa=0.0, bounds={"b": (0.0, 1.0)}, headroom_min=0.1)
    fresh.load_state_dict(state)
    R2 = torch.tensor([[0.0, 0.5], [1.0, 0.1], [0.3, 0.2], [0.9, 0.4]])
    torch.testing.assert_close(fresh(R2, 2, update=False), t(R2, 2, update=False))
    torch.testing.assert_close(fresh(R2, 2), t(R2, 2))
    assert fresh.state_dict()["num_updates"] == t.state_dict()["num_updates"] == 2
    with pytest.raises(ValueError, match="components"):
        SaturationWeighted({"x": 1.0}).load_state_dict(state)
    with pytest.raises(RuntimeError, match="update=False before any update"):
        SaturationWeighted({"x": 1.0})(torch.zeros(2, 1), 2, update=False)


# --------------------------------------------------------------------------------------------------- CLI


def test_score_cli_on_a_folder_of_pngs(tmp_path):
    g = torch.Generator().manual_seed(0)
    images = [np.full((32, 32, 3), 128, np.uint8), (torch.rand(32, 32, 3, generator=g) * 255).byte().numpy()]
    for i, a in enumerate(images):
        Image.fromarray(a).save(tmp_path / f"{i:03d}.png")
    (tmp_path / "prompts.txt").write_text("# prompts\na grey square\n\nnoise\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-m", "rewards", "score", "--reward", "jpeg_compressibility", "--images",
                           str(tmp_path), "--prompts", str(tmp_path / "prompts.txt"), "--kwargs", '{"quality": 90}'],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    rows = result["images"]
    assert [(r["file"], r["index"], r["prompt"]) for r in rows] == [("000.png", 0, "a grey square"), ("001.png", 1, "noise")]
    assert set(rows[0]) == {"file", "index", "prompt", "score", "jpeg_kb"}
    assert rows[0]["score"] > rows[1]["score"] and rows[0]["score"] == pytest.approx(-rows[0]["jpeg_kb"])
    summary = result["summary"]
    assert summary["reward"] == "jpeg_compressibility" and summary["n"] == 2 and summary["kwargs"] == {"quality": 90}
    assert set(summary["stats"]) == {"score", "jpeg_kb"} and summary["stats"]["score"]["n"] == 2
    assert summary["stats"]["score"]["mean"] == pytest.approx((rows[0]["score"] + rows[1]["score"]) / 2)
    from rewards.__main__ import main  # errors: a clear message and exit code 2, in-process

    assert main(["score", "--reward", "jpeg_compressibility", "--images", str(tmp_path), "--prompts",
                 str(tmp_path / "prompts.txt"), "--kwargs", '{"qualty": 90}']) == 2


def test_component_group_stats_measure_each_terms_spread():
    from flowgrpo.advantages import component_group_stats

    comps = {"a": torch.tensor([1.0, 1.0, 0.0, 2.0]), "b": torch.tensor([0.5, 0.5, 0.5, 0.5]), "c": torch.zeros(4)}
    stats = component_group_stats(comps, ["a", "b"], 2)
    # Hoyer index of the raw scores: a's groups [1, 1] (constant: 0) and [0, 2] (one-hot: 1); b constant: 0
    assert stats == pytest.approx({"a/zero_std_group_fraction": 0.5, "a/group_std_mean": 0.5, "a/hoyer": 0.5,
                                   "b/zero_std_group_fraction": 1.0, "b/group_std_mean": 0.0, "b/hoyer": 0.0})
    assert stats["b/hoyer"] == 0.0  # a constant group: exactly 0
    with pytest.raises(ValueError, match="trainer.group_size=3"):
        component_group_stats(comps, ["a"], 3)
