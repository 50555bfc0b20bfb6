"""KVPO, the algorithm (``algo=kvpo``): its config, its plan, advantages relative to each group's reference run,
and the loss of its update (the TVE replay of each branch under the unrouted context).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Sequence

import torch

from ...config import AlgoConfig
from ...knobs import knob
from ...offload import HostCopy
from ...rollout import Rollout, SamplingModel
from ...runlog import log
from ..base import Algorithm, Batch, GalleryNotes, Scores, UpdateContext
from ..old_policy import OldPolicy
from .objective import branch_log_policy, fuse_advantages, kvpo_loss, reference_relative_advantages, tve_scores
from .routing import FORKS, RoutingPlan, plan_routing, route_fn
from .rollout import BranchedRollout

__all__ = ["BranchingConfig", "KVPOConfig", "KVPO", "LOCAL_REWARDS", "BRANCH_SOURCES", "ADVANTAGE_SOURCES"]

#: ``algo.local_reward``: what the local advantage scores (the fork segment, or the fork's routed frames)
LOCAL_REWARDS = ("segment", "blocks")
#: ``algo.branch_source``: what makes a group's branches differ (routing, the official; or a fresh noise draw)
BRANCH_SOURCES = ("routed", "noise")
#: ``algo.advantage_from``: what each signal's advantage is computed from (one aggregate reward, the official; or
#: every reward component standardised on its own)
ADVANTAGE_SOURCES = ("aggregate", "aspects")


@dataclass
class BranchingConfig(AlgoConfig):
    """What every algorithm training KVPO's routed branches shares (``algo=kvpo``, ``algo=kvpo_awm``): where the
    streams fork, what the branches attend, which blocks are trained and the advantages relative to each group's
    reference run. ``trainer.group_size`` = branches + 1: the last member of each group is the reference (unrouted)
    run. No two branches of a group attend the same frames: a group whose fork's pool holds fewer distinct
    selections streams fewer branches (:meth:`KVPO.group_branches`; counted by the loss info's ``branches_short``)."""

    routed_blocks: int = knob(2, ge=1)  # P consecutive routed blocks from the fork (fewer where a stream has no room)
    # anywhere: any eligible fork (official); after_switch: the first blocks after a prompt switch, whose unrouted
    # window still shows the motion before it; at_switch: a segment's first block
    fork: str = knob("anywhere", choices=FORKS)
    nearest_m: int = knob(1, ge=0)  # frames just before a routed block it keeps attending (official m minus the block)
    outside_window: bool = True  # draw older frames only from outside the fork block's unrouted window
    replay_blocks: int = knob(0, ge=0)  # blocks trained from the fork (replayed for the TVE score); 0 = the routed ones
    w_local: float = knob(1.0, ge=0)  # weight of the fork segment's (local) advantage after std normalisation
    w_global: float = knob(0.5, ge=0)  # weight of the whole stream's (global) advantage after std normalisation
    adv_clip: float = knob(2.5, gt=0)  # fused advantages clamped to +-adv_clip
    # a component's advantage divides by max(std over the group, floor) (reward units): near-ties stay small instead
    # of becoming unit-size advantages; 0 = the official std (its scale is kept by the local/global normalisation)
    adv_std_floor: float = knob(0.0, ge=0)
    # segment: the local reward is the fork segment's segment<s>/<name>; blocks: the reward scored on the fork's
    # routed frames alone (window/<name>; the official scores its fork chunk)
    local_reward: str = knob("segment", choices=LOCAL_REWARDS)
    # aggregate (official: its one continuous reward, HPSv3, per signal): the local signal from the mean of the local
    # components, the global one from the reward's scalar, each relative to the reference run; aspects: every local
    # and global component relative to it and standardised on its own, then summed
    advantage_from: str = knob("aggregate", choices=ADVANTAGE_SOURCES)
    local_components: List[str] = field(default_factory=lambda: ["adherence", "direction", "speed"])  # the local reward's components (segment<s>/<name> or window/<name>)
    global_components: List[str] = field(default_factory=lambda: [
        "adherence", "direction", "speed", "identity", "teleport", "smoothness", "recovery", "anti_freeze"])  # the whole stream's reward components (advantage_from=aspects)
    # routed (official): branches share every noise draw and differ in the older frames their routed blocks attend;
    # noise (a control): the same fork and the same blocks regenerated after it, every branch attending the
    # unrouted context, each with a fresh noise draw in the blocks routing would act on
    branch_source: str = knob("routed", choices=BRANCH_SOURCES)
    branch_batch: int = knob(0, ge=0)  # branches streamed / replayed together (each holds a KV cache); 0 = all


@dataclass
class KVPOConfig(BranchingConfig):
    """``algo=kvpo``: the official defaults where they carry over to a small model (the routing geometry follows the
    model: ``n = window − block − nearest_m`` older frames per branch); the branches as ``BranchingConfig``, trained
    by the TVE policy on the branch simplex."""

    grad_steps: int = knob(2, ge=1)  # per replayed block, the first steps that carry the gradient (official 2)
    sigma_floor: float = knob(1.0, ge=0)  # TVE weights 1/(2·max(sigma, floor)^2): the official 1 weighs steps equally
    clip_low: float = knob(0.1, gt=0, le=0.99)  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = knob(0.2, gt=0)  # the asymmetric upper clip
    kl_beta: float = knob(10.0, ge=0)  # weight of the discrete KL(pi_theta || pi_init) on the branch simplex
    old_sync_every: int = knob(2, ge=1)  # the rollout (old) policy takes the trained weights every n iterations


class KVPO(Algorithm):
    """KVPO on a streaming model (the package docstring): the rollout forks each prompt's stream into ``G`` routed
    branches and one reference run sharing every noise draw; the update replays each branch under the unrouted
    context (TVE), and applies PPO on the branch simplex with the KL to the initial policy.

    A group's branches are distinct: with fewer distinct selections than ``G`` in its pool it streams ``G' < G``
    branches, and its advantages, TVE policy and loss run over those ``G'`` (the other rows weigh nothing).
    ``algo.branch_source=noise`` is the control of routing: the same forks and blocks, branches differing by a fresh
    noise draw instead.

    Phases through the contract: :meth:`plan` (the chunk axis and one update unit per row), :meth:`make_rollout`
    (the branched streams, :class:`BranchedRollout`, with the old policy), :meth:`advantages` (relative to each
    group's reference run), :meth:`loss` (per micro-batch: the exact gradient of each group's loss for the branches it
    holds), :meth:`end_iteration` (old-policy sync), :meth:`gallery` (each branch, its policy probability and its
    routed frames). It needs the reference policy only for its KL term (``algo.kl_beta > 0``); the reference runs
    are the last member of each group (:meth:`baseline_members`).
    """

    name = "kvpo"
    config_class = KVPOConfig
    streaming = True

    def __init__(self, base_sigmas: torch.Tensor, **kwargs) -> None:
        super().__init__(base_sigmas, **kwargs)
        self.old = OldPolicy()
        self.iterations_since_sync = 0
        self._cache: dict[tuple, torch.Tensor] = {}
        # π of each branch under the policy of the update's last loss of an iteration, for the gallery: (iteration, [n])
        self._pi: tuple[int, torch.Tensor] | None = None
        self._short_logged: set[tuple[int, int, int]] = set()  # (pool size, n, G) logged once
        if self.cfg.branch_source == "noise" and self.name == "kvpo":
            log.warning("algo.branch_source=noise with algo=kvpo: the noise branches stream under the unrouted "
                        "context, so the TVE replay under the rollout (old) policy reproduces each of them and "
                        "scores 0; the policy gradient on the branch simplex vanishes right after each sync and "
                        "stays as small as the weights' move from the old policy between syncs. The control's "
                        "loss is meaningful with algo=kvpo_awm.")

    @classmethod
    def check_config(cls, algo_cfg, sampler_cfg) -> list[str]:
        if sampler_cfg.kernel != "cps":
            return [f"algo=kvpo samples with the streaming model's own sampler: sampler.kernel={sampler_cfg.kernel!r} "
                    "must be 'cps' (sampler=stream)"]
        return []

    # ------------------------------------------------------------------------------------------ phase 1
    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None):
        rows = self._check_batch(num_prompts, group_size)
        if group_size < 3:
            raise ValueError(f"algo=kvpo needs trainer.group_size >= 3 (at least 2 routed branches + the reference "
                             f"run), got {group_size}")
        K, S = self.num_chunks, self.num_steps
        sde = (self.base_sigmas[1:] > 0).expand(rows, K, S).clone()  # the sampler's re-noise steps (shared noise)
        train = torch.zeros(rows, K, S, dtype=torch.bool)
        train[:, 0, 0] = True  # one update unit per row: its branch (the reference rows weigh nothing)
        return self._make_plan(self.base_sigmas, sde, train, group_size)

    def baseline_members(self, group_size: int) -> torch.Tensor:
        """The last member of each group: the unrouted reference run, the baseline of the group's branches."""
        return torch.arange(group_size) == group_size - 1

    def trained_steps(self) -> tuple[int, str]:
        return 1, ("algo=kvpo: one TVE replay per routed branch (the reference run of each group is the baseline, "
                   "not trained)")

    # ------------------------------------------------------------------------------------------ phase 2
    def routing_plan(self, layout: dict, segments: Sequence[int], *, num_branches: int, seed: int, iteration: int,
                     prompt_index: int) -> RoutingPlan:
        """The routing plan of one stream (``segments``: its segment per block) with ``num_branches`` branches:
        ``algo.routed_blocks`` blocks, or the most a stream's segments leave room for."""
        bf = layout["block_frames"]
        starts = [k * bf for k in range(1, len(segments)) if segments[k] != segments[k - 1]]
        blocks = self.cfg.routed_blocks
        while True:
            try:
                return plan_routing(len(segments) * bf, bf, layout["sink_frames"], layout["window_frames"],
                                    num_branches=num_branches, routed_blocks=blocks, nearest_m=self.cfg.nearest_m,
                                    seed=seed, iteration=iteration, prompt_index=prompt_index,
                                    cache_frames=layout["cache_frames"], recache=layout.get("recache", False),
                                    outside_window=self.cfg.outside_window,
                                    segment_starts=starts, fork=self.cfg.fork)
            except ValueError:
                if blocks == 1:
                    raise
                blocks -= 1

    def note_short(self, plan: RoutingPlan) -> None:
        """Log, once per (pool size, ``n``, ``G``), that a routing plan has fewer branches than asked: its pool holds
        fewer distinct selections of ``n`` frames than ``G`` (:func:`plan_routing`). The group then streams and
        trains those branches only; the loss info counts such groups every iteration (``branches_short``)."""
        if not plan.missing_branches:
            return
        kind = (plan.pool_end - plan.pool_start, plan.num_older, plan.requested_branches)
        if kind in self._short_logged:
            return
        self._short_logged.add(kind)
        log.warning(f"kvpo: a fork at frame {plan.fork_frame} has a pool of {kind[0]} older frames, which holds "
                    f"{plan.num_branches} distinct selections of {kind[1]} frames: its group streams "
                    f"{plan.num_branches} branches instead of trainer.group_size - 1 = {kind[2]} (logged once per "
                    f"pool size; train/branches_short counts the groups)")

    @staticmethod
    def group_branches(batch: Batch, group: int) -> int:
        """How many branches group ``group`` streamed: its first rows (its last is the reference run); fewer than
        ``trainer.group_size - 1`` when its routing plan has fewer distinct selections. The rows between its
        branches and its reference run stream nothing (they hold the reference run) and weigh nothing."""
        G1 = batch.plan.group_size
        active = batch.extras.get("active_branch")
        if active is None:  # a batch made before the rollout recorded it (a stand-in): every branch
            return G1 - 1
        return int(active[group * G1: group * G1 + G1 - 1].sum())

    @staticmethod
    def short_groups(batch: Batch) -> int:
        """Groups of the batch that streamed fewer branches than ``trainer.group_size - 1``."""
        G1 = batch.plan.group_size
        active = batch.extras.get("active_branch")
        if active is None:
            return 0
        return int((active.view(-1, G1)[:, :-1].sum(1) < G1 - 1).sum())

    def branch_route(self, batch: Batch, row: int):
        """The route row ``row``'s blocks were streamed with: its branch's (``algo.branch_source=routed``), else
        ``None`` (the unrouted context: a reference run, or a noise branch)."""
        G1 = batch.plan.group_size
        if row % G1 == G1 - 1 or batch.extras.get("branch_source", "routed") == "noise":
            return None
        return route_fn(batch.extras["routing"][row // G1], row % G1)

    def rollout_guidance(self) -> bool:
        """Whether the branches stream with the run's guidance (else the conditional velocity): the training guidance
        (``Needs.training_guidance``), which the TVE replay must reproduce."""
        return self.needs.training_guidance

    def make_rollout(self, model: SamplingModel, **engine: Any) -> Rollout:
        """Phase 2: the branched streams (:class:`BranchedRollout`), sampled with the old policy."""
        return BranchedRollout(self, model, **engine)

    # ------------------------------------------------------------------------------------------ phase 4
    def advantages(self, scores: Scores) -> torch.Tensor:
        """Each branch's fused local and global advantage relative to its group's reference run (computed on this
        process's whole groups, then gathered); whether any branch beat it is kept for the loss.

        Per group of ``G'`` branches (its streamed ones) and its reference run: with ``algo.advantage_from=aggregate``
        (the official, whose reward is one continuous score) each signal has one reward, the local one the mean of
        the local components, the global one the reward's scalar; with ``aspects`` every component is a reward of
        its own. Each reward gives ``(r_g − r_ref) / std([r_1..r_G', r_ref])`` (summed over a signal's rewards);
        the two signals are fused by :func:`fuse_advantages`.

        The loss is halved when no branch beats the reference run (the official "mechanism_2", arXiv 2605.14278's
        code, ``models/longlive/trainer/kvpo.py``): "beats" compares the *raw* aggregate rewards, a branch's mean
        local component and its scalar reward against the reference run's, on each signal that is trained (weight
        > 0), whatever ``advantage_from`` is; not the standardised signals, whose sign a component's scale can
        flip."""
        batch = scores.batch
        cfg = self.cfg
        G1 = batch.plan.group_size
        G = G1 - 1
        n = len(batch.prompts)
        comps = {k: v.detach().double().cpu() for k, v in batch.components.items()}
        rewards = batch.rewards.detach().double().cpu()
        aspects = cfg.advantage_from == "aspects"
        if aspects:
            missing = [c for c in cfg.global_components if c not in comps]
            if missing:
                raise KeyError(f"algo.global_components names {missing}, which the reward does not return (it "
                               f"returns {sorted(comps)})")
        adv = torch.zeros(n, dtype=torch.float32)
        beats = []
        floor = cfg.adv_std_floor
        weight = {"local": cfg.w_local, "global": cfg.w_global}
        for p in range(n // G1):
            rows = torch.arange(p * G1, (p + 1) * G1)
            branches = self.group_branches(batch, p)
            scored = torch.cat([rows[:branches], rows[G:]])  # its streamed branches, then its reference run
            seg = int(batch.extras["fork_segment"][p * G1])
            local_names = ([f"window/{c}" for c in cfg.local_components] if cfg.local_reward == "blocks"
                           else [f"segment{seg}/{c}" for c in cfg.local_components])
            if cfg.local_components and not any(c in comps for c in local_names):
                raise KeyError(f"algo.local_components: the reward returns none of {local_names} "
                               + ("(the components of the fork's routed frames, which reward=long_video returns for a "
                                  "stream whose metadata names a window)" if cfg.local_reward == "blocks"
                                  else "(per-segment components, as reward=long_video's segment<k>/<name>)"))

            def finite(names):
                return {c: comps[c][scored] for c in names if c in comps and torch.isfinite(comps[c][scored]).all()}

            local_values = finite(local_names)
            raw = {}  # each signal's raw aggregate reward [G' + 1] (the reference run last)
            if local_values:
                raw["local"] = torch.stack(list(local_values.values())).mean(0)
            if torch.isfinite(rewards[scored]).all():
                raw["global"] = rewards[scored]
            per_signal = ({"local": local_values, "global": finite(cfg.global_components)} if aspects
                          else {kind: {kind: values} for kind, values in raw.items()})
            signals, norms = {}, {}
            for kind, values in per_signal.items():
                if values:
                    branch = {c: v[:branches] for c, v in values.items()}
                    ref = {c: v[branches] for c, v in values.items()}
                    signals[kind] = reference_relative_advantages(branch, ref, std_floor=floor)
                    if floor > 0:  # normalised by the std it has without the floor: near-ties stay small
                        norms[kind] = reference_relative_advantages(branch, ref)
            beats.append(any(bool((v[:branches] > v[branches]).any()) for kind, v in raw.items() if weight[kind] > 0))
            local = signals.get("local") if cfg.w_local > 0 else None
            global_ = signals.get("global") if cfg.w_global > 0 else None
            if local is None and global_ is None:
                continue
            adv[rows[:branches]] = fuse_advantages(local, global_, w_local=cfg.w_local, w_global=cfg.w_global,
                                                   clip=cfg.adv_clip, local_norm=norms.get("local"),
                                                   global_norm=norms.get("global"))
        batch.extras["beats_reference"] = torch.tensor(beats)
        return scores.gather(adv)

    # ------------------------------------------------------------------------------------------ phase 5
    def replay_scores(self, ctx: UpdateContext, batch: Batch, rows: torch.Tensor, *, grad: bool) -> torch.Tensor:
        """TVE scores ``[len(rows)]`` of branch rows, each replayed under the unrouted context from its pre-fork
        state with the current ``ctx`` weights: the gradient flows through the first ``algo.grad_steps`` steps of
        each replayed block (with ``grad``); between blocks the replay writes its own last prediction."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        size = self.cfg.branch_batch
        if size and len(rows) > size:  # at most algo.branch_batch replays (and their KV caches) at a time
            return torch.cat([self.replay_scores(ctx, batch, rows[i:i + size], grad=grad)
                              for i in range(0, len(rows), size)])
        sigmas = batch.plan.sigmas[:-1]
        S = sigmas.shape[0]
        forks = batch.extras["fork_block"][rows]
        out = [None] * len(rows)
        for f in forks.unique().tolist():
            sel = (forks == f).nonzero().squeeze(1)
            r = rows[sel]
            plan = batch.extras["routing"][int(r[0]) // batch.plan.group_size]
            count = self.cfg.replay_blocks or plan.blocks
            blocks = list(range(f, min(f + count, self.num_chunks)))
            G1 = batch.plan.group_size
            cond = type(batch.extras["fork_cond"][0]).cat([batch.extras["fork_cond"][int(i) // G1] for i in r])
            if isinstance(cond, HostCopy):  # kept in host memory by the rollout (trainer.offload_kept_context)
                cond = cond.to(batch.latents.device)
            preds = []
            for k in blocks:
                steps = []
                for j in range(S):
                    x = batch.latents[r, k, j]
                    with torch.set_grad_enabled(grad and j < self.cfg.grad_steps):
                        v = ctx.velocity(x, float(sigmas[j]), cond)
                        steps.append(x - float(sigmas[j]) * v.float())
                preds.append(torch.stack(steps, 1))
                if k != blocks[-1]:
                    cond = ctx.commit(steps[-1].detach(), cond)
            replay = torch.stack(preds, 1)  # [b, R, S, ...]
            recorded = batch.extras["x0"][r][:, blocks].to(replay.device)
            scores = tve_scores(replay, recorded, sigmas, self.cfg.sigma_floor)
            for i, s in zip(sel.tolist(), scores):
                out[i] = s
        return torch.stack(out)

    def _group_scores(self, ctx: UpdateContext, batch: Batch, group: int, which: str) -> torch.Tensor:
        """No-grad TVE scores of a group's ``G'`` streamed branches under the old, initial or current weights, once
        per (iteration, epoch, group) — the current ones also per optimizer update."""
        key = (which, int(ctx.iteration), int(ctx.epoch), group, int(ctx.updates) if which == "current" else -1)
        if key not in self._cache:
            G1 = batch.plan.group_size
            rows = torch.arange(group * G1, group * G1 + self.group_branches(batch, group))
            with torch.no_grad():
                if which == "old":
                    with self.old.swapped_in(ctx.params):
                        scores = self.replay_scores(ctx, batch, rows, grad=False)
                elif which == "init":
                    with ctx.reference():
                        scores = self.replay_scores(ctx, batch, rows, grad=False)
                else:
                    scores = self.replay_scores(ctx, batch, rows, grad=False)
            self._cache[key] = scores.detach()
        return self._cache[key]

    def loss(self, ctx: UpdateContext, batch: Batch, rows: torch.Tensor,
             steps: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        rows, steps = self._check_transitions(batch.plan, rows, steps)
        G1 = batch.plan.group_size
        current_iteration = (int(ctx.iteration), int(ctx.epoch))
        self._cache = {k: v for k, v in self._cache.items() if (k[1], k[2]) == current_iteration}
        if self._pi is None or self._pi[0] != ctx.iteration or len(self._pi[1]) != len(batch.prompts):
            self._pi = (int(ctx.iteration), torch.full((len(batch.prompts),), float("nan")))
        reference = self.needs.reference  # the initial policy of the KL term: only with algo.kl_beta > 0
        total, infos = None, []
        # each group's streamed branches (its first G' rows; the reference run and rows it did not stream weigh
        # nothing)
        size = {g: self.group_branches(batch, g) for g in set((rows // G1).tolist())}
        trained = torch.tensor([int(r) % G1 < size[int(r) // G1] for r in rows], dtype=torch.bool)
        groups = [g for g in sorted(size) if bool(((rows // G1 == g) & trained).any())]
        for group in groups:  # every weight swap (old policy, reference) before any graph is built
            self._group_scores(ctx, batch, group, "old")
            if reference:
                self._group_scores(ctx, batch, group, "init")
            if int(((rows // G1 == group) & trained).sum()) < size[group]:
                self._group_scores(ctx, batch, group, "current")
        for group in groups:
            G = size[group]
            members = rows[(rows // G1 == group) & trained]
            old = self._group_scores(ctx, batch, group, "old")
            init = self._group_scores(ctx, batch, group, "init") if reference else None
            adv = batch.advantages[group * G1: group * G1 + G].detach().float().cpu()
            beats = bool(batch.extras["beats_reference"][group])
            live = self.replay_scores(ctx, batch, members, grad=True)
            idx = (members % G1).tolist()
            if len(members) == G:  # the whole group: its loss directly
                order = torch.tensor(idx).argsort()
                scores = live[order]
                group_loss, info = kvpo_loss(scores, old.to(scores.device),
                                             None if init is None else init.to(scores.device),
                                             adv.to(scores.device), clip_low=self.cfg.clip_low,
                                             clip_high=self.cfg.clip_high, kl_coef=self.cfg.kl_beta,
                                             any_branch_beats_reference=beats)
            else:  # part of a group: d(loss)/d(score) at the current scores, times the scores held here
                current = self._group_scores(ctx, batch, group, "current").clone().requires_grad_(True)
                full, info = kvpo_loss(current, old, init, adv, clip_low=self.cfg.clip_low,
                                       clip_high=self.cfg.clip_high, kl_coef=self.cfg.kl_beta,
                                       any_branch_beats_reference=beats)
                coef = torch.autograd.grad(full, current)[0].to(live.device)
                group_loss = (coef[idx] * live).sum() + (full.detach() - (coef[idx] * live.detach()).sum())
            total = group_loss if total is None else total + group_loss
            infos.append(info)
            with torch.no_grad():  # π of the group's branches at this update, for the gallery
                scores = (live.detach().float().cpu()[torch.tensor(idx).argsort()] if len(members) == G
                          else self._group_scores(ctx, batch, group, "current").float().cpu())
                self._pi[1][group * G1: group * G1 + G] = branch_log_policy(scores).exp()
        if total is None:  # only reference runs in this micro-batch: nothing to train
            zero = sum(p.sum() * 0.0 for p in ctx.params)
            return zero, {}
        info = {k: sum(float(i[k]) for i in infos) / len(infos) for k in infos[0]}
        info["branches_short"] = float(self.short_groups(batch))  # groups of the batch with fewer branches
        # the mean over groups of their losses, whatever the micro-batching: each micro-batch weighs its rows' share
        return total / (len(rows) / G1), info

    def gallery(self, batch: Batch) -> GalleryNotes:
        """Columns ``kvpo/pi``: each branch's probability under the policy of the update's last loss (NaN for the
        reference runs); ``kvpo/routed_from`` / ``kvpo/routed_to``: the pixel frames its routed blocks cover (NaN for
        the reference runs); ``kvpo/branch``: the branch index (-1: the reference run; NaN: a row its group did not
        stream, its pool holding fewer distinct selections). Notes ``branch g  pi 0.312  routed 13-20`` for a branch
        (``noise 13-20`` with ``algo.branch_source=noise``), ``reference run`` for the unrouted one, ``not
        streamed`` for an unused row. Marks: each group's routed pixel frames, on its reference run too (there they
        are the same frames generated unrouted, so a group's rows show the same frames side by side)."""
        columns = self._gallery_columns(batch)
        return GalleryNotes(columns=columns, notes=self._gallery_notes(batch, columns),
                            marks=self._gallery_marks(batch, columns))

    def _gallery_columns(self, batch: Batch) -> dict[str, torch.Tensor]:
        n, G1 = len(batch.prompts), batch.plan.group_size
        pi = self._pi[1] if self._pi is not None and len(self._pi[1]) == n else torch.full((n,), float("nan"))
        start = torch.full((n,), float("nan"))
        end = torch.full((n,), float("nan"))
        streamed = [r % G1 < self.group_branches(batch, r // G1) for r in range(n)]
        branch = torch.tensor([-1.0 if r % G1 == G1 - 1 else float(r % G1) if streamed[r] else float("nan")
                               for r in range(n)])
        t = batch.extras["temporal_factor"]  # the model's pixel frames per latent frame (the rollout recorded it)
        for r in range(n):
            if r % G1 != G1 - 1 and streamed[r]:
                plan = batch.extras["routing"][r // G1]
                # latent frame f holds pixel frames t·f - t + 1 .. t·f (frame 0: pixel 0)
                start[r] = max(0, t * plan.fork_frame - t + 1)
                end[r] = t * (plan.end_frame - 1)
        return {"kvpo/pi": pi, "kvpo/routed_from": start, "kvpo/routed_to": end, "kvpo/branch": branch}

    @staticmethod
    def _gallery_notes(batch: Batch, columns: dict[str, torch.Tensor]) -> list[list[str]]:
        notes = []
        how = "noise" if batch.extras.get("branch_source", "routed") == "noise" else "routed"
        for r in range(len(batch.prompts)):
            b = float(columns["kvpo/branch"][r])
            if math.isnan(b):
                notes.append(["not streamed"])
                continue
            if b < 0:
                notes.append(["reference run"])
                continue
            pi = float(columns["kvpo/pi"][r])
            notes.append([f"branch {int(b)}"] + ([] if math.isnan(pi) else [f"pi {pi:.3f}"])
                         + [f"{how} {int(columns['kvpo/routed_from'][r])}-{int(columns['kvpo/routed_to'][r])}"])
        return notes

    @staticmethod
    def _gallery_marks(batch: Batch, columns: dict[str, torch.Tensor]) -> torch.Tensor:
        G1 = batch.plan.group_size
        marks = torch.stack([columns["kvpo/routed_from"], columns["kvpo/routed_to"]], dim=1)
        for r in range(G1 - 1, len(batch.prompts), G1):
            marks[r] = marks[r - G1 + 1]  # the group's first branch (always streamed)
        return marks

    def end_iteration(self, ctx: UpdateContext | None = None) -> None:
        """Sync the rollout (old) policy with the trained weights every ``algo.old_sync_every`` iterations."""
        if ctx is None:
            return
        self.iterations_since_sync += 1
        if self.iterations_since_sync >= self.cfg.old_sync_every:
            self.old.move(ctx.params)
            self.iterations_since_sync = 0
        self._cache = {}

    @contextlib.contextmanager
    def sampling_policy(self, ctx: UpdateContext) -> Iterator[None]:
        """Rollouts stream with the old policy."""
        with self.old.swapped_in(ctx.params):
            yield

    def state_dict(self) -> dict:
        return {"old": self.old.state_dict(), "iterations_since_sync": self.iterations_since_sync}

    def load_state_dict(self, state: dict) -> None:
        self.old.load_state_dict(state.get("old"))
        self.iterations_since_sync = int(state.get("iterations_since_sync", 0))
        self._cache = {}  # scores of weights the loaded state may no longer hold

    def describe_branches(self) -> str:
        """The banner's account of the branches and their advantages (``BranchingConfig``), for every algorithm
        training KVPO's routed branches."""
        c = self.cfg
        branches = (f"with shared noise, {c.routed_blocks} routed blocks (nearest {c.nearest_m}, fork {c.fork})"
                    if c.branch_source == "routed" else
                    f"unrouted, a fresh noise draw in {c.routed_blocks} blocks from the fork (the noise control; fork "
                    f"{c.fork})")
        source = "the aggregate reward" if c.advantage_from == "aggregate" else "each component"
        return (f"{self.num_chunks} blocks × {self.num_steps} steps; groups of branches + 1 reference run {branches}, "
                f"advantages from {source}, local ({c.local_reward}) {c.w_local:g} + global {c.w_global:g} (clip "
                f"±{c.adv_clip:g}, std floor {c.adv_std_floor:g})")

    def describe(self) -> str:
        c = self.cfg
        return (f"kvpo (KVPO): {self.describe_branches()}; TVE replay of {c.replay_blocks or c.routed_blocks} blocks "
                f"(gradient through {c.grad_steps} steps each), clip [{1 - c.clip_low:g}, {1 + c.clip_high:g}], KL to "
                f"the initial policy {c.kl_beta:g}, old policy synced every {c.old_sync_every} iterations")
