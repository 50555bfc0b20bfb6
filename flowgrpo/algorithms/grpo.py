"""Flow-GRPO (arXiv 2505.05470) and DanceGRPO (arXiv 2505.07818): SDE on every step, GRPO on the trajectory.

Every step of the rollout is stochastic (``sampler.sde=all``; kernel and noise level from the sampler:
``flow_grpo``, ``dance`` or ``cps`` — a CPS step into σ' = 0 has no density and stays ODE). The trajectory's
group advantage is broadcast to every trained step.

``algo.timestep_fraction = f < 1`` trains ``max(1, ⌊f·n⌋)`` of a sample's ``n`` SDE steps (the anchors'
``int(num_steps · timestep_fraction)``). Which ones: a uniform random subset drawn per sample from the plan's
generator — DanceGRPO's per-sample ``randperm`` over the timesteps. Flow-GRPO's current trainer has the same
code with the permutation commented out to ``arange``, i.e. it trains the *first* ``⌊f·T⌋`` steps (its 0.99
default drops just the final step); ``algo.timestep_selection=first`` (``GRPO(selection="first")``) reproduces that.
"""

from __future__ import annotations

import torch

from .base import Algorithm, RolloutPlan
from .schedule import SELECTIONS, sde_steps, select_trained, trained_step_count

__all__ = ["GRPO"]


class GRPO(Algorithm):
    """Full-trajectory GRPO (Flow-GRPO / DanceGRPO). See the module docstring.

    Args:
        base_sigmas: ``[T+1]`` schedule.
        selection: which steps ``timestep_fraction < 1`` trains: ``"random"`` per sample (default, DanceGRPO)
            or ``"first"`` (Flow-GRPO's trainer).
        **kwargs: :class:`~flowgrpo.algorithms.base.Algorithm`'s (kernel, noise level, solver, advantage knobs,
            ``timestep_fraction``).
    """

    name = "grpo"

    def __init__(self, base_sigmas: torch.Tensor, *, selection: str = "random", **kwargs) -> None:
        super().__init__(base_sigmas, **kwargs)
        if selection not in SELECTIONS:
            raise ValueError(f"timestep selection {selection!r} is not one of {', '.join(SELECTIONS)}")
        self.selection = selection
        self.steps = sde_steps("all", self.base_sigmas, self.kernel)
        if not bool(self.steps.any()):
            raise ValueError(f"sampler.num_steps={self.num_steps} leaves no stochastic step for the "
                             f"{self.kernel} kernel (its step into sigma'=0 is ODE): raise sampler.num_steps")

    @classmethod
    def from_config(cls, algo_cfg, sampler_cfg, base_sigmas, *, window=None) -> "GRPO":
        if sampler_cfg.sde != "all":
            raise ValueError(
                f"algo=grpo (Flow-GRPO / DanceGRPO) makes every step stochastic but sampler.sde="
                f"{sampler_cfg.sde!r}: use sampler=sde, sampler=dance or sampler=cps (sampler.sde=all); for the "
                "MixGRPO window use algo=mix_grpo, for one SDE step per prompt algo=flash_grpo"
            )
        return cls(base_sigmas, selection=algo_cfg.timestep_selection, **cls._common_kwargs(algo_cfg, sampler_cfg))

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None) -> RolloutPlan:
        rows = self._check_batch(num_prompts, group_size)
        sde = self.steps.expand(rows, -1).clone()
        train = select_trained(sde, self.timestep_fraction, selection=self.selection, generator=generator)
        return self._make_plan(self.base_sigmas, sde, train, group_size)

    def describe(self) -> str:
        n = int(self.steps.sum())
        k = trained_step_count(n, self.timestep_fraction)
        trained = f"all {n}" if k == n else f"{k} ({self.selection}) of the {n}"
        return (f"grpo (Flow-GRPO / DanceGRPO): SDE on {n} of {self.num_steps} steps, {self._kernel_text()}; "
                f"trains {trained} SDE steps per sample; {self._adv_text()}")
