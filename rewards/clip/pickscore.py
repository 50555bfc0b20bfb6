"""PickScore (Kirstain et al., "Pick-a-Pic", arXiv 2305.01569): a CLIP ViT-H/14 fine-tuned on human preferences.

Reference: the model card of ``yuvalkirstain/PickScore_v1`` [code]::

    processor = AutoProcessor.from_pretrained("laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
    model = AutoModel.from_pretrained("yuvalkirstain/PickScore_v1")
    image_inputs = processor(images=images, padding=True, truncation=True, max_length=77, return_tensors="pt")
    text_inputs = processor(text=prompt, padding=True, truncation=True, max_length=77, return_tensors="pt")
    image_embs, text_embs = model.get_image_features(**image_inputs), model.get_text_features(**text_inputs)
    # both L2-normalised
    scores = model.logit_scale.exp() * (text_embs @ image_embs.T)[0]

Here each image is scored against its own prompt: ``pickscore = logit_scale.exp() * cos(image, prompt)`` (the
reference's number, around 20 on real images, ``logit_scale.exp()`` being 100). The training scalar is
``pickscore / scale``; ``scale=1`` keeps the reference's number, Flow-GRPO trains on ``pickscore / 26``.

Preprocessing is the reference processor's (transformers 4's PIL ``CLIPImageProcessor``: shortest side to 224 with
PIL bicubic, centre crop 224 with transformers' floor offset, OpenAI mean / std), read from ``processor_path``'s
config and reproduced by :func:`rewards.clip.transforms.resize_center_crop` -- transformers 5 loads a torchvision
backend by default, whose tensor resize differs from PIL's by up to about one grey level per pixel.
"""

from __future__ import annotations

import torch

from ..base import RewardOutput, register
from ..images import to_uint8_images
from .._loading import resolve_device, resolve_dtype
from .common import check_prompts, encode_unique, in_chunks, load_hf_clip, normalized, pooled
from .transforms import resize_center_crop

__all__ = ["PickScore"]

DEFAULT_MODEL = "yuvalkirstain/PickScore_v1"
DEFAULT_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


@register("pickscore")
class PickScore:
    """PickScore of each (image, prompt) pair.

    Args:
        model_path: hub id or local directory of the PickScore ``CLIPModel``.
        processor_path: hub id or directory of the CLIP-H tokenizer + image processor it was trained with.
        scale: training scalar = ``pickscore / scale`` (1: the reference's number; Flow-GRPO uses 26).
        device, dtype: where / in what precision the model runs (default: current CUDA device else CPU; float32).
        batch_size: images (and distinct prompts) per forward pass.

    Components: ``pickscore`` (``logit_scale.exp() * cos``, the reference's number).

    >>> reward = PickScore(device="cuda")                                       # doctest: +SKIP
    >>> reward(images, ["a photo of a cat"] * len(images)).components["pickscore"]  # doctest: +SKIP
    """

    def __init__(self, model_path: str = DEFAULT_MODEL, processor_path: str = DEFAULT_PROCESSOR, *, scale: float = 1.0,
                 device=None, dtype=None, batch_size: int = 32):
        if scale <= 0:
            raise ValueError(f"pickscore: scale must be > 0, got {scale}")
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.scale, self.batch_size = float(scale), int(batch_size)
        self.model, self.tokenizer, self.image_config = load_hf_clip(
            model_path, processor_path, reward="pickscore", model_kwarg="model_path", processor_kwarg="processor_path",
            device=self.device, dtype=self.dtype)
        self.max_length = self.model.config.text_config.max_position_embeddings

    def preprocess(self, arrays) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` arrays -> the reference processor's ``pixel_values``."""
        return resize_center_crop(arrays, **self.image_config, crop_rounding="floor")

    def _image_features(self, arrays) -> torch.Tensor:
        pixels = self.preprocess(arrays).to(self.device, self.dtype)
        return normalized(pooled(self.model.get_image_features(pixel_values=pixels)))

    def _text_features(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        return normalized(pooled(self.model.get_text_features(**tokens.to(self.device))))

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        arrays = to_uint8_images(images, reward="pickscore")
        prompts = check_prompts(prompts, len(arrays), "pickscore")
        if not arrays:
            return RewardOutput(torch.zeros(0), {"pickscore": torch.zeros(0)})
        image = torch.cat([self._image_features(arrays[s]) for s in in_chunks(len(arrays), self.batch_size)])
        text = encode_unique(prompts, self._text_features, self.batch_size)
        raw = self.model.logit_scale.exp().float() * (image * text).sum(-1)
        raw = raw.cpu()
        return RewardOutput(scores=raw / self.scale, components={"pickscore": raw})
