"""A ``sampler`` node made concrete: the training and evaluation schedules, the SDE kernel and the ODE solver."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from ..config import validate

__all__ = ["Sampler", "build_sampler"]


@dataclass
class Sampler:
    """A ``sampler`` node made concrete: the schedules, the SDE kernel and the ODE solver.

    Attributes:
        sigmas: ``[T+1]`` schedule of training rollouts (the model scheduler's, unless ``sampler.shift`` is set).
        eval_sigmas: ``[T_eval+1]`` schedule of held-out ODE evaluation.
        kernel, noise_level, solver: as in the config.

    Which steps of a rollout are stochastic and trained is the algorithm's plan
    (``flowgrpo.algorithms.build_algorithm(cfg.algo, cfg.sampler, sampler.sigmas)``).
    """

    sigmas: torch.Tensor
    eval_sigmas: torch.Tensor
    kernel: str
    noise_level: float
    solver: str

    @property
    def num_steps(self) -> int:
        return self.sigmas.shape[0] - 1


def build_sampler(sampler: DictConfig, *, adapter=None, model: DictConfig | None = None) -> Sampler:
    """A :class:`Sampler` from a ``sampler`` node.

    The schedule is the model scheduler's own (``adapter.sigmas`` at ``model``'s size: SD3/Wan static shift,
    FLUX's resolution-dependent μ); without an adapter, or with ``sampler.shift`` set, it is
    ``samplers.flow_sigmas(num_steps, shift)`` (shift 3.0 when unset, SD3's).
    """
    validate(sampler)
    from samplers import flow_sigmas

    def sigmas(steps: int) -> torch.Tensor:
        if sampler.shift is None and adapter is not None:
            size = {} if model is None else {"height": model.height, "width": model.width,
                                             "num_frames": model.num_frames}
            return adapter.sigmas(steps, **size).float().cpu()
        return flow_sigmas(steps, 3.0 if sampler.shift is None else sampler.shift)

    return Sampler(
        sigmas=sigmas(sampler.num_steps),
        eval_sigmas=sigmas(sampler.eval_num_steps),
        kernel=sampler.kernel,
        noise_level=float(sampler.noise_level),
        solver=sampler.solver,
    )
