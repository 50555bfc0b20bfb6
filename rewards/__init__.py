"""Reward models usable on their own: ``from rewards import load``. Never imports ``flowgrpo``."""

from .base import RewardOutput, available, load, register
from .geneval import GenEval  # registers "geneval"

__all__ = ["GenEval", "RewardOutput", "available", "load", "register"]
