"""The reference image preprocessing of the CLIP-family rewards, on the uint8 images of :mod:`rewards.images`.

Two transforms cover every reference (each checked against its reference in ``tests/test_learned_rewards.py``):

:func:`resize_center_crop` -- OpenAI CLIP's ``Compose([Resize(n, BICUBIC), CenterCrop(n), ToTensor(), Normalize])``
    on a PIL image: the shortest side resized to ``size`` with PIL's bicubic filter (long side
    ``int(size * long / short)``), a centre crop, ``/255``, ``(x - mean) / std``. Used by CLIPScore (Hessel et al.),
    the LAION aesthetic predictor (OpenAI ``clip.load`` preprocess) and ImageReward (its ``_transform(224)``), all with
    torchvision's crop offset ``round((H - crop) / 2)`` (``crop_rounding="round"``). transformers' CLIP image
    processor (PIL backend, i.e. transformers 4's ``CLIPImageProcessor`` that PickScore was trained and published
    with) does the same except the crop offset ``(H - crop) // 2`` (``crop_rounding="floor"``): the two differ by one
    pixel when ``H - crop`` is odd and ``(H - crop) / 2`` rounds up.

:func:`resize_longest_pad` -- HPSv2's ``preprocess_val``: its ``create_model_and_transforms(...,
    light_augmentation=True)`` builds ``image_transform(..., resize_longest_max=True)`` =
    ``Compose([ToTensor(), ResizeMaxSize(224), Normalize])``: the *longest* side resized to ``size`` on the float
    tensor (torchvision ``F.resize``, bicubic, antialias -- the torchvision >= 0.17 default), the other side
    ``round(dim * scale)``, zero padding centred (``pad // 2`` before) to a square, then normalised. This is not
    mainstream open_clip's val transform (shortest side + centre crop); HPSv2 scores with its own fork's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

__all__ = ["OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD", "resize_center_crop", "resize_longest_pad"]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """torchvision's ``Normalize`` on a float ``[..., 3, H, W]`` tensor (same ops, same float32 rounding)."""
    mean_t = torch.as_tensor(mean, dtype=x.dtype).view(-1, 1, 1)
    std_t = torch.as_tensor(std, dtype=x.dtype).view(-1, 1, 1)
    return (x - mean_t) / std_t


def _to_float(array: np.ndarray) -> torch.Tensor:
    """torchvision's ``ToTensor`` of a uint8 ``[H, W, 3]`` array: ``[3, H, W]`` float32 in [0, 1]."""
    return torch.from_numpy(np.array(array, dtype=np.uint8, copy=True)).permute(2, 0, 1).contiguous().float().div(255)


def resize_center_crop(images: Sequence[np.ndarray], size: int, crop: int | None = None, *,
                       mean: Sequence[float] = OPENAI_CLIP_MEAN, std: Sequence[float] = OPENAI_CLIP_STD,
                       crop_rounding: str = "round") -> torch.Tensor:
    """Shortest side -> ``size`` (PIL bicubic), centre crop ``crop`` (default ``size``), normalise: ``[B, 3, crop, crop]``.

    ``crop_rounding``: ``"round"`` (torchvision ``CenterCrop``) or ``"floor"`` (transformers' image processors).
    """
    crop = size if crop is None else crop
    if crop > size:
        raise ValueError(f"crop={crop} larger than the resized shortest side size={size}")
    if crop_rounding not in ("round", "floor"):
        raise ValueError(f"crop_rounding={crop_rounding!r}: expected 'round' (torchvision) or 'floor' (transformers)")
    out = []
    for array in images:
        pil = Image.fromarray(array)
        width, height = pil.size
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(size * long / short)
        new_w, new_h = (size, new_long) if width <= height else (new_long, size)
        if (new_w, new_h) != (width, height):
            pil = pil.resize((new_w, new_h), Image.BICUBIC)
        if crop_rounding == "round":
            top, left = int(round((new_h - crop) / 2.0)), int(round((new_w - crop) / 2.0))
        else:
            top, left = (new_h - crop) // 2, (new_w - crop) // 2
        out.append(np.asarray(pil)[top:top + crop, left:left + crop])
    return _normalize(torch.stack([_to_float(a) for a in out]), mean, std)


def resize_longest_pad(images: Sequence[np.ndarray], size: int, *, mean: Sequence[float] = OPENAI_CLIP_MEAN,
                       std: Sequence[float] = OPENAI_CLIP_STD, fill: float = 0.0) -> torch.Tensor:
    """HPSv2's ``ResizeMaxSize``: longest side -> ``size`` (tensor bicubic, antialias), centred zero pad, normalise."""
    out = []
    for array in images:
        x = _to_float(array)
        height, width = x.shape[-2:]
        scale = size / float(max(height, width))
        if scale != 1.0:
            new_h, new_w = round(height * scale), round(width * scale)
            x = F.interpolate(x[None], size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)[0]
        # HPSv2 pads only when it resized; a non-square image whose longest side is already ``size`` would reach
        # its model non-square and fail there. Padding it too changes nothing where the reference works.
        pad_h, pad_w = size - x.shape[-2], size - x.shape[-1]
        if pad_h or pad_w:
            x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=fill)
        out.append(x)
    return _normalize(torch.stack(out), mean, std)
