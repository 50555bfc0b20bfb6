"""ImageReward (Xu et al., "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image Generation",
arXiv 2304.05977), rebuilt on transformers' BLIP modules.

The ``image-reward`` package does not import under transformers 5, so its architecture is rebuilt
here from ``ImageReward/ImageReward.py`` and ``models/BLIP/*`` (github THUDM/ImageReward) [code]:

- image encoder: BLIP's ViT-L/16 at 224 (``create_vit('large', 224)``: width 1024, depth 24, 16 heads, MLP 4096,
  LayerNorm eps 1e-6, exact GELU) = :class:`transformers.BlipVisionModel`; its ``last_hidden_state`` (after the final
  LayerNorm, all tokens) is BLIP's ``visual_encoder(image)``;
- text encoder: BLIP's ``med.BertModel`` (BERT-base, 12 layers, vocabulary 30524 = bert-base-uncased + ``[DEC]`` +
  ``[ENC]``, a cross-attention block per layer over the image tokens, no pooler) =
  :class:`transformers.BlipTextModel` (``add_pooling_layer=False``; called as an encoder, ``is_decoder=False``);
- head: the ``[CLS]`` hidden state -> the LAION-aesthetic-style MLP ``768 -> 1024 -> 128 -> 64 -> 16 -> 1``
  (:class:`rewards.clip.aesthetic.AestheticMLP`), then ``(r - 0.16717362830052426) / 1.0333394966054072``.

Scoring as ``ImageReward.score``: the prompt tokenised by the BLIP tokenizer with ``padding="max_length",
truncation=True, max_length=35``; the image through ``_transform(224)`` (OpenAI CLIP's preprocess: bicubic
shortest-side resize, centre crop, OpenAI mean / std; :func:`rewards.clip.transforms.resize_center_crop`); the image
attention mask all ones.

``ImageReward.pt`` (hub repo ``THUDM/ImageReward``) is the reference model's ``state_dict``; its keys map onto
the transformers modules by :data:`KEY_RULES` (first matching rule wins; a key no rule matches is an error):

===========================================================  =====================================================
``ImageReward.pt``                                            here (:class:`ImageRewardModel`)
===========================================================  =====================================================
``blip.visual_encoder.cls_token``                             ``vision_model.embeddings.class_embedding``
``blip.visual_encoder.pos_embed``                             ``vision_model.embeddings.position_embedding``
``blip.visual_encoder.patch_embed.proj.*``                    ``vision_model.embeddings.patch_embedding.*``
``blip.visual_encoder.blocks.{i}.norm1.*`` / ``norm2.*``      ``vision_model.encoder.layers.{i}.layer_norm1.*`` / ``2``
``blip.visual_encoder.blocks.{i}.attn.qkv.*``                 ``vision_model.encoder.layers.{i}.self_attn.qkv.*``
``blip.visual_encoder.blocks.{i}.attn.proj.*``                ``vision_model.encoder.layers.{i}.self_attn.projection.*``
``blip.visual_encoder.blocks.{i}.mlp.fc1.*`` / ``fc2.*``      ``vision_model.encoder.layers.{i}.mlp.fc1.*`` / ``fc2``
``blip.visual_encoder.norm.*``                                ``vision_model.post_layernorm.*``
``blip.text_encoder.embeddings.position_ids``                 dropped (a non-persistent buffer here)
``blip.text_encoder.*``                                       ``text_encoder.*`` (med's names are transformers')
``mlp.layers.*``                                              ``mlp.layers.*``
``blip.vision_proj.*``, ``blip.text_proj.*``                  dropped (BLIP's contrastive projections; unused)
===========================================================  =====================================================

This is transformers' own BLIP conversion (``convert_blip_original_pytorch_to_hf.py``: same fused ``qkv`` layout,
text-encoder keys unchanged).

Images holding NaN or inf raise ``ValueError`` naming the reward and the samples; degenerate images (uniform, noise)
are scored by the model like any other (:mod:`rewards.base`).
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

from .base import RewardOutput, register
from .clip.aesthetic import AestheticMLP
from .clip.common import check_prompts, in_chunks
from .clip.transforms import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, resize_center_crop
from .images import to_uint8_images
from ._loading import MissingWeightsError, check_tokenizer, from_pretrained, load_state_dict_file, resolve_device, resolve_dtype

__all__ = ["KEY_RULES", "ImageReward", "ImageRewardModel", "imagereward_configs", "map_reference_state_dict"]

REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
DEFAULT_TOKENIZER = "bert-base-uncased"
CHECKPOINT_NAME = "ImageReward.pt"
FETCH = (f"Get {CHECKPOINT_NAME} from the hub repo THUDM/ImageReward (`huggingface-cli download THUDM/ImageReward "
         f"{CHECKPOINT_NAME}` where a hub is reachable)")

# ImageReward's BLIP: create_vit('large', 224) and med_config.json with encoder_width = 1024.
VISION_DEFAULTS = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       image_size=224, patch_size=16, layer_norm_eps=1e-6, hidden_act="gelu", attention_dropout=0.0)
TEXT_DEFAULTS = dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     max_position_embeddings=512, layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     is_decoder=True)  # is_decoder builds the cross-attention blocks; forward runs as an encoder

# (pattern on the reference key, replacement); None drops the key. Order matters: first match wins.
KEY_RULES: list[tuple[str, str | None]] = [
    (r"^blip\.visual_encoder\.cls_token$", "vision_model.embeddings.class_embedding"),
    (r"^blip\.visual_encoder\.pos_embed$", "vision_model.embeddings.position_embedding"),
    (r"^blip\.visual_encoder\.patch_embed\.proj\.(weight|bias)$", r"vision_model.embeddings.patch_embedding.\1"),
    (r"^blip\.visual_encoder\.blocks\.(\d+)\.norm([12])\.(weight|bias)$", r"vision_model.encoder.layers.\1.layer_norm\2.\3"),
    (r"^blip\.visual_encoder\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)$", r"vision_model.encoder.layers.\1.self_attn.qkv.\2"),
    (r"^blip\.visual_encoder\.blocks\.(\d+)\.attn\.proj\.(weight|bias)$",
     r"vision_model.encoder.layers.\1.self_attn.projection.\2"),
    (r"^blip\.visual_encoder\.blocks\.(\d+)\.mlp\.(fc[12])\.(weight|bias)$", r"vision_model.encoder.layers.\1.mlp.\2.\3"),
    (r"^blip\.visual_encoder\.norm\.(weight|bias)$", r"vision_model.post_layernorm.\1"),
    (r"^blip\.text_encoder\.embeddings\.position_ids$", None),
    (r"^blip\.text_encoder\.(.+)$", r"text_encoder.\1"),
    (r"^mlp\.layers\.(\d+)\.(weight|bias)$", r"mlp.layers.\1.\2"),
    (r"^blip\.(vision_proj|text_proj)\.(weight|bias)$", None),
]
_COMPILED = [(re.compile(p), r) for p, r in KEY_RULES]


def map_reference_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``ImageReward.pt``'s state dict -> :class:`ImageRewardModel`'s keys (by :data:`KEY_RULES`); unknown keys raise."""
    out, unknown = {}, []
    for key, value in state.items():
        for pattern, repl in _COMPILED:
            if pattern.match(key):
                if repl is not None:
                    out[pattern.sub(repl, key)] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise KeyError(f"keys not in ImageReward's layout: {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    return out


def imagereward_configs(config: dict | None = None):
    """``(BlipVisionConfig, BlipTextConfig)`` of ImageReward, with ``config={"vision_config": {...}, "text_config": {...}}``
    overriding fields (tests build tiny twins this way). The text encoder's cross-attention width follows the vision width."""
    from transformers import BlipTextConfig, BlipVisionConfig

    config = dict(config or {})
    unknown = set(config) - {"vision_config", "text_config"}
    if unknown:
        raise ValueError(f"imagereward: config= takes 'vision_config' and 'text_config', got {sorted(unknown)}")
    vision = BlipVisionConfig(**{**VISION_DEFAULTS, **config.get("vision_config", {})})
    text = {**TEXT_DEFAULTS, **config.get("text_config", {})}
    text.setdefault("encoder_hidden_size", vision.hidden_size)
    return vision, BlipTextConfig(**text)


def _skip_init():
    """transformers' ``no_init_weights`` (random init of a 450M-parameter model costs seconds), if it has one."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


class ImageRewardModel(nn.Module):
    """BLIP ViT + cross-attending BERT + MLP head; ``forward`` returns the raw (unnormalised) reward ``[B]``."""

    def __init__(self, vision_config, text_config):
        super().__init__()
        from transformers import BlipTextModel, BlipVisionModel

        self.vision_model = BlipVisionModel(vision_config)
        self.text_encoder = BlipTextModel(text_config, add_pooling_layer=False)
        self.mlp = AestheticMLP(text_config.hidden_size)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        image_embeds = self.vision_model(pixel_values=pixel_values).last_hidden_state
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        text = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image_embeds,
                                 encoder_attention_mask=image_atts, is_decoder=False)
        features = text.last_hidden_state[:, 0, :].float()  # [CLS]; the head runs in float32 as the reference
        return self.mlp(features).squeeze(-1)


@register("imagereward")
class ImageReward:
    """ImageReward of each (image, prompt) pair.

    Args:
        checkpoint: path to ``ImageReward.pt`` (the reference model's state dict, mapped by :data:`KEY_RULES`).
        tokenizer: hub id or directory of the BERT tokenizer (``bert-base-uncased``; ``[DEC]`` / ``[ENC]`` are added
            as the reference's ``init_tokenizer`` does, unless already there).
        config: overrides of the architecture (``{"vision_config": {...}, "text_config": {...}}``), for tiny twins.
        max_length: prompt tokens (35, the reference's).
        device, dtype, batch_size: as for every learned reward (the MLP head always runs in float32).

    Components: ``imagereward`` (normalised, the score) and ``imagereward_raw`` (the MLP output before it).
    """

    def __init__(self, checkpoint: str | None = None, tokenizer: str = DEFAULT_TOKENIZER, *, config: dict | None = None,
                 max_length: int = 35, device=None, dtype=None, batch_size: int = 32):
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.max_length, self.batch_size = int(max_length), int(batch_size)
        example = f"rewards.load('imagereward', checkpoint='/path/to/{CHECKPOINT_NAME}')"
        state = load_state_dict_file(checkpoint, reward="imagereward", what=f"ImageReward checkpoint ({CHECKPOINT_NAME})",
                                     kwarg="checkpoint", fetch=FETCH, example=example)
        state = state.get("state_dict", state)

        from transformers import AutoTokenizer

        tok_example = "rewards.load('imagereward', tokenizer='/path/to/bert-base-uncased')"
        self.tokenizer = from_pretrained(AutoTokenizer.from_pretrained, tokenizer, reward="imagereward",
                                         what="BERT tokenizer", kwarg="tokenizer", example=tok_example)
        check_tokenizer(self.tokenizer, tokenizer, reward="imagereward", kwarg="tokenizer", example=tok_example)
        vocab = self.tokenizer.get_vocab()
        if "[DEC]" not in vocab:  # as the reference's init_tokenizer
            self.tokenizer.add_special_tokens({"bos_token": "[DEC]"})
        if "[ENC]" not in vocab:
            self.tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})

        vision_config, text_config = imagereward_configs(config)
        if len(self.tokenizer) > text_config.vocab_size:
            raise ValueError(f"imagereward: the tokenizer from {tokenizer!r} has {len(self.tokenizer)} tokens, more than "
                             f"the text encoder's vocabulary ({text_config.vocab_size}); is it bert-base-uncased?")
        with _skip_init():  # every weight is overwritten by the strict load below
            model = ImageRewardModel(vision_config, text_config)
        try:
            model.load_state_dict(map_reference_state_dict(state), strict=True)
        except (KeyError, RuntimeError) as err:
            raise MissingWeightsError("imagereward", f"ImageReward checkpoint ({CHECKPOINT_NAME})", str(checkpoint),
                                      "checkpoint", reason=f"its tensors do not fit ImageReward's architecture: "
                                      f"{str(err)[:300]}", fetch=FETCH, example=example) from err
        self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)
        self.model.mlp.float()
        self.image_size = vision_config.image_size

    def preprocess(self, arrays) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` arrays -> ImageReward's ``_transform(224)`` (OpenAI CLIP's preprocess)."""
        return resize_center_crop(arrays, self.image_size, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, crop_rounding="round")

    def _raw(self, arrays, prompts: list[str]) -> torch.Tensor:
        pixels = self.preprocess(arrays).to(self.device, self.dtype)
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=self.max_length,
                                return_tensors="pt").to(self.device)
        return self.model(pixels, tokens["input_ids"], tokens["attention_mask"])

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        arrays = to_uint8_images(images, reward="imagereward")
        prompts = check_prompts(prompts, len(arrays), "imagereward")
        if not arrays:
            return RewardOutput(torch.zeros(0), {"imagereward": torch.zeros(0), "imagereward_raw": torch.zeros(0)})
        raw = torch.cat([self._raw(arrays[s], prompts[s]) for s in in_chunks(len(arrays), self.batch_size)]).float().cpu()
        score = (raw - REWARD_MEAN) / REWARD_STD
        return RewardOutput(scores=score, components={"imagereward": score, "imagereward_raw": raw})
