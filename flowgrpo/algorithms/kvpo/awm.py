r"""KVPO's routed branches trained by streaming AWM (``algo=kvpo_awm``, :class:`KVPOAWM`): the ablation that tells
KVPO's exploration apart from its objective.

KVPO (arXiv 2605.14278) changes two things at once against a streaming GRPO: *how it explores* (``G`` branches that
share every noise draw and differ only in the older cached frames their routed blocks attend, scored relative to an
unrouted reference run) and *what it trains* (the TVE surrogate: a softmax over the branches of how well the model
replays each branch under the unrouted context, with PPO's clip and a KL on the branch simplex). This algorithm
keeps the first and swaps the second for the update of streaming AWM (:mod:`~flowgrpo.algorithms.stream_awm`,
AWM = arXiv 2509.25050): with the same branches, the same advantages and the same trained blocks, a difference in
learning is the objective's; against streaming AWM on its own independent streams, it is the exploration's.

* **Rollout, advantages, gallery**: KVPO's (:class:`~flowgrpo.algorithms.kvpo.BranchedRollout`, reference-relative
  fused advantages, ``algo.fork``, ``algo.local_reward``, ``algo.adv_std_floor``, ``algo.advantage_from``,
  ``algo.branch_source``: :class:`BranchingConfig`; with ``branch_source=noise`` the branches and the loss's
  forward are unrouted, the branches differing by their noise in the blocks from the fork), the
  branches streamed with the run's guidance as KVPO streams them. The rollout samples with the trained weights (AWM
  is on-policy; its trust region is the EMA below, not an old policy).
* **Trained blocks**: those KVPO's TVE replays, from each group's fork the routed blocks (``algo.replay_blocks``
  from it when set); the reference runs are not trained (their advantage is 0 by construction, and every block
  before the fork is shared by the whole group).
* **Loss**: per trained block ``k`` of branch ``g``, AWM's advantage-weighted flow matching
  (:func:`~flowgrpo.algorithms.awm.awm_objective`): the clean block re-noised with fresh ``ε`` to a level ``σ_k``
  (streaming AWM's stratified draw over the stream's blocks), ``ℓ = mean (v_θ(x_σ) − (ε − x₀))²`` weighted by
  ``algo.weighting``, the policy term ``−Â_g·exp(w − sg(w))`` with the branch's KVPO advantage scaled to
  ``±algo.advantage_max``, plus the EMA trust region and the KL to the reference.
* **The context the blocks were made with.** The velocity is the teacher-forced forward of streaming AWM
  (``UpdateContext.teacher_forced_velocity``) with each branch's route: a routed block's clean frames (whose keys
  its routed write pass cached) and its noisy copy attend the sink, the branch's older frames and the nearest ones,
  exactly what the routed stream attended; the blocks after them attend the routed blocks' keys as computed under
  that route. So the prediction of a routed block equals the cached, routed stream's at the same ``σ`` and input
  (the tests check it, and that the unrouted mask differs). TVE, by contrast, replays the branch under the
  *unrouted* context: the likelihood of what the branch made under the context the model deploys with.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ...knobs import knob_of
from ..awm import awm_objective, scaled_advantages
from ..base import Batch, UpdateContext
from ..losses import keyed_noise, renoise
from ..stream_awm import AWMUpdateConfig, StreamingTrustRegion, stratified_sigmas
from .algorithm import KVPO, BranchingConfig

__all__ = ["KVPOAWMConfig", "KVPOAWM"]


# adv_clip is restated from BranchingConfig (knob_of): as a field of both parents, the dataclass would take
# AWMUpdateConfig's, the default of every algorithm (tests/test_kvpo.py checks every field's origin)
@dataclass
class KVPOAWMConfig(AWMUpdateConfig, BranchingConfig):
    """``algo=kvpo_awm``: KVPO's branches (``BranchingConfig``, KVPO's defaults) and streaming AWM's update
    (``AWMUpdateConfig``, its defaults), which scales KVPO's advantages (clipped at ``adv_clip``) to
    ``±advantage_max``."""

    adv_clip: float = knob_of(BranchingConfig, "adv_clip")  # fused advantages clamped to +-adv_clip


class KVPOAWM(StreamingTrustRegion, KVPO):
    """KVPO's routed branches with streaming AWM's update (see the module docstring).

    Args:
        base_sigmas: ``[S+1]`` a block's schedule (``StreamAdapter.sigmas``).
        **kwargs: the sampler's kernel (``cps``) / noise level / solver, ``chunks`` and fields of
            :class:`KVPOAWMConfig`.
    """

    name = "kvpo_awm"
    config_class = KVPOAWMConfig
    streaming = True

    def rollout_guidance(self) -> bool:
        """The branches stream with the run's guidance, as KVPO's do (the teacher-forced loss fits the conditional
        velocity whatever the rollout sampled with, as streaming AWM's)."""
        return True

    def trained_steps(self) -> tuple[int, str]:
        return 1, ("algo=kvpo_awm: one teacher-forced forward per routed branch (its routes applied), AWM's loss on "
                   "the blocks from its fork (the reference run of each group is the baseline, not trained)")

    @contextlib.contextmanager
    def sampling_policy(self, ctx: UpdateContext) -> Iterator[None]:
        """Rollouts stream with the trained weights (AWM is on-policy)."""
        yield

    def loss(self, ctx: UpdateContext, batch: Batch, rows: torch.Tensor,
             steps: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        rows, steps = self._check_transitions(batch.plan, rows, steps)
        G1 = batch.plan.group_size
        # the streamed branches; the reference runs (and rows a group with fewer branches did not stream) weigh nothing
        rows = rows[torch.tensor([int(r) % G1 < self.group_branches(batch, int(r) // G1) for r in rows],
                                 dtype=torch.bool)]
        if not len(rows):
            return sum(p.sum() * 0.0 for p in ctx.params), {}
        x0 = batch.latents[rows, :, -1]                               # [b, K, C, F, h, w] the committed blocks
        K = x0.shape[1]
        gens = [ctx.generator(int(batch.global_rows[r]) // G1, 3) if cfg.group_noise
                else ctx.generator(int(batch.global_rows[r]), 2) for r in rows.tolist()]
        sigma = torch.stack([stratified_sigmas(K, shift=self.time_shift, logit_mean=cfg.logit_mean,
                                               logit_std=cfg.logit_std, generator=g) for g in gens]).to(x0.device)
        eps = keyed_noise(x0, gens)
        x_t = renoise(x0.flatten(0, 1), sigma.flatten(), eps.flatten(0, 1))[0].view_as(x0)
        plans = batch.extras["routing"]
        routes = [self.branch_route(batch, r) for r in rows.tolist()]  # None: a noise branch's unrouted context
        trained = torch.zeros(len(rows), K, dtype=torch.bool)        # the blocks KVPO's TVE replays
        for i, r in enumerate(rows.tolist()):
            fork = int(batch.extras["fork_block"][r])
            trained[i, fork:fork + (cfg.replay_blocks or plans[r // G1].blocks)] = True
        trained = trained.to(x0.device)
        cond = batch.cond[rows]

        def velocity():
            return ctx.teacher_forced_velocity(x0, x_t, sigma, cond, routes=routes)[trained]

        v_ema = v_ref = None
        with torch.no_grad():  # first: swapping the EMA weights in changes the parameters in place
            if cfg.ema_kl_beta > 0:
                with self.ema.swapped_in(ctx.params):
                    v_ema = velocity()
            if cfg.kl_beta > 0:
                with ctx.reference():
                    v_ref = velocity()
        v = velocity()
        adv = scaled_advantages(batch.advantages[rows].detach().float(), cfg.adv_clip, cfg.advantage_max)
        adv = adv.to(x0.device)[:, None].expand(len(rows), K)[trained]
        loss, info = awm_objective(v, (eps - x0)[trained], sigma[trained], adv, cfg, v_ema, v_ref)
        info["sigma_mean"] = sigma[trained].mean().detach()
        info["branches_short"] = float(self.short_groups(batch))  # groups of the batch with fewer branches
        return loss, info

    def describe(self) -> str:
        c = self.cfg
        return (f"kvpo_awm (KVPO's routed branches, streaming AWM's update): {self.describe_branches()}, scaled to "
                f"±{c.advantage_max:g}; AWM on the blocks from the fork under each branch's routes, {c.weighting} "
                f"weighting, EMA trust region {c.ema_kl_beta:g} (decay cap {c.ema_kl_decay:g}), KL weight {c.kl_beta:g}")
