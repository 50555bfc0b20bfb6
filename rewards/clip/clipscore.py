"""CLIPScore (Hessel et al., "CLIPScore: A Reference-free Evaluation Metric for Image Captioning", arXiv 2104.08718).

``clipscore = w * max(cos(image, "A photo depicts " + prompt), 0)`` with ``w = 2.5``, as the reference
implementation (github jmhessel/clipscore, ``clipscore.py``) [code]: the caption gets the prefix
``"A photo depicts "``, is tokenised with truncation to 77 tokens, and image / text embeddings are L2-normalised.
The reference's images go through OpenAI CLIP's preprocess (``Resize(224, BICUBIC)``, ``CenterCrop(224)``,
``ToTensor``, ``Normalize``), reproduced by :func:`rewards.clip.transforms.resize_center_crop` with torchvision's
crop offset; sizes / mean / std come from the checkpoint's image processor config.

The paper used ViT-B/32; the default here is ViT-L/14 (``openai/clip-vit-large-patch14``, torchmetrics' default and
a stronger judge): set ``clip_path`` for another transformers CLIP checkpoint.
"""

from __future__ import annotations

import torch

from ..base import RewardOutput, register
from ..images import to_uint8_images
from .._loading import resolve_device, resolve_dtype
from .common import check_prompts, encode_unique, in_chunks, load_hf_clip, normalized, pooled
from .transforms import resize_center_crop

__all__ = ["CLIPScore"]

DEFAULT_CLIP = "openai/clip-vit-large-patch14"


@register("clipscore")
class CLIPScore:
    """CLIPScore of each (image, prompt) pair.

    Args:
        clip_path: hub id or local directory of a transformers CLIP checkpoint (model, tokenizer, image processor).
        w: the reference's rescaling weight (2.5).
        prefix: prepended to every prompt (the reference's ``"A photo depicts "``; ``""`` for none).
        device, dtype, batch_size: as for every learned reward.

    Components: ``clipscore`` (``w * max(cos, 0)``, the score) and ``clip_cosine`` (the cosine itself).
    """

    def __init__(self, clip_path: str = DEFAULT_CLIP, *, w: float = 2.5, prefix: str = "A photo depicts ",
                 device=None, dtype=None, batch_size: int = 32):
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.w, self.batch_size = float(w), int(batch_size)
        self.prefix = prefix if not prefix or prefix.endswith(" ") else prefix + " "  # as the reference
        self.model, self.tokenizer, self.image_config = load_hf_clip(
            clip_path, clip_path, reward="clipscore", model_kwarg="clip_path", processor_kwarg="clip_path",
            device=self.device, dtype=self.dtype)
        self.max_length = self.model.config.text_config.max_position_embeddings

    def preprocess(self, arrays) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` arrays -> OpenAI CLIP's preprocess (torchvision crop offset)."""
        return resize_center_crop(arrays, **self.image_config, crop_rounding="round")

    def _image_features(self, arrays) -> torch.Tensor:
        pixels = self.preprocess(arrays).to(self.device, self.dtype)
        return normalized(pooled(self.model.get_image_features(pixel_values=pixels)))

    def _text_features(self, prompts: list[str]) -> torch.Tensor:
        texts = [self.prefix + p for p in prompts]
        tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        return normalized(pooled(self.model.get_text_features(**tokens.to(self.device))))

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        arrays = to_uint8_images(images, reward="clipscore")
        prompts = check_prompts(prompts, len(arrays), "clipscore")
        if not arrays:
            return RewardOutput(torch.zeros(0), {"clipscore": torch.zeros(0), "clip_cosine": torch.zeros(0)})
        image = torch.cat([self._image_features(arrays[s]) for s in in_chunks(len(arrays), self.batch_size)])
        cosine = (image * encode_unique(prompts, self._text_features, self.batch_size)).sum(-1).cpu()
        score = self.w * cosine.clamp(min=0)
        return RewardOutput(scores=score, components={"clipscore": score, "clip_cosine": cosine})
