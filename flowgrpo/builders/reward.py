"""The reward a ``reward`` node names (``rewards.load``, or your own by import path with ``reward=custom``), with
errors that name the key to change."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from ..config import config_key, validate

__all__ = ["build_reward", "build_aggregator", "given_reward"]

#: rewards handed over as Python objects (``flowgrpo.train(..., reward=fn)``), by the label ``reward.target`` holds
_GIVEN: dict[str, Any] = {}


@contextlib.contextmanager
def given_reward(reward: Any) -> Iterator[str]:
    """Inside the block, ``reward.target=<label>`` builds ``reward`` itself (a function, a reward object, or a class),
    whether or not the label imports (a lambda, a function of a notebook); yields the label
    (:func:`rewards.custom.target_label`, ``module:name``), which the run's config records."""
    from rewards.custom import target_label

    label = target_label(reward)
    if label in _GIVEN and _GIVEN[label] is not reward:
        raise RuntimeError(f"another reward is already given as {label!r}: one run at a time in a process")
    _GIVEN[label] = reward
    try:
        yield label
    finally:
        _GIVEN.pop(label, None)


def build_reward(reward: DictConfig):
    """``rewards.load(reward.name, **reward.kwargs)``, or for ``reward=custom`` the reward ``reward.target`` names
    (:func:`rewards.custom.from_target`: a function is wrapped, a class built with ``reward.kwargs``); errors name
    ``reward.name`` / ``reward.target`` / ``reward.kwargs``, and a target that does not import fails here, before any
    model is built."""
    validate(reward)
    import rewards

    kwargs = OmegaConf.to_container(reward.kwargs, resolve=True)
    if reward.name == "custom":
        target = reward.get("target")
        if not target:
            raise ValueError(f"reward=custom trains your own reward and {config_key(reward, 'target')} is not set: "
                             f"set {config_key(reward, 'target')}=package.module:function, the import path of your "
                             "function fn(images, prompts, metadata) (or of a reward class of your module), e.g. "
                             "my_rewards:redness (docs/your-own.md)")
        return rewards.from_target(_GIVEN.get(target, target), kwargs, key=config_key(reward, "target"),
                                   kwargs_key=config_key(reward, "kwargs"))
    if reward.name not in rewards.available():
        raise KeyError(
            f"{config_key(reward, 'name')}={reward.name!r} is not a registered reward; available: "
            f"{', '.join(rewards.available()) or '(none)'}; your own: reward=custom reward.target=package.module:name"
        )
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
