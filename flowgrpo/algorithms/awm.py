"""AWM, Advantage Weighted Matching (arXiv 2509.25050): the pretraining flow-matching loss on the policy's own clean
samples, weighted by their advantages.

The paper shows that likelihood-ratio GRPO on diffusion models is a noisy-target denoising score matching; AWM keeps
the pretraining objective instead and moves it with the reward. The rollout is any sampler's (here the sampler's
ODE: no SDE step, no log-prob, as DiffusionNFT); only each sample's clean final latent ``x₀`` and its reward are kept.
The update re-noises ``x₀`` with fresh ``ε`` to ``algo.train_timesteps`` noise levels of the sampler's grid, one drawn
uniformly in each of that many strata of the grid indices ``[lo, ⌊T·algo.timestep_fraction⌋)`` (``lo`` = 1 with
``algo.skip_first``: σ = 1 is never trained), and per trained ``(sample, σ)``:

* ``ℓ = mean_d (v_θ(x_σ) − (ε − x₀))²``, the flow-matching error;
* a weighting ``w(ℓ, σ)`` (``algo.weighting``): ``uniform`` ℓ, ``t`` σℓ, ``t2`` σ²ℓ, ``huber`` σ(√(ℓ+10⁻¹⁰) − 10⁻⁵),
  ``ghuber`` σ((ℓ+10⁻¹⁰)^p − 10⁻¹⁰ᵖ)/p with ``p = algo.ghuber_power`` (the default: its gradient is
  ``σ(ℓ+10⁻¹⁰)^{p−1}∇ℓ``, which lowers the weight of samples the model already fits badly);
* the policy term ``−Â·exp(−w − sg(−w))``, ``Â = clip(A, ±adv_clip)/adv_clip·algo.advantage_max``: its value is
  ``−Â`` and its gradient ``Â·∇w``, i.e. positively rewarded samples are fitted, negatively rewarded ones pushed
  away. The authors' PPO form compares with ``sg`` of the current value, so its ratio is always 1 and the clip never
  acts (their README says so); we write the term without a clip for that reason;
* ``L = mean(policy) + algo.kl_beta·mean‖v_θ − v_ref‖² + algo.ema_kl_beta·mean‖v_θ − v_ema‖²``.

With advantages summing to zero and ``uniform`` weighting the policy term is linear in ``v_θ`` and unbounded below, so
the regression to ``v_ema`` — a slow copy of the trained weights, moved after every iteration as
``θ_ema ← d·θ_ema + (1−d)·θ`` with ``d = min(algo.ema_kl_decay, 0.001·u)`` at update count ``u`` — is what keeps
the update in a trust region (the authors' "KL to an EMA, as TRPO"). Defaults are the authors' SD3 GenEval
configuration (``scxue/advantage_weighted_matching``, ``config/dgx_awm.py``): 6 stratified levels over 90 % of the
grid, σ = 1 skipped, ``ghuber`` with ``p = 0.25``, ``kl_beta 0.001``, ``ema_kl_beta 1``, decay cap 0.3, advantages
with the batch std, clipped at ±5 and scaled to ±1. Departure: the strata are drawn per sample rather than once per
micro-batch (the same expectation, less correlated across samples). The authors' SA-Solver rollout with a noise
window is not reproduced: the rollout is the sampler's ODE.

Guidance. The authors sample and train without classifier-free guidance. With a model that samples with guidance
(``model.guidance_scale`` > 1) the rollout keeps it, and the loss fits the *conditional* velocity
(``algo.cfg_in_training=false``, the default): flow matching is the conditional velocity's objective, and fitting the
guided velocity to ``ε − x₀`` instead pulls it back towards the unguided data distribution (on the embedded world
that run did not learn at all: held-out strict 0.227 → 0.223 after 50 iterations, against 0.43 after 25 without).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import AlgoConfig
from ..knobs import knob
from .base import Algorithm, Batch, UpdateContext
from .losses import add_velocity_kl, keyed_noise, renoise
from .old_policy import OldPolicy

__all__ = ["AWMConfig", "AWM", "awm_weight", "awm_objective", "scaled_advantages", "stratified_levels", "ema_decay"]

WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")


@dataclass
class AWMConfig(AlgoConfig):
    """``algo=awm``: the authors' SD3 GenEval defaults."""

    global_std: bool = True  # (r - mean_prompt) / std over the whole batch, as the authors' global_std
    cfg_in_training: bool = False  # fit the conditional velocity (the authors train without CFG); rollouts keep CFG
    kl_beta: float = knob(0.001, ge=0)  # weight of mean (v_theta - v_ref)^2, the reference = LoRA disabled
    ema_kl_beta: float = knob(1.0, ge=0)  # weight of mean (v_theta - v_ema)^2 (the trust region)
    ema_kl_decay: float = knob(0.3, ge=0, le=0.999)  # cap of the EMA decay d = min(cap, 0.001 u)
    train_timesteps: int = knob(6, ge=1)  # noise levels trained per sample, one per stratum
    timestep_fraction: float = knob(0.9, gt=0, le=1)  # strata cover grid indices [lo, int(T * f))
    skip_first: bool = True  # lo = 1: sigma = 1 is never trained (the authors' discrete_wo_init)
    weighting: str = knob("ghuber", choices=WEIGHTINGS)  # w(l, sigma) in the policy term
    ghuber_power: float = knob(0.25, gt=0)  # p of the ghuber weighting
    advantage_max: float = knob(1.0, gt=0)  # clipped advantages scaled to [-advantage_max, advantage_max]


def awm_weight(loss: torch.Tensor, sigma: torch.Tensor, weighting: str, power: float = 0.25) -> torch.Tensor:
    """``w(ℓ, σ)`` per sample (float64 as the authors compute it); the policy log-likelihood surrogate is ``−w``."""
    loss, sigma = loss.double(), sigma.double()
    if weighting == "uniform":
        return loss
    if weighting == "t":
        return sigma * loss
    if weighting == "t2":
        return sigma**2 * loss
    if weighting == "huber":
        return sigma * (torch.sqrt(loss + 1e-10) - 1e-5)
    if weighting == "ghuber":
        floor = torch.tensor(1e-10, dtype=torch.float64)
        return sigma * ((loss + 1e-10).pow(power) - floor.pow(power)) / power
    raise ValueError(f"algo.weighting={weighting!r} is not one of {', '.join(WEIGHTINGS)}")


def scaled_advantages(advantages: torch.Tensor, clip: float, advantage_max: float) -> torch.Tensor:
    """``Â = clip(A, ±clip)/clip·advantage_max`` (``algo.adv_clip``, ``algo.advantage_max``)."""
    return advantages.float().clamp(-clip, clip) / clip * advantage_max


def awm_objective(v: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor, advantages: torch.Tensor, cfg,
                  v_ema: torch.Tensor | None = None,
                  v_ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """AWM's loss over ``B`` trained items (a sample at one noise level; a block of a stream at its own): the
    advantage-weighted policy term ``mean(−Â·exp(w − sg(w)))`` with ``w = awm_weight(ℓ, σ)``,
    ``ℓ = mean_d (v − target)²``, plus ``cfg.ema_kl_beta·mean‖v − v_ema‖²`` and ``cfg.kl_beta·mean‖v − v_ref‖²``
    when those velocities are given. ``v``, ``target`` ``[B, ...]``; ``sigma``, ``advantages`` (already
    :func:`scaled_advantages`) ``[B]``; ``cfg`` has ``weighting``, ``ghuber_power``, ``ema_kl_beta``, ``kl_beta``."""
    fm = _sq_mean(v.double() - target.double())
    w = awm_weight(fm, sigma, cfg.weighting, cfg.ghuber_power)
    adv = advantages.to(fm.device).double()
    ratio = torch.exp(w.detach() - w)  # exp(log-likelihood surrogate − its stop-gradient): 1, with ∇ = −∇w
    loss = (-adv * ratio).mean().float()
    info: dict[str, Any] = {"policy_loss": loss.detach(), "fm_loss": fm.detach().mean().float(),
                            "weighted_fm": w.detach().mean().float()}
    if v_ema is not None:
        loss = add_velocity_kl(loss, info, v, v_ema, cfg.ema_kl_beta, key="ema_kl")
    if v_ref is not None:
        loss = add_velocity_kl(loss, info, v, v_ref, cfg.kl_beta)
    return loss, info


def stratified_levels(num_steps: int, count: int, fraction: float, skip_first: bool, rows: int,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """``LongTensor[rows, count]``: per row one grid index drawn uniformly in each of ``count`` strata of
    ``[lo, ⌊num_steps·fraction⌋)`` (boundaries ``linspace(lo, ⌊T·f⌋, count+1)`` floored, as the authors'; a stratum
    narrower than one index gives its lower bound)."""
    lo, hi = (1 if skip_first else 0), int(num_steps * fraction)
    if hi - lo < count:
        raise ValueError(f"algo.train_timesteps={count} levels do not fit in grid indices [{lo}, {hi}) of "
                         f"sampler.num_steps={num_steps} (algo.timestep_fraction={fraction:g}, "
                         f"algo.skip_first={skip_first}): lower algo.train_timesteps or raise sampler.num_steps")
    bounds = torch.linspace(lo, hi, count + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    u = torch.rand(rows, count, generator=generator)
    return lower + (u * (upper - lower)).long()


def ema_decay(updates: int, cap: float) -> float:
    """``d = min(cap, 0.001·updates)`` of the EMA the policy is regressed to (the authors' linear schedule)."""
    return min(cap, 0.001 * updates)


class EMATrustRegion:
    """AWM's trust-region centre ``θ_ema`` (``self.ema``, an :class:`OldPolicy` the algorithm makes): moved after
    every iteration and kept in checkpoints. Mixed into :class:`AWM` and streaming AWM."""

    def end_iteration(self, ctx: UpdateContext | None = None) -> None:
        """``θ_ema ← d·θ_ema + (1−d)·θ``, ``d`` = :func:`ema_decay` at ``ctx.updates``."""
        if ctx is None:
            return
        self.ema.move(ctx.params, keep=ema_decay(int(ctx.updates), self.cfg.ema_kl_decay))

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state.get("ema"))


class AWM(EMATrustRegion, Algorithm):
    """Advantage Weighted Matching. See the module docstring.

    Args:
        base_sigmas: ``[T+1]`` schedule (the sampler's grid; its first ``T`` points are the training noise levels).
        **kwargs: the sampler's kernel / noise level / solver (only the solver is used: the rollout is an ODE) and
            fields of :class:`AWMConfig`.
    """

    name = "awm"
    config_class = AWMConfig

    def __init__(self, base_sigmas: torch.Tensor, **kwargs) -> None:
        super().__init__(base_sigmas, **kwargs)
        cfg = self.cfg
        stratified_levels(self.num_steps, cfg.train_timesteps, cfg.timestep_fraction, cfg.skip_first, 0)  # checks
        self.ema = OldPolicy()  # θ_ema, the trust-region centre

    @classmethod
    def check_config(cls, algo_cfg, sampler_cfg) -> list[str]:
        lo, hi = (1 if algo_cfg.skip_first else 0), int(sampler_cfg.num_steps * algo_cfg.timestep_fraction)
        if hi - lo < algo_cfg.train_timesteps:
            return [f"algo.train_timesteps={algo_cfg.train_timesteps} noise levels do not fit in grid indices "
                    f"[{lo}, {hi}) of sampler.num_steps={sampler_cfg.num_steps}: lower algo.train_timesteps or raise "
                    "sampler.num_steps / algo.timestep_fraction"]
        return []

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None):
        rows = self._check_batch(num_prompts, group_size)
        cfg = self.cfg
        levels = stratified_levels(self.num_steps, cfg.train_timesteps, cfg.timestep_fraction, cfg.skip_first, rows,
                                   generator)
        train = torch.zeros(rows, self.num_steps, dtype=torch.bool)
        train[torch.arange(rows).unsqueeze(1), levels] = True  # strata are >= 1 index wide: distinct levels
        return self._make_plan(self.base_sigmas, torch.zeros_like(train), train, group_size)

    def trained_steps(self) -> tuple[int, str]:
        cfg = self.cfg
        lo, hi = (1 if cfg.skip_first else 0), int(self.num_steps * cfg.timestep_fraction)
        return cfg.train_timesteps, (f"algo=awm: {cfg.train_timesteps} noise levels per sample, one per stratum of "
                                     f"grid indices [{lo}, {hi}) (algo.train_timesteps, algo.timestep_fraction), "
                                     "re-noised from the clean sample")

    def policy_advantages(self, advantages: torch.Tensor) -> torch.Tensor:
        """``Â = clip(A, ±adv_clip)/adv_clip·advantage_max``."""
        return scaled_advantages(advantages, self.cfg.adv_clip, self.cfg.advantage_max)

    def loss(self, ctx: UpdateContext, batch: Batch, rows: torch.Tensor,
             steps: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        plan = batch.plan
        rows, steps = self._check_transitions(plan, rows, steps)
        x0 = batch.latents[rows, -1]
        sigma = plan.sigmas[steps].to(x0.device)
        # fresh noise per (sample, noise level), keyed by the global row: the same on any number of processes and
        # after a resume
        eps = keyed_noise(x0, (ctx.generator(int(batch.global_rows[r]), int(s))
                               for r, s in zip(rows.tolist(), steps.tolist())))
        x_t, _ = renoise(x0, sigma, eps)
        cond = batch.cond[rows]
        # the EMA's and the reference's velocities first: swapping the EMA weights in changes the parameters in place
        v_ema = v_ref = None
        with torch.no_grad():
            if cfg.ema_kl_beta > 0:
                with self.ema.swapped_in(ctx.params):
                    v_ema = ctx.velocity(x_t, sigma, cond)
            if cfg.kl_beta > 0:
                with ctx.reference():
                    v_ref = ctx.velocity(x_t, sigma, cond)
        v = ctx.velocity(x_t, sigma, cond)
        return awm_objective(v, eps - x0, sigma, self.policy_advantages(batch.advantages[rows]), cfg, v_ema, v_ref)

    def describe(self) -> str:
        cfg = self.cfg
        return (f"awm (Advantage Weighted Matching): ODE rollouts ({self.solver}, {self.num_steps} steps); trains "
                f"{cfg.train_timesteps} stratified noise levels per sample, {cfg.weighting} weighting, EMA trust "
                f"region {cfg.ema_kl_beta:g} (decay cap {cfg.ema_kl_decay:g}), KL weight {cfg.kl_beta:g}; "
                f"{self._adv_text()}, scaled to ±{cfg.advantage_max:g}")


def _sq_mean(x: torch.Tensor) -> torch.Tensor:
    """Per-sample mean of ``x²`` over the non-batch dims."""
    return x.pow(2).mean(dim=tuple(range(1, x.ndim)))
