"""Flash-GRPO (arXiv 2605.15980): iso-temporal single SDE step per prompt, temporal gradient rectification.

* **Iso-temporal grouping.** Per prompt ``p`` draw ``k_p ~ U{0 … K−1}`` (``K = algo.max_step``, default
  the first half of the steps; ``samplers.flash_plan``) from the plan's generator. All ``G`` rollouts of ``p``
  (different initial noise) are ODE everywhere except one SDE step at ``k_p`` (``samplers.single_step_mask``);
  that one transition is stored and trained: one forward+backward per sample per iteration.
* **Advantages** ``(r_i − mean_p)/(std over the whole batch + 1e-4)``, clipped ±5 — ``algo.global_std`` is
  on by default, as the paper.
* **Rectification.** ``∂ log π/∂v = −λ_k·ξ`` grows with λ_k, so steps with a large λ dominate the gradient;
  each transition is weighted ``w_i = (1/λ_{k_i}) / mean_batch(1/λ_k)`` (``samplers.rectification_weights``, λ of
  the active kernel via ``samplers.kernel_lambda``). The mean runs over every sample of the plan's global batch
  and is fixed at plan time, so neither the split over processes nor micro-batching changes a weight.

Flash-GRPO places its own SDE step; the sampler gives the schedule, kernel, noise level and the ODE solver.

**Cheaper rollouts** (ours; neither changes the trained transition's distribution). With ``algo.shared_noise`` a
group's members are identical up to ``k_p``, so the rollout integrates that ODE prefix once per prompt. With
``algo.compress_ratio < 1`` the ODE steps after ``k_p`` only have to reach a decodable sample: they run on
``max(1, ⌊n·ratio⌋)`` steps uniform in σ (``samplers.compress_tail``, the MixGRPO-Flash tail, per prompt since
``k_p`` is), best with ``sampler.solver=dpm++2m``. ``experiment=flash_grpo_fast`` turns both on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from samplers import flash_plan, kernel_lambda, single_step_mask

from ..knobs import knob
from .base import RolloutPlan
from .policy_gradient import PolicyGradient, PolicyGradientConfig

__all__ = ["FlashGRPOConfig", "FlashGRPO"]


@dataclass
class FlashGRPOConfig(PolicyGradientConfig):
    """``algo=flash_grpo``: the paper's defaults."""

    clip_range: float = knob(1e-3, gt=0)  # Flash-GRPO's epsilon (per-element mean log-prob)
    global_std: bool = True  # (r - mean_prompt) / std over the whole batch
    max_step: Optional[int] = knob(None, ge=1)  # K: k_p ~ U{0..K-1}; null = the first half of sampler.num_steps
    rectify: bool = True  # weight each transition by (1/lambda_k)/mean(1/lambda): equal gradient scale across steps
    compress_ratio: float = knob(1.0, gt=0, le=1)  # < 1: the ODE steps after k_p on max(1, floor(n*ratio)) steps (sampler.solver)


class FlashGRPO(PolicyGradient):
    """Flash-GRPO. See the module docstring.

    Args:
        base_sigmas: ``[T+1]`` schedule.
        **kwargs: the sampler's kernel / noise level / solver, and fields of :class:`FlashGRPOConfig`
            (``max_step``: ``K``, ``None`` = ``max(1, T // 2)``; ``rectify``).
    """

    name = "flash_grpo"
    config_class = FlashGRPOConfig

    def __init__(self, base_sigmas: torch.Tensor, **kwargs) -> None:
        super().__init__(base_sigmas, **kwargs)
        T = self.num_steps
        k_max = self.cfg.max_step if self.cfg.max_step is not None else max(1, T // 2)
        if not 1 <= k_max <= T:
            raise ValueError(f"algo.max_step={k_max} must be in [1, sampler.num_steps={T}]")
        if self.kernel == "cps" and not float(self.base_sigmas[k_max]) > 0:
            raise ValueError(f"algo.max_step={k_max} lets k_p reach the final step into sigma'=0, where the "
                             f"cps kernel has no density: set algo.max_step <= {T - 1}")
        self.max_step = k_max

    @classmethod
    def check_config(cls, algo_cfg, sampler_cfg) -> list[str]:
        if algo_cfg.max_step is not None and algo_cfg.max_step > sampler_cfg.num_steps:
            return [f"algo.max_step={algo_cfg.max_step} exceeds sampler.num_steps={sampler_cfg.num_steps}"]
        return []

    def trained_steps(self) -> tuple[int, str]:
        return 1, "algo=flash_grpo: one SDE step k_p per prompt"

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None) -> RolloutPlan:
        self._check_batch(num_prompts, group_size)
        steps = flash_plan(num_prompts, self.num_steps, max_step=self.max_step, generator=generator)
        mask = single_step_mask(steps, self.num_steps, group_size)
        # The rectification's mean(1/λ) over the whole batch, fixed here: a process that trains a slice of the
        # rows (RolloutPlan.subset) or a micro-batch weights its transitions exactly as one process would.
        inv_lambda_mean = float(self._inv_lambda(self.base_sigmas, steps).mean())
        return self._make_plan(self.base_sigmas, mask, mask.clone(), group_size, flash_steps=steps,
                               inv_lambda_mean=inv_lambda_mean, tail_ratio=self.cfg.compress_ratio)

    def _inv_lambda(self, sigmas: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return 1.0 / kernel_lambda(sigmas[steps], sigmas[steps + 1], kernel=self.kernel, noise_level=self.noise_level)

    def loss_weights(self, plan: RolloutPlan, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """``w = (1/λ_k) / mean_batch(1/λ)`` at ``(rows, steps)`` (``samplers.rectification_weights`` over the
        plan's whole batch, whatever slice of it ``plan`` and ``rows`` cover); ones without
        ``algo.rectify``."""
        rows, steps = self._check_transitions(plan, rows, steps)
        if not self.cfg.rectify:
            return torch.ones(rows.shape, dtype=torch.float32)
        norm = plan.info.get("inv_lambda_mean")
        if norm is None:  # a plan made elsewhere: normalise over its own trained transitions
            norm = float(self._inv_lambda(plan.sigmas, plan.trained_transitions()[1]).mean())
        return self._inv_lambda(plan.sigmas, steps) / norm

    def describe(self) -> str:
        tail = f", the steps after it compressed ×{self.cfg.compress_ratio:g}" if self.cfg.compress_ratio < 1 else ""
        return (f"flash_grpo (Flash-GRPO): one SDE step per prompt, k_p ~ U{{0..{self.max_step - 1}}} of "
                f"{self.num_steps} steps{tail}, {self._kernel_text()}, ODE elsewhere ({self.solver}); gradient "
                f"rectification {'on' if self.cfg.rectify else 'off'}; {self._adv_text()}")
