r"""Streaming AWM: Advantage Weighted Matching (arXiv 2509.25050) on a streaming video model, one teacher-forced
forward per stream.

The rollout is streaming GRPO's (:mod:`~flowgrpo.algorithms.stream_grpo`): ``G`` streams per prompt sequence from the
model's own few-step sampler, block by block against the KV cache, each whole stream scored by the reward. Nothing of
the sampler's steps is kept for the update but every block's clean result ``x₀_k`` (what the stream committed to its
cache) and the stream's advantage.

The update is AWM's advantage-weighted flow-matching loss (:func:`~flowgrpo.algorithms.awm.awm_objective`), with the
block as the trained item. Per stream and inner epoch, each of its ``K`` blocks is re-noised with fresh ``ε`` to its
own level ``σ_k``: one level drawn in each of ``K`` equal-probability strata of the training distribution of noise
levels, assigned to the blocks in a random order, so every forward covers the whole range. That distribution is
the pretraining's: ``u = sigmoid(N(algo.logit_mean, algo.logit_std²))`` shifted as the model's steps,
``σ = s·u/(1 + (s − 1)·u)`` with ``s = algo.shift`` (null: the model's own ``model.stream.shift``, read off the
block schedule). With ``algo.group_noise`` the ``G`` streams of a group draw the same levels and noise (common
random numbers): the loss's gradient then differs between members only through their clean blocks, and the part
that depends on the draw alone, the same for every member, cancels against the group's zero-mean advantages
instead of adding noise to every update. All ``K`` noisy blocks are then denoised in **one forward** over
``[the stream's clean blocks; its noisy blocks]`` under the teacher-forcing mask of
:func:`~flowgrpo.models.causal_wan.teacher_forcing_mask`
(``UpdateContext.teacher_forced_velocity``, ``StreamAdapter.teacher_forced_velocity``): each noisy block attends
to itself and to the clean frames the stream's cache held for it (sink and window as the model streams; after a
re-cache at a prompt switch, the window re-written under the new prompt), each frame under its own segment's
prompt, so block ``k``'s velocity is the one the cached stream computes for it at ``σ_k`` (the tests check this
to float rounding). Per block ``k``:

* ``ℓ_k = mean_d (v_θ(x_{σ_k}) − (ε_k − x₀_k))²`` and the weighting ``w(ℓ_k, σ_k)`` of ``algo.weighting``;
* the policy term ``−Â_k·exp(w_k − sg(w_k))``; ``Â_k`` is the stream's advantage (``algo.advantage=stream``) or
  the advantage of block ``k``'s segment (``algo.advantage=segment``: per segment, the mean of the reward's
  ``segment<j>/<name>`` components named by ``algo.segment_components``, group-normalised with the group's std;
  each process holds whole groups), or their sum (``algo.advantage=stream+segment``: the whole stream's outcome
  and the block's own segment's, so the components only the whole stream has, identity and anti-freeze, still
  weigh), clipped and scaled as AWM's;
* ``L = mean_k(policy) + algo.ema_kl_beta·mean‖v_θ − v_ema‖² + algo.kl_beta·mean‖v_θ − v_ref‖²``, the velocities
  of the EMA trust region (AWM's, moved after every iteration) and of the reference (LoRA disabled) computed by the
  same teacher-forced forward.

The gradient also flows through the clean context, whose keys and values the same weights compute (as when the
model was pretrained by teacher forcing); the cached stream's context is the no-grad write pass of the same
function. No classifier-free guidance in the update: the loss fits the conditional velocity. With a model that
samples with guidance (``model.guidance_scale`` > 1) the rollout keeps it and the update still fits the conditional
velocity, as AWM's ``algo.cfg_in_training=false``.

The forward-process, clip-wise update of a streaming model on its own rollouts over a rolling KV cache is also the
idea of Astrolabe (arXiv 2603.17051).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from ..advantages import group_advantages
from ..config import AlgoConfig
from ..knobs import knob
from .awm import WEIGHTINGS, EMATrustRegion, awm_objective, scaled_advantages
from .base import Algorithm, Batch, Scores, UpdateContext
from .losses import keyed_noise, renoise
from .old_policy import OldPolicy

__all__ = ["AWMUpdateConfig", "StreamAWMConfig", "StreamAWM", "StreamingTrustRegion", "stratified_sigmas", "sigma_cdf", "schedule_shift", "segment_advantages"]

ADVANTAGES = ("stream", "segment", "stream+segment")


@dataclass
class AWMUpdateConfig(AlgoConfig):
    """The knobs of streaming AWM's update, the one schema of every algorithm that trains with it
    (``algo=stream_awm``, ``algo=kvpo_awm``): AWM's defaults (the authors' SD3 GenEval configuration) where they
    apply."""

    cfg_in_training: bool = False  # must stay false: the teacher-forced update fits the conditional velocity
    kl_beta: float = knob(0.001, ge=0)  # weight of mean (v_theta - v_ref)^2, the reference = LoRA disabled
    ema_kl_beta: float = knob(1.0, ge=0)  # weight of mean (v_theta - v_ema)^2 (the trust region)
    ema_kl_decay: float = knob(0.3, ge=0, le=0.999)  # cap of the EMA decay d = min(cap, 0.001 u)
    weighting: str = knob("ghuber", choices=WEIGHTINGS)  # w(l, sigma) in the policy term, per block
    ghuber_power: float = knob(0.25, gt=0)  # p of the ghuber weighting
    advantage_max: float = knob(1.0, gt=0)  # clipped advantages scaled to [-advantage_max, advantage_max]
    logit_mean: float = 0.0  # noise levels: u = sigmoid(N(logit_mean, logit_std^2)), as the pretraining draws them
    logit_std: float = knob(1.0, gt=0)  # std of that normal
    shift: Optional[float] = knob(None, gt=0)  # sigma = s·u/(1+(s-1)·u); null = the model's model.stream.shift
    # true: the members of a group are re-noised with the same levels and noise (common random numbers: the part of
    # the loss's gradient that depends only on the draw is then the same for every member, and cancels where the
    # group's advantages sum to zero); false: every member draws its own
    group_noise: bool = False


@dataclass
class StreamAWMConfig(AWMUpdateConfig):
    """``algo=stream_awm``: streaming AWM's update (``AWMUpdateConfig``) on independent streams, with AWM's
    batch-std advantages."""

    global_std: bool = True  # stream advantages: (r - mean_prompt) / std over the whole batch, as AWM
    # stream: every block the stream's; segment: its segment's; stream+segment: the sum of the two
    advantage: str = knob("stream", choices=ADVANTAGES)
    # advantage=segment / stream+segment: a segment's reward is the mean of these segment<k>/<name> components
    segment_components: List[str] = field(default_factory=lambda: ["adherence", "direction", "speed"])


def schedule_shift(base_sigmas: torch.Tensor) -> float:
    """The static shift ``s`` of a streaming model's block schedule ``[σ_0, …, σ_{S−1}, 0]``
    (``samplers.stream_sigmas``: ``σ_j = s·b_j/(1 + (s − 1)·b_j)``, ``b_j = 1 − j/S``), from ``σ_1``."""
    steps = base_sigmas.shape[0] - 1
    if steps < 2:
        raise ValueError("a one-step block schedule does not show its shift: set algo.shift (model.stream.shift)")
    b, s1 = 1.0 - 1.0 / steps, float(base_sigmas[1])
    return s1 * (1.0 - b) / (b * (1.0 - s1))


def stratified_sigmas(count: int, *, shift: float, logit_mean: float = 0.0, logit_std: float = 1.0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """``[count]`` float32 noise levels, one drawn in each of ``count`` equal-probability strata of the distribution
    ``σ = s·u/(1 + (s − 1)·u)``, ``u = sigmoid(N(logit_mean, logit_std²))`` (by its inverse CDF), in a random
    order (one ``rand`` of ``count``, then one ``randperm``, from ``generator``)."""
    p = (torch.arange(count, dtype=torch.float64) + torch.rand(count, generator=generator, dtype=torch.float64))
    p = (p / count).clamp(1e-12, 1 - 1e-12)
    u = torch.sigmoid(logit_mean + logit_std * torch.special.ndtri(p))
    sigma = shift * u / (1 + (shift - 1) * u)
    return sigma[torch.randperm(count, generator=generator)].float()


def sigma_cdf(sigma: torch.Tensor, *, shift: float, logit_mean: float = 0.0, logit_std: float = 1.0) -> torch.Tensor:
    """The distribution function of :func:`stratified_sigmas`' distribution at ``sigma`` (its stratum is
    ``⌊count·cdf⌋``)."""
    s = sigma.double()
    u = s / (shift - (shift - 1) * s)
    return torch.special.ndtr((torch.logit(u) - logit_mean) / logit_std)


def segment_advantages(components: dict[str, torch.Tensor], segments: torch.Tensor, group_size: int,
                       names: List[str], clip: float) -> torch.Tensor:
    """``[n, P]``: per row and segment ``j`` (``P`` the most segments of a row in ``segments`` ``[n, K]``, the
    segment of each block), the group advantage of the segment's reward, the mean of the components
    ``segment<j>/<name>`` over ``names``. Within a group (``group_size`` consecutive rows), a component counts
    for segment ``j`` when it is finite for every member (``recovery`` has no value for the first segment);
    normalised with the group's std, clipped at ``±clip``. A segment no block of the group has gets 0."""
    n = segments.shape[0]
    P = int(segments.max()) + 1
    comps = {k: v.detach().double().cpu() for k, v in components.items()}
    out = torch.zeros(n, P, dtype=torch.float32)
    for j in range(P):
        keys = [f"segment{j}/{c}" for c in names]
        if not any(k in comps for k in keys):
            raise KeyError(f"algo.advantage=segment: the reward returns none of {keys} (per-segment components such "
                           f"as reward=long_video's segment<k>/<name>; algo.segment_components={list(names)}); it "
                           f"returns {sorted(comps)}")
        for start in range(0, n, group_size):
            rows = slice(start, start + group_size)
            if not bool((segments[rows] == j).any()):
                continue
            values = [comps[k][rows] for k in keys if k in comps and bool(torch.isfinite(comps[k][rows]).all())]
            if not values:
                raise ValueError(f"algo.advantage=segment: none of {keys} is finite for rows {start}-"
                                 f"{start + group_size - 1}, whose blocks include segment {j}")
            reward = torch.stack(values).mean(0)
            out[rows, j] = group_advantages(reward, group_size, global_std=False, clip=clip)
    return out


class StreamingTrustRegion(EMATrustRegion):
    """What every teacher-forced streaming update shares (streaming AWM, KVPO's branches trained by it): the noise
    levels' shift read off the model's block schedule (or ``algo.shift``), the EMA trust-region centre, and the
    config checks that go with them."""

    def __init__(self, base_sigmas: torch.Tensor, **kwargs) -> None:
        super().__init__(base_sigmas, **kwargs)
        self.time_shift = float(self.cfg.shift) if self.cfg.shift is not None else schedule_shift(self.base_sigmas)
        self.ema = OldPolicy()  # θ_ema, the trust-region centre

    @classmethod
    def check_config(cls, algo_cfg, sampler_cfg) -> list[str]:
        errors = super().check_config(algo_cfg, sampler_cfg)
        if algo_cfg.cfg_in_training:
            errors.append(f"algo.cfg_in_training=true: the teacher-forced update of algo={cls.name} fits the "
                          "conditional velocity (no guidance); set algo.cfg_in_training=false")
        if algo_cfg.shift is None and sampler_cfg.num_steps < 2:
            errors.append("algo.shift=null reads the model's shift off its block schedule, which one step "
                          "(sampler.num_steps=1) does not show: set algo.shift to model.stream.shift")
        return errors


class StreamAWM(StreamingTrustRegion, Algorithm):
    """Streaming AWM (see the module docstring).

    Args:
        base_sigmas: ``[S+1]`` a block's schedule (``StreamAdapter.sigmas``: the model's few-step list, then 0).
        chunks: ``K``, the blocks of a stream.
        **kwargs: the sampler's kernel (``cps``) / noise level / solver and fields of :class:`StreamAWMConfig`.
    """

    name = "stream_awm"
    config_class = StreamAWMConfig
    streaming = True

    @classmethod
    def check_config(cls, algo_cfg, sampler_cfg) -> list[str]:
        errors = []
        if sampler_cfg.kernel != "cps":
            errors.append(f"algo=stream_awm rolls out with the streaming sampler, the cps kernel: "
                          f"sampler.kernel={sampler_cfg.kernel!r} must be 'cps' (sampler=stream)")
        return errors + super().check_config(algo_cfg, sampler_cfg)

    # ------------------------------------------------------------------------------------------ phase 1
    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None):
        """Streaming GRPO's rollout (every re-noise step of every block through the cps kernel); one trained item
        per stream, its flat step 0: the update's one teacher-forced forward over all its blocks."""
        rows = self._check_batch(num_prompts, group_size)
        K, S = self.num_chunks, self.num_steps
        sde = (self.base_sigmas[1:] > 0).expand(rows, K, S).clone()  # the re-noise steps, as algo=stream_grpo
        train = torch.zeros(rows, K, S, dtype=torch.bool)
        train[:, 0, 0] = True
        return self._make_plan(self.base_sigmas, sde, train, group_size)

    def trained_steps(self) -> tuple[int, str]:
        return 1, (f"algo=stream_awm: one teacher-forced forward per stream over its {self.num_chunks} blocks, each "
                   f"re-noised to its own stratified noise level")

    # ------------------------------------------------------------------------------------------ phase 4
    def advantages(self, scores: Scores) -> torch.Tensor:
        """Per-segment group advantages (``algo.advantage=segment`` or ``stream+segment``, from this process's
        whole groups) are kept in ``batch.extras`` for the loss. ``segment`` returns each stream's mean of them over
        its blocks (the stream's logged advantage), gathered; ``stream`` and ``stream+segment`` the stream
        advantages of the gathered rewards."""
        if self.cfg.advantage == "stream":
            return super().advantages(scores)
        batch = scores.batch
        segments = batch.cond.segments.cpu()
        per_segment = segment_advantages(batch.components, segments, batch.plan.group_size,
                                         list(self.cfg.segment_components), self.cfg.adv_clip)
        batch.extras["segment_advantages"] = per_segment
        if self.cfg.advantage == "segment":
            return scores.gather(per_segment.gather(1, segments).mean(1))
        return super().advantages(scores)

    def block_advantages(self, batch: Batch, rows: torch.Tensor) -> torch.Tensor:
        """``[b, K]`` each block's advantage before scaling: its stream's, its segment's, or their sum."""
        stream = batch.advantages[rows].detach().float().cpu().unsqueeze(1).expand(len(rows), self.num_chunks)
        if self.cfg.advantage == "stream":
            return stream
        per_segment = batch.extras["segment_advantages"][rows].gather(1, batch.cond.segments[rows].cpu())
        return per_segment if self.cfg.advantage == "segment" else stream + per_segment

    # ------------------------------------------------------------------------------------------ phase 5
    def block_sigmas(self, generator: torch.Generator) -> torch.Tensor:
        cfg = self.cfg
        return stratified_sigmas(self.num_chunks, shift=self.time_shift, logit_mean=cfg.logit_mean,
                                 logit_std=cfg.logit_std, generator=generator)

    def loss(self, ctx: UpdateContext, batch: Batch, rows: torch.Tensor,
             steps: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        rows, steps = self._check_transitions(batch.plan, rows, steps)
        x0 = batch.latents[rows, :, -1]                                   # [b, K, C, F, h, w] the committed blocks
        b, K = x0.shape[:2]
        # per stream one generator keyed by its global row (algo.group_noise: by its group): its levels, then its
        # noise (any number of processes, and after a resume, draw the same)
        G = batch.plan.group_size
        gens = [ctx.generator(int(batch.global_rows[r]) // G, 1) if cfg.group_noise
                else ctx.generator(int(batch.global_rows[r])) for r in rows.tolist()]
        sigma = torch.stack([self.block_sigmas(g) for g in gens]).to(x0.device)          # [b, K]
        eps = keyed_noise(x0, gens)
        x_t, _ = renoise(x0.flatten(0, 1), sigma.flatten(), eps.flatten(0, 1))
        x_t = x_t.view_as(x0)
        cond = batch.cond[rows]
        v_ema = v_ref = None
        with torch.no_grad():  # first: swapping the EMA weights in changes the parameters in place
            if cfg.ema_kl_beta > 0:
                with self.ema.swapped_in(ctx.params):
                    v_ema = ctx.teacher_forced_velocity(x0, x_t, sigma, cond).flatten(0, 1)
            if cfg.kl_beta > 0:
                with ctx.reference():
                    v_ref = ctx.teacher_forced_velocity(x0, x_t, sigma, cond).flatten(0, 1)
        v = ctx.teacher_forced_velocity(x0, x_t, sigma, cond).flatten(0, 1)
        adv = scaled_advantages(self.block_advantages(batch, rows), cfg.adv_clip, cfg.advantage_max).flatten()
        loss, info = awm_objective(v, (eps - x0).flatten(0, 1), sigma.flatten(), adv, cfg, v_ema, v_ref)
        info["sigma_mean"] = sigma.mean().detach()
        return loss, info

    def describe(self) -> str:
        cfg = self.cfg
        seg = "per-segment advantages (" + ", ".join(cfg.segment_components) + ")"
        adv = {"stream": self._adv_text(), "segment": seg,
               "stream+segment": f"{self._adv_text()} plus {seg}"}[cfg.advantage]
        return (f"stream_awm (streaming AWM): {self.num_chunks} blocks × {self.num_steps} steps rolled out with "
                f"{self._kernel_text()}; one teacher-forced forward per stream, {self.num_chunks} stratified noise "
                f"levels (shift {self.time_shift:g}), {cfg.weighting} weighting, EMA trust region "
                f"{cfg.ema_kl_beta:g} (decay cap {cfg.ema_kl_decay:g}), KL weight {cfg.kl_beta:g}; {adv}, "
                f"scaled to ±{cfg.advantage_max:g}")

