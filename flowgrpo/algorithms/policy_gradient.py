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

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """Phase 4: the group advantages, or with ``algo.slas_gamma`` the SLAS-shaped ones."""
        if self.cfg.slas_gamma is None:
            return super().advantages(rewards, group_size)
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
        """Rescore the stored transitions ``(rows, steps)`` with the current weights. With a chunk axis
        (streaming), chunk ``c``'s transitions are rescored under the conditioning it was generated under
        (``batch.chunk_conds[c]``): one velocity call per chunk present."""
        plan = batch.plan
        rows, steps = self._check_transitions(plan, rows, steps)
        if not bool(plan.sde_mask.flatten(1)[rows, steps].all()):
            raise ValueError("a trained transition must be an SDE step (only those have a log-prob)")
        chunks, steps = plan.chunk_step(steps)
        if plan.num_chunks == 1:
            x, x_next = batch.latents[rows, steps], batch.latents[rows, steps + 1]
        else:
            x, x_next = batch.latents[rows, chunks, steps], batch.latents[rows, chunks, steps + 1]
        sigma, sigma_next = plan.sigmas[steps].to(x.device), plan.sigmas[steps + 1].to(x.device)
        if plan.num_chunks == 1:
            cond = batch.cond[rows]
            v = ctx.velocity(x, sigma, cond)
        else:  # each chunk under its own conditioning (the KL term does the same with cond=None)
            cond = None
            v = self._chunked_velocity(ctx, batch, rows, chunks, x, sigma)
        out = sde_step(v, x, sigma, sigma_next, kernel=plan.kernel, noise_level=plan.noise_level, prev_sample=x_next)
        return out, v, (x, sigma, sigma_next, cond, rows, steps, chunks)

    @staticmethod
    def _chunked_velocity(ctx: UpdateContext, batch: Batch, rows, chunks, x, sigma) -> torch.Tensor:
        v = None
        for c in chunks.unique().tolist():
            sel = (chunks == c).nonzero().squeeze(1)
            part = ctx.velocity(x[sel], sigma[sel], batch.chunk_conds[c][rows[sel]])
            if v is None:
                v = part.new_empty(x.shape)
            v[sel] = part
        return v

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
        step, v, (x, sigma, sigma_next, cond, rows, steps, chunks) = self._transition(ctx, batch, rows, steps)
        numel = x[0].numel()
        log_prob, old, weights = self.ratio_terms(batch, step, rows, flat)
        loss, info = ppo_clip_loss(log_prob, old, batch.advantages[rows], clip_range=cfg.clip_range,
                                   weights=weights.to(x.device))
        if cfg.kl_beta > 0:
            with torch.no_grad(), ctx.reference():
                v_ref = (ctx.velocity(x, sigma, cond) if cond is not None
                         else self._chunked_velocity(ctx, batch, rows, chunks, x, sigma))
            kl = sde_kl(v, v_ref, sigma, sigma_next, kernel=batch.plan.kernel, noise_level=batch.plan.noise_level)
            if cfg.logprob_reduction == "mean":
                kl = kl / numel
            loss = loss + cfg.kl_beta * kl.mean()
            info["kl"] = kl.mean().detach()
        return loss, info
