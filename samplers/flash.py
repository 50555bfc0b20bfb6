"""Flash-GRPO's single-step plan and temporal gradient rectification (arXiv 2605.15980).

Iso-temporal grouping: per prompt ``p`` draw ``k_p ~ U{0 … K−1}`` (``K`` defaults to the first half of the
steps); all ``G`` rollouts of ``p`` are ODE everywhere but one SDE step at ``k_p``. Since
``∂ log π/∂v = −λ_k·ξ`` (see :func:`samplers.kernel_lambda`), steps with large ``λ`` dominate the gradient;
weighting each sample's loss by ``w_i = (1/λ_{k_i}) / mean_batch(1/λ_k)`` rectifies that.
"""

from __future__ import annotations

import torch

from .steps import kernel_lambda

__all__ = ["flash_plan", "single_step_mask", "rectification_weights"]


def flash_plan(
    num_prompts: int,
    num_steps: int,
    *,
    max_step: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw the single SDE step ``k_p`` of each prompt uniformly from ``{0, …, K−1}``, ``K = max_step`` or
    ``num_steps // 2`` (at least 1). Returns ``LongTensor[num_prompts]``."""
    k_max = max_step if max_step is not None else max(1, num_steps // 2)
    if not 1 <= k_max <= num_steps:
        raise ValueError(f"max_step={k_max} must be in [1, num_steps={num_steps}]")
    return torch.randint(0, k_max, (num_prompts,), generator=generator)


def single_step_mask(steps: torch.Tensor, num_steps: int, group_size: int = 1) -> torch.Tensor:
    """Bool ``[P·G, T]``: row ``p·G + g`` is True only at ``steps[p]`` (group members are consecutive)."""
    steps = torch.as_tensor(steps, dtype=torch.long)
    per_sample = steps.repeat_interleave(group_size)
    mask = torch.zeros(per_sample.shape[0], num_steps, dtype=torch.bool)
    mask[torch.arange(per_sample.shape[0]), per_sample] = True
    return mask


def rectification_weights(
    sigmas: torch.Tensor,
    steps: torch.Tensor,
    *,
    kernel: str = "flow_grpo",
    noise_level: float = 0.7,
) -> torch.Tensor:
    """``w_i = (1/λ_{k_i}) / mean_i(1/λ_{k_i})`` for per-sample trained steps ``k_i`` (float32 ``[N]``).
    λ is computed from the active kernel, never hard-coded."""
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32)
    steps = torch.as_tensor(steps, dtype=torch.long)
    lam = kernel_lambda(sigmas[steps], sigmas[steps + 1], kernel=kernel, noise_level=noise_level)
    inv = 1.0 / lam
    return inv / inv.mean()
