"""Learned image rewards (PickScore, HPSv2.1, LAION aesthetic, CLIPScore, ImageReward) on tiny random twins.

No real weights exist offline, so every reward is loaded the way a user loads it (a saved transformers directory,
an open_clip / ImageReward / aesthetic checkpoint file) from a tiny random-initialised twin, and compared with the
reference procedure written out independently here: the PickScore model card, HPSv2's ``img_score.py`` with its own
``ResizeMaxSize`` transform, LAION's ``simple_inference.py``, Hessel et al.'s ``clipscore.py``, and ImageReward's
BLIP forward re-implemented from ``vit.py`` / ``med.py`` on a state dict in ``ImageReward.pt``'s key layout.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import rewards
from rewards import MissingWeightsError
from rewards.clip.transforms import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, resize_center_crop, resize_longest_pad
from twins import save_tiny_clip  # tests/twins.py

torch.set_num_threads(1)

# (H, W): both orientations, crop offsets where torchvision's round() and transformers' floor differ, a no-resize one
SHAPES = [(37, 53), (64, 64), (50, 91), (91, 50), (64, 70), (55, 48), (40, 75), (32, 32)]


def _images(shapes=SHAPES, seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for h, w in shapes]


@pytest.fixture(autouse=True)
def _empty_hub_cache(tmp_path, monkeypatch):
    """Default hub ids must fail here even on a machine whose HF cache holds the real checkpoints."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A tiny transformers CLIP checkpoint (model + tokenizer + image processor), saved like a hub one."""
    root = tmp_path_factory.mktemp("clip")
    torch.manual_seed(0)
    save_tiny_clip(root)
    return root


def _reference_clip(clip_dir):
    from transformers import AutoTokenizer, CLIPModel

    return CLIPModel.from_pretrained(clip_dir).eval(), AutoTokenizer.from_pretrained(clip_dir)


def _openai_clip_preprocess(size):
    """OpenAI CLIP's ``_transform(n_px)`` (also ImageReward's, Hessel's CLIPScore's, LAION aesthetic's via clip.load)."""
    from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

    return Compose([Resize(size, interpolation=InterpolationMode.BICUBIC), CenterCrop(size),
                    lambda im: im.convert("RGB"), ToTensor(), Normalize(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)])


def _hpsv2_preprocess_val(size):
    """HPSv2's ``preprocess_val`` (``light_augmentation=True``): ToTensor -> its ResizeMaxSize -> Normalize, as released."""
    import torchvision.transforms.functional as TF
    from torchvision.transforms import Compose, InterpolationMode, Normalize, ToTensor

    def resize_max_size(img):
        height, width = img.shape[1:]
        scale = size / float(max(height, width))
        if scale != 1.0:
            new_size = tuple(round(dim * scale) for dim in (height, width))
            img = TF.resize(img, new_size, InterpolationMode.BICUBIC)
            pad_h, pad_w = size - new_size[0], size - new_size[1]
            img = TF.pad(img, padding=[pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
        return img

    return Compose([lambda im: im.convert("RGB"), ToTensor(), resize_max_size, Normalize(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)])


# ------------------------------------------------------------------------------------------ preprocessing


def test_preprocessing_equals_the_reference_transforms():
    from transformers import CLIPImageProcessorPil

    arrays = _images()
    pils = [Image.fromarray(a) for a in arrays]
    for size in (32, 24):
        # torchvision's OpenAI-CLIP transform (CLIPScore, aesthetic, ImageReward)
        ours = resize_center_crop(arrays, size, crop_rounding="round")
        ref = torch.stack([_openai_clip_preprocess(size)(p) for p in pils])
        assert ours.shape == (len(arrays), 3, size, size)
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
        # transformers' PIL CLIP processor (PickScore's reference processor)
        hf = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
        ours_floor = resize_center_crop(arrays, size, crop_rounding="floor")
        torch.testing.assert_close(ours_floor, hf(images=pils, return_tensors="pt")["pixel_values"], rtol=0, atol=1e-5)
        # the two crop conventions really differ on some shapes, so choosing per reference matters
        assert not torch.allclose(ours, ours_floor)
        # HPSv2's own preprocess_val
        hps = resize_longest_pad(arrays, size)
        torch.testing.assert_close(hps, torch.stack([_hpsv2_preprocess_val(size)(p) for p in pils]), rtol=0, atol=1e-5)
    # crop smaller than the resize (CLIP processors with crop < shortest edge)
    hf = CLIPImageProcessorPil(size={"shortest_edge": 36}, crop_size={"height": 30, "width": 30})
    torch.testing.assert_close(resize_center_crop(arrays, 36, 30, crop_rounding="floor"),
                               hf(images=pils, return_tensors="pt")["pixel_values"], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ PickScore


def test_pickscore_matches_the_model_card_procedure(clip_dir):
    from transformers import AutoImageProcessor

    reward = rewards.load("pickscore", model_path=str(clip_dir), processor_path=str(clip_dir), device="cpu", batch_size=2)
    arrays = _images(SHAPES[:4], seed=1)
    prompts = ["a red circle", "a photo of three dogs on a long road", "a red circle", "x"]  # repeats, lengths differ
    out = reward([Image.fromarray(a) for a in arrays], prompts)
    assert out.scores.shape == (4,) and set(out.components) == {"pickscore"}
    # the model card, one (image, prompt) at a time, with transformers' PIL processor
    model, tok = _reference_clip(clip_dir)
    processor = AutoImageProcessor.from_pretrained(clip_dir, backend="pil")
    with torch.no_grad():
        for i, (array, prompt) in enumerate(zip(arrays, prompts)):
            pixels = processor(images=[Image.fromarray(array)], return_tensors="pt")["pixel_values"]
            text = tok([prompt], padding=True, truncation=True, max_length=77, return_tensors="pt")
            image_embs = F.normalize(model.get_image_features(pixel_values=pixels).pooler_output, dim=-1)
            text_embs = F.normalize(model.get_text_features(**text).pooler_output, dim=-1)
            expected = model.logit_scale.exp() * (text_embs @ image_embs.T)[0, 0]
            torch.testing.assert_close(out.components["pickscore"][i], expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(out.scores, out.components["pickscore"])
    scaled = rewards.load("pickscore", model_path=str(clip_dir), processor_path=str(clip_dir), device="cpu", scale=26)
    torch.testing.assert_close(scaled([Image.fromarray(a) for a in arrays], prompts).scores, out.components["pickscore"] / 26)
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        reward([Image.fromarray(a) for a in arrays[:2]], ["one"])


# ------------------------------------------------------------------------------------------------ CLIPScore


def test_clipscore_matches_hessel_and_rewards_its_own_prompt(clip_dir):
    reward = rewards.load("clipscore", clip_path=str(clip_dir), device="cpu")
    arrays = _images([(48, 64)] * 3, seed=2)
    batch = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)  # uint8 [B, 3, H, W]
    prompts = ["a cat", "a dog on a skateboard", "a cat"]
    out = reward(batch, prompts)
    assert set(out.components) == {"clipscore", "clip_cosine"} and out.scores.shape == (3,)
    model, tok = _reference_clip(clip_dir)
    with torch.no_grad():  # Hessel et al.: prefix "A photo depicts ", OpenAI preprocess, w * clip(cos, 0)
        pixels = torch.stack([_openai_clip_preprocess(32)(Image.fromarray(a)) for a in arrays])
        img = F.normalize(model.get_image_features(pixel_values=pixels).pooler_output, dim=-1)
        text = tok(["A photo depicts " + p for p in prompts], padding=True, truncation=True, max_length=77, return_tensors="pt")
        txt = F.normalize(model.get_text_features(**text).pooler_output, dim=-1)
    cosine = (img * txt).sum(-1)
    torch.testing.assert_close(out.components["clip_cosine"], cosine, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.scores, 2.5 * cosine.clamp(min=0), rtol=0, atol=1e-5)
    # Point every image embedding at the text embedding of "a cat": its own prompt scores the maximum w * 1, the
    # opposite direction scores 0 (the max(cos, 0) clamp) while the cosine says -1.
    with torch.no_grad():
        tokens = reward.tokenizer(["A photo depicts a cat"], return_tensors="pt")
        target = reward.model.get_text_features(**tokens).pooler_output[0]
        bias = torch.randn(reward.model.config.vision_config.hidden_size)
        reward.model.vision_model.post_layernorm.weight.zero_()
        reward.model.vision_model.post_layernorm.bias.copy_(bias)  # pooled output = bias, whatever the image
        reward.model.visual_projection.weight.copy_(torch.outer(target, bias) / bias.dot(bias))  # bias -> target
    aligned = reward(batch, ["a cat", "a dog on a skateboard", "a cat"])
    torch.testing.assert_close(aligned.scores[[0, 2]], torch.tensor([2.5, 2.5]), rtol=0, atol=1e-5)
    assert aligned.scores[1] < 2.5 - 1e-3
    with torch.no_grad():
        reward.model.visual_projection.weight.neg_()
    opposite = reward(batch[:1], ["a cat"])
    assert opposite.scores.item() == 0.0 and opposite.components["clip_cosine"].item() == pytest.approx(-1.0, abs=1e-5)


# ------------------------------------------------------------------------------------------------ aesthetic


def test_aesthetic_matches_laion_simple_inference(clip_dir, tmp_path):
    from rewards.clip.aesthetic import AestheticMLP

    torch.manual_seed(3)
    mlp = AestheticMLP(16)  # 16 = the twin's projection_dim (ViT-L/14: 768)
    ckpt = tmp_path / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(mlp.state_dict(), ckpt)
    assert sorted(mlp.state_dict()) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    reward = rewards.load("aesthetic", checkpoint=str(ckpt), clip_path=str(clip_dir), device="cpu")
    arrays = _images(SHAPES[:3], seed=4)
    out = reward([Image.fromarray(a) for a in arrays], None)
    assert out.scores.shape == (3,) and set(out.components) == {"aesthetic"}
    again = reward([Image.fromarray(a) for a in arrays], ["ignored"] * 3)
    torch.testing.assert_close(again.scores, out.scores)  # eval mode: the MLP's dropouts are off
    model, _ = _reference_clip(clip_dir)
    with torch.no_grad():  # simple_inference.py: encode_image, numpy L2 normalisation, MLP
        feats = model.get_image_features(
            pixel_values=torch.stack([_openai_clip_preprocess(32)(Image.fromarray(a)) for a in arrays])).pooler_output.numpy()
        l2 = np.atleast_1d(np.linalg.norm(feats, 2, -1))
        l2[l2 == 0] = 1
        expected = mlp.eval()(torch.from_numpy(feats / np.expand_dims(l2, -1)).float()).squeeze(-1)
    torch.testing.assert_close(out.scores, expected, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ HPSv2.1


@pytest.fixture(scope="module")
def tiny_open_clip(tmp_path_factory):
    """A tiny open_clip ViT registered as an architecture, and an HPS-style checkpoint ``{"state_dict": ...}`` of it."""
    import open_clip

    root = tmp_path_factory.mktemp("hps")
    name = "flowgrpo-tiny-vit"
    cfg = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    (root / f"{name}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(root / f"{name}.json")
    torch.manual_seed(5)
    model = open_clip.create_model(name, pretrained=None, output_dict=True)
    torch.save({"state_dict": model.state_dict()}, root / "HPS_v2.1_compressed.pt")
    return name, root / "HPS_v2.1_compressed.pt"


def test_hpsv21_matches_hpsv2_img_score(tiny_open_clip):
    import open_clip

    name, ckpt = tiny_open_clip
    reward = rewards.load("hpsv21", checkpoint=str(ckpt), model_name=name, device="cpu", batch_size=2)
    arrays = _images(SHAPES[:5], seed=6)
    prompts = ["a cat", "A Photo of TWO cats", "a cat", "", "a " + "very " * 100 + "long prompt"]  # truncation too
    out = reward([Image.fromarray(a) for a in arrays], prompts)
    assert out.scores.shape == (5,) and set(out.components) == {"hpsv21"}
    # img_score.py: load_state_dict(ckpt['state_dict']), preprocess_val, get_tokenizer, diag(image @ text.T)
    model = open_clip.create_model(name, pretrained=None, output_dict=True)
    model.load_state_dict(torch.load(ckpt)["state_dict"])
    model.eval()
    tokenizer = open_clip.get_tokenizer(name)
    with torch.no_grad():
        for i, (array, prompt) in enumerate(zip(arrays, prompts)):
            outputs = model(_hpsv2_preprocess_val(32)(Image.fromarray(array))[None], tokenizer([prompt]))
            expected = torch.diagonal(outputs["image_features"] @ outputs["text_features"].T)[0]
            torch.testing.assert_close(out.scores[i], expected, rtol=0, atol=1e-5)
    # a bare state dict (some copies) loads the same
    bare = ckpt.with_name("bare.pt")
    torch.save(torch.load(ckpt)["state_dict"], bare)
    torch.testing.assert_close(rewards.load("hpsv21", checkpoint=str(bare), model_name=name, device="cpu")(
        [Image.fromarray(a) for a in arrays], prompts).scores, out.scores)


# ------------------------------------------------------------------------------------------------ ImageReward

VISION = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=40)


@pytest.fixture(scope="module")
def tiny_imagereward(tmp_path_factory):
    """A BERT tokenizer from a vocab file, and a random state dict in ``ImageReward.pt``'s layout (BLIP vit.py + med.py
    + MLP, written out from the reference modules' parameter names and shapes)."""
    from transformers import BertTokenizer

    root = tmp_path_factory.mktemp("imagereward")
    words = ["a", "photo", "of", "the", "cat", "cats", "dog", "red", "blue", "on", "two", "three"]
    letters = list("abcdefghijklmnopqrstuvwxyz0123456789")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + letters + ["##" + c for c in letters] + words
    vocab += [f"filler{i}" for i in range(300 - len(vocab))]  # a real-looking size (the reward refuses near-empty ones)
    (root / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    BertTokenizer(str(root / "vocab.txt")).save_pretrained(root / "tokenizer")
    vocab_size = len(dict.fromkeys(vocab)) + 2  # + [DEC], [ENC] as init_tokenizer adds

    g = torch.Generator().manual_seed(7)
    D, P, Lv, Iv = VISION["hidden_size"], VISION["patch_size"], VISION["num_hidden_layers"], VISION["intermediate_size"]
    H, Lt, It, MP = TEXT["hidden_size"], TEXT["num_hidden_layers"], TEXT["intermediate_size"], TEXT["max_position_embeddings"]
    N = (VISION["image_size"] // P) ** 2

    def w(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else 1 / math.sqrt(shape[-1]))

    def ln(dim):
        return {"weight": 1 + 0.1 * torch.randn(dim, generator=g), "bias": 0.1 * torch.randn(dim, generator=g)}

    def linear(prefix, out_f, in_f):
        return {f"{prefix}.weight": w(out_f, in_f), f"{prefix}.bias": w(out_f, scale=0.02)}

    sd = {}
    v = "blip.visual_encoder."
    sd.update({v + "cls_token": w(1, 1, D, scale=0.02), v + "pos_embed": w(1, N + 1, D, scale=0.02),
               v + "patch_embed.proj.weight": w(D, 3, P, P, scale=1 / math.sqrt(3 * P * P)),
               v + "patch_embed.proj.bias": w(D, scale=0.02)})
    for i in range(Lv):
        b = f"{v}blocks.{i}."
        sd.update({b + "norm1." + k: t for k, t in ln(D).items()})
        sd.update({b + "norm2." + k: t for k, t in ln(D).items()})
        sd.update(linear(b + "attn.qkv", 3 * D, D) | linear(b + "attn.proj", D, D))
        sd.update(linear(b + "mlp.fc1", Iv, D) | linear(b + "mlp.fc2", D, Iv))
    sd.update({v + "norm." + k: t for k, t in ln(D).items()})
    t = "blip.text_encoder."
    sd.update({t + "embeddings.word_embeddings.weight": w(vocab_size, H, scale=0.5),
               t + "embeddings.position_embeddings.weight": w(MP, H, scale=0.5),
               t + "embeddings.position_ids": torch.arange(MP)[None]})
    sd.update({t + "embeddings.LayerNorm." + k: x for k, x in ln(H).items()})
    for i in range(Lt):
        b = f"{t}encoder.layer.{i}."
        for att, kv in (("attention", H), ("crossattention", D)):
            sd.update(linear(b + att + ".self.query", H, H) | linear(b + att + ".self.key", H, kv)
                      | linear(b + att + ".self.value", H, kv))
            sd.update(linear(b + att + ".output.dense", H, H))
            sd.update({b + att + ".output.LayerNorm." + k: x for k, x in ln(H).items()})
        sd.update(linear(b + "intermediate.dense", It, H) | linear(b + "output.dense", H, It))
        sd.update({b + "output.LayerNorm." + k: x for k, x in ln(H).items()})
    sd.update(linear("blip.vision_proj", 16, D) | linear("blip.text_proj", 16, H))
    for idx, (o, i_) in zip((0, 2, 4, 6, 7), ((1024, H), (128, 1024), (64, 128), (16, 64), (1, 16))):
        sd.update(linear(f"mlp.layers.{idx}", o, i_))
    torch.save(sd, root / "ImageReward.pt")
    config = {"vision_config": VISION, "text_config": {**TEXT, "vocab_size": vocab_size}}
    return root, sd, config


def _reference_imagereward(sd, pixels, input_ids, attention_mask):
    """ImageReward.score's forward from BLIP's vit.py and med.py, on the reference-layout state dict."""
    D, heads = VISION["hidden_size"], VISION["num_attention_heads"]
    v = "blip.visual_encoder."

    def attend(q, k, v_, n_heads, mask=None):
        B, Lq, C = q.shape
        q, k, v_ = (x.view(B, x.shape[1], n_heads, -1).transpose(1, 2) for x in (q, k, v_))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores + mask
        return (scores.softmax(-1) @ v_).transpose(1, 2).reshape(B, Lq, C)

    def lin(x, p):
        return F.linear(x, sd[p + ".weight"], sd[p + ".bias"])

    # vit.py VisionTransformer.forward
    x = F.conv2d(pixels, sd[v + "patch_embed.proj.weight"], sd[v + "patch_embed.proj.bias"], stride=VISION["patch_size"])
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([sd[v + "cls_token"].expand(x.shape[0], -1, -1), x], 1)
    x = x + sd[v + "pos_embed"][:, : x.shape[1]]
    for i in range(VISION["num_hidden_layers"]):
        b = f"{v}blocks.{i}."
        h = F.layer_norm(x, (D,), sd[b + "norm1.weight"], sd[b + "norm1.bias"], 1e-6)
        q, k, v_ = lin(h, b + "attn.qkv").chunk(3, dim=-1)  # qkv.reshape(B, N, 3, heads, C // heads)
        x = x + lin(attend(q, k, v_, heads), b + "attn.proj")
        h = F.layer_norm(x, (D,), sd[b + "norm2.weight"], sd[b + "norm2.bias"], 1e-6)
        x = x + lin(F.gelu(lin(h, b + "mlp.fc1")), b + "mlp.fc2")
    image_embeds = F.layer_norm(x, (D,), sd[v + "norm.weight"], sd[v + "norm.bias"], 1e-6)
    # med.py BertModel (multimodal): embeddings, then per layer self-attention, cross-attention, feed-forward
    H, t = TEXT["hidden_size"], "blip.text_encoder."

    def add_norm(out, residual, p):
        return F.layer_norm(out + residual, (H,), sd[p + ".weight"], sd[p + ".bias"], 1e-12)

    L = input_ids.shape[1]
    h = sd[t + "embeddings.word_embeddings.weight"][input_ids] + sd[t + "embeddings.position_embeddings.weight"][:L]
    h = F.layer_norm(h, (H,), sd[t + "embeddings.LayerNorm.weight"], sd[t + "embeddings.LayerNorm.bias"], 1e-12)
    mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
    for i in range(TEXT["num_hidden_layers"]):
        b = f"{t}encoder.layer.{i}."
        s = b + "attention."
        ctx = attend(lin(h, s + "self.query"), lin(h, s + "self.key"), lin(h, s + "self.value"),
                     TEXT["num_attention_heads"], mask)
        h = add_norm(lin(ctx, s + "output.dense"), h, s + "output.LayerNorm")
        c = b + "crossattention."
        ctx = attend(lin(h, c + "self.query"), lin(image_embeds, c + "self.key"), lin(image_embeds, c + "self.value"),
                     TEXT["num_attention_heads"])
        h = add_norm(lin(ctx, c + "output.dense"), h, c + "output.LayerNorm")
        h = add_norm(lin(F.gelu(lin(h, b + "intermediate.dense")), b + "output.dense"), h, b + "output.LayerNorm")
    r = h[:, 0]
    for idx in (0, 2, 4, 6, 7):
        r = lin(r, f"mlp.layers.{idx}")
    return ((r - 0.16717362830052426) / 1.0333394966054072).squeeze(-1)


def test_imagereward_loads_the_reference_layout_and_matches_its_forward(tiny_imagereward):
    from transformers import BertTokenizer

    from rewards.image_reward import map_reference_state_dict

    root, sd, config = tiny_imagereward
    reward = rewards.load("imagereward", checkpoint=str(root / "ImageReward.pt"), tokenizer=str(root / "tokenizer"),
                          config=config, device="cpu", batch_size=2)
    arrays = _images(SHAPES[:3], seed=8)
    prompts = ["a photo of a red cat", "two dogs on the", "a photo of a red cat"]
    out = reward([Image.fromarray(a) for a in arrays], prompts)
    assert out.scores.shape == (3,) and set(out.components) == {"imagereward", "imagereward_raw"}
    torch.testing.assert_close(out.scores, (out.components["imagereward_raw"] - 0.16717362830052426) / 1.0333394966054072)
    # the reference: init_tokenizer (bert + [DEC] + [ENC]), max_length=35 padding, _transform(224) at the twin's 32
    tok = BertTokenizer(str(root / "vocab.txt"))
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    assert len(reward.tokenizer) == len(tok) == config["text_config"]["vocab_size"]
    with torch.no_grad():
        for i, (array, prompt) in enumerate(zip(arrays, prompts)):
            text = tok(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
            pixels = _openai_clip_preprocess(32)(Image.fromarray(array))[None]
            expected = _reference_imagereward(sd, pixels, text.input_ids, text.attention_mask)[0]
            torch.testing.assert_close(out.scores[i], expected, rtol=0, atol=1e-4)
    # every reference key is mapped or knowingly dropped; the model's keys are all covered
    mapped = map_reference_state_dict(sd)
    assert set(mapped) == set(reward.model.state_dict())
    dropped = {k for k in sd if not map_reference_state_dict({k: sd[k]})}
    assert dropped == {"blip.text_encoder.embeddings.position_ids", "blip.vision_proj.weight", "blip.vision_proj.bias",
                       "blip.text_proj.weight", "blip.text_proj.bias"}
    # a checkpoint that is not ImageReward's says so, naming the file and the key to set
    bad = root / "not-imagereward.pt"
    torch.save({**sd, "blip.itm_head.weight": torch.zeros(2, 32)}, bad)
    with pytest.raises(MissingWeightsError, match=r"not-imagereward\.pt.*blip\.itm_head\.weight.*checkpoint="):
        rewards.load("imagereward", checkpoint=str(bad), tokenizer=str(root / "tokenizer"), config=config, device="cpu")


# ------------------------------------------------------------------------------------------- missing weights


def test_missing_weights_errors_name_the_source_and_the_key(clip_dir, tiny_imagereward, tmp_path):
    root, _, config = tiny_imagereward
    cases = [
        (dict(name="pickscore"), r"yuvalkirstain/PickScore_v1.*model_path="),
        (dict(name="pickscore", model_path=str(clip_dir)), r"laion/CLIP-ViT-H-14-laion2B-s32B-b79K.*processor_path="),
        (dict(name="clipscore"), r"openai/clip-vit-large-patch14.*clip_path="),
        (dict(name="clipscore", clip_path=str(tmp_path / "nowhere")), r"nowhere.*clip_path="),
        (dict(name="aesthetic"), r"sac\+logos\+ava1-l14-linearMSE\.pth.*improved-aesthetic-predictor.*checkpoint="),
        (dict(name="aesthetic", checkpoint=str(tmp_path / "gone.pth")), r"gone\.pth.*no such file.*checkpoint="),
        (dict(name="hpsv21"), r"HPS_v2\.1_compressed\.pt.*xswu/HPSv2.*checkpoint="),
        (dict(name="imagereward"), r"ImageReward\.pt.*THUDM/ImageReward.*checkpoint="),
        (dict(name="imagereward", checkpoint=str(root / "ImageReward.pt"), config=config), r"bert-base-uncased.*tokenizer="),
    ]
    # a checkpoint missing a weight (transformers would only warn and initialise it at random)
    import shutil

    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial-clip"
    shutil.copytree(clip_dir, partial)
    state = load_file(partial / "model.safetensors")
    del state["visual_projection.weight"]
    save_file(state, partial / "model.safetensors", metadata={"format": "pt"})
    cases.append((dict(name="clipscore", clip_path=str(partial)), r"partial-clip.*visual_projection\.weight.*clip_path="))
    for kwargs, message in cases:
        name = kwargs.pop("name")
        with pytest.raises(MissingWeightsError, match=message) as info:
            rewards.load(name, device="cpu", **kwargs)
        assert isinstance(info.value, OSError) and info.value.reward == name, name


# ------------------------------------------------------------------------------------------- dtype / batching


def test_bfloat16_and_batching_agree_with_float32(clip_dir, tiny_open_clip, tiny_imagereward, tmp_path):
    from rewards.clip.aesthetic import AestheticMLP

    torch.save(AestheticMLP(16).state_dict(), tmp_path / "aesthetic.pth")
    name, hps_ckpt = tiny_open_clip
    root, _, config = tiny_imagereward
    builds = {
        "pickscore": dict(model_path=str(clip_dir), processor_path=str(clip_dir)),
        "clipscore": dict(clip_path=str(clip_dir)),
        "aesthetic": dict(checkpoint=str(tmp_path / "aesthetic.pth"), clip_path=str(clip_dir)),
        "hpsv21": dict(checkpoint=str(hps_ckpt), model_name=name),
        "imagereward": dict(checkpoint=str(root / "ImageReward.pt"), tokenizer=str(root / "tokenizer"), config=config),
    }
    images = torch.rand(5, 3, 40, 48, generator=torch.Generator().manual_seed(9))
    prompts = ["a cat", "a red dog", "a cat", "two cats on the", "a cat"]
    for reward_name, kwargs in builds.items():
        full = rewards.load(reward_name, device="cpu", **kwargs)
        out = full(images, prompts)
        # one image at a time gives what the batch gives (prompt padding, de-duplicated prompts)
        singles = torch.cat([full(images[i:i + 1], prompts[i:i + 1]).scores for i in range(5)])
        torch.testing.assert_close(singles, out.scores, rtol=0, atol=1e-5, msg=reward_name)
        half = rewards.load(reward_name, device="cpu", dtype="bfloat16", **kwargs)
        low = half(images, prompts)
        assert low.scores.dtype == torch.float32 and set(low.components) == set(out.components), reward_name
        spread = out.scores.abs().max().item() + 1e-3
        torch.testing.assert_close(low.scores, out.scores, rtol=0, atol=0.05 * spread, msg=reward_name)
