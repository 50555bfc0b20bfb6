"""The full dotted key of a config value, for error messages that name what to change."""

from __future__ import annotations

from omegaconf import DictConfig

__all__ = ["config_key"]


def config_key(node: DictConfig, name: str) -> str:
    """Full dotted key of ``node.name`` (``data.train_file``), or ``name`` for a detached node."""
    prefix = node._get_full_key(None) if isinstance(node, DictConfig) else ""
    return f"{prefix}.{name}" if prefix else name
