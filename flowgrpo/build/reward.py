"""The reward a ``reward`` node names (``rewards.load``), with errors that name the key to change."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ..config import config_key, validate

__all__ = ["build_reward"]


def build_reward(reward: DictConfig):
    """``rewards.load(reward.name, **reward.kwargs)``; errors name ``reward.name`` / ``reward.kwargs``."""
    validate(reward)
    import rewards

    if reward.name not in rewards.available():
        raise KeyError(
            f"{config_key(reward, 'name')}={reward.name!r} is not a registered reward; available: "
            f"{', '.join(rewards.available()) or '(none)'}"
        )
    kwargs = OmegaConf.to_container(reward.kwargs, resolve=True)
    try:
        return rewards.load(reward.name, **kwargs)
    except TypeError as err:
        raise TypeError(f"{config_key(reward, 'kwargs')}={kwargs!r} rejected by reward {reward.name!r}: {err}") from err
