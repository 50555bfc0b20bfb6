"""GRPO algorithms as small modules plugging into the trainer's phases (DESIGN.md): plan (1), advantage (4),
update weights and loss (5).

* ``grpo`` — Flow-GRPO (arXiv 2505.05470) / DanceGRPO (arXiv 2505.07818): :class:`GRPO`;
* ``mix_grpo`` — MixGRPO / MixGRPO-Flash (arXiv 2507.21802): :class:`MixGRPO`;
* ``flash_grpo`` — Flash-GRPO (arXiv 2605.15980): :class:`FlashGRPO`.

:func:`build_algorithm` picks one by ``algo.name``; :func:`ppo_clip_loss` / :func:`reduce_log_prob` are the
shared update.
"""

from .base import ALGORITHMS, Algorithm, RolloutPlan, build_algorithm
from .flash_grpo import FlashGRPO
from .grpo import GRPO
from .losses import ppo_clip_loss, reduce_log_prob
from .mix_grpo import MixGRPO

__all__ = ["ALGORITHMS", "Algorithm", "RolloutPlan", "build_algorithm", "GRPO", "MixGRPO", "FlashGRPO",
           "ppo_clip_loss", "reduce_log_prob"]
