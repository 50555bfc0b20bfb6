"""Flow-GRPO (arXiv 2505.05470) and DanceGRPO (arXiv 2505.07818): SDE on every step, GRPO on the trajectory.

Every step of the rollout is stochastic (kernel and noise level from the sampler: ``sampler=sde`` Flow-GRPO's,
``sampler=dance`` DanceGRPO's, ``sampler=cps`` CPS — whose step into σ' = 0 has no density and stays ODE). The
trajectory's group advantage is broadcast to every trained step.

``algo.timestep_fraction = f < 1`` trains ``max(1, ⌊f·n⌋)`` of a sample's ``n`` SDE steps (the published
trainers' ``int(num_steps · timestep_fraction)``). Which ones (``algo.timestep_selection``): ``random``, a uniform
subset drawn per sample from the plan's generator — DanceGRPO's per-sample ``randperm`` over the timesteps; or
``first``, the noisiest ones — Flow-GRPO's trainer has the same code with the permutation commented out to
``arange``, so it trains the first ``⌊f·T⌋`` steps (its 0.99 default drops just the final step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..knobs import knob
from .policy_gradient import PolicyGradient, PolicyGradientConfig
from .schedule import SELECTIONS, select_trained, trained_step_count

__all__ = ["GRPOConfig", "GRPO", "DanceGRPOConfig", "DanceGRPO"]


@dataclass
class GRPOConfig(PolicyGradientConfig):
    """``algo=grpo``: Flow-GRPO's defaults (its GenEval recipe, per-group std)."""

    kl_beta: float = knob(0.04, ge=0)  # Flow-GRPO's beta (the authors' geneval_sd3 and general_ocr_sd3 configs)
    timestep_fraction: float = knob(1.0, gt=0, le=1)  # fraction of each sample's SDE steps trained (DanceGRPO 0.6)
    timestep_selection: str = knob("random", choices=SELECTIONS)  # random per sample, or first = the noisiest


def trained_fraction(cfg: GRPOConfig, n: int, note: str) -> tuple[int, str]:
    """``(K, note)`` for ``algo.timestep_fraction`` of ``n`` SDE steps (GRPO and MixGRPO's ``trained_steps``)."""
    if cfg.timestep_fraction < 1:
        note += f" × algo.timestep_fraction={cfg.timestep_fraction:g} ({cfg.timestep_selection})"
    return trained_step_count(n, cfg.timestep_fraction), note


def _all_steps(sigmas: torch.Tensor, kernel: str) -> torch.Tensor:
    """Bool ``[T]``: every step stochastic, except a CPS step into σ' = 0 (its std is 0 there: no density)."""
    mask = torch.ones(sigmas.shape[0] - 1, dtype=torch.bool)
    if kernel == "cps":
        mask &= sigmas[1:] > 0
    return mask


class GRPO(PolicyGradient):
    """Full-trajectory GRPO (Flow-GRPO / DanceGRPO). See the module docstring.

    Args:
        base_sigmas: ``[T+1]`` schedule.
        kernel, noise_level, solver: the sampler's.
        **options: fields of :class:`GRPOConfig` (``timestep_fraction``, ``kl_beta``, ...).
    """

    name = "grpo"
    config_class = GRPOConfig

    def __init__(self, base_sigmas: torch.Tensor, **kwargs) -> None:
        super().__init__(base_sigmas, **kwargs)
        self.steps = _all_steps(self.base_sigmas, self.kernel)
        if not bool(self.steps.any()):
            raise ValueError(f"sampler.num_steps={self.num_steps} leaves no stochastic step for the "
                             f"{self.kernel} kernel (its step into sigma'=0 is ODE): raise sampler.num_steps")

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None):
        rows = self._check_batch(num_prompts, group_size)
        sde = self.steps.expand(rows, -1).clone()
        train = select_trained(sde, self.cfg.timestep_fraction, selection=self.cfg.timestep_selection,
                               generator=generator)
        return self._make_plan(self.base_sigmas, sde, train, group_size)

    def trained_steps(self) -> tuple[int, str]:
        n = int(self.steps.sum())
        note = f"sampler.num_steps={self.num_steps}" + (", CPS's final step is ODE" if n < self.num_steps else "")
        return trained_fraction(self.cfg, n, note)

    def describe(self) -> str:
        n = int(self.steps.sum())
        k = self.trained_steps()[0]
        trained = f"all {n}" if k == n else f"{k} ({self.cfg.timestep_selection}) of the {n}"
        return (f"grpo (Flow-GRPO / DanceGRPO): SDE on {n} of {self.num_steps} steps, {self._kernel_text()}; "
                f"trains {trained} SDE steps per sample; {self._adv_text()}")


@dataclass
class DanceGRPOConfig(GRPOConfig):
    """``algo=dance_grpo``: DanceGRPO's defaults (no KL, 60% of the steps, one initial noise per group)."""

    kl_beta: float = knob(0.0, ge=0)  # DanceGRPO trains without a KL term
    timestep_fraction: float = knob(0.6, gt=0, le=1)  # DanceGRPO trains a random 60% of the steps per sample
    shared_noise: bool = True  # one initial noise per group


class DanceGRPO(GRPO):
    """DanceGRPO (arXiv 2505.07818): :class:`GRPO` with its paper's defaults. Its constant-η kernel is the
    sampler's (``sampler=dance``, which ``conf/algo/dance_grpo.yaml`` selects unless a sampler is chosen)."""

    name = "dance_grpo"
    config_class = DanceGRPOConfig

    def describe(self) -> str:
        return "dance_grpo (DanceGRPO)" + super().describe().split(" (Flow-GRPO / DanceGRPO)", 1)[1]
