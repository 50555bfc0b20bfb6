"""Reward models usable on their own: ``from rewards import load``. Never imports ``flowgrpo``."""

from .base import RewardOutput, available, load, register

__all__ = ["RewardOutput", "available", "load", "register"]
