"""``multi``: several rewards scored together, every sub-reward kept as components, ``scores`` their weighted sum.

>>> import torch, rewards
>>> r = rewards.load("multi", components=[{"name": "jpeg_compressibility", "weight": 1.0},
...                                       {"name": "jpeg_incompressibility", "weight": 0.5}])
>>> out = r(torch.full((2, 3, 32, 32), 0.5), ["", ""])
>>> sorted(out.components)
['jpeg_compressibility', 'jpeg_compressibility/jpeg_kb', 'jpeg_incompressibility', 'jpeg_incompressibility/jpeg_kb']
>>> r.weights
{'jpeg_compressibility': 1.0, 'jpeg_incompressibility': 0.5}

Each sub-reward's score becomes the component ``<prefix>`` and each of its components ``<prefix>/<component>``;
``prefix`` defaults to the reward's name (give ``prefix`` to use one reward twice with different kwargs).
:attr:`MultiReward.weights` maps those prefixes to weights, ready for the aggregators of :mod:`rewards.aggregate`
(:func:`~rewards.aggregate.per_reward_group_advantages`, :class:`~rewards.aggregate.TaRoS`), which work on the
per-reward components rather than on the weighted sum.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .base import RewardOutput, load, register

__all__ = ["MultiReward"]

_SPEC_KEYS = {"name", "weight", "kwargs", "prefix"}


class MultiReward:
    """``scores = Σ_k w_k·score_k`` (raw weights, Flow-GRPO's ``multi_score``); components: every sub-reward's
    score (``<prefix>``) and components (``<prefix>/<name>``).

    Args:
        components: list of ``{"name": reward name, "weight": w (default 1.0), "kwargs": {...} (default {}),
            "prefix": component prefix (default: name)}``. A weight of 0 scores and logs a reward without
            training on it.
    """

    def __init__(self, components: Sequence[Mapping[str, Any]]):
        if not components:
            raise ValueError("multi reward: components is empty; give a list of {name, weight, kwargs}")
        self.rewards: dict[str, object] = {}
        self.weights: dict[str, float] = {}
        for i, spec in enumerate(components):
            if not isinstance(spec, Mapping) or "name" not in spec:
                raise ValueError(f"multi reward: components[{i}] must be a mapping with a 'name', got {spec!r}")
            unknown = sorted(set(spec) - _SPEC_KEYS)
            if unknown:
                raise ValueError(f"multi reward: components[{i}] has unknown keys {unknown}; allowed: {sorted(_SPEC_KEYS)}")
            name = str(spec["name"])
            if name == "multi":
                raise ValueError(f"multi reward: components[{i}] is itself 'multi'; list its parts instead")
            prefix = str(spec.get("prefix") or name)
            if prefix in self.rewards:
                raise ValueError(f"multi reward: two components use the prefix {prefix!r}; set 'prefix' to tell them apart")
            weight = float(spec.get("weight", 1.0))
            if not weight >= 0:
                raise ValueError(f"multi reward: components[{i}] ({prefix}) has weight {weight}; weights must be >= 0")
            try:
                self.rewards[prefix] = load(name, **dict(spec.get("kwargs") or {}))
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
