"""Video rewards on clips ``[B, T, 3, H, W]`` in [0, 1] (or uint8): text alignment, consistency, flicker, motion.

========================  ==========================================================================  =============
reward                    score                                                                       weights
========================  ==========================================================================  =============
``video_clip``            CLIP cosine(text, frame), mean over frames                                  CLIP (path)
``video_consistency``     VBench subject consistency: mean_t ½(max(0,cos(f_t,f_{t−1})) +              DINO / CLIP
                          max(0,cos(f_t,f_0))) of per-frame features                                  (path), or
                                                                                                      ``pixels``
``video_flicker``         VBench temporal flickering: (255 − MAD)/255, MAD = mean |x_t − x_{t−1}|     none
                          over pixels and consecutive pairs, on uint8 frames
``video_motion``          motion magnitude: mean dense optical-flow magnitude (OpenCV Farnebäck)      none
                          as a fraction of the frame's shorter side, or the mean absolute
                          difference of consecutive blurred grey frames (``method="frame_diff"``)
``video_sharpness``       per-frame edge sharpness: mean of the strongest ``top`` fraction of grey    none
                          neighbour differences, /255, mean over frames (a no-reference frame-quality
                          term: blur lowers it, a crisp 1-pixel edge of full contrast scores 1)
========================  ==========================================================================  =============

VBench (arXiv 2311.17982, ``vbench/subject_consistency.py``, ``temporal_flickering.py``) scores one video at a
time; these are batched over clips. Consistency uses VBench's DINO preprocessing (shorter side resized to 224,
bilinear, ImageNet normalisation; the model's CLS feature) with ``backbone="dino"``, or CLIP's own image
processor with ``backbone="clip"``. ``backbone="pixels"`` is a weight-free stand-in (per-frame mean-removed
16×16 area-downsampled pixels, so the cosine is a pixel correlation) that must be chosen explicitly: a missing
backbone raises, it never falls back to pixels.

Flicker and motion measure opposite things: a clip with no change scores 1.0 flicker and 0 motion; VBench pairs
them (and its RAFT-based *dynamic degree*) so that a generator cannot win both by freezing. Our ``video_motion``
uses Farnebäck flow (classical, no weights) instead of RAFT; components give the mean flow magnitude in pixels
per frame and the mean of each frame pair's top-5% magnitudes (the statistic VBench's dynamic degree
thresholds).

Degenerate clips (:func:`rewards.images.degenerate`: every frame uniform -- all black, all white, one flat colour --
or pure noise) score 0 under ``video_flicker``, ``video_motion``, ``video_sharpness`` and ``video_consistency``, whose scales have a
floor of 0: a frozen flat clip would otherwise earn the best possible flicker and consistency (1.0), and noise
made-up motion. Their measurement components (``flicker_mad``, ``motion_px``, ``motion_top5_px``) keep what was
measured; the score-scale ones (``flicker``, ``motion``, ``consistency*``) are 0. ``video_clip`` is a learned
model's judgement (a prompt may ask for a plain or noisy picture) and scores what it sees. Clips holding NaN or
inf raise ``ValueError`` naming the reward and the samples under every video reward (:func:`to_video`).

Weights load on the first call (or :meth:`load`), so configs instantiate offline; a missing checkpoint raises
an ``OSError`` naming the path / hub id and the keyword to set.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.nn.functional as F

from ._loading import check_tokenizer, from_pretrained, resolve_device, resolve_dtype
from .base import RewardOutput, register
from .images import check_pixels, degenerate

__all__ = ["to_video", "VideoClipScore", "VideoConsistency", "VideoFlicker", "VideoMotion", "VideoSharpness"]

DEFAULT_CLIP = "openai/clip-vit-large-patch14"
DEFAULT_DINO = "facebook/dino-vitb16"
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def to_video(videos, reward: str | None = None) -> torch.Tensor:
    """Clips in any accepted form → uint8 ``[B, T, 3, H, W]`` on the CPU.

    Accepts float ``[B, T, 3, H, W]`` in [0, 1], uint8 ``[B, T, 3, H, W]``, numpy ``[B, T, H, W, 3]``, or a list
    of clips, each a list of PIL images or a ``[T, 3, H, W]`` / ``[T, H, W, 3]`` array. Float clips holding NaN or
    inf, or values outside [0, 1], raise ``ValueError`` naming ``reward`` and the clips
    (:func:`rewards.images.check_pixels`: [-1, 1] → pass ``(x + 1) / 2``, [0, 255] → ``x / 255``).
    """
    if isinstance(videos, (list, tuple)):
        from PIL import Image

        tensors = []
        for clip in videos:
            if isinstance(clip, Image.Image):
                raise ValueError("video reward: got a list of images; video rewards score clips [B, T, 3, H, W] "
                                 "(or a list of clips, each a list of frames)")
            if isinstance(clip, (list, tuple)):
                clip = np.stack([np.asarray(f.convert("RGB")) if isinstance(f, Image.Image) else np.asarray(f) for f in clip])
            tensors.append(torch.as_tensor(clip))
        check_pixels(tensors, reward, "clips")
        clips = [to_video(clip[None], reward)[0] for clip in tensors]
        if not clips:  # an empty batch: its size is unknown, and every reward answers it before reading a size
            return torch.zeros((0, 0, 3, 0, 0), dtype=torch.uint8)
        shapes = {tuple(c.shape) for c in clips}
        if len(shapes) != 1:
            raise ValueError(f"video reward: clips of a batch must share [T, 3, H, W], got {sorted(shapes)}")
        return torch.stack(clips)
    x = torch.from_numpy(np.ascontiguousarray(videos)) if isinstance(videos, np.ndarray) else videos
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"video reward: expected a tensor [B, T, 3, H, W] or a list of clips, got {type(videos).__name__}")
    x = x.detach().cpu()
    if x.ndim == 4:
        raise ValueError(f"video reward: got images {tuple(x.shape)}; video rewards score clips [B, T, 3, H, W]")
    if x.ndim != 5:
        raise ValueError(f"video reward: expected [B, T, 3, H, W], got shape {tuple(x.shape)}")
    if x.shape[2] != 3 and x.shape[-1] == 3:
        x = x.permute(0, 1, 4, 2, 3)
    if x.shape[2] != 3:
        raise ValueError(f"video reward: expected 3 colour channels in [B, T, 3, H, W], got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        return x.contiguous()
    if not x.is_floating_point():
        raise ValueError(f"video reward: expected float frames in [0, 1] or uint8, got {x.dtype}")
    check_pixels(x, reward, "clips")
    return (x.float().clamp(0, 1) * 255).round().to(torch.uint8)


def _empty(*components: str) -> RewardOutput:
    """The answer to an empty batch: no scores, every component empty."""
    return RewardOutput(torch.zeros(0), {name: torch.zeros(0) for name in components})


def _content(video: torch.Tensor) -> torch.Tensor:
    """float64 ``[B]``: 1 for clips with content, 0 for degenerate ones (:func:`rewards.images.degenerate`)."""
    return torch.tensor([flag is None for flag in degenerate(video)], dtype=torch.float64)


def _select_frames(video: torch.Tensor, num_frames: int | None) -> torch.Tensor:
    """Evenly spaced ``num_frames`` of ``[B, T, ...]`` (all when None or ≥ T)."""
    T = video.shape[1]
    if num_frames is None or num_frames >= T:
        return video
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    index = torch.linspace(0, T - 1, num_frames).round().long()
    return video[:, index]


def _features(out) -> torch.Tensor:
    """transformers 5 returns an output object from get_*_features: the embedding is pooler_output."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class _Clip:
    """A transformers CLIP checkpoint (model, tokenizer, image processor) loaded from a path or hub id."""

    def __init__(self, reward: str, path: str, kwarg: str, device, torch_dtype):
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        kw = {"torch_dtype": torch_dtype} if torch_dtype is not None else {}
        what = "CLIP model / tokenizer / image processor"
        load = dict(reward=reward, what=what, kwarg=kwarg)
        self.model = from_pretrained(CLIPModel.from_pretrained, path, **load, **kw).to(device).eval()
        self.tokenizer = from_pretrained(AutoTokenizer.from_pretrained, path, **load)
        self.processor = from_pretrained(AutoImageProcessor.from_pretrained, path, **load)
        check_tokenizer(self.tokenizer, path, reward=reward, kwarg=kwarg)  # near-empty when its files are missing
        self.device = device

    @torch.no_grad()
    def image_features(self, frames: torch.Tensor, batch_size: int) -> torch.Tensor:
        """uint8 ``[N, 3, H, W]`` → unit-norm float32 ``[N, D]`` (CLIP's reference preprocessing)."""
        feats = []
        for chunk in frames.split(batch_size):
            pixels = self.processor(images=chunk, return_tensors="pt")["pixel_values"]
            pixels = pixels.to(self.device, self.model.dtype)
            feats.append(F.normalize(_features(self.model.get_image_features(pixel_values=pixels)).float(), dim=-1))
        return torch.cat(feats)

    @torch.no_grad()
    def text_features(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(list(prompts), padding=True, truncation=True, return_tensors="pt").to(self.device)
        return F.normalize(_features(self.model.get_text_features(**tokens)).float(), dim=-1)


class VideoClipScore:
    """CLIP text–frame alignment: ``cos(text, frame)`` averaged over (``num_frames`` evenly spaced) frames.

    Components: ``clip_frame_mean`` (the score), ``clip_frame_min`` (worst frame).

    Args:
        clip_path: CLIP checkpoint, local path or hub id (transformers format).
        num_frames: frames scored per clip, evenly spaced (None: all).
        device, torch_dtype: where / in what precision CLIP runs (default cuda if available, float32).
        batch_size: frames per CLIP forward.
    """

    modality = "video"  # scores clips [B, T, 3, H, W]: a trainer refuses it with an image model

    def __init__(self, clip_path: str = DEFAULT_CLIP, *, num_frames: int | None = 8, device=None,
                 torch_dtype: str | None = None, batch_size: int = 64):
        self.clip_path, self.num_frames, self.batch_size = clip_path, num_frames, int(batch_size)
        self.device = resolve_device(device)
        # None keeps the checkpoint's own dtype
        self.torch_dtype = None if torch_dtype is None else resolve_dtype(torch_dtype)
        self._clip: _Clip | None = None
        self.load()  # fail at construction, before any rollout, when the weights are missing

    def load(self) -> "VideoClipScore":
        if self._clip is None:
            self._clip = _Clip("video_clip", self.clip_path, "clip_path", self.device, self.torch_dtype)
        return self

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        video = _select_frames(to_video(images, reward="video_clip"), self.num_frames)
        B, T = video.shape[:2]
        if len(prompts) != B:
            raise ValueError(f"video_clip: {B} clips but {len(prompts)} prompts")
        if B == 0:
            return _empty("clip_frame_mean", "clip_frame_min")
        clip = self.load()._clip
        frames = clip.image_features(video.flatten(0, 1), self.batch_size).view(B, T, -1)
        text = clip.text_features(prompts)
        sim = (frames * text[:, None]).sum(-1).cpu()  # [B, T]
        return RewardOutput(scores=sim.mean(1), components={"clip_frame_mean": sim.mean(1), "clip_frame_min": sim.amin(1)})


class VideoConsistency:
    """Subject consistency (VBench): per-frame features compared with the previous and the first frame.

    ``score = mean_{t≥1} ½·(max(0, cos(f_t, f_{t−1})) + max(0, cos(f_t, f_0)))``; components ``consistency``
    (the score), ``consistency_prev`` and ``consistency_first`` (the two halves, each clamped at 0 and averaged).

    Args:
        backbone: ``"dino"`` (transformers ViT-style model from ``model_path``, CLS feature, VBench's
            preprocessing), ``"clip"`` (CLIP image features from ``model_path``, CLIP's processor) or ``"pixels"``
            (weight-free, see module doc; must be chosen explicitly).
        model_path: checkpoint for dino / clip (default ``facebook/dino-vitb16`` / ``openai/clip-vit-large-patch14``).
        num_frames: frames used per clip, evenly spaced (None: all, as VBench).
        image_size: dino's shorter-side resize (VBench: 224).
        device, torch_dtype, batch_size: as :class:`VideoClipScore`.
    """

    modality = "video"  # scores clips [B, T, 3, H, W]: a trainer refuses it with an image model

    def __init__(self, backbone: str = "dino", model_path: str | None = None, *, num_frames: int | None = None,
                 image_size: int = 224, device=None, torch_dtype: str | None = None, batch_size: int = 64):
        if backbone not in ("dino", "clip", "pixels"):
            raise ValueError(f"video_consistency: backbone must be 'dino', 'clip' or 'pixels', got {backbone!r}")
        if backbone == "pixels" and model_path is not None:
            raise ValueError("video_consistency: backbone='pixels' uses no weights; drop model_path")
        self.backbone = backbone
        self.model_path = model_path or {"dino": DEFAULT_DINO, "clip": DEFAULT_CLIP}.get(backbone)
        self.num_frames, self.image_size, self.batch_size = num_frames, int(image_size), int(batch_size)
        self.device = resolve_device(device)
        # None keeps the checkpoint's own dtype
        self.torch_dtype = None if torch_dtype is None else resolve_dtype(torch_dtype)
        self._model = None
        self.load()  # fail at construction, before any rollout, when the weights are missing

    def load(self) -> "VideoConsistency":
        if self._model is not None or self.backbone == "pixels":
            return self
        if self.backbone == "clip":
            self._model = _Clip("video_consistency", self.model_path, "model_path", self.device, self.torch_dtype)
            return self
        from transformers import AutoModel

        kw = {"torch_dtype": self.torch_dtype} if self.torch_dtype is not None else {}
        model = from_pretrained(AutoModel.from_pretrained, self.model_path, reward="video_consistency",
                                what="DINO backbone (a transformers ViT-style model)", kwarg="model_path", **kw)
        self._model = model.to(self.device).eval()
        self._interpolate = "interpolate_pos_encoding" in inspect.signature(model.forward).parameters
        return self

    @torch.no_grad()
    def features(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 ``[N, 3, H, W]`` → unit-norm float32 ``[N, D]`` on the CPU."""
        if self.backbone == "pixels":
            x = F.adaptive_avg_pool2d(frames.float() / 255.0, 16).flatten(1)
            return F.normalize(x - x.mean(1, keepdim=True), dim=-1)
        self.load()
        import torchvision.transforms.functional as TF

        if self.backbone == "clip":
            return self._model.image_features(frames, self.batch_size).cpu()
        feats = []
        mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1)
        for chunk in frames.split(self.batch_size):
            # VBench's dino_transform: Resize(224) of the uint8 frames (shorter side, bilinear, antialias=False), /255
            x = TF.resize(chunk.to(self.device), [self.image_size], antialias=False).float() / 255.0
            x = ((x - mean) / std).to(self._model.dtype)
            kw = {"interpolate_pos_encoding": True} if self._interpolate else {}
            out = self._model(pixel_values=x, **kw)
            feats.append(F.normalize(out.last_hidden_state[:, 0].float(), dim=-1).cpu())  # CLS after the final norm
        return torch.cat(feats)

    def __call__(self, images, prompts=None, metadata=None) -> RewardOutput:
        video = to_video(images, reward="video_consistency")
        if len(video) == 0:
            return _empty("consistency", "consistency_prev", "consistency_first")
        content = _content(video)  # on every frame, not only the selected ones
        video = _select_frames(video, self.num_frames)
        B, T = video.shape[:2]
        if T < 2:
            raise ValueError(f"video_consistency: clips need at least 2 frames, got {T}")
        f = self.features(video.flatten(0, 1)).view(B, T, -1).double()
        prev = (f[:, 1:] * f[:, :-1]).sum(-1).clamp_min(0).mean(1) * content  # degenerate clips: 0
        first = (f[:, 1:] * f[:, :1]).sum(-1).clamp_min(0).mean(1) * content
        score = (prev + first) / 2
        return RewardOutput(scores=score.float(), components={
            "consistency": score, "consistency_prev": prev, "consistency_first": first})


class VideoFlicker:
    """Temporal flickering (VBench): ``(255 − MAD)/255`` with MAD the mean absolute difference of consecutive
    uint8 frames (over pixels, channels and pairs). Components: ``flicker`` (the score), ``flicker_mad`` (MAD, 0–255).
    A degenerate clip (every frame flat or noise) scores 0, not the 1.0 a frozen flat clip would measure.
    """

    modality = "video"  # scores clips [B, T, 3, H, W]: a trainer refuses it with an image model

    def __call__(self, images, prompts=None, metadata=None) -> RewardOutput:
        video = to_video(images, reward="video_flicker")
        if len(video) == 0:
            return _empty("flicker", "flicker_mad")
        if video.shape[1] < 2:
            raise ValueError(f"video_flicker: clips need at least 2 frames, got {video.shape[1]}")
        x = video.to(torch.int16)
        mad = (x[:, 1:] - x[:, :-1]).abs().double().mean(dim=(1, 2, 3, 4))
        score = (255.0 - mad) / 255.0 * _content(video)  # degenerate clips: 0
        return RewardOutput(scores=score.float(), components={"flicker": score, "flicker_mad": mad})


def _grey(video: torch.Tensor) -> torch.Tensor:
    """uint8 ``[B, T, 3, H, W]`` → float ``[B, T, H, W]`` in [0, 255] (ITU-R 601 luma, as cv2.COLOR_RGB2GRAY)."""
    w = torch.tensor([0.299, 0.587, 0.114], dtype=torch.float32).view(1, 1, 3, 1, 1)
    return (video.float() * w).sum(2)


class VideoMotion:
    """Motion magnitude of consecutive frames (see module doc).

    ``method="flow"``: dense Farnebäck optical flow (OpenCV; pyramid 0.5 × 3 levels, window 15, 3 iterations,
    poly 5 / 1.2 — OpenCV's reference settings) of consecutive grey frames; score = mean flow magnitude divided
    by the shorter frame side (fraction of the frame per frame). Components ``motion`` (the score), ``motion_px``
    (mean magnitude, pixels per frame), ``motion_top5_px`` (mean over pairs of the mean of the top 5% magnitudes).

    ``method="frame_diff"``: no flow; score = mean |g_t − g_{t−1}|/255 of grey frames blurred by a
    ``blur``-pixel box filter (which damps pixel noise), component ``motion``. Cheaper, but any change counts
    (flicker and lighting too).

    Args:
        method: ``"flow"`` or ``"frame_diff"``. num_frames: frames used per clip, evenly spaced (None: all).
        blur: box-filter size for ``frame_diff`` (1: none).
    """

    modality = "video"  # scores clips [B, T, 3, H, W]: a trainer refuses it with an image model

    def __init__(self, method: str = "flow", *, num_frames: int | None = None, blur: int = 3):
        if method not in ("flow", "frame_diff"):
            raise ValueError(f"video_motion: method must be 'flow' or 'frame_diff', got {method!r}")
        if method == "flow":
            try:
                import cv2  # noqa: F401
            except ImportError as err:
                raise ImportError("video_motion method='flow' needs OpenCV: pip install opencv-python-headless "
                                  f"(or use method='frame_diff') [{err}]") from err
        if blur < 1:
            raise ValueError(f"video_motion: blur must be >= 1, got {blur}")
        self.method, self.num_frames, self.blur = method, num_frames, int(blur)

    def __call__(self, images, prompts=None, metadata=None) -> RewardOutput:
        video = to_video(images, reward="video_motion")
        if len(video) == 0:
            return _empty("motion") if self.method == "frame_diff" else _empty("motion", "motion_px", "motion_top5_px")
        content = _content(video)  # on every frame, not only the selected ones
        video = _select_frames(video, self.num_frames)
        B, T = video.shape[:2]
        if T < 2:
            raise ValueError(f"video_motion: clips need at least 2 frames, got {T}")
        grey = _grey(video)  # [B, T, H, W]
        if self.method == "frame_diff":
            g = grey.flatten(0, 1)[:, None]
            if self.blur > 1:
                g = F.avg_pool2d(g, self.blur, stride=1, padding=self.blur // 2, count_include_pad=False)
            g = g.view(B, T, *g.shape[-2:])
            score = ((g[:, 1:] - g[:, :-1]).abs().mean(dim=(1, 2, 3)) / 255.0).double() * content
            return RewardOutput(scores=score.float(), components={"motion": score})
        import cv2

        frames = grey.round().clamp(0, 255).to(torch.uint8).numpy()
        mean_px, top_px = np.zeros(B), np.zeros(B)
        for b in range(B):
            means, tops = [], []
            for t in range(T - 1):
                flow = cv2.calcOpticalFlowFarneback(frames[b, t], frames[b, t + 1], None, 0.5, 3, 15, 3, 5, 1.2, 0)
                mag = np.sqrt((flow.astype(np.float64) ** 2).sum(-1)).ravel()
                means.append(mag.mean())
                k = max(1, int(round(0.05 * mag.size)))
                tops.append(np.partition(mag, mag.size - k)[-k:].mean())
            mean_px[b], top_px[b] = np.mean(means), np.mean(tops)
        mean_px_t = torch.from_numpy(mean_px)
        score = mean_px_t / min(video.shape[-2:]) * content  # degenerate clips: 0
        return RewardOutput(scores=score.float(), components={
            "motion": score, "motion_px": mean_px_t, "motion_top5_px": torch.from_numpy(top_px)})


class VideoSharpness:
    """Per-frame edge sharpness, a weight-free frame-quality term: for each grey frame (0–255) the absolute
    differences of horizontal and vertical neighbours; the frame's score is the mean of its strongest ``top``
    fraction divided by 255, and the clip's the mean over frames. A blurred edge spreads its contrast over several
    pixels and scores lower; a crisp one-pixel step from white to black scores 1. It saturates once edges are crisp
    (every sample of a group then scores alike) and rewards any high-frequency content, noise included: a term to
    combine with task rewards, not to train on alone. Degenerate clips (flat or pure noise) score 0.

    Components: ``sharpness`` (the score), ``sharpness_min`` (the worst frame's).

    Args:
        top: fraction of each frame's neighbour differences averaged (0 < top ≤ 1).
    """

    modality = "video"  # scores clips [B, T, 3, H, W]: a trainer refuses it with an image model

    def __init__(self, top: float = 0.02):
        if not 0 < top <= 1:
            raise ValueError(f"video_sharpness: top must be in (0, 1], got {top}")
        self.top = float(top)

    def __call__(self, images, prompts=None, metadata=None) -> RewardOutput:
        video = to_video(images, reward="video_sharpness")
        if len(video) == 0:
            return _empty("sharpness", "sharpness_min")
        grey = _grey(video)  # [B, T, H, W], 0..255
        if min(grey.shape[-2:]) < 2:
            raise ValueError(f"video_sharpness: frames need at least 2x2 pixels, got {tuple(grey.shape[-2:])}")
        diffs = torch.cat([(grey[..., :, 1:] - grey[..., :, :-1]).abs().flatten(2),
                           (grey[..., 1:, :] - grey[..., :-1, :]).abs().flatten(2)], dim=2)  # [B, T, N]
        k = max(1, int(round(self.top * diffs.shape[-1])))
        per_frame = diffs.topk(k, dim=-1).values.mean(-1).double() / 255.0  # [B, T]
        content = _content(video)
        score = per_frame.mean(1) * content
        return RewardOutput(scores=score.float(), components={
            "sharpness": score, "sharpness_min": per_frame.min(1).values * content})


register("video_clip")(VideoClipScore)
register("video_consistency")(VideoConsistency)
register("video_flicker")(VideoFlicker)
register("video_motion")(VideoMotion)
register("video_sharpness")(VideoSharpness)
