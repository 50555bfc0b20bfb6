"""The reward a ``reward`` node names (``rewards.load``), with errors that name the key to change."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ..config import config_key, validate

__all__ = ["build_reward", "build_aggregator"]


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


def build_aggregator(cfg: DictConfig, reward):
    """The :class:`~flowgrpo.advantages.RewardAggregator` of ``reward.aggregate`` for the built ``reward``, or None for
    ``sum`` (the algorithm normalises the weighted sum like any reward); ``global_std`` and ``clip`` are the
    algorithm's (``algo.global_std``, ``algo.adv_clip``). The algorithm is handed it: phase 4 is the algorithm's."""
    from ..advantages import RewardAggregator

    if cfg.reward.aggregate.name == "sum":
        return None
    if not hasattr(reward, "weights") or getattr(reward, "score", "mean") != "mean":
        raise ValueError(f"reward.aggregate.name={cfg.reward.aggregate.name!r} needs a reward whose score is a "
                         "weighted sum of its components (reward=multi, or reward=long_video with score=mean); "
                         f"{cfg.reward.name!r} has no per-component weights or scores one component")
    return RewardAggregator(cfg.reward.aggregate, reward.weights, global_std=cfg.algo.global_std,
                            clip=cfg.algo.adv_clip)
