"""``multi``: several rewards scored together, every sub-reward kept as components, ``scores`` their weighted sum.

>>> import torch, rewards
>>> r = rewards.load("multi", components=[{"name": "jpeg_compressibility", "weight": 1.0},
...                                       {"name": "jpeg_incompressibility", "weight": 0.5}])
>>> out = r(torch.full((2, 3, 32, 32), 0.5), ["", ""])
>>> sorted(out.components)
['jpeg_compressibility', 'jpeg_compressibility/jpeg_kb', 'jpeg_incompressibility', 'jpeg_incompressibility/jpeg_kb']
>>> r.weights
{'jpeg_compressibility': 1.0, 'jpeg_incompressibility': 0.5}

A component is a registered reward (``"name"``), your own by import path (``"target": "my_rewards:redness"``, built
as ``reward=custom`` builds it: :func:`rewards.custom.from_target`) or, from Python, a callable (``"reward": fn``,
wrapped by :func:`rewards.wrap`). Each sub-reward's score becomes the component ``<prefix>`` and each of its
components ``<prefix>/<component>``; ``prefix`` defaults to the reward's name (a target's or callable's last name,
``redness``; give ``prefix`` to use one reward twice with different kwargs).
:attr:`MultiReward.weights` maps those prefixes to weights, ready for the aggregators of :mod:`rewards.aggregate`
(:func:`~rewards.aggregate.per_reward_group_advantages`, :class:`~rewards.aggregate.TaRoS`), which work on the
per-reward components rather than on the weighted sum.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .base import RewardOutput, load, register
from .custom import from_target, short_name

__all__ = ["MultiReward"]

_SPEC_KEYS = {"name", "target", "reward", "weight", "kwargs", "prefix"}
_SOURCES = ("name", "target", "reward")  # exactly one of them says which reward a component is


class MultiReward:
    """``scores = Σ_k w_k·score_k`` (raw weights, Flow-GRPO's ``multi_score``); components: every sub-reward's
    score (``<prefix>``) and components (``<prefix>/<name>``).

    Args:
        components: list of ``{"name": reward name, "weight": w (default 1.0), "kwargs": {...} (default {}),
            "prefix": component prefix (default: name)}``; instead of ``"name"``, ``"target"``: an import path
            (``"my_rewards:redness"``) or ``"reward"``: a callable. A weight of 0 scores and logs a reward without
            training on it.
    """

    def __init__(self, components: Sequence[Mapping[str, Any]]):
        if not components:
            raise ValueError("multi reward: components is empty; give a list of {name, weight, kwargs}")
        self.rewards: dict[str, object] = {}
        self.weights: dict[str, float] = {}
        for i, spec in enumerate(components):
            sources = [k for k in _SOURCES if isinstance(spec, Mapping) and spec.get(k) is not None]
            if len(sources) != 1:
                raise ValueError(f"multi reward: components[{i}] must be a mapping with one of 'name' (a registered "
                                 f"reward), 'target' (an import path) or 'reward' (a callable), got {spec!r}")
            unknown = sorted(set(spec) - _SPEC_KEYS)
            if unknown:
                raise ValueError(f"multi reward: components[{i}] has unknown keys {unknown}; allowed: {sorted(_SPEC_KEYS)}")
            name = str(spec["name"]) if sources == ["name"] else short_name(spec[sources[0]])
            if sources == ["name"] and name == "multi":
                raise ValueError(f"multi reward: components[{i}] is itself 'multi'; list its parts instead")
            prefix = str(spec.get("prefix") or name)
            if prefix in self.rewards:
                raise ValueError(f"multi reward: two components use the prefix {prefix!r}; set 'prefix' to tell them apart")
            weight = float(spec.get("weight", 1.0))
            if not weight >= 0:
                raise ValueError(f"multi reward: components[{i}] ({prefix}) has weight {weight}; weights must be >= 0")
            kwargs = dict(spec.get("kwargs") or {})
            if sources != ["name"]:  # your own: its errors name the component
                where = f"components[{i}]"
                self.rewards[prefix] = from_target(spec[sources[0]], kwargs, key=f"{where}.{sources[0]}",
                                                   kwargs_key=f"{where}.kwargs")
            else:
                try:
                    self.rewards[prefix] = load(name, **kwargs)
                except TypeError as err:
                    raise TypeError(f"multi reward: components[{i}] ({name}) rejected its kwargs: {err}") from err
            self.weights[prefix] = weight
        if not sum(self.weights.values()) > 0:
            raise ValueError(f"multi reward: weights {self.weights} sum to 0; give at least one positive weight")

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        total, components = None, {}
        for prefix, reward in self.rewards.items():
            out = reward(images, prompts, metadata)
            scores = out.scores.detach().cpu()  # sub-rewards may score on different devices
            components[prefix] = scores
            for name, value in out.components.items():
                components[f"{prefix}/{name}"] = value.detach().cpu()
            w = self.weights[prefix]
            if w:
                term = scores.double() * w
                total = term if total is None else total + term
        return RewardOutput(scores=total.float(), components=components)

    def __repr__(self) -> str:
        return f"MultiReward({', '.join(f'{p}×{w:g}' for p, w in self.weights.items())})"


register("multi")(MultiReward)
