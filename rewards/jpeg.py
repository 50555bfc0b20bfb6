"""JPEG compressibility / incompressibility (DDPO, arXiv 2305.13301): the size of the image saved as a JPEG.

Weight-free and deterministic, so it doubles as a cheap reward for smoke runs and as the quickly saturating
"hackable" term of multi-reward experiments.

>>> import torch, rewards
>>> smooth, noisy = torch.full((1, 3, 64, 64), 0.5), torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
>>> r = rewards.load("jpeg_compressibility")
>>> bool(r(torch.cat([smooth, noisy]), ["", ""]).scores[0] > r(torch.cat([smooth, noisy]), ["", ""]).scores[1])
True
"""

from __future__ import annotations

import io

import torch
from PIL import Image

from .base import RewardOutput, register
from .images import to_uint8_images

__all__ = ["JpegCompressibility", "jpeg_size_kb"]


def jpeg_size_kb(images, quality: int = 95, reward: str = "jpeg_size_kb") -> torch.Tensor:
    """Size in kB of each image saved as a JPEG at ``quality`` (float32 ``[B]``); NaN / inf pixels raise."""
    sizes = []
    for array in to_uint8_images(images, reward=reward):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegCompressibility:
    """Reward ``−size_kB`` (compressibility) or ``+size_kB`` (``incompressible=True``) of the JPEG-encoded image.

    Components: ``jpeg_kb`` (the size itself).

    Degenerate images are scored as any image: the size is what this reward measures, and a flat image is the most
    compressible one (the known hack of this term; pair it with a content reward). Images holding NaN or inf raise
    ``ValueError`` naming the reward and the samples.
    """

    def __init__(self, quality: int = 95, incompressible: bool = False):
        if not 1 <= quality <= 100:
            raise ValueError(f"quality must be in [1, 100], got {quality}")
        self.quality = quality
        self.sign = 1.0 if incompressible else -1.0
        self.name = "jpeg_incompressibility" if incompressible else "jpeg_compressibility"

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        size = jpeg_size_kb(images, self.quality, reward=self.name)
        return RewardOutput(scores=self.sign * size, components={"jpeg_kb": size})


register("jpeg_compressibility")(JpegCompressibility)
register("jpeg_incompressibility")(lambda quality=95: JpegCompressibility(quality, incompressible=True))
