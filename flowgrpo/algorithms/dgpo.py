"""DGPO, Direct Group Preference Optimization (arXiv 2510.08425): DPO between the better and the worse half of a
group, with a Diffusion-DPO implicit reward; no likelihood and no stochastic step.

The objective is ``log σ(R_θ(G⁺) − R_θ(G⁻))``: a group's well-rewarded samples should become more likely, relative to
a reference, than its badly rewarded ones. With the flow-matching error as the implicit log-likelihood, and the
group advantages ``A_i`` (per-prompt mean, group std) as the signed weights of the two halves, the group's
preference margin is

    ℓ_i   = mean_d (v_θ(x_σ,i) − (ε_g − x₀,i))²          ε_g one fresh noise for the whole group at this σ
    z_g   = (β_dpo / G) · Σ_{i∈g} A_i · (ℓ_i − ℓ_ref,i)     (no gradient)
    L     = mean_i σ(z_g) · A_i · ℓ_i  +  kl_beta · mean ‖v_θ − v_ref‖²

whose gradient is that of ``−log σ(−z_g)`` divided by ``β_dpo`` (and scaled by ``G`` over the micro-batch size): each
group is weighted by how much it still gets its preference wrong, ``σ(z_g)`` (½ at the reference). ``ℓ_ref`` is the
reference's error (LoRA disabled), or with ``algo.use_ema_ref`` the error of a slow copy of the trained weights.

The rollout is the sampler's ODE (the authors': noise level 0); only each sample's clean ``x₀`` and reward are kept.
The update trains ``algo.train_timesteps`` distinct noise levels drawn from the first ``algo.trunc_steps + 1`` of the
grid (the high-noise end), the same for every sample of the batch, every member of a group at the same level with
the same noise in the same micro-batch (``Needs.whole_groups``: the trainer keeps groups whole; the per-process micro-batch
must be a multiple of the group size). The authors' "DSM clip": with ``algo.clip_dsm``, a sample whose
``ρ = exp(ℓ_ema − ℓ_θ)`` left ``[1 − ε, 1 + ε]`` in its advantage's direction (``A > 0, ρ > 1 + ε`` or
``A ≤ 0, ρ < 1 − ε``; ``ε = algo.clip_range``) stops contributing a gradient through ``ℓ_θ``; ``ℓ_ema`` is the error of
the slow copy ``θ_ema ← d·θ_ema + (1 − d)·θ`` moved after every optimizer update, ``d = min(0.3, 0.001·u)``.

Defaults: the authors' SD3.5-M GenEval configuration (``Luo-Yihong/DGPO``, ``config/dgpo.py``): 4 of the first 5
levels of a 10-step grid, ``beta_dpo 100``, ``clip_range 1e-2`` with the DSM clip, ``kl_beta 0.02``, group std,
advantages clipped at ±5; training without classifier-free guidance (``algo.cfg_in_training=false``) while the
rollout samples with the model's guidance. Not reproduced: their switch of the sampling weights to the slow copy after
500 updates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..config import AlgoConfig
from ..knobs import knob
from .base import Algorithm, Batch, Needs, UpdateContext
from .losses import add_velocity_kl, keyed_noise, renoise, sq_mean
from .old_policy import OldPolicy

__all__ = ["DGPOConfig", "DGPO", "dgpo_policy_loss", "dsm_clip_mask"]


@dataclass
class DGPOConfig(AlgoConfig):
    """``algo=dgpo``: the authors' SD3.5-M GenEval defaults."""

    kl_beta: float = knob(0.02, ge=0)  # weight of mean (v_theta - v_ref)^2 (the authors' train.beta)
    cfg_in_training: bool = False  # the authors train without classifier-free guidance
    beta_dpo: float = knob(100.0, gt=0)  # scale of the group's preference margin z_g
    train_timesteps: int = knob(4, ge=1)  # distinct noise levels trained per sample (the same for the batch)
    trunc_steps: int = knob(4, ge=0)  # levels are drawn from grid indices 0 .. trunc_steps (high noise)
    clip_dsm: bool = True  # the DSM clip against the slow copy
    clip_range: float = knob(1e-2, gt=0)  # its epsilon
    use_ema_ref: bool = False  # the slow copy as the DPO reference instead of the LoRA-disabled model
    ema_decay_cap: float = knob(0.3, ge=0, le=0.999)  # the slow copy's decay d = min(cap, 0.001 u)


def dgpo_policy_loss(loss: torch.Tensor, ref_loss: torch.Tensor, advantages: torch.Tensor, group_size: int,
                     beta_dpo: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean_i σ(z_g)·A_i·ℓ_i, z)`` for rows in whole groups (consecutive, ``group_size`` each).

    Args:
        loss: ``[b]`` flow-matching errors ``ℓ_i`` (carry the gradient).
        ref_loss: ``[b]`` the reference's ``ℓ_ref,i``.
        advantages: ``[b]`` the group advantages ``A_i``.
    """
    b = loss.shape[0]
    if b % group_size:
        raise ValueError(f"DGPO needs whole groups: {b} rows are not groups of {group_size}")
    adv = advantages.to(loss.dtype)
    with torch.no_grad():
        z = (adv * beta_dpo * (loss - ref_loss) / group_size).view(-1, group_size).sum(dim=1)
    weight = torch.sigmoid(z).repeat_interleave(group_size)
    return (weight * adv * loss).mean(), z


def dsm_clip_mask(loss: torch.Tensor, old_loss: torch.Tensor, advantages: torch.Tensor,
                  clip_range: float) -> torch.Tensor:
    """Where the DSM clip stops the gradient: ``ρ = exp(ℓ_old − ℓ)`` beyond ``1 + ε`` for ``A > 0``, below
    ``1 − ε`` for ``A ≤ 0``."""
    ratio = torch.exp(old_loss.detach() - loss.detach())
    return torch.where(advantages > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)


class DGPO(Algorithm):
    """DGPO. See the module docstring.

    Args:
        base_sigmas: ``[T+1]`` schedule (the sampler's grid).
        **kwargs: the sampler's kernel / noise level / solver (only the solver is used: the rollout is an ODE) and
            fields of :class:`DGPOConfig`.
    """

    name = "dgpo"
    config_class = DGPOConfig

    @classmethod
    def declare_needs(cls, algo_cfg) -> Needs:
        """Whole groups at one trained step; the reference's velocity for the DPO margin (unless the slow copy
        stands in, ``algo.use_ema_ref``) and for the KL term."""
        return dataclasses.replace(super().declare_needs(algo_cfg), whole_groups=True,
                                   reference=not algo_cfg.use_ema_ref or algo_cfg.kl_beta > 0)

    def __init__(self, base_sigmas: torch.Tensor, **kwargs) -> None:
        super().__init__(base_sigmas, **kwargs)
        errors = self.check_config(self.cfg, None, num_steps=self.num_steps)
        if errors:
            raise ValueError(errors[0])
        self.ema = OldPolicy()  # the slow copy (DSM clip, optional reference)
        self._moved_at = 0  # optimizer updates the slow copy has followed

    @classmethod
    def check_config(cls, algo_cfg, sampler_cfg, num_steps: int | None = None) -> list[str]:
        steps = num_steps if num_steps is not None else sampler_cfg.num_steps
        levels = min(algo_cfg.trunc_steps + 1, steps)
        if algo_cfg.train_timesteps > levels:
            return [f"algo.train_timesteps={algo_cfg.train_timesteps} distinct noise levels do not fit in the first "
                    f"{levels} of the grid (algo.trunc_steps={algo_cfg.trunc_steps}, sampler.num_steps={steps}): "
                    "lower algo.train_timesteps or raise algo.trunc_steps"]
        return []

    @property
    def uses_ema(self) -> bool:
        return bool(self.cfg.clip_dsm or self.cfg.use_ema_ref)

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None):
        rows = self._check_batch(num_prompts, group_size)
        cfg = self.cfg
        levels = min(cfg.trunc_steps + 1, self.num_steps)
        chosen = torch.randperm(levels, generator=generator)[: cfg.train_timesteps]  # shared by the whole batch
        train = torch.zeros(rows, self.num_steps, dtype=torch.bool)
        train[:, chosen] = True
        return self._make_plan(self.base_sigmas, torch.zeros_like(train), train, group_size)

    def trained_steps(self) -> tuple[int, str]:
        cfg = self.cfg
        levels = min(cfg.trunc_steps + 1, self.num_steps)
        return cfg.train_timesteps, (f"algo=dgpo: {cfg.train_timesteps} of the first {levels} noise levels "
                                     "(algo.train_timesteps, algo.trunc_steps), the same for the batch, re-noised "
                                     "from the clean sample with one noise per group")

    def _follow(self, ctx: UpdateContext) -> None:
        """Move the slow copy once per optimizer update since it last moved (``d = min(cap, 0.001·u)`` at each)."""
        updates = int(ctx.updates)
        self.ema.ensure(ctx.params)
        while self._moved_at < updates:
            self._moved_at += 1
            self.ema.move(ctx.params, keep=min(self.cfg.ema_decay_cap, 0.001 * self._moved_at))

    def loss(self, ctx: UpdateContext, batch: Batch, rows: torch.Tensor,
             steps: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        plan = batch.plan
        G = plan.group_size
        rows, steps = self._check_transitions(plan, rows, steps)
        groups = rows.view(-1, G) if rows.numel() % G == 0 else None
        if groups is None or bool((groups != groups[:, :1] + torch.arange(G)).any()) \
                or bool((groups[:, 0] % G != 0).any()) or bool((steps.view(-1, G) != steps.view(-1, G)[:, :1]).any()):
            raise ValueError("algo=dgpo needs whole groups at one trained step per loss call (the trainer's "
                             "Needs.whole_groups): a micro-batch of trainer.group_size multiples, rows in group order")
        x0 = batch.latents[rows, -1]
        sigma = plan.sigmas[steps].to(x0.device)
        # one noise per (group, noise level), keyed by the global group: the same on any number of processes and
        # after a resume
        group_ids = (batch.global_rows[rows] // G).tolist()[::G]
        eps = keyed_noise(x0, (ctx.generator(g, int(s)) for g, s in zip(group_ids, steps.tolist()[::G])))
        eps = eps.repeat_interleave(G, dim=0)
        x_t, _ = renoise(x0, sigma, eps)
        target = eps - x0
        cond = batch.cond[rows]
        if self.uses_ema:
            self._follow(ctx)
        with torch.no_grad():  # before v_θ: swapping the slow copy in changes the parameters in place
            v_ref = None
            if self.needs.reference:
                with ctx.reference():
                    v_ref = ctx.velocity(x_t, sigma, cond)
            v_ema = None
            if self.uses_ema:
                with self.ema.swapped_in(ctx.params):
                    v_ema = ctx.velocity(x_t, sigma, cond)
        v = ctx.velocity(x_t, sigma, cond)
        fm = sq_mean(target - v)
        adv = batch.advantages[rows].to(x0.device).float().clamp(-cfg.adv_clip, cfg.adv_clip)
        info: dict[str, Any] = {"fm_loss": fm.detach().mean()}
        if cfg.clip_dsm:
            clipped = dsm_clip_mask(fm, sq_mean(target - v_ema), adv, cfg.clip_range)
            fm = torch.where(clipped, fm.detach(), fm)
            info["clip_fraction"] = clipped.float().mean()
        ref_fm = sq_mean(target - (v_ema if cfg.use_ema_ref else v_ref))
        loss, z = dgpo_policy_loss(fm, ref_fm, adv, G, cfg.beta_dpo)
        info.update(policy_loss=loss.detach(), group_weight=torch.sigmoid(z).mean(), margin=z.mean())
        if cfg.kl_beta > 0:
            loss = add_velocity_kl(loss, info, v, v_ref, cfg.kl_beta)
        return loss, info

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "moved_at": self._moved_at}

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state.get("ema"))
        self._moved_at = int(state.get("moved_at", 0))

    def describe(self) -> str:
        cfg = self.cfg
        clip = f"DSM clip {cfg.clip_range:g}" if cfg.clip_dsm else "no DSM clip"
        ref = "the slow copy" if cfg.use_ema_ref else "the reference"
        return (f"dgpo (DGPO): ODE rollouts ({self.solver}, {self.num_steps} steps); trains {cfg.train_timesteps} of "
                f"the first {min(cfg.trunc_steps + 1, self.num_steps)} noise levels, group preference against {ref}, "
                f"beta_dpo={cfg.beta_dpo:g}, {clip}, KL weight {cfg.kl_beta:g}; {self._adv_text()}")
