"""Reward models usable on their own: ``from rewards import load``. Never imports ``flowgrpo``."""

from .base import RewardOutput, available, load, register
from .geneval import GenEval  # registers "geneval"
from .jpeg import JpegCompressibility  # registers "jpeg_compressibility", "jpeg_incompressibility"

__all__ = ["GenEval", "JpegCompressibility", "RewardOutput", "available", "load", "register"]
