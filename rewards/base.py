"""The reward contract shared by every reward model.

A reward is a callable ``reward(images, prompts, metadata=None) -> RewardOutput``. ``images`` is a float
tensor ``[B, 3, H, W]`` in [0, 1], a uint8 tensor, or a list of PIL images; videos are ``[B, T, 3, H, W]``. Your own
function ``fn(images, prompts, metadata) -> list[float] | Tensor | RewardOutput`` becomes one with
:func:`rewards.wrap`, or by import path with ``rewards.load("custom", target="my_rewards:redness")``
(:mod:`rewards.custom`).

A reward class may declare what it scores as a class attribute ``modality = "video" | "image" | "any"``; a
trainer refuses a video reward with an image model (and the reverse) before loading weights
(:func:`flowgrpo.builders.check_reward_model`, which reads ``video_*`` names as video and the rest as image when the
attribute is absent).

A reward whose rules may change declares ``version`` (an int, raised whenever the same input would score
differently) and ``describe()`` (one line: its name, version and settings, e.g. ``long_video v2 (score=mean)``):
the trainer's log names it and keys held-out evaluations by it (``Trainer.held_out_key``), and evaluation scripts
write it next to their numbers (``scored_by``), so a result says which rules scored it.

Bad samples, the same way in every reward:

- **Float pixels outside [0, 1] raise** ``ValueError`` naming the reward, the batch indices and the likely cause:
  values in [-1, 1] (a VAE's raw output: pass ``(x + 1) / 2``) or up to 255 (pass ``x / 255``). Clamped, they would
  be scored as another picture. 1e-3 of slack is left for rounding (:func:`rewards.images.check_pixels`).
- **An empty batch** gets an empty result (``scores`` of shape ``[0]``).

- **NaN / inf pixels raise** ``ValueError`` naming the reward and the batch indices (a diverged model decodes to
  NaN; cast to uint8 it would read as a black image and be scored). No reward returns NaN or a made-up score for
  them, so a diverged run stops at its first reward call with the cause in the message.
- **Degenerate samples score 0** where 0 is the floor of the reward's scale and means "nothing there":
  ``geneval``, ``video_geneval``, ``ocr``, ``video_flicker``, ``video_motion``, ``video_sharpness``,
  ``video_consistency``. A sample is
  degenerate when it is uniform (all black, all white, one flat colour) or pure noise, every frame of it for a
  clip (:func:`rewards.images.degenerate`; a single small shape on white is content).
- Learned preference / alignment models (``pickscore``, ``hpsv21``, ``imagereward``, ``aesthetic``, ``clipscore``,
  ``video_clip``) score degenerate samples as their model does: their outputs have no "nothing" value to force,
  and a prompt may ask for a plain or a noisy picture. ``jpeg_*`` measure file size, which is defined for any image.
- ``multi`` inherits from its parts; ``remote`` raises on non-finite input like the others (its conversion is
  :func:`rewards.images.to_uint8_images`) and otherwise returns its server's scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["RewardOutput", "register", "load", "available"]


@dataclass
class RewardOutput:
    """Scores of one batch: ``scores`` is the training scalar, ``components`` every part of it, all ``[B]``."""

    scores: torch.Tensor
    components: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.scores = torch.as_tensor(self.scores, dtype=torch.float32)
        if self.scores.ndim != 1:
            raise ValueError(f"RewardOutput.scores must be 1-D [B], got shape {tuple(self.scores.shape)}")
        batch = self.scores.shape[0]
        for name, value in list(self.components.items()):
            value = torch.as_tensor(value, dtype=torch.float32)
            if value.shape != (batch,):
                raise ValueError(f"RewardOutput component {name!r} has shape {tuple(value.shape)}, expected ({batch},)")
            self.components[name] = value


_REGISTRY: dict[str, Callable[..., object]] = {}


def register(name: str):
    """Class/function decorator: make a reward constructible as ``rewards.load(name, **kwargs)``."""

    def wrap(factory):
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"reward name {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return wrap


def available() -> list[str]:
    """Names accepted by :func:`load`."""
    return sorted(_REGISTRY)


def load(name: str, **kwargs):
    """Build a reward by its config name, e.g. ``rewards.load("geneval", detector="shapes")``."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown reward {name!r}; available: {', '.join(available()) or '(none)'}")
    return _REGISTRY[name](**kwargs)
