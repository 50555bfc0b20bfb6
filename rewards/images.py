"""Batch images in any of the reward contract's forms -> list of uint8 ``[H, W, 3]`` numpy arrays (shared by every reward)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

__all__ = ["to_uint8_images"]


def _from_array(x: np.ndarray, where: str) -> np.ndarray:
    if x.ndim != 3:
        raise ValueError(f"{where}: expected an image [3, H, W] or [H, W, 3], got shape {x.shape}")
    if x.shape[0] == 3 and x.shape[-1] != 3:
        x = np.transpose(x, (1, 2, 0))
    if x.shape[-1] != 3:
        raise ValueError(f"{where}: expected 3 colour channels, got shape {x.shape}")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    if np.issubdtype(x.dtype, np.floating):
        return np.rint(np.clip(x.astype(np.float64), 0.0, 1.0) * 255.0).astype(np.uint8)
    raise ValueError(f"{where}: expected uint8 or float images in [0, 1], got dtype {x.dtype}")


def to_uint8_images(images) -> list[np.ndarray]:
    """Convert float ``[B, 3, H, W]`` in [0, 1], uint8 ``[B, 3, H, W]``, or a list of PIL images / arrays."""
    if isinstance(images, torch.Tensor):
        if images.ndim == 5:
            raise ValueError(f"this reward scores images [B, 3, H, W], not videos: got shape {tuple(images.shape)}")
        if images.ndim != 4:
            raise ValueError(f"images: expected [B, 3, H, W], got shape {tuple(images.shape)}")
        x = images.detach().cpu()
        x = x if x.dtype == torch.uint8 else x.float()
        return [_from_array(img.numpy(), f"images[{i}]") for i, img in enumerate(x)]
    if isinstance(images, np.ndarray):
        if images.ndim != 4:
            raise ValueError(f"images: expected [B, 3, H, W] or [B, H, W, 3], got shape {images.shape}")
        return [_from_array(img, f"images[{i}]") for i, img in enumerate(images)]
    if isinstance(images, (list, tuple)):
        out = []
        for i, img in enumerate(images):
            if isinstance(img, Image.Image):
                out.append(np.asarray(img.convert("RGB"), dtype=np.uint8))
            elif isinstance(img, torch.Tensor):
                t = img.detach().cpu()
                out.append(_from_array((t if t.dtype == torch.uint8 else t.float()).numpy(), f"images[{i}]"))
            elif isinstance(img, np.ndarray):
                out.append(_from_array(img, f"images[{i}]"))
            else:
                raise ValueError(f"images[{i}]: expected a PIL image, tensor or array, got {type(img).__name__}")
        return out
    raise ValueError(f"images: expected a tensor [B, 3, H, W] or a list of PIL images, got {type(images).__name__}")
