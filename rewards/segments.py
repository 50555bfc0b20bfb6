"""``segments``: any clip reward applied to each segment of a stream whose prompt switches.

A stream's metadata lists its segments (``{"start": pixel frame, "prompt": ...}``, plus ``num_frames``; the format
of ``assets/prompts/streams_*.jsonl``). Segment ``k``'s clip is its frames from ``start + grace`` to the next start
(at most ``clip_frames`` of them, centred in what is left, when set), scored by the inner reward against the
segment's own prompt and metadata (the segment dict, so a GenEval-style segment keeps its ``include`` list). So a
reward made for short clips judges a long video the way long-video RL scores it: per segment, each with its own
prompt (KVPO's official "global" reward averages per-segment clips the same way).

>>> reward = rewards.load("segments", reward="video_geneval")                     # doctest: +SKIP
>>> out = reward(videos, prompts, metadata)
>>> out.scores                      # mean over each stream's segments of the inner reward's score
>>> out.components["segment1/score"], out.components["segment1/motion"]   # per segment (NaN past a stream's last)

Components: ``segment<k>/score`` and ``segment<k>/<component>`` for every component of the inner reward, and
``score`` (the training scalar: the mean of ``segment<k>/score`` over a stream's segments). Streams with fewer
segments than the batch's longest get NaN in the segments they lack.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from .base import RewardOutput, load, register

__all__ = ["SegmentReward"]


@register("segments")
class SegmentReward:
    """Score every segment of a stream with ``reward`` (see the module docstring).

    Args:
        reward: the inner reward's registered name (a clip reward: ``video_geneval``, ``video_clip``, ...).
        kwargs: its keyword arguments.
        grace: frames after a switch left out of the segment's clip (the model's time to follow the new prompt).
        clip_frames: most frames per clip (centred in the segment); ``None``: the whole segment.
    """

    modality = "video"

    def __init__(self, reward: str, kwargs: Mapping[str, Any] | None = None, grace: int = 0,
                 clip_frames: int | None = None):
        if reward in ("segments", "multi"):
            raise ValueError(f"segments: reward={reward!r} cannot be nested here; name a clip reward")
        if grace < 0 or (clip_frames is not None and clip_frames < 1):
            raise ValueError(f"segments: grace must be >= 0 and clip_frames >= 1 or None, got {grace}, {clip_frames}")
        self.name = reward
        self.inner = load(reward, **dict(kwargs or {}))
        self.grace, self.clip_frames = int(grace), clip_frames

    def check_metadata(self, metadata: Mapping) -> None:
        """A stream: ``num_frames`` and ``segments`` with ascending ``start`` from 0 and a ``prompt`` each; every
        segment long enough for the grace period."""
        if not isinstance(metadata, Mapping) or not isinstance(metadata.get("segments"), Sequence) \
                or not metadata["segments"] or "num_frames" not in metadata:
            raise ValueError("segments: each metadata record needs 'num_frames' and a non-empty 'segments' list")
        for start, end, segment in self._bounds(metadata):
            if not isinstance(segment, Mapping) or "prompt" not in segment:
                raise ValueError(f"segments: the segment starting at frame {start} has no 'prompt'")
            if end - start <= self.grace:
                raise ValueError(f"segments: the segment at frames [{start}, {end}) leaves no frame after the "
                                 f"grace period of {self.grace}")
        check = getattr(self.inner, "check_metadata", None)
        if callable(check):
            for segment in metadata["segments"]:
                check(segment)

    def _bounds(self, metadata: Mapping) -> list[tuple[int, int, Mapping]]:
        segments = list(metadata["segments"])
        starts = [int(s["start"]) for s in segments]
        if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"segments: segment starts {starts} must rise from 0")
        ends = starts[1:] + [int(metadata["num_frames"])]
        return list(zip(starts, ends, segments))

    def _clip(self, start: int, end: int) -> tuple[int, int]:
        lo = start + self.grace
        if self.clip_frames is not None and end - lo > self.clip_frames:
            lo += (end - lo - self.clip_frames) // 2
            end = lo + self.clip_frames
        return lo, end

    def __call__(self, videos, prompts: Sequence[str] | None = None,
                 metadata: Sequence[Mapping] | None = None) -> RewardOutput:
        if isinstance(videos, (list, tuple)) and not videos or isinstance(videos, torch.Tensor) and len(videos) == 0:
            return RewardOutput(torch.zeros(0), {"score": torch.zeros(0)})  # an empty batch: no segments to score
        if not isinstance(videos, torch.Tensor) or videos.ndim != 5:
            raise ValueError("segments: videos must be a [B, T, 3, H, W] tensor")
        if metadata is None or len(metadata) != videos.shape[0]:
            raise ValueError("segments: pass one stream metadata record per video")
        batch = videos.shape[0]
        jobs: dict[int, list[tuple[int, int, int, int, Mapping]]] = {}  # clip length -> (row, k, lo, hi, segment)
        most = 0
        for row, meta in enumerate(metadata):
            self.check_metadata(meta)
            if int(meta["num_frames"]) != videos.shape[1]:
                raise ValueError(f"segments: metadata[{row}] says {meta['num_frames']} frames, the video has "
                                 f"{videos.shape[1]}")
            bounds = self._bounds(meta)
            most = max(most, len(bounds))
            for k, (start, end, segment) in enumerate(bounds):
                lo, hi = self._clip(start, end)
                jobs.setdefault(hi - lo, []).append((row, k, lo, hi, segment))
        components: dict[str, torch.Tensor] = {}

        def put(name: str, row: int, value: float) -> None:
            components.setdefault(name, torch.full((batch,), math.nan))[row] = value

        for clips in jobs.values():  # clips of one length go through the inner reward together
            frames = torch.stack([videos[row, lo:hi] for row, _, lo, hi, _ in clips])
            out = self.inner(frames, [str(s["prompt"]) for *_, s in clips], [dict(s) for *_, s in clips])
            for i, (row, k, *_rest) in enumerate(clips):
                put(f"segment{k}/score", row, float(out.scores[i]))
                for name, value in out.components.items():
                    put(f"segment{k}/{name}", row, float(value[i]))
        per_segment = torch.stack([components[f"segment{k}/score"] for k in range(most)], 1)
        scores = torch.nanmean(per_segment, dim=1)
        components["score"] = scores.clone()
        return RewardOutput(scores, dict(sorted(components.items())))
