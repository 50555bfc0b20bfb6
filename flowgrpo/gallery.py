"""Sample galleries: what the policy generates, next to what the reward said.

>>> gallery = Gallery(run_dir, logger=logger)                  # a RunLogger (any backend), or None    # doctest: +SKIP
>>> gallery.log(step, prompts, images, rewards=out.scores, components=out.components,
...             advantages=adv, group_size=G)                                                      # doctest: +SKIP
>>> rows = read_gallery(run_dir / "gallery" / "train")         # in a notebook                     # doctest: +SKIP

Which samples: the first ``max_rows`` of the batch; or, given ``group_size`` (the batch is consecutive groups of
that many samples of one prompt, as the trainer lays it out), the first ``k`` of **every** group with
``k = min(group_size, max(1, max_rows // groups))``, so every prompt of the batch shows. That is ``max_rows`` rows
or fewer, except with more groups than ``max_rows``: then one row per group.

Each call writes, always (so a run with ``logger=none`` can still be looked at):

- ``out_dir/gallery/{tag}/step-{step:06d}.parquet``, one row per sample: ``step`` (int64), ``prompt`` (string),
  ``image_png`` (PNG bytes), ``num_frames`` (int32; null for images), one float32 column per reward component,
  ``reward`` (float32) and ``advantage`` (float32, null when not given). Videos are stored as a **PNG strip** of
  all their frames side by side (``num_frames`` of them, equal widths): lossless, and readable with PIL alone,
  no ffmpeg. The price is size: a strip is as large as the frames' PNGs; log few rows of full-size videos.
- ``out_dir/gallery/{tag}/step-{step:06d}.png``, a grid meant to be read by a person. Every sample is a cell: a
  white label band on top, with the prompt (wrapped to the cell's width, at most 4 lines, cut with ``...``) and
  then ``reward 0.734  adv +1.234`` (``adv`` only when advantages were given; on two lines when one is too
  narrow), drawn in Pillow's default bitmap font (shipped with Pillow; latin-1, other characters show as ``?``);
  below it a 1-pixel grey line and the media, upscaled by nearest neighbour by the integer factor
  ``s = ceil(128 / min(H, W))`` (at least 1: a 64x64 sample shows at 128x128). Images sit in rows of up to 8
  cells; a video is one row per sample, a strip of up to 8 evenly spaced frames (first and last included) with 2
  grey pixels between frames, its label above the strip. The label band is ``6 + 13 · L`` pixels high, ``L``
  being the most lines any label of the grid needs, so cells line up. Cells are separated and framed by 2 grey
  (128, 128, 128) pixels, so white backgrounds do not run into each other. :func:`labelled_grid` draws the same
  grid for any samples, frame count, upscaling and label notes (held-out sample sheets). ``log(notes=...)`` adds
  pieces to a label (KVPO: the branch and its policy probability); ``log(marks=...)`` points out a window of a
  video's frames (KVPO: the routed ones) with an orange bar under every shown frame inside it, the window's first,
  middle and last frame always among those shown.

- ``out_dir/gallery/{tag}/step-{step:06d}/NNN.{png,jpg,mp4}``, every sample's own file, the one the HTML index and
  the trackers show: images as PNG (JPEG, quality 95, from a short side of 256 pixels up), of the stored pixels, not
  upscaled nor labelled; videos as MP4 written with ``diffusers.utils.export_to_video`` at ``fps`` (needs ``imageio``
  and ``imageio-ffmpeg``; without them an animated GIF, with one warning).
- ``out_dir/gallery/index.html`` (:func:`write_index`), rewritten after every gallery: every gallery of the run
  directory, per tag and step, each sample's media with its prompt, reward, advantage and reward components, and
  links to the grids and parquet files; its links are relative, so it opens from a copy of the run directory.

and then hands the gallery (a :class:`GalleryPage`) to the run's logger, if any: ``RunLogger.log_gallery`` logs it as
its backend shows galleries (W&B: a table and a captioned media panel; TensorBoard: the grid, a caption table and GIF
clips; see :mod:`flowgrpo.builders.logger`), at ``step`` (log it no later than the scalars of that step: W&B drops steps
that go back). A NaN reward component (a tag it does not apply to) is an empty cell.

Media arrive as float in [0, 1] (uint8 accepted) and are stored as ``round(x · 255)`` uint8, the rounding of
``diffusers``' ``numpy_to_pil``. Call on the main process only.
"""

from __future__ import annotations

import html
import io
import math
import os
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image, ImageDraw, ImageFont

__all__ = ["Gallery", "GalleryPage", "labelled_grid", "read_gallery", "to_uint8", "write_index"]

_GRID_COLS = 8  # images per grid row
_GRID_FRAMES = 8  # frames per video row of the grid
_PAD = 2  # grey pixels between (and around) grid cells
_MIN_SIDE = 128  # media are upscaled (nearest, integer factor) until their short side reaches this
_PROMPT_LINES = 4  # at most this many lines of prompt per label
_LINE_H = 13  # pixels per label line
_MARGIN = 3  # white pixels around a label's text
_FRAME_RGB = (128, 128, 128)  # gaps, frames and separators
_MARK_RGB = (230, 110, 0)  # the bar under marked frames (a window of the clip the label explains)
_MARK_H = 4  # its height in pixels
_JPEG_FROM = 256  # a sample's own file is a JPEG from this short side up (a PNG below)
_FIXED = ("step", "prompt", "image_png", "num_frames", "reward", "advantage", "image", "video", "pil")
_FONT = None


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


# ------------------------------------------------------------------------------------------ the labelled grid


def _font():
    """Pillow's default bitmap font (``load_default_imagefont`` since Pillow 10.1, where ``load_default`` became a
    FreeType font whose narrow spaces run words together at this size; ``load_default`` before)."""
    global _FONT
    if _FONT is None:
        _FONT = getattr(ImageFont, "load_default_imagefont", ImageFont.load_default)()
    return _FONT


def _drawable(text: str) -> str:
    """Text the font can take: a bitmap font encodes latin-1 only (other characters become ``?``)."""
    if isinstance(_font(), ImageFont.FreeTypeFont):
        return text
    return text.encode("latin-1", "replace").decode("latin-1")


def _wrap(pieces: list[str], width: int, *, sep: str = " ", max_lines: int | None = None) -> list[str]:
    """Greedy lines of ``pieces`` joined by ``sep`` within ``width`` pixels; a piece wider than a line is cut by
    characters; past ``max_lines`` the last kept line ends in ``...``."""
    font = _font()
    fits = lambda s: font.getlength(s) <= width  # noqa: E731
    units: list[str] = []
    for piece in pieces:
        while piece and not fits(piece):
            k = 1
            while k < len(piece) and fits(piece[:k + 1]):
                k += 1
            units.append(piece[:k])
            piece = piece[k:]
        if piece:
            units.append(piece)
    lines: list[str] = []
    for unit in units:
        if lines and fits(lines[-1] + sep + unit):
            lines[-1] += sep + unit
        else:
            lines.append(unit)
    if max_lines is not None and len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        while last and not fits(last + "..."):
            last = last[:-1]
        lines[-1] = last.rstrip() + "..."
    return lines


def _label(prompt: str, notes: list[str], width: int) -> list[str]:
    """The lines of one cell's label: the prompt, then the notes (e.g. the scores) two spaces apart."""
    text = _drawable(prompt).split() or ["(empty prompt)"]
    return _wrap(text, width, max_lines=_PROMPT_LINES) + _wrap([_drawable(n) for n in notes], width, sep="  ")


def _upscale(hwc: np.ndarray, s: int) -> np.ndarray:
    return hwc if s == 1 else hwc.repeat(s, axis=0).repeat(s, axis=1)


def _grid(media: list[np.ndarray], labels: list[list[str]], ncols: int) -> np.ndarray:
    """Labelled cells (HWC uint8 media of one size, their label lines) in rows of ``ncols`` on grey."""
    mh, mw = media[0].shape[:2]
    band = 2 * _MARGIN + _LINE_H * max(len(lines) for lines in labels)
    ch, cw = band + 1 + mh, mw
    nrows = math.ceil(len(media) / ncols)
    ncols = min(ncols, len(media))
    out = np.empty((nrows * (ch + _PAD) + _PAD, ncols * (cw + _PAD) + _PAD, 3), dtype=np.uint8)
    out[:] = _FRAME_RGB
    for i, cell in enumerate(media):
        y, x = _PAD + (i // ncols) * (ch + _PAD), _PAD + (i % ncols) * (cw + _PAD)
        out[y:y + band, x:x + cw] = 255
        out[y + band + 1:y + ch, x:x + cw] = cell  # the row between stays grey: the label/media line
    canvas = Image.fromarray(out)
    draw = ImageDraw.Draw(canvas)
    font = _font()
    for i, lines in enumerate(labels):
        y, x = _PAD + (i // ncols) * (ch + _PAD), _PAD + (i % ncols) * (cw + _PAD)
        for j, line in enumerate(lines):
            draw.text((x + _MARGIN, y + _MARGIN + j * _LINE_H), line, fill=(0, 0, 0), font=font)
    return np.asarray(canvas)


def _frames_strip(frames: list[np.ndarray]) -> np.ndarray:
    """HWC frames side by side with ``_PAD`` grey pixels between them."""
    h, w = frames[0].shape[:2]
    out = np.empty((h, len(frames) * (w + _PAD) - _PAD, 3), dtype=np.uint8)
    out[:] = _FRAME_RGB
    for k, f in enumerate(frames):
        out[:, k * (w + _PAD):k * (w + _PAD) + w] = f
    return out


def _pick_frames(frames: int, max_frames: int, mark: tuple[int, int] | None) -> np.ndarray:
    """Evenly spaced frame indices (first and last included), plus the first, middle and last frame of ``mark``."""
    pick = np.linspace(0, frames - 1, max(1, min(frames, max_frames))).round().astype(int)
    if mark is not None:
        a, b = mark
        pick = np.concatenate([pick, [a, (a + b) // 2, b]])
    return np.unique(pick)


def _mark(value) -> tuple[int, int] | None:
    """A ``(first, last)`` frame range from a pair of numbers; None for a missing or NaN pair."""
    if value is None:
        return None
    a, b = (float(v) for v in value)
    if math.isnan(a) or math.isnan(b):
        return None
    return int(a), int(b)


def labelled_grid(
    media: torch.Tensor,
    prompts: list[str],
    notes: list[list[str]],
    *,
    columns: int | None = None,
    max_frames: int = _GRID_FRAMES,
    min_side: int = _MIN_SIDE,
    marks=None,
) -> Image.Image:
    """The labelled grid of :meth:`Gallery.log` (its ``.png``) for any samples and label notes.

    Args:
        media: images ``[N, 3, H, W]`` or videos ``[N, T, 3, H, W]``, float in [0, 1] or uint8 (:func:`to_uint8`).
        prompts: ``N`` prompts, the first lines of each label (wrapped, at most 4 lines, latin-1).
        notes: per sample the pieces of the label's last lines, two spaces apart and wrapped between pieces
            (``Gallery.log``: ``["reward 0.734", "adv +1.234"]``).
        columns: cells per row (default: 8 images, or one video per row).
        max_frames: a video shows this many evenly spaced frames (first and last included), or all it has.
        min_side: media are upscaled by nearest neighbour by the integer factor ``ceil(min_side / min(H, W))``.
        marks: videos only: per sample ``(first, last)`` frame indices of a window to point out (NaN or None: no
            window), e.g. the frames a KVPO branch generated with a routed context. The window's first, middle and
            last frame are shown besides the evenly spaced ones, and every shown frame inside it has an orange bar
            under it (each strip gets a 4-pixel row for these bars when any sample has a window).

    Returns:
        The RGB grid: label bands, media, 2-pixel grey frames, as the module doc describes.
    """
    if media.ndim not in (4, 5) or media.shape[-3] != 3 or media.shape[0] == 0:
        raise ValueError(f"labelled_grid: media must be a non-empty [N,3,H,W] or [N,T,3,H,W], got {tuple(media.shape)}")
    if not len(prompts) == len(notes) == media.shape[0]:
        raise ValueError(f"labelled_grid: {media.shape[0]} samples, {len(prompts)} prompts, {len(notes)} notes")
    pixels = to_uint8(media)
    h, w = pixels.shape[-2:]
    s = max(1, math.ceil(min_side / min(h, w)))
    if pixels.ndim == 5:
        frames = pixels.shape[1]
        windows = [None] * len(pixels) if marks is None else [_mark(m) for m in marks]
        if len(windows) != len(pixels):
            raise ValueError(f"labelled_grid: {len(pixels)} samples, {len(windows)} marks")
        for i, window in enumerate(windows):
            if window is not None and not 0 <= window[0] <= window[1] < frames:
                raise ValueError(f"labelled_grid: mark {window} of sample {i} is not a frame range within "
                                 f"[0, {frames})")
        picks = [_pick_frames(frames, max_frames, window) for window in windows]
        width = max(len(p) for p in picks)
        barred = any(window is not None for window in windows)  # then every strip gets the bar row: cells line up
        fw = w * s + _PAD  # one shown frame and the gap after it
        cells = []
        for p, pick, window in zip(pixels, picks, windows):
            shown = [_upscale(p[t].permute(1, 2, 0).numpy(), s) for t in pick]
            shown += [np.full_like(shown[0], 255)] * (width - len(shown))  # strips of one width: white filler
            strip = _frames_strip(shown)
            if barred:
                bar = np.empty((_MARK_H, strip.shape[1], 3), dtype=np.uint8)
                bar[:] = _FRAME_RGB
                for k, t in enumerate(pick):
                    if window is not None and window[0] <= t <= window[1]:
                        bar[:, k * fw:k * fw + fw - _PAD] = _MARK_RGB
                strip = np.concatenate([strip, bar])
            cells.append(strip)
        ncols = columns or 1
    else:
        cells = [_upscale(p.permute(1, 2, 0).numpy(), s) for p in pixels]
        ncols = columns or _GRID_COLS
    text_width = cells[0].shape[1] - 2 * _MARGIN
    labels = [_label(str(prompt), list(note), text_width) for prompt, note in zip(prompts, notes)]
    return Image.fromarray(_grid(cells, labels, ncols))


def _column(values, name: str, index: torch.Tensor, batch: int) -> torch.Tensor:
    t = torch.as_tensor(values).detach().cpu().float().reshape(-1)
    if t.shape[0] <= int(index.max()):
        raise ValueError(f"Gallery.log: {name} has {t.shape[0]} values for {batch} samples")
    return t[index]


def _rows(batch: int, max_rows: int, group_size: int | None) -> torch.Tensor:
    """The batch rows a gallery shows (see the module doc)."""
    if group_size is None:
        return torch.arange(min(batch, max_rows))
    if group_size < 1 or batch % group_size:
        raise ValueError(f"Gallery.log: {batch} samples do not split into groups of group_size={group_size}")
    groups = batch // group_size
    k = min(group_size, max(1, max_rows // groups))
    return torch.tensor([g * group_size + j for g in range(groups) for j in range(k)], dtype=torch.long)


@dataclass
class GalleryPage:
    """One gallery as a logger backend receives it (:meth:`flowgrpo.builders.RunLogger.log_gallery`); its files are
    written.

    Attributes:
        tag, step: as given to :meth:`Gallery.log`.
        captions: per sample: the prompt, then ``reward 0.734  adv +1.234`` (advantage when given), on two lines.
        media: per sample its file: an image (``.png``; ``.jpg`` from a short side of 256 up) or a video (``.mp4``;
            ``.gif`` without ffmpeg), under ``gallery/{tag}/step-NNNNNN/``.
        is_video: videos or images.
        grid: the labelled grid PNG.
        columns, rows: the table: ``step, prompt, image|video, *components, reward, advantage``; the media cell
            (column ``media_column``) of each row is None, NaN scores are None.
        frames: videos: per sample its uint8 frames ``[T, H, W, 3]``; None for images.
        fps: the videos' frame rate.
    """

    tag: str
    step: int
    captions: list[str]
    media: list[Path]
    is_video: bool
    grid: Path
    columns: list[str]
    rows: list[list]
    media_column: str
    frames: list[np.ndarray] | None = None
    fps: int = 8

    def gif(self, i: int) -> bytes:
        """Sample ``i`` as an animated GIF (looping; for viewers that take images only)."""
        return _gif_bytes(self.frames[i], self.fps)


def _gif_bytes(frames: np.ndarray, fps: int) -> bytes:
    buf = io.BytesIO()
    pil = [Image.fromarray(f) for f in frames]
    pil[0].save(buf, format="GIF", save_all=True, append_images=pil[1:], duration=max(20, round(1000 / fps)), loop=0)
    return buf.getvalue()


def _can_encode_mp4() -> bool:
    try:
        import imageio  # noqa: F401  (export_to_video's backend)
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return False
    return True


class Gallery:
    """Writes sample galleries into ``out_dir/gallery/`` (and its HTML index) and hands each to a logger (see the
    module doc).

    Args:
        out_dir: the run directory.
        logger: a :class:`flowgrpo.builders.RunLogger` (any backend), or None for files only.
        max_rows: samples per gallery: the first ones of the batch, or, when ``log`` is given ``group_size``,
            spread over every group (at least one per group, so more than ``max_rows`` when there are more groups).
        fps: frame rate of the videos (files and logger).
    """

    def __init__(self, out_dir: str | os.PathLike, *, logger=None, max_rows: int = 16, fps: int = 8):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.out_dir = Path(out_dir)
        self.logger = logger
        self.max_rows = max_rows
        self.fps = fps
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
        group_size: int | None = None,
        tag: str = "train",
        fps: int | None = None,
        notes: list[list[str]] | None = None,
        marks: torch.Tensor | None = None,
    ) -> dict:
        """Log some samples of a batch: the first ``max_rows``, or with ``group_size`` some of every group.

        Args:
            step: training step (x axis of the trackers, file name here).
            prompts: ``B`` prompts.
            media: images ``[B, 3, H, W]`` or videos ``[B, T, 3, H, W]``, float in [0, 1] (or uint8).
            rewards: ``[B]`` training scalar; components: ``{name: [B]}`` (e.g. ``RewardOutput.components``);
                advantages: ``[B]`` or None.
            group_size: None, or ``G`` when the batch is consecutive groups of ``G`` samples of one prompt: the
                gallery then shows the first ``k = min(G, max(1, max_rows // (B / G)))`` samples of every group.
            tag: ``"train"``, ``"eval"``, ...: the sub-directory and the trackers' key prefix.
            fps: frame rate of the videos (default: the gallery's).
            notes: per sample (``B`` lists) more pieces for the grid's label, after the reward and advantage.
            marks: videos: ``[B, 2]`` first and last frame of a window the grid points out (NaN: none), as
                :func:`labelled_grid`'s ``marks``.

        Returns:
            ``{"parquet": path, "grid": path, "media": [one file per sample], "index": the HTML index}``.
        """
        if media.ndim not in (4, 5) or media.shape[-3] != 3:
            raise ValueError(f"Gallery.log: media must be [B,3,H,W] or [B,T,3,H,W], got {tuple(media.shape)}")
        is_video = media.ndim == 5
        fps = self.fps if fps is None else fps
        components = dict(components or {})
        clash = sorted(set(components) & set(_FIXED))
        if clash:
            raise ValueError(f"Gallery.log: reward component names {clash} clash with the gallery's own columns")
        batch = media.shape[0]
        if batch == 0:
            raise ValueError("Gallery.log: an empty batch")
        index = _rows(batch, self.max_rows, group_size)
        n = len(index)
        if len(prompts) <= int(index.max()):
            raise ValueError(f"Gallery.log: {len(prompts)} prompts for {batch} samples")
        prompts = [str(prompts[i]) for i in index.tolist()]
        pixels = to_uint8(media[index.to(media.device)])  # [n, (T,) 3, H, W]
        rewards_t = _column(rewards, "rewards", index, batch)
        adv_t = None if advantages is None else _column(advantages, "advantages", index, batch)
        comp_t = {name: _column(v, f"components[{name!r}]", index, batch) for name, v in components.items()}

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
        try:
            pq.write_table(table, tmp)
            os.replace(tmp, parquet)  # a half-written file never carries the final name
        except BaseException:
            tmp.unlink(missing_ok=True)  # a failed write (disk full) leaves no hidden partial file behind
            raise

        if notes is not None and len(notes) != batch:
            raise ValueError(f"Gallery.log: notes for {len(notes)} samples, the batch has {batch}")
        if marks is not None and tuple(marks.shape) != (batch, 2):
            raise ValueError(f"Gallery.log: marks must be [{batch}, 2], got {tuple(marks.shape)}")
        scores = [[f"reward {float(rewards_t[i]):.3f}"] + ([] if adv_t is None else [f"adv {float(adv_t[i]):+.3f}"])
                  for i in range(n)]
        labels = [scores[i] + ([] if notes is None else [str(x) for x in notes[r]])
                  for i, r in enumerate(index.tolist())]
        grid = folder / f"{stem}.png"
        shown_marks = None if marks is None or not is_video else marks.detach().cpu().float()[index].tolist()
        labelled_grid(pixels, prompts, labels, marks=shown_marks).save(grid)

        video_frames = [p.permute(0, 2, 3, 1).numpy() for p in pixels] if is_video else None  # [T, H, W, 3]
        files = self._write_media(folder / stem, strips, video_frames, fps)
        media_column = "video" if is_video else "image"
        page = GalleryPage(
            tag=tag, step=int(step), captions=[f"{p}\n{'  '.join(s)}" for p, s in zip(prompts, scores)],
            media=files, is_video=is_video, grid=grid,
            columns=["step", "prompt", media_column, *comp_t, "reward", "advantage"],
            rows=[[int(step), prompts[i], None, *(_num(v[i]) for v in comp_t.values()), _num(rewards_t[i]),
                   None if adv_t is None else _num(adv_t[i])] for i in range(n)],
            media_column=media_column, frames=video_frames, fps=fps)
        if self.logger is not None:
            self.logger.log_gallery(page)
        return {"parquet": parquet, "grid": grid, "media": files, "index": write_index(self.out_dir / "gallery")}

    def _write_media(self, folder: Path, strips: list[np.ndarray], frames: list[np.ndarray] | None,
                     fps: int) -> list[Path]:
        """One file per sample in ``folder``: ``NNN.png`` (``.jpg`` when large) or ``NNN.mp4`` (``.gif`` without
        ffmpeg); a file left from an earlier write of this step is replaced."""
        folder.mkdir(exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
        files = []
        if frames is None:
            for i, hwc in enumerate(strips):
                large = min(hwc.shape[:2]) >= _JPEG_FROM
                path = folder / f"{i:03d}.{'jpg' if large else 'png'}"
                Image.fromarray(hwc).save(path, **({"quality": 95} if large else {}))
                files.append(path)
            return files
        mp4 = _can_encode_mp4()
        if not mp4 and not self._warned_video:
            warnings.warn("Gallery: mp4 videos need `pip install imageio imageio-ffmpeg`; writing GIFs instead",
                          stacklevel=3)
            self._warned_video = True
        for i, clip in enumerate(frames):
            if mp4:
                from diffusers.utils import export_to_video

                path = folder / f"{i:03d}.mp4"
                # PIL frames go in as their uint8 pixels (float frames are scaled by 255 and truncated)
                export_to_video([Image.fromarray(f) for f in clip], str(path), fps=fps)
            else:
                path = folder / f"{i:03d}.gif"
                path.write_bytes(_gif_bytes(clip, fps))
            files.append(path)
        return files


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


# ------------------------------------------------------------------------------------------ the HTML index

_INDEX_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { margin-top: 1.6em; border-bottom: 2px solid #888; }
h3 { font-size: 1.05em; margin: 1.2em 0 0.4em; } h3 small { font-weight: normal; color: #555; }
nav a, h3 a { margin-right: 0.6em; }
.cells { display: flex; flex-wrap: wrap; gap: 10px; }
figure { margin: 0; width: 196px; border: 1px solid #aaa; background: #fafafa; }
figure img, figure video { width: 196px; display: block; image-rendering: pixelated; background: #000; }
figcaption { font-size: 12px; padding: 4px 6px; line-height: 1.35; overflow-wrap: anywhere; }
figcaption .scores { font-family: ui-monospace, monospace; }
figcaption .parts { font-family: ui-monospace, monospace; color: #555; }
"""


_INDEX_ROWS: dict[tuple[Path, int], list[dict]] = {}  # (gallery file, its mtime) -> its rows without pixels


def _index_rows(parquet: Path) -> list[dict]:
    """A gallery file's rows without their pixels, read once per version of the file."""
    key = (parquet.resolve(), parquet.stat().st_mtime_ns)
    if key not in _INDEX_ROWS:
        names = [c for c in pq.read_schema(parquet).names if c != "image_png"]
        _INDEX_ROWS[key] = pq.read_table(parquet, columns=names).to_pylist()
    return _INDEX_ROWS[key]


def _rel(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` as a URL path (each part quoted)."""
    return "/".join(quote(part) for part in path.relative_to(root).parts)


def _fmt(value) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def write_index(gallery_dir: str | os.PathLike) -> Path:
    """Write ``gallery_dir/index.html``: every gallery under ``gallery_dir`` (``{tag}/step-NNNNNN.parquet``), one
    section per tag, newest step first; per step the samples with their media (images, or videos that play) and
    captions (prompt, reward, advantage, every reward component), and links to the labelled grid and the parquet
    file. Links are relative, so the page opens from the run directory anywhere. :meth:`Gallery.log` rewrites it
    after each gallery; call it on an older run's ``gallery/`` to (re)build one. Returns its path."""
    gallery_dir = Path(gallery_dir)
    tags = sorted(p.parent.name for p in gallery_dir.glob("*/step-*.parquet"))
    tags = sorted(set(tags), key=lambda t: (t != "train", t))  # training first, then eval, ...
    esc = html.escape
    out = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>Galleries: {esc(gallery_dir.resolve().parent.name)}</title>",
           f"<style>{_INDEX_CSS}</style></head><body>",
           f"<h1>Galleries of {esc(gallery_dir.resolve().parent.name)}</h1>",
           "<nav>" + "".join(f'<a href="#{quote(t)}">{esc(t)}</a>' for t in tags) + "</nav>"]
    if not tags:
        out.append("<p>No gallery yet.</p>")
    for tag in tags:
        files = sorted((gallery_dir / tag).glob("step-*.parquet"), reverse=True)
        out.append(f'<h2 id="{quote(tag)}">{esc(tag)}</h2>')
        out.append("<nav>steps: " + "".join(f'<a href="#{quote(tag)}-{int(f.stem[5:])}">{int(f.stem[5:])}</a>'
                                             for f in files) + "</nav>")
        for parquet in files:
            step = int(parquet.stem[5:])
            grid = parquet.with_suffix(".png")
            links = [f'<a href="{_rel(grid, gallery_dir)}">labelled grid</a>'] if grid.exists() else []
            links.append(f'<a href="{_rel(parquet, gallery_dir)}">parquet</a>')
            out.append(f'<h3 id="{quote(tag)}-{step}">step {step} <small>{" · ".join(links)}</small></h3>')
            media = {int(p.stem): p for p in (gallery_dir / tag / parquet.stem).glob("*.*") if p.stem.isdigit()}
            out.append('<div class="cells">')
            for i, row in enumerate(_index_rows(parquet)):
                path = media.get(i)
                if path is None:
                    shown = ""
                elif path.suffix == ".mp4":
                    shown = (f'<video src="{_rel(path, gallery_dir)}" autoplay loop muted playsinline controls '
                             'preload="auto"></video>')
                else:
                    shown = f'<img src="{_rel(path, gallery_dir)}" alt="sample {i}" loading="lazy">'
                scores = [f"reward {_fmt(row['reward']) or 'n/a'}"]
                if _fmt(row.get("advantage")) is not None:
                    scores.append(f"adv {row['advantage']:+.3f}")
                parts = [f"{esc(k)}&nbsp;{_fmt(v)}" for k, v in row.items() if k not in _FIXED and _fmt(v) is not None]
                out.append(f"<figure>{shown}<figcaption>{esc(row['prompt'])}<br>"
                           f'<span class="scores">{esc("  ".join(scores))}</span>'
                           + (f'<br><span class="parts">{" · ".join(parts)}</span>' if parts else "")
                           + "</figcaption></figure>")
            out.append("</div>")
    out.append("</body></html>")
    index = gallery_dir / "index.html"
    gallery_dir.mkdir(parents=True, exist_ok=True)
    tmp = gallery_dir / f".index.html.{uuid.uuid4().hex[:8]}"
    tmp.write_text("\n".join(out) + "\n", encoding="utf-8")
    os.replace(tmp, index)
    return index
