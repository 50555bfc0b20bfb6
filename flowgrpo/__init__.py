"""flowgrpo: GRPO-style reward alignment of flow-matching generators over diffusers pipelines."""

__version__ = "0.1.0"
