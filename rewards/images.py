"""Batch images in any of the reward contract's forms -> list of uint8 ``[H, W, 3]`` numpy arrays (shared by every
reward), the checks every conversion makes (finite pixels, float pixels in [0, 1]), and :func:`degenerate`, the flag
for samples without content.

**Non-finite pixels raise.** A diverged model decodes to NaN; cast to uint8, NaN silently becomes 0, a black image
that detector-based rewards used to score as content. :func:`to_uint8_images` (and :func:`rewards.video.to_video`)
therefore raise ``ValueError`` naming the reward and the samples, so a run fails loudly at the reward instead of
training on made-up scores (the trainer refuses non-finite rewards too).

**Float pixels outside [0, 1] raise** (:func:`check_range`; ``RANGE_TOLERANCE`` = 1e-3 of slack for rounding, values
within it are clipped). Clamped, an image in [0, 255] would read as nearly all white and one in [-1, 1] (the VAE's raw
output) would lose its dark half, and both would be scored as if nothing were wrong (the JPEG reward gave −1.98 kB
for an image in [0, 255] and −5.45 kB for the same image in [0, 1]). The error names the likely cause and the fix:
``(x + 1) / 2`` for values in [-1, 1], ``x / 255`` for values up to 255. uint8 tensors / arrays and PIL images are
taken as they are.

**Degenerate samples** (:func:`degenerate`): a frame is

- ``"uniform"`` when at most ``0.1%`` of its pixels differ from its median colour by more than ``tolerance``
  (0.05 of the range, ~13 grey levels, on any channel): all black, all white, one flat colour, with mild noise;
- ``"noise"`` when it has no spatial structure: the variance of its ``4 x 4`` block means is under
  ``noise_ratio`` (0.09) of its pixel variance (channels pooled). Independent pixel noise keeps ``1/16`` (0.0625)
  of its variance under block averaging; a drawn object keeps most of its own: a single circumradius-6 shape on
  white keeps 0.65, so a sparse scene is never noise, and even under pixel noise of std 0.25 (64 grey levels) the
  same shape keeps over 0.11 and a 12 px square 0.25.

A clip (``[B, T, 3, H, W]``) is degenerate when every one of its frames is. Frames under 16 px on a side are too
small to judge and are never flagged. Rule-based rewards score degenerate samples 0; learned preference /
alignment models score them as their model does (the list is in :mod:`rewards.base`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from PIL import Image

__all__ = ["RANGE_TOLERANCE", "check_finite", "check_pixels", "check_range", "degenerate", "degenerate_frame",
           "to_uint8_images"]

MIN_SIDE = 16  # frames smaller than this are never flagged (too few pixels for the statistics)
UNIFORM_FRACTION = 0.001  # at most this fraction of pixels may stray from the median colour of a uniform frame
BLOCK = 4  # block size of the structure test
RANGE_TOLERANCE = 1e-3  # float pixels may stray this far outside [0, 1] (rounding) before the conversion refuses them


def check_finite(bad: Sequence[int], reward: str | None, what: str = "images") -> None:
    """Raise the shared error for samples ``bad`` (indices) holding NaN / inf pixels; nothing when ``bad`` is empty."""
    if len(bad) == 0:
        return
    bad = [int(i) for i in bad]
    shown = f"{bad[:8]}{' ...' if len(bad) > 8 else ''}"
    raise ValueError(
        f"{reward or 'reward'}: {what} at batch indices {shown} hold NaN or inf pixels (a diverged model or a broken "
        f"decode); rewards raise on non-finite input rather than score it (cast to uint8, NaN reads as a black image)")


def check_range(bad: Sequence[int], low: float, high: float, reward: str | None, what: str = "images") -> None:
    """Raise the shared error for samples ``bad`` (indices) whose float pixels leave [0, 1] by more than
    ``RANGE_TOLERANCE``; ``low`` / ``high``: the smallest and largest value of those samples. Nothing when ``bad`` is
    empty. The message names the likely cause from the range seen: [-1, 1] (a VAE's raw output) or [0, 255]."""
    if len(bad) == 0:
        return
    bad = [int(i) for i in bad]
    shown = f"{bad[:8]}{' ...' if len(bad) > 8 else ''}"
    tol = RANGE_TOLERANCE
    if low < -tol and low >= -1 - tol and high <= 1 + tol:
        cause = "they look like values in [-1, 1], a VAE's raw output: pass (x + 1) / 2"
    elif high > 1 + tol and high <= 255 + tol and low >= -tol:
        cause = "they look like values in [0, 255]: pass x / 255 (or a uint8 tensor)"
    else:
        cause = "map them to [0, 1] first (x.clamp(0, 1) if they only overshoot it)"
    raise ValueError(
        f"{reward or 'reward'}: float {what} at batch indices {shown} hold values in [{low:.4g}, {high:.4g}], outside "
        f"[0, 1]; {cause}. Rewards refuse them rather than clamp and score a different picture")


def _out_of_range(x: torch.Tensor) -> tuple[list[int], float, float]:
    """Rows (dim 0) of a finite float tensor with values outside [0, 1] beyond the tolerance, and their min / max."""
    if not x.is_floating_point() or x.numel() == 0:
        return [], 0.0, 1.0
    low, high = x.reshape(x.shape[0], -1).aminmax(dim=1)
    rows = ((low < -RANGE_TOLERANCE) | (high > 1 + RANGE_TOLERANCE)).nonzero().flatten()
    if len(rows) == 0:
        return [], 0.0, 1.0
    return rows.tolist(), float(low[rows].min()), float(high[rows].max())


def check_pixels(samples, reward: str | None = None, what: str = "images") -> None:
    """The checks of every conversion, without converting: float tensors / arrays (a batch ``[B, ...]``, or a list
    of samples) must be finite and in [0, 1] (``RANGE_TOLERANCE``). uint8, PIL images and anything else pass."""
    if isinstance(samples, np.ndarray) and np.issubdtype(samples.dtype, np.floating):
        samples = torch.from_numpy(np.ascontiguousarray(samples))
    if isinstance(samples, torch.Tensor):
        if samples.ndim == 0 or not samples.is_floating_point():
            return
        x = samples.detach()
        check_finite(_nonfinite_rows(x), reward, what)
        check_range(*_out_of_range(x), reward, what)
        return
    if isinstance(samples, (list, tuple)):
        nonfinite, outside, low, high = [], [], math.inf, -math.inf
        for i, s in enumerate(samples):
            if isinstance(s, np.ndarray) and np.issubdtype(s.dtype, np.floating):
                s = torch.from_numpy(np.ascontiguousarray(s))
            if not isinstance(s, torch.Tensor) or not s.is_floating_point() or s.numel() == 0:
                continue
            s = s.detach()
            if not bool(torch.isfinite(s).all()):
                nonfinite.append(i)
                continue
            lo, hi = float(s.min()), float(s.max())
            if lo < -RANGE_TOLERANCE or hi > 1 + RANGE_TOLERANCE:
                outside.append(i)
                low, high = min(low, lo), max(high, hi)
        check_finite(nonfinite, reward, what)
        check_range(outside, low, high, reward, what)


def _nonfinite_rows(x: torch.Tensor) -> list[int]:
    """Indices along dim 0 of a float tensor whose values are not all finite."""
    if not x.is_floating_point() or x.numel() == 0:
        return []
    return (~torch.isfinite(x)).flatten(1).any(1).nonzero().flatten().tolist()


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


def to_uint8_images(images, reward: str | None = None) -> list[np.ndarray]:
    """Convert float ``[B, 3, H, W]`` in [0, 1], uint8 ``[B, 3, H, W]``, or a list of PIL images / arrays.

    Float images holding NaN or inf, or values outside [0, 1] (:func:`check_range`), raise ``ValueError`` naming
    ``reward`` and the sample indices (module doc).
    """
    if isinstance(images, torch.Tensor):
        if images.ndim == 5:
            raise ValueError(f"this reward scores images [B, 3, H, W], not videos: got shape {tuple(images.shape)}")
        if images.ndim != 4:
            raise ValueError(f"images: expected [B, 3, H, W], got shape {tuple(images.shape)}")
        x = images.detach().cpu()
        x = x if x.dtype == torch.uint8 else x.float()
        check_pixels(x, reward)
        return [_from_array(img.numpy(), f"images[{i}]") for i, img in enumerate(x)]
    if isinstance(images, np.ndarray):
        if images.ndim != 4:
            raise ValueError(f"images: expected [B, 3, H, W] or [B, H, W, 3], got shape {images.shape}")
        check_pixels(images, reward)
        return [_from_array(img, f"images[{i}]") for i, img in enumerate(images)]
    if isinstance(images, (list, tuple)):
        out = []
        for i, img in enumerate(images):
            if isinstance(img, Image.Image):
                out.append(np.asarray(img.convert("RGB"), dtype=np.uint8))
            elif isinstance(img, torch.Tensor):
                t = img.detach().cpu()
                out.append(t if t.dtype == torch.uint8 else t.float())
            elif isinstance(img, np.ndarray):
                out.append(img)
            else:
                raise ValueError(f"images[{i}]: expected a PIL image, tensor or array, got {type(img).__name__}")
        check_pixels(out, reward)
        return [a if isinstance(img, Image.Image) else
                _from_array(a.numpy() if isinstance(a, torch.Tensor) else a, f"images[{i}]")
                for i, (img, a) in enumerate(zip(images, out))]
    raise ValueError(f"images: expected a tensor [B, 3, H, W] or a list of PIL images, got {type(images).__name__}")


# ---------------------------------------------------------------------------------------------- degenerate


def degenerate_frame(frame: np.ndarray, *, tolerance: float = 0.05, noise_ratio: float = 0.09) -> str | None:
    """``"uniform"``, ``"noise"`` or None (the frame has content) for one uint8 ``[H, W, 3]`` frame (module doc)."""
    h, w = frame.shape[:2]
    if min(h, w) < MIN_SIDE:
        return None
    x = frame.reshape(-1, frame.shape[-1]).astype(np.float32)
    stray = np.abs(x - np.median(x, axis=0)).max(axis=1) > tolerance * 255.0
    if stray.sum() <= UNIFORM_FRACTION * len(x):
        return "uniform"
    hb, wb = h // BLOCK * BLOCK, w // BLOCK * BLOCK
    crop = frame[:hb, :wb].astype(np.float64)
    pixel_var = crop.var(axis=(0, 1)).sum()
    block_var = crop.reshape(hb // BLOCK, BLOCK, wb // BLOCK, BLOCK, -1).mean(axis=(1, 3)).var(axis=(0, 1)).sum()
    if pixel_var > 0 and block_var < noise_ratio * pixel_var:
        return "noise"
    return None


def degenerate(samples, *, tolerance: float = 0.05, noise_ratio: float = 0.09) -> list[str | None]:
    """Per sample, why it is degenerate -- ``"non-finite"``, ``"uniform"``, ``"noise"`` -- or None (it has content).

    ``samples``: images in any form :func:`to_uint8_images` takes, or clips: a ``[B, T, 3, H, W]`` tensor / a
    ``[B, T, H, W, 3]`` or ``[B, T, 3, H, W]`` array (float in [0, 1] or uint8). A clip is degenerate when every frame
    is: ``"uniform"`` / ``"noise"`` when all its frames are that, ``"uniform+noise"`` for a mix.

    >>> import torch
    >>> img = torch.ones(3, 3, 64, 64); img[0] = 0; img[1] = torch.rand(3, 64, 64); img[2, :, 20:28, 10:18] = 0
    >>> degenerate(img)
    ['uniform', 'noise', None]
    """
    if isinstance(samples, np.ndarray) and samples.ndim == 5:
        samples = torch.from_numpy(np.ascontiguousarray(samples))
    if isinstance(samples, torch.Tensor) and samples.ndim == 5:
        x = samples.detach().cpu()
        if x.shape[2] != 3 and x.shape[-1] == 3:
            x = x.permute(0, 1, 4, 2, 3)
        out: list[str | None] = []
        for clip in x:
            if clip.is_floating_point() and not bool(torch.isfinite(clip).all()):
                out.append("non-finite")
                continue
            kinds: set[str] = set()
            for frame in clip:  # stops at the first frame with content (the usual case: the first one)
                kind = degenerate_frame(to_uint8_images(frame[None])[0], tolerance=tolerance, noise_ratio=noise_ratio)
                if kind is None:
                    break
                kinds.add(kind)
            else:
                out.append("+".join(sorted(kinds)) or None)  # a clip without frames is left to the reward
                continue
            out.append(None)
        return out
    batch = isinstance(samples, (list, tuple)) or (isinstance(samples, (torch.Tensor, np.ndarray)) and samples.ndim == 4)
    if not batch:
        to_uint8_images(samples)  # raises the conversion's own error for a wrong type or shape
    bad = set(_nonfinite_indices(samples))
    return ["non-finite" if i in bad else degenerate_frame(to_uint8_images([s])[0], tolerance=tolerance,
                                                           noise_ratio=noise_ratio) for i, s in enumerate(samples)]


def _nonfinite_indices(samples) -> list[int]:
    """Indices of the samples (rows of a tensor / array, items of a list) holding NaN or inf."""
    if isinstance(samples, torch.Tensor):
        return _nonfinite_rows(samples.detach().cpu())
    out = []
    for i, s in enumerate(samples):
        a = s.detach().cpu().float().numpy() if isinstance(s, torch.Tensor) else np.asarray(s)
        if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
            out.append(i)
    return out
