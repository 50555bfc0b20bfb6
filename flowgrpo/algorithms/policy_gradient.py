"""The update shared by the GRPO family (Flow-GRPO, DanceGRPO, MixGRPO, Flash-GRPO): PPO-clip on the exact
per-step log-probabilities of the stored SDE transitions, plus the KL to the reference policy.

For a trained transition ``x_s → x_{s+1}`` of row ``i``, the update rescores it with the current weights through
the same ``samplers.sde_step`` that sampled it (``prev_sample=``), so with unchanged weights the ratio is exactly 1.
``L = ppo_clip(log π_θ, log π_old, A_i; w) + β·KL(π_θ ‖ π_ref)`` with the SDE kernel's closed-form Gaussian KL
(``samplers.sde_kl``), both on the scale of ``logprob_reduction`` (``losses`` explains the scales).

``algo.slas_gamma = γ`` shapes the advantages of any of them super-linearly (SLAS, arXiv 2605.10937:
:func:`flowgrpo.advantages.slas_advantages`) in place of the group-std normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from samplers import sde_kl, sde_step

from ..advantages import slas_advantages
from ..config import AlgoConfig
from ..knobs import knob
from ..rollout import StoredTransitions
from .base import Algorithm, Batch, RolloutPlan, UpdateContext
from .losses import REDUCTIONS, ppo_clip_loss, reduce_log_prob

__all__ = ["PolicyGradientConfig", "PolicyGradient"]


@dataclass
class PolicyGradientConfig(AlgoConfig):
    """What every PPO-clip algorithm has."""

    clip_range: float = knob(1e-4, gt=0)  # PPO epsilon on the per-step ratio (its scale follows logprob_reduction)
    logprob_reduction: str = knob("mean", choices=REDUCTIONS)  # sum: exact density; mean: per latent element
    # SLAS (arXiv 2605.10937): advantages sign(u)|u|^(1+gamma), u = (r - group mean)/batch std, rescaled to unit
    # RMS; replaces the std normalisation (global_std unused). null = off
    slas_gamma: Optional[float] = knob(None, ge=0)


class PolicyGradient(Algorithm):
    """PPO-clip over stored SDE transitions (no ``name``: a base for the GRPO family, not an algorithm itself).

    Subclasses plan which steps are stochastic and trained, and may weight transitions (:meth:`loss_weights`).
    """

    config_class = PolicyGradientConfig

    def reward_advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """The group advantages, or with ``algo.slas_gamma`` the SLAS-shaped ones."""
        if self.cfg.slas_gamma is None:
            return super().reward_advantages(rewards, group_size)
        return slas_advantages(rewards, group_size, gamma=self.cfg.slas_gamma, clip=self.cfg.adv_clip)

    def _adv_text(self) -> str:
        if self.cfg.slas_gamma is None:
            return super()._adv_text()
        return f"advantage (SLAS, gamma={self.cfg.slas_gamma:g}: batch std, super-linear, clip ±{self.cfg.adv_clip:g})"

    def loss_weights(self, plan: RolloutPlan, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """A float32 weight per trained transition ``(rows[i], steps[i])`` (indices into ``plan``); 1 unless the
        algorithm rectifies (Flash-GRPO)."""
        rows, steps = self._check_transitions(plan, rows, steps)
        return torch.ones(rows.shape, dtype=torch.float32)

    def ratio_terms(self, batch: Batch, step, rows: torch.Tensor,
                    steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log π_θ, log π_old, w)`` of the trained transitions ``(rows, steps)`` (flat step indices) for the
        PPO ratio ``exp(log π_θ − log π_old)``, on the scale of ``algo.logprob_reduction``; ``step`` is their rescoring
        with the current weights (``samplers.sde_step``'s output). GRPO-Guard replaces the ratio here."""
        numel = step.mean[0].numel()
        log_prob = reduce_log_prob(step.log_prob, numel, self.cfg.logprob_reduction)
        old = reduce_log_prob(batch.log_probs.flatten(1)[rows, steps], numel, self.cfg.logprob_reduction)
        return log_prob, old, self.loss_weights(batch.plan, rows, steps)

    def _transition(self, ctx: UpdateContext, batch: Batch, rows: torch.Tensor, steps: torch.Tensor):
        """Rescore the stored transitions ``(rows, steps)`` with the current weights, each under the conditioning it
        was sampled with (:class:`~flowgrpo.rollout.StoredTransitions`, whatever the batch's chunk layout).
        Returns ``(step, v, transitions)``."""
        plan = batch.plan
        rows, steps = self._check_transitions(plan, rows, steps)
        if not bool(plan.sde_mask.flatten(1)[rows, steps].all()):
            raise ValueError("a trained transition must be an SDE step (only those have a log-prob)")
        t = StoredTransitions(batch, rows, steps)
        v = t.velocity(ctx.velocity)
        out = sde_step(v, t.x, t.sigma, t.sigma_next, kernel=plan.kernel, noise_level=plan.noise_level,
                       prev_sample=t.x_next)
        return out, v, t

    @torch.no_grad()
    def transition_log_prob(self, ctx: UpdateContext, batch: Batch, rows: torch.Tensor,
                            steps: torch.Tensor) -> torch.Tensor:
        """``[b]`` exact log π (summed over the latent) of the stored transitions ``(rows, steps)`` under the
        current weights: with unchanged weights it equals ``batch.log_probs[rows, steps]`` bit for bit."""
        return self._transition(ctx, batch, rows, steps)[0].log_prob

    def loss(self, ctx: UpdateContext, batch: Batch, rows: torch.Tensor,
             steps: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        flat = torch.as_tensor(steps, dtype=torch.long).cpu()
        step, v, t = self._transition(ctx, batch, rows, steps)
        rows = t.rows
        numel = t.x[0].numel()
        log_prob, old, weights = self.ratio_terms(batch, step, rows, flat)
        loss, info = ppo_clip_loss(log_prob, old, batch.advantages[rows], clip_range=cfg.clip_range,
                                   weights=weights.to(t.x.device))
        if cfg.kl_beta > 0:
            with torch.no_grad(), ctx.reference():
                v_ref = t.velocity(ctx.velocity)
            kl = sde_kl(v, v_ref, t.sigma, t.sigma_next, kernel=batch.plan.kernel, noise_level=batch.plan.noise_level)
            if cfg.logprob_reduction == "mean":
                kl = kl / numel
            loss = loss + cfg.kl_beta * kl.mean()
            info["kl"] = kl.mean().detach()
        return loss, info
