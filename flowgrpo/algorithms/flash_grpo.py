"""Flash-GRPO (arXiv 2605.15980): iso-temporal single SDE step per prompt, temporal gradient rectification.

* **Iso-temporal grouping.** Per prompt ``p`` draw ``k_p ~ U{0 … K−1}`` (``K = algo.flash.max_step``, default
  the first half of the steps; ``samplers.flash_plan``) from the plan's generator. All ``G`` rollouts of ``p``
  (different initial noise) are ODE everywhere except one SDE step at ``k_p`` (``samplers.single_step_mask``);
  that one transition is stored and trained: one forward+backward per sample per iteration.
* **Advantages** ``(r_i − mean_p)/(std over the whole batch + 1e-4)``, clipped ±5 — ``algo.global_std`` is
  ``true`` in ``conf/algo/flash_grpo.yaml``, as the paper.
* **Rectification.** ``∂ log π/∂v = −λ_k·ξ`` grows with λ_k, so steps with a large λ dominate the gradient;
  each transition is weighted ``w_i = (1/λ_{k_i}) / mean_batch(1/λ_k)`` (``samplers.rectification_weights``, λ of
  the active kernel via ``samplers.kernel_lambda``). The mean runs over every sample of the plan's global batch
  and is fixed at plan time, so neither the split over processes nor micro-batching changes a weight.

``sampler.sde`` (and a MixGRPO window / compression) is ignored: Flash-GRPO places its own SDE step. The
sampler still gives the schedule, kernel, noise level and the ODE solver.
"""

from __future__ import annotations

import torch

from samplers import flash_plan, kernel_lambda, single_step_mask

from .base import Algorithm, RolloutPlan

__all__ = ["FlashGRPO"]


class FlashGRPO(Algorithm):
    """Flash-GRPO. See the module docstring.

    Args:
        base_sigmas: ``[T+1]`` schedule.
        max_step: ``K``; ``None`` = ``max(1, T // 2)``.
        rectify: weight transitions by ``(1/λ)/mean(1/λ)``; else 1.
        global_std: advantages over the batch std (default, as the paper).
        **kwargs: :class:`~flowgrpo.algorithms.base.Algorithm`'s.
    """

    name = "flash_grpo"

    def __init__(self, base_sigmas: torch.Tensor, *, max_step: int | None = None, rectify: bool = True,
                 global_std: bool = True, **kwargs) -> None:
        super().__init__(base_sigmas, global_std=global_std, **kwargs)
        T = self.num_steps
        k_max = max_step if max_step is not None else max(1, T // 2)
        if not 1 <= k_max <= T:
            raise ValueError(f"algo.flash.max_step={k_max} must be in [1, sampler.num_steps={T}]")
        if self.kernel == "cps" and not float(self.base_sigmas[k_max]) > 0:
            raise ValueError(f"algo.flash.max_step={k_max} lets k_p reach the final step into sigma'=0, where the "
                             f"cps kernel has no density: set algo.flash.max_step <= {T - 1}")
        self.max_step = k_max
        self.rectify = bool(rectify)

    @classmethod
    def from_config(cls, algo_cfg, sampler_cfg, base_sigmas, *, window=None) -> "FlashGRPO":
        return cls(base_sigmas, max_step=algo_cfg.flash.max_step, rectify=bool(algo_cfg.flash.rectify),
                   **cls._common_kwargs(algo_cfg, sampler_cfg))

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None) -> RolloutPlan:
        self._check_batch(num_prompts, group_size)
        steps = flash_plan(num_prompts, self.num_steps, max_step=self.max_step, generator=generator)
        mask = single_step_mask(steps, self.num_steps, group_size)
        # The rectification's mean(1/λ) over the whole batch, fixed here: a process that trains a slice of the
        # rows (RolloutPlan.subset) or a micro-batch weights its transitions exactly as one process would.
        inv_lambda_mean = float(self._inv_lambda(self.base_sigmas, steps).mean())
        return self._make_plan(self.base_sigmas, mask, mask.clone(), group_size, flash_steps=steps,
                               inv_lambda_mean=inv_lambda_mean)

    def _inv_lambda(self, sigmas: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return 1.0 / kernel_lambda(sigmas[steps], sigmas[steps + 1], kernel=self.kernel, noise_level=self.noise_level)

    def loss_weights(self, plan: RolloutPlan, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """``w = (1/λ_k) / mean_batch(1/λ)`` at ``(rows, steps)`` (``samplers.rectification_weights`` over the
        plan's whole batch, whatever slice of it ``plan`` and ``rows`` cover); ones without
        ``algo.flash.rectify``."""
        rows, steps = self._check_transitions(plan, rows, steps)
        if not self.rectify:
            return torch.ones(rows.shape, dtype=torch.float32)
        norm = plan.info.get("inv_lambda_mean")
        if norm is None:  # a plan made elsewhere: normalise over its own trained transitions
            norm = float(self._inv_lambda(plan.sigmas, plan.trained_transitions()[1]).mean())
        return self._inv_lambda(plan.sigmas, steps) / norm

    def describe(self) -> str:
        return (f"flash_grpo (Flash-GRPO): one SDE step per prompt, k_p ~ U{{0..{self.max_step - 1}}} of "
                f"{self.num_steps} steps, {self._kernel_text()}, ODE elsewhere ({self.solver}); gradient "
                f"rectification {'on' if self.rectify else 'off'}; {self._adv_text()}")
