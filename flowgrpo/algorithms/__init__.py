"""Algorithms as small modules plugging into the trainer's phases (``flowgrpo.trainer``): plan (1), the choice of
rollout (2, :mod:`flowgrpo.rollout`), advantage (4), the loss of the update (5).

* ``grpo`` — Flow-GRPO (arXiv 2505.05470) / DanceGRPO (arXiv 2505.07818): :class:`GRPO`;
* ``mix_grpo`` — MixGRPO / MixGRPO-Flash (arXiv 2507.21802): :class:`MixGRPO`;
* ``flash_grpo`` — Flash-GRPO (arXiv 2605.15980): :class:`FlashGRPO`;
* any other module of this package that defines an :class:`Algorithm` with a ``name`` (imported below, so adding
  an algorithm is one new module and one ``conf/algo/<name>.yaml``).

:func:`build_algorithm` picks one by ``algo.name``; :func:`ppo_clip_loss` / :func:`reduce_log_prob` are the
GRPO family's loss (:class:`PolicyGradient`).
"""

import importlib
import pkgutil

from .base import (ALGORITHMS, Algorithm, Batch, GalleryNotes, Needs, RolloutPlan, Scores, UpdateContext,
                   build_algorithm)
from .flash_grpo import FlashGRPO
from .grpo import GRPO
from .losses import ppo_clip_loss, reduce_log_prob
from .mix_grpo import MixGRPO
from .policy_gradient import PolicyGradient

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")  # each registers its algorithms by name

__all__ = ["ALGORITHMS", "Algorithm", "Batch", "GalleryNotes", "Needs", "RolloutPlan", "Scores", "UpdateContext",
           "build_algorithm", "PolicyGradient",
           "GRPO", "MixGRPO", "FlashGRPO", "ppo_clip_loss", "reduce_log_prob"]
