"""Sample galleries: what the policy generates, next to what the reward said.

>>> gallery = Gallery(run_dir, wandb_run=logger.run)          # logger.run is None with logger=none  # doctest: +SKIP
>>> gallery.log(step, prompts, images, rewards=out.scores, components=out.components,
...             advantages=adv)                                                                    # doctest: +SKIP
>>> rows = read_gallery(run_dir / "gallery" / "train")         # in a notebook                     # doctest: +SKIP

Each call writes, always (so a run with ``logger=none`` can still be looked at):

- ``out_dir/gallery/{tag}/step-{step:06d}.parquet``, one row per sample: ``step`` (int64), ``prompt`` (string),
  ``image_png`` (PNG bytes), ``num_frames`` (int32; null for images), one float32 column per reward component,
  ``reward`` (float32) and ``advantage`` (float32, null when not given). Videos are stored as a **PNG strip** of
  all their frames side by side (``num_frames`` of them, equal widths): lossless, and readable with PIL alone,
  no ffmpeg. The price is size: a strip is as large as the frames' PNGs; log few rows of full-size videos.
- ``out_dir/gallery/{tag}/step-{step:06d}.png``, a grid: images in rows of up to 8; videos one row per sample of
  up to 8 evenly spaced frames. Cells are separated (and framed) by 2 white pixels.

and, with a W&B run, a ``wandb.Table(step, prompt, image|video, *components, reward, advantage)`` under
``{tag}/gallery`` at ``step`` (log it no later than the scalars of that step: W&B drops steps that go back).
Images (PIL, from the stored uint8 pixels) go in as JPEGs; videos as mp4 files written with ``diffusers.utils.export_to_video`` into
``step-{step:06d}-mp4/`` (needs ``imageio`` and ``imageio-ffmpeg``; without them the frame strip is logged as an
image, with one warning).

Media arrive as float in [0, 1] (uint8 accepted) and are stored as ``round(x · 255)`` uint8, the rounding of
``diffusers``' ``numpy_to_pil``. Call on the main process only.
"""

from __future__ import annotations

import io
import math
import os
import uuid
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

__all__ = ["Gallery", "read_gallery", "to_uint8"]

_GRID_COLS = 8  # images per grid row
_GRID_FRAMES = 8  # frames per video row of the grid
_PAD = 2  # white pixels between (and around) grid cells
_FIXED = ("step", "prompt", "image_png", "num_frames", "reward", "advantage", "image", "video", "pil")


def to_uint8(media: torch.Tensor) -> torch.Tensor:
    """Float media in [0, 1] (clamped; NaN → 0) to uint8 by rounding; uint8 passes through. Same shape, on CPU."""
    media = media.detach().cpu()
    if media.dtype == torch.uint8:
        return media
    media = torch.nan_to_num(media.float(), nan=0.0).clamp(0, 1)
    return (media * 255).round().to(torch.uint8)


def _png(hwc: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(hwc).save(buf, format="PNG")
    return buf.getvalue()


def _strip(frames: torch.Tensor) -> np.ndarray:
    """uint8 ``[T, 3, H, W]`` → ``[H, T·W, 3]`` (frames side by side)."""
    t, c, h, w = frames.shape
    return frames.permute(2, 0, 3, 1).reshape(h, t * w, c).numpy()


def _grid(rows: list[list[np.ndarray]], h: int, w: int) -> np.ndarray:
    """HWC uint8 cells laid out row by row on white with ``_PAD`` pixels between and around them."""
    ncols = max(len(r) for r in rows)
    out = np.full((len(rows) * (h + _PAD) + _PAD, ncols * (w + _PAD) + _PAD, 3), 255, dtype=np.uint8)
    for i, row in enumerate(rows):
        for j, cell in enumerate(row):
            y, x = _PAD + i * (h + _PAD), _PAD + j * (w + _PAD)
            out[y:y + h, x:x + w] = cell
    return out


def _column(values, name: str, batch: int) -> torch.Tensor:
    t = torch.as_tensor(values).detach().cpu().float().reshape(-1)
    if t.shape[0] < batch:
        raise ValueError(f"Gallery.log: {name} has {t.shape[0]} values for {batch} samples")
    return t[:batch]


class Gallery:
    """Writes sample galleries into ``out_dir/gallery/`` and, when given a run, to W&B (see the module doc).

    Args:
        out_dir: the run directory.
        wandb_run: a ``wandb`` run (``RunLogger.run``), or None for files only.
        max_rows: samples per gallery (the first ones of the batch).
    """

    def __init__(self, out_dir: str | os.PathLike, *, wandb_run=None, max_rows: int = 16):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.out_dir = Path(out_dir)
        self.wandb_run = wandb_run
        self.max_rows = max_rows
        self._warned_video = False

    def log(
        self,
        step: int,
        prompts: list[str],
        media: torch.Tensor,
        *,
        rewards: torch.Tensor,
        components: dict[str, torch.Tensor] | None = None,
        advantages: torch.Tensor | None = None,
        tag: str = "train",
        fps: int = 8,
    ) -> dict[str, Path]:
        """Log the first ``max_rows`` samples of a batch.

        Args:
            step: training step (x axis in W&B, file name here).
            prompts: ``B`` prompts.
            media: images ``[B, 3, H, W]`` or videos ``[B, T, 3, H, W]``, float in [0, 1] (or uint8).
            rewards: ``[B]`` training scalar; components: ``{name: [B]}`` (e.g. ``RewardOutput.components``);
                advantages: ``[B]`` or None.
            tag: ``"train"``, ``"eval"``, ...: the sub-directory and the W&B key prefix.
            fps: frame rate of the W&B videos.

        Returns:
            ``{"parquet": path, "grid": path}``, plus ``"mp4": dir`` when videos were encoded for W&B.
        """
        if media.ndim not in (4, 5) or media.shape[-3] != 3:
            raise ValueError(f"Gallery.log: media must be [B,3,H,W] or [B,T,3,H,W], got {tuple(media.shape)}")
        is_video = media.ndim == 5
        components = dict(components or {})
        clash = sorted(set(components) & set(_FIXED))
        if clash:
            raise ValueError(f"Gallery.log: reward component names {clash} clash with the gallery's own columns")
        n = min(media.shape[0], self.max_rows)
        if len(prompts) < n:
            raise ValueError(f"Gallery.log: {len(prompts)} prompts for {media.shape[0]} samples")
        prompts = [str(p) for p in prompts[:n]]
        pixels = to_uint8(media[:n])  # [n, (T,) 3, H, W]
        rewards_t = _column(rewards, "rewards", n)
        adv_t = None if advantages is None else _column(advantages, "advantages", n)
        comp_t = {name: _column(v, f"components[{name!r}]", n) for name, v in components.items()}

        folder = self.out_dir / "gallery" / tag
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"step-{int(step):06d}"
        frames = pixels.shape[1] if is_video else 1
        strips = [_strip(p) if is_video else p.permute(1, 2, 0).numpy() for p in pixels]  # HWC uint8

        columns = {
            "step": pa.array([int(step)] * n, pa.int64()),
            "prompt": pa.array(prompts, pa.string()),
            "image_png": pa.array([_png(s) for s in strips], pa.binary()),
            "num_frames": pa.array([frames if is_video else None] * n, pa.int32()),
        }
        for name, values in comp_t.items():
            columns[name] = pa.array(values.numpy(), pa.float32())
        columns["reward"] = pa.array(rewards_t.numpy(), pa.float32())
        columns["advantage"] = (pa.nulls(n, pa.float32()) if adv_t is None
                                else pa.array(adv_t.numpy(), pa.float32()))
        table = pa.table(columns)
        parquet = folder / f"{stem}.parquet"
        tmp = folder / f".{stem}.parquet.{uuid.uuid4().hex[:8]}"
        pq.write_table(table, tmp)
        os.replace(tmp, parquet)  # a half-written file never carries the final name

        h, w = pixels.shape[-2:]
        if is_video:
            pick = np.unique(np.linspace(0, frames - 1, min(frames, _GRID_FRAMES)).round().astype(int))
            rows = [[p[t].permute(1, 2, 0).numpy() for t in pick] for p in pixels]
        else:
            cells = [p.permute(1, 2, 0).numpy() for p in pixels]
            rows = [cells[i:i + _GRID_COLS] for i in range(0, n, _GRID_COLS)]
        grid = folder / f"{stem}.png"
        Image.fromarray(_grid(rows, h, w)).save(grid)
        out = {"parquet": parquet, "grid": grid}

        if self.wandb_run is not None:
            mp4_dir = self._log_wandb(step, tag, prompts, pixels, strips, comp_t, rewards_t, adv_t, folder, stem, fps)
            if mp4_dir is not None:
                out["mp4"] = mp4_dir
        return out

    def _log_wandb(self, step, tag, prompts, pixels, strips, comp_t, rewards_t, adv_t, folder, stem, fps):
        import wandb  # optional and lazy

        is_video = pixels.ndim == 5
        mp4_dir = None
        if is_video:
            try:
                import imageio  # noqa: F401  (export_to_video's backend)
                import imageio_ffmpeg  # noqa: F401
                can_encode = True
            except ImportError:
                can_encode = False
                if not self._warned_video:
                    warnings.warn("Gallery: W&B videos need `pip install imageio imageio-ffmpeg`; logging frame "
                                  "strips as images instead", stacklevel=3)
                    self._warned_video = True
            if can_encode:
                from diffusers.utils import export_to_video

                mp4_dir = folder / f"{stem}-mp4"
                mp4_dir.mkdir(exist_ok=True)
        cells = []
        for i, p in enumerate(pixels):
            if is_video and mp4_dir is not None:
                path = mp4_dir / f"{i:03d}.mp4"
                export_to_video([Image.fromarray(f.permute(1, 2, 0).numpy()) for f in p], str(path), fps=fps)
                cells.append(wandb.Video(str(path), format="mp4"))
            else:
                # A PIL image: wandb 0.31 reads numpy arrays as HWC only (CHW ones raise), torch tensors as CHW.
                cells.append(wandb.Image(Image.fromarray(strips[i]), file_type="jpg"))
        columns = ["step", "prompt", "video" if is_video else "image", *comp_t, "reward", "advantage"]
        table = wandb.Table(columns=columns)
        for i in range(len(prompts)):
            row = [int(step), prompts[i], cells[i], *(_num(v[i]) for v in comp_t.values()),
                   _num(rewards_t[i]), None if adv_t is None else _num(adv_t[i])]
            table.add_data(*row)
        self.wandb_run.log({f"{tag}/gallery": table}, step=int(step))
        return mp4_dir


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if math.isnan(v) else v


def read_gallery(path: str | os.PathLike) -> list[dict]:
    """Rows of a gallery parquet file (or of every ``step-*.parquet`` in a directory, by step), images decoded.

    Each row: ``step``, ``prompt``, ``image`` (uint8 tensor ``[3, H, W]``) or ``video`` (``[T, 3, H, W]``),
    ``pil`` (the PIL image; for videos the frame strip), ``num_frames`` (None for images), every component, ``reward``,
    ``advantage`` (None when not logged). Floats as stored (float32 values as Python floats).
    """
    path = Path(path)
    files = sorted(path.glob("step-*.parquet")) if path.is_dir() else [path]
    rows: list[dict] = []
    for file in files:
        for record in pq.read_table(file).to_pylist():
            pil = Image.open(io.BytesIO(record.pop("image_png")))
            pil.load()
            hwc = torch.from_numpy(np.array(pil.convert("RGB")))
            t = record["num_frames"]
            if t is not None:
                h, tw, c = hwc.shape
                record["video"] = hwc.reshape(h, t, tw // t, c).permute(1, 3, 0, 2).contiguous()
            else:
                record["image"] = hwc.permute(2, 0, 1).contiguous()
            record["pil"] = pil
            rows.append(record)
    return rows
