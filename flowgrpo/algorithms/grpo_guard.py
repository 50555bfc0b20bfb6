"""GRPO-Guard (arXiv 2510.22319): Flow-GRPO with a re-centred ratio and a per-step gradient reweighting.

Why the plain ratio needs a guard. A trained transition ``x → x'`` was drawn as ``x' = μ_old + s·z`` (``z`` standard
normal, ``s`` the kernel's std, which does not depend on the weights). With ``d = μ_θ − μ_old`` the per-element
log-ratio is

    log r = mean(z ⊙ d) / s − mean(d²) / (2 s²)

whose expectation over ``z`` is ``−mean(d²)/(2s²) ≤ 0``: the ratio sits left of 1, more so at low-noise steps (small
``s``), and differently at each step. PPO's upper clip ``1 + ε`` then rarely fires, so over-confident positive
updates pass unclipped. GRPO-Guard's two changes, as this module implements them:

* **ratio normalisation**: ``log r̂ = s·(log r + mean(d²)/(2s²))``, which equals ``mean(z ⊙ (μ_θ − μ_old))``
  exactly: zero-mean in ``z`` and on the same scale at every step. It is computed in that closed form from the
  stored transition (``z = (x' − μ_old)/s``), which is why the rollout keeps each SDE step's mean ``μ_old``
  (``Batch.means``; the algorithm declares ``Needs.record_means``). The bias term keeps its gradient, so
  ``∇log r̂ = mean(z ⊙ ∇μ_θ)``.
* **step reweighting** (``algo.step_reweight``): each transition's clipped surrogate is divided by ``|Δσ|`` of its
  step. As ``∂μ/∂v = −Δσ·(1 + g²(1−σ)/(2σ))`` for the Flow-GRPO kernel, the gradient through ``v_θ`` is then
  ``(1 + g²(1−σ)/(2σ))·mean(z ⊙ ∇v_θ)``: no step dominates because its ``Δσ`` or ``s`` is small (the plain
  Flow-GRPO gradient carries ``√|Δσ|/g``, which blows up where the noise is small).

Everything else — which steps are stochastic and trained, the group advantages, the KL to the reference — is
Flow-GRPO's (:class:`~flowgrpo.algorithms.grpo.GRPO`). With ``algo.logprob_reduction=sum`` the ratio is
``sum(z ⊙ d)`` (the exact-density scale) instead of the per-element mean. Authors' code is not public; this follows
the paper and agrees with the open implementations in Flow-Factory and verl-omni (which keep the bias attached and
divide by ``|Δσ|``). As the normalised ratio moves by ``O(‖d‖)`` rather than ``O(‖d‖/s)``, the clip range is small;
the default ``1e-4`` on the per-element scale is Flow-Factory's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from samplers import StepOutput

from .base import Batch, Needs
from .grpo import GRPO, GRPOConfig
from .losses import reduce_log_prob

__all__ = ["GRPOGuardConfig", "GRPOGuard", "normalized_log_ratio"]


@dataclass
class GRPOGuardConfig(GRPOConfig):
    """``algo=grpo_guard``: Flow-GRPO's defaults with the normalised ratio and the ``1/|Δσ|`` step weight."""

    step_reweight: bool = True  # divide each transition's surrogate by |sigma' - sigma| of its step (the paper's)


def normalized_log_ratio(mean: torch.Tensor, mean_old: torch.Tensor, prev_sample: torch.Tensor, std: torch.Tensor,
                         reduction: str = "mean") -> torch.Tensor:
    """GRPO-Guard's ``log r̂ = reduce(z ⊙ (μ_θ − μ_old))`` per sample, with ``z = (x' − μ_old)/s``.

    Args:
        mean: ``[B, ...]`` the trained policy's transition mean ``μ_θ`` (carries the gradient).
        mean_old: ``[B, ...]`` the sampling policy's mean, recorded at rollout.
        prev_sample: ``[B, ...]`` the stored next state ``x'``.
        std: ``[B]`` the kernel's std ``s`` of each transition (> 0).
        reduction: ``"mean"`` over the latent elements (the published scale) or ``"sum"``.

    Equals ``s·(log r + reduce(d²)/(2s²))`` with ``log r`` the plain log-ratio on the same scale (``d = μ_θ − μ_old``).
    """
    if not bool((std > 0).all()):
        raise ValueError("GRPO-Guard's ratio needs a stochastic step (std > 0); a deterministic step has no ratio")
    shape = (-1, *([1] * (mean.ndim - 1)))
    z = (prev_sample.float() - mean_old.float()) / std.float().view(shape)
    inner = (z.detach() * (mean.float() - mean_old.float().detach())).flatten(1).sum(1)
    return reduce_log_prob(inner, mean[0].numel(), reduction)


class GRPOGuard(GRPO):
    """Flow-GRPO with GRPO-Guard's normalised ratio and step reweighting. See the module docstring.

    Args:
        base_sigmas: ``[T+1]`` schedule.
        **kwargs: the sampler's kernel / noise level / solver and fields of :class:`GRPOGuardConfig`.
    """

    name = "grpo_guard"
    config_class = GRPOGuardConfig

    @classmethod
    def declare_needs(cls, algo_cfg) -> Needs:  # the normalised ratio reads the rollout's mean of every SDE step
        return dataclasses.replace(super().declare_needs(algo_cfg), record_means=True)

    def ratio_terms(self, batch: Batch, step: StepOutput, rows: torch.Tensor,
                    steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log r̂, 0, w)``: the normalised log-ratio against a zero old log-prob, so PPO's ratio is ``r̂``; ``w`` is
        ``1/|Δσ|`` of each step with ``algo.step_reweight``."""
        if batch.means is None:
            raise ValueError("algo=grpo_guard needs each SDE step's mean from the rollout (Batch.means), which the "
                             "rollout records for it; a batch built by hand must fill it")
        rows, steps = rows.to(batch.means.device), steps.to(batch.means.device)
        mean_old = batch.means[rows, steps]
        if not bool(torch.isfinite(mean_old).all()):
            raise ValueError("Batch.means is NaN at a trained step: the rollout did not record it as an SDE step")
        log_ratio = normalized_log_ratio(step.mean, mean_old, batch.latents[rows, steps + 1], step.std,
                                         self.cfg.logprob_reduction)
        weights = self.loss_weights(batch.plan, rows.cpu(), steps.cpu())
        if self.cfg.step_reweight:
            sig = batch.plan.sigmas
            weights = weights / (sig[steps.cpu()] - sig[steps.cpu() + 1]).abs()
        return log_ratio, torch.zeros_like(log_ratio), weights

    def describe(self) -> str:
        tail = super().describe().split(": ", 1)[1]
        weight = "surrogate / |dsigma| per step" if self.cfg.step_reweight else "no step reweighting"
        return f"grpo_guard (GRPO-Guard): normalised ratio mean(z*(mu_theta - mu_old)), {weight}; {tail}"
