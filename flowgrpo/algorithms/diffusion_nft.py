"""DiffusionNFT (arXiv 2509.16117): online policy optimisation on the forward process, with no likelihood.

The rollout is a deterministic ODE (the sampler's solver; no SDE step, no log-prob): only each sample's clean
final latent ``x₀`` and its reward are kept. The update re-noises ``x₀`` to noise levels of the sampler's own grid,
``x_σ = (1−σ)·x₀ + σ·ε`` with fresh ``ε`` (``algo.timestep_fraction`` of the ``T`` grid points per sample, drawn
per sample), and regresses two implicit policies built from the trained velocity ``v_θ`` and the old policy's
``v_old``:

* positive ``v⁺ = (1−β)·v_old + β·v_θ``, negative ``v⁻ = (1+β)·v_old − β·v_θ`` (``β`` = ``algo.beta``);
* the reward becomes an optimality probability ``r = clip(A_c / (2·adv_clip) + ½, 0, 1)`` from the group
  advantage ``A`` (per-prompt mean, batch std) clipped to ``A_c ∈ [−adv_clip, adv_clip]``;
* ``L = adv_clip · mean[(r·ℓ(v⁺) + (1−r)·ℓ(v⁻)) / β] + kl_beta · mean‖v_θ − v_ref‖²``.

``ℓ`` (``algo.loss_space``): ``"x0"`` is the authors' code (NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``): the
error of ``x̂₀ = x_σ − σ·v`` against ``x₀``, squared and divided by its own detached mean absolute value
(an adaptive weight, in float64); ``"v"`` is the paper's plain flow-matching loss ``mean (v − (ε − x₀))²``. For the
``"v"`` loss the minimiser at each ``x_σ`` is ``v* = v_old + E[(2r−1)·(v − v_old) | x_σ] / β`` with
``v = ε − x₀``: positively rewarded samples pull the velocity towards them, negatively rewarded ones push it away,
and at ``θ = θ_old`` the gradient is the advantage-weighted flow-matching gradient ``2(2r−1)(v_old − v)``.

The old policy samples the rollouts and is the centre of the implicit policies. It is a copy of the trainable weights,
moved after every iteration as ``θ_old ← η·θ_old + (1−η)·θ`` with ``η`` from ``algo.decay_type`` at the current
optimizer update count ``u`` (the authors' ``return_decay``): ``0`` → 0 (fully on-policy); ``1`` →
``min(0.001·u, 0.5)``; ``2`` → 0 for ``u < 75``, then ``min(0.0075·(u−75), 0.999)``.

Two different betas: ``algo.beta`` mixes the implicit policies; ``algo.kl_beta`` weighs the regression to the
reference (LoRA disabled). Defaults are the authors' SD3.5-M GenEval configuration (``beta 1.0``, ``kl_beta 1e-4``,
``decay_type 1``, 9 of 10 noise levels, advantages with the batch std clipped at ±5). The authors sample and train
without classifier-free guidance; here the trained velocity is the one the rollout samples with
(``algo.cfg_in_training``, on by default): with ``model.guidance_scale`` > 1 the guided velocity is the policy.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..config import AlgoConfig
from ..knobs import knob
from .base import Algorithm, Batch, UpdateContext
from .losses import add_velocity_kl, keyed_noise, renoise, sq_mean
from .old_policy import OldPolicy
from .schedule import select_trained, trained_step_count

__all__ = ["DiffusionNFTConfig", "DiffusionNFT", "old_policy_decay", "optimality_probability"]

ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")


@dataclass
class DiffusionNFTConfig(AlgoConfig):
    """``algo=diffusion_nft``: the authors' defaults (SD3.5-M, GenEval)."""

    global_std: bool = True  # (r - mean_prompt) / std over the whole batch, as the authors' stat tracker
    kl_beta: float = knob(1e-4, ge=0)  # weight of mean (v_theta - v_ref)^2 (the authors' train.beta)
    beta: float = knob(1.0, gt=0)  # mixing of the implicit policies v+- (the authors' beta; 0.1 learns faster, less stable)
    timestep_fraction: float = knob(0.99, gt=0, le=1)  # noise levels trained per sample: int(T * f) of the T grid points
    decay_type: int = knob(1, choices=(0, 1, 2))  # old-policy EMA schedule: 0 on-policy, 1 min(0.001u, 0.5), 2 delayed
    adv_mode: str = knob("all", choices=ADV_MODES)  # reshape the clipped advantage before the map to r
    loss_space: str = knob("x0", choices=("x0", "v"))  # x0: the authors' adaptive-weighted loss; v: the paper's


def old_policy_decay(updates: int, decay_type: int) -> float:
    """``η`` of the old-policy update after ``updates`` optimizer updates (the authors' ``return_decay``)."""
    flat, rate, cap = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[int(decay_type)]
    return 0.0 if updates < flat else min((updates - flat) * rate, cap)


def optimality_probability(advantages: torch.Tensor, adv_clip: float, adv_mode: str = "all") -> torch.Tensor:
    """``r ∈ [0, 1]`` from group advantages: clip to ±``adv_clip``, reshape by ``adv_mode``, map linearly
    (``A = 0`` → ½, ``A = adv_clip`` → 1)."""
    a = advantages.float().clamp(-adv_clip, adv_clip)
    if adv_mode == "positive_only":
        a = a.clamp(0, adv_clip)
    elif adv_mode == "negative_only":
        a = a.clamp(-adv_clip, 0)
    elif adv_mode == "one_only":
        a = (a > 0).float()
    elif adv_mode == "binary":
        a = torch.sign(a)
    elif adv_mode != "all":
        raise ValueError(f"algo.adv_mode={adv_mode!r} is not one of {', '.join(ADV_MODES)}")
    return (a / adv_clip / 2 + 0.5).clamp(0, 1)


class DiffusionNFT(Algorithm):
    """DiffusionNFT. See the module docstring.

    Args:
        base_sigmas: ``[T+1]`` schedule (the sampler's grid: its first ``T`` points are the training noise levels).
        **kwargs: the sampler's kernel / noise level / solver (only the solver is used: the rollout is an ODE) and
            fields of :class:`DiffusionNFTConfig`.
    """

    name = "diffusion_nft"
    config_class = DiffusionNFTConfig

    def __init__(self, base_sigmas: torch.Tensor, **kwargs) -> None:
        super().__init__(base_sigmas, **kwargs)
        self.old = OldPolicy()  # the old policy's copy of the trainable weights

    # ------------------------------------------------------------------------------------------ phases

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None):
        rows = self._check_batch(num_prompts, group_size)
        ode = torch.zeros(rows, self.num_steps, dtype=torch.bool)
        grid = torch.ones(rows, self.num_steps, dtype=torch.bool)
        train = select_trained(grid, self.cfg.timestep_fraction, selection="random", generator=generator)
        return self._make_plan(self.base_sigmas, ode, train, group_size)

    def trained_steps(self) -> tuple[int, str]:
        k = trained_step_count(self.num_steps, self.cfg.timestep_fraction)
        return k, (f"algo=diffusion_nft: {k} of the {self.num_steps} noise levels per sample "
                   f"(algo.timestep_fraction={self.cfg.timestep_fraction:g}), re-noised from the clean sample")

    @contextlib.contextmanager
    def sampling_policy(self, ctx: UpdateContext) -> Iterator[None]:
        """Rollouts sample from the old policy."""
        with self.old.swapped_in(ctx.params):
            yield

    def loss(self, ctx: UpdateContext, batch: Batch, rows: torch.Tensor,
             steps: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        plan = batch.plan
        rows, steps = self._check_transitions(plan, rows, steps)
        x0 = batch.latents[rows, -1]
        sigma = plan.sigmas[steps].to(x0.device)
        # fresh noise per (sample, noise level), from generators keyed by the global row: the same on any number of
        # processes and after a resume
        eps = keyed_noise(x0, (ctx.generator(int(batch.global_rows[r]), int(s))
                               for r, s in zip(rows.tolist(), steps.tolist())))
        x_t, s_ = renoise(x0, sigma, eps)
        cond = batch.cond[rows]
        with torch.no_grad(), self.old.swapped_in(ctx.params):
            v_old = ctx.velocity(x_t, sigma, cond)
        v = ctx.velocity(x_t, sigma, cond)
        r = optimality_probability(batch.advantages[rows], cfg.adv_clip, cfg.adv_mode).to(x0.device)
        v_pos = cfg.beta * v + (1 - cfg.beta) * v_old
        v_neg = (1 + cfg.beta) * v_old - cfg.beta * v
        if cfg.loss_space == "x0":
            loss_pos, loss_neg = _x0_loss(x_t, s_, v_pos, x0), _x0_loss(x_t, s_, v_neg, x0)
        else:
            target = eps - x0
            loss_pos, loss_neg = sq_mean(v_pos - target), sq_mean(v_neg - target)
        per_sample = (r * loss_pos + (1 - r) * loss_neg) / cfg.beta
        loss = cfg.adv_clip * per_sample.mean()
        info: dict[str, Any] = {"policy_loss": loss.detach(), "r_mean": r.mean(),
                                "old_deviation": sq_mean(v.detach() - v_old).mean()}
        if cfg.kl_beta > 0:
            with torch.no_grad(), ctx.reference():
                v_ref = ctx.velocity(x_t, sigma, cond)
            loss = add_velocity_kl(loss, info, v, v_ref, cfg.kl_beta)
        return loss, info

    def end_iteration(self, ctx: UpdateContext | None = None) -> None:
        """``θ_old ← η·θ_old + (1−η)·θ``, ``η`` = :func:`old_policy_decay` at ``ctx.updates``."""
        if ctx is None:
            return
        self.old.move(ctx.params, keep=old_policy_decay(int(ctx.updates), self.cfg.decay_type))

    def state_dict(self) -> dict:
        return {"old": self.old.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.old.load_state_dict(state.get("old"))

    def describe(self) -> str:
        k = self.trained_steps()[0]
        return (f"diffusion_nft (DiffusionNFT): ODE rollouts ({self.solver}, {self.num_steps} steps) from the old "
                f"policy (decay type {self.cfg.decay_type}); trains {k} of {self.num_steps} noise levels per sample, "
                f"beta={self.cfg.beta:g}, {self.cfg.loss_space}-space loss, KL weight {self.cfg.kl_beta:g}; "
                f"{self._adv_text()}")


def _x0_loss(x_t: torch.Tensor, sigma: torch.Tensor, v: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """The authors' adaptive x₀-space loss: ``mean((x̂₀ − x₀)² / sg(mean|x̂₀ − x₀|))`` per sample, the weight in
    float64 and floored at 1e-5."""
    err = (x_t - sigma * v) - x0
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        weight = err.double().abs().mean(dim=dims, keepdim=True).clamp(min=1e-5)
    return (err.pow(2) / weight).mean(dim=dims).float()
