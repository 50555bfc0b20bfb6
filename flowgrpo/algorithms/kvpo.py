r"""KVPO (``algo=kvpo``, :class:`KVPO`) and its building blocks: routing plans over the KV context, the TVE branch
policy, reference-relative advantages and the clipped loss on the branch simplex.

KVPO (arXiv 2605.14278, "KVPO: ODE-Native GRPO for Autoregressive Video Alignment via KV Semantic Exploration";
official code github.com/Richard-Zhang-AI/KVPO, ``models/longlive/trainer/kvpo.py`` and
``models/longlive/pipeline/diversity_sampling.py``) is GRPO for streaming video models that explores through the
*context* instead of the noise. A stream is generated up to a fork block; from there ``G`` branches continue with
the same noise, each attending, during ``P`` consecutive routed blocks, to its own selection of older cached frames
instead of the newest ones. One more run from the fork, the *unrouted run* (the reference branch), keeps the
normal sink + window context and is the baseline of the advantages. Nothing is sampled from a Gaussian policy;
the policy is a distribution over the ``G`` branches, scored by how well the model reproduces each branch's own
denoising trajectory under the normal context.

The pieces, in the order a training step uses them:

**Routing plan** (:func:`plan_routing`, :class:`RoutingPlan`, :func:`route_fn`, :func:`batched_route_fn`). With
blocks of ``b`` frames, ``s`` sink frames, a window of ``w`` frames (the newest, the block's own included: the
meaning of ``CausalWan``'s ``window_frames``) and ``m`` nearest frames, a block in the routed span attends to

    sink ``[0, s)`` + the branch's ``n`` older frames + the ``m`` frames just before the block ``[f − m, f)``,

with ``n = w − b − m``: the same number of frames as the unrouted context (sink + the ``w − b`` frames before
the block), so every row of a batch attends the same count and routing changes *which* frames, not how many.
Positions are absolute frame positions, by which CausalWan's cache addresses its frames, so the planned frames
are the frames attended, whatever the cache has evicted. The fork ``f₀`` (a block start) is eligible when the ``P`` routed
blocks ``[f₀, f₀ + P·b)`` fit in the stream and do not cross a segment start, ``f₀ ≥ s + w`` (a full window
behind it), and the pool of older frames holds at least ``n`` frames. The pool is ``[lo, hi)`` with

* ``hi = f₀ + b − w`` (default, ``outside_window=True``): only frames the unrouted window of the fork block does
  not attend, so every branch attends ``n`` frames the reference branch does not; with ``outside_window=False``,
  ``hi = f₀ − m``: every frame before the nearest ones;
* ``lo = s``, or with a bounded cache (``cache_frames = C``) ``lo = max(s, f₀ + (P − 1)·b − (C − s))``: the
  oldest frame still cached when the last routed block reads (CausalWan evicts the oldest non-sink frames first).

The official rule (``plan_perturbation``) has the same ``lo`` and ``hi = f₀ − m_official``, where its
``m_official`` counts the block itself (its nearest slice ends at the end of the block): ``m_official = m + b``.
Its pool therefore stops ``b`` frames before the nearest ones (frames no branch attends) and holds ``w − 2b − m``
frames of the unrouted window (2 with its defaults), which ``outside_window`` leaves out. Its budget
``n = local_attn − sink − m_official`` is ours, as its ``local_attn`` counts the sink (``local_attn = s + w``).

One fork and one permutation of the pool (length ``L``) are drawn per (seed, iteration, prompt index) from a
``numpy.random.SeedSequence``. Each branch takes ``n`` consecutive entries of the permutation (cyclically), from
one of the evenly spaced starts ``⌊j·L/G⌋``. When the pool holds ``G·n`` frames the starts are ``n`` or more apart
and the branches are disjoint. Otherwise two branches whose starts are ``d`` apart share
``max(0, n − d) + max(0, n − (L − d))`` frames; any two share at most that for ``d = ⌊L/G⌋`` (the least any ``G``
windows of one permutation can guarantee), and every pool frame is used by ``⌊G·n/L⌋`` or ``⌈G·n/L⌉`` branches.
Branch ``g`` takes start ``j = g·q mod G``, the stride ``q`` (coprime with ``G``) chosen so consecutive branches
share the fewest frames: branch indices mean nothing to the loss, but any run of consecutive branches (a subset,
a chunk of a backward pass) is then spread over the pool. With the official geometry (blocks of 3, sink 3,
window 9, a 33-frame cache: ``L = 12``, ``n = 5``, ``G = 8``) any two branches share at most 4 frames and 1.71 on
average, consecutive ones at most 1. (The official shift ``max(1, L // G)`` packs the starts into the first
``G·shift`` entries: with its pool of 14 every pair of consecutive branches shares 4 of 5 frames and a pair shares
2.14 on average; spread evenly, 1.36.)

The official code maps planned frames to ring-buffer slots one block late once the buffer has rolled (the routed
frames are the planned ones plus ``b``); addressing by position has no such offset, which the tests check.

**TVE scores** (:func:`tve_scores`, "trajectory velocity energy"). Each branch's recorded inputs ``x_{k,j}`` and
clean predictions ``x̂₀_{k,j}`` (block ``k``, step ``j``) are replayed by the model being trained under the
unrouted context, giving ``x̂₀'_{k,j}``; the branch's score is

    ``s_g = Σ_k Σ_j −mean((x̂₀'_{k,j} − x̂₀_{k,j})²) / (2·max(σ_j, σ_floor)²)``

(mean over the elements of a block). Both predictions start from the same input (``x̂₀ = x − σ·v``), so the
squared error is ``σ²·‖Δv‖²``: an energy of the velocity change. ``σ_floor = 1`` (the official default) weights
every step ``1/2``, as Self-Forcing's noise levels are all ≤ 1. The replay itself is the caller's: the official
one covers every block of the fork chunk from the fork, keeps the gradient of the first 2 steps of each block
only, and between blocks writes its own last prediction (not the recorded block) into the cache.

**Branch policy** (:func:`branch_log_policy`): ``log π(g) = log_softmax_g(s_g)``; adding a constant to every score
changes nothing.

**Advantages** (:func:`reference_relative_advantages`, :func:`fuse_advantages`). Per reward component ``c``,
``A_c(g) = (r_c(g) − r_c(ref)) / (std([r_c(1), …, r_c(G), r_c(ref)]) + 1e-8)`` (unbiased std over ``G + 1``
values), then ``A = Σ_c w_c·A_c``. Such an advantage is computed for the *local* signal (rewards of the fork
segment) and the *global* one (the whole stream); each is divided by its own std over the branches (biased;
left unchanged when that std is ≤ 1e-8), they are summed with weights 1.0 and 0.5 and clamped to ±2.5. The
sign stays relative to the reference branch: no mean is subtracted.

**Loss** (:func:`kvpo_loss`). On the simplex, ``ρ_g = exp(clamp(log π_θ(g) − log π_old(g), −20, 20))`` (each
normalised by its logsumexp, so raw scores or log-policies may be passed);

    ``L = −mean_g min(ρ_g·A_g, clip(ρ_g, 1 − 0.1, 1 + 0.2)·A_g) + β·Σ_g π_θ(g)·(log π_θ(g) − log π_init(g))``

with ``β = 10`` and ``π_init`` the policy of the initial weights. When no branch beats the reference branch on
any signal, the loss is halved. The official code ("mechanism_2") writes this as a softmax over the ``G``
log-policies plus one extra zero logit, scaling the loss by ``1 − π_extra``; since the ``G`` probabilities sum to
one, ``π_extra = 1/(1 + 1) = 1/2`` exactly, and the scale is 1 when some branch wins (the extra logit is −∞).
It is implemented as what it computes: a factor 1/2.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Mapping, Sequence

import numpy as np
import torch

from samplers import stream_rollout

from ..config import AlgoConfig
from ..knobs import knob
from ..rollout import Rollout, SamplingModel
from ..seeding import ALGO_STREAM, seeded_generator
from .base import Algorithm, Batch, UpdateContext

__all__ = ["RoutingPlan", "plan_routing", "route_fn", "batched_route_fn", "stacked_route_fn", "unrouted_positions",
           "tve_scores", "branch_log_policy", "reference_relative_advantage", "reference_relative_advantages",
           "fuse_advantages", "kvpo_loss", "BranchedRollout", "KVPOConfig", "KVPO"]

#: ``route(frame_offset, num_frames, cached_positions) -> positions`` (``CausalWan.routed``'s hook).
Route = Callable[[int, int, list], "list[int] | torch.Tensor"]


# ------------------------------------------------------------------------------------------------- routing plan


@dataclass(frozen=True)
class RoutingPlan:
    """Where a prompt's stream forks and which older frames each branch attends (see the module docstring).

    Attributes:
        fork_frame: first frame of the first routed block (a block start).
        blocks: ``P``, consecutive routed blocks: frames ``[fork_frame, end_frame)``.
        block_frames, sink_frames, window_frames: the stream's (``CausalWan``'s) geometry.
        nearest_m: frames just before each routed block it keeps attending (its own block aside; the official
            ``m_nearest_frames`` is ``nearest_m + block_frames``).
        positions_per_branch: ``G`` ascending lists of the ``n`` older absolute frame positions of each branch.
        pool_start, pool_end: the older frames were drawn from ``[pool_start, pool_end)``.
        eligible_forks: every fork frame that was eligible (the fork was drawn uniformly from them).
    """

    fork_frame: int
    blocks: int
    block_frames: int
    sink_frames: int
    window_frames: int
    nearest_m: int
    positions_per_branch: list[list[int]]
    pool_start: int
    pool_end: int
    eligible_forks: list[int] = field(default_factory=list)

    @property
    def end_frame(self) -> int:
        """One past the last routed frame."""
        return self.fork_frame + self.blocks * self.block_frames

    @property
    def num_branches(self) -> int:
        return len(self.positions_per_branch)

    @property
    def num_older(self) -> int:
        """``n``: older frames per branch."""
        return len(self.positions_per_branch[0]) if self.positions_per_branch else 0

    def is_routed(self, frame_offset: int) -> bool:
        """Is the block starting at ``frame_offset`` one of the routed blocks?"""
        return self.fork_frame <= frame_offset < self.end_frame

    def context(self, branch: int | None, frame_offset: int, num_frames: int, cached: Sequence[int]) -> list[int]:
        """The cached positions the block at ``[frame_offset, frame_offset + num_frames)`` attends besides itself,
        for ``branch`` (``None``: the reference branch, always unrouted). Raises when a planned frame is not cached
        (evicted by a too small cache, or dropped by a prompt-switch re-cache)."""
        if branch is None or not self.is_routed(frame_offset):
            return unrouted_positions(frame_offset, num_frames, cached, self.sink_frames, self.window_frames)
        if not 0 <= branch < self.num_branches:
            raise ValueError(f"branch {branch} is not one of the plan's {self.num_branches} branches")
        nearest = list(range(frame_offset - self.nearest_m, frame_offset))
        wanted = self.positions_per_branch[branch] + nearest
        have = set(cached)
        missing = [p for p in wanted if p not in have]
        if missing:
            raise ValueError(f"branch {branch} plans frames {missing} for the block at {frame_offset}, but they are "
                             f"not cached (cached: {sorted(have)}): a bounded cache or a re-cache dropped them")
        return sorted([p for p in cached if p < self.sink_frames] + wanted)


def unrouted_positions(frame_offset: int, num_frames: int, cached: Sequence[int], sink_frames: int,
                       window_frames: int | None) -> list[int]:
    """``CausalWan.context_positions``' rule on explicit positions: the cached frames before the block that are
    sink frames or among the newest ``window_frames`` (the block's own included), ascending."""
    end = frame_offset + num_frames
    return [p for p in cached if p < frame_offset and (window_frames is None or p < sink_frames
                                                       or p >= end - window_frames)]


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def plan_routing(
    num_frames: int,
    block_frames: int,
    sink_frames: int,
    window_frames: int,
    *,
    num_branches: int = 8,
    routed_blocks: int = 5,
    nearest_m: int = 1,
    seed: int = 0,
    iteration: int = 0,
    prompt_index: int = 0,
    cache_frames: int | None = None,
    recache: bool = False,
    outside_window: bool = True,
    min_fork_frame: int | None = None,
    max_fork_frame: int | None = None,
    segment_starts: Sequence[int] = (),
) -> RoutingPlan:
    """Draw a fork block and ``G`` branch selections of older frames (the module docstring gives every rule).

    Args:
        num_frames: latent frames of the stream.
        block_frames, sink_frames, window_frames: the stream's geometry (``CausalWan``'s arguments; the window
            counts the newest frames including the block).
        num_branches: ``G``.
        routed_blocks: ``P``, consecutive routed blocks from the fork.
        nearest_m: frames just before each routed block it keeps attending (the official ``m`` minus
            ``block_frames``: 1 for its 4 with blocks of 3). ``n = window_frames − block_frames − nearest_m``
            older frames per branch; it must be >= 1.
        seed, iteration, prompt_index: the draw is a function of these alone (``numpy.random.SeedSequence``).
        recache: the model re-caches at prompt switches (``CausalWan.recache``): past the latest switch ``s``
            before the fork only the sink and ``[s + block_frames − window_frames, s)`` stay cached from before it,
            so the pool starts there.
        cache_frames: ``CausalWan``'s bound on cached frames (``None``: every frame stays cached); the pool keeps
            only frames still cached at the last routed block.
        outside_window: the pool ends where the fork block's unrouted window starts (default) or just before
            the nearest frames.
        min_fork_frame: earliest fork (default ``sink_frames + window_frames``: a full window behind it).
        max_fork_frame: latest fork (inclusive; the official "within the first chunks" option).
        segment_starts: frames where a segment starts (prompt switches, chunk boundaries): the routed blocks lie
            in one segment.

    Returns:
        the :class:`RoutingPlan`.
    """
    num_frames = _check_int("num_frames", num_frames, 1)
    block_frames = _check_int("block_frames", block_frames, 1)
    sink_frames = _check_int("sink_frames", sink_frames, 0)
    window_frames = _check_int("window_frames", window_frames, 1)
    num_branches = _check_int("num_branches", num_branches, 2)
    routed_blocks = _check_int("routed_blocks", routed_blocks, 1)
    nearest_m = _check_int("nearest_m", nearest_m, 0)
    for name, value in (("seed", seed), ("iteration", iteration), ("prompt_index", prompt_index)):
        _check_int(name, value, 0)
    if sink_frames % block_frames or window_frames % block_frames:
        raise ValueError(f"sink_frames ({sink_frames}) and window_frames ({window_frames}) must be whole blocks of "
                         f"block_frames ({block_frames})")
    n = window_frames - block_frames - nearest_m
    if n < 1:
        raise ValueError(f"nearest_m={nearest_m} leaves no older frame to route: n = window_frames - block_frames - "
                         f"nearest_m = {window_frames} - {block_frames} - {nearest_m} must be >= 1")
    if cache_frames is not None:
        cache_frames = _check_int("cache_frames", cache_frames, sink_frames + window_frames)
    earliest = sink_frames + window_frames if min_fork_frame is None else _check_int("min_fork_frame",
                                                                                     min_fork_frame, 0)
    latest = num_frames if max_fork_frame is None else _check_int("max_fork_frame", max_fork_frame, 0)
    span = routed_blocks * block_frames
    starts = sorted(int(s) for s in segment_starts)

    eligible: list[tuple[int, int, int]] = []
    for fork in range(0, num_frames - span + 1, block_frames):
        if fork < earliest or fork > latest or any(fork < s < fork + span for s in starts):
            continue
        lo = sink_frames
        if cache_frames is not None:
            lo = max(lo, fork + span - block_frames - (cache_frames - sink_frames))
        if recache:
            switched = [s for s in starts if s <= fork]
            if switched:  # CausalWan.recache_start of the latest switch: earlier non-sink frames were dropped
                lo = max(lo, min(sink_frames, switched[-1]), switched[-1] + block_frames - window_frames)
        hi = fork + block_frames - window_frames if outside_window else fork - nearest_m
        if hi - lo >= n:
            eligible.append((fork, lo, hi))
    if not eligible:
        raise ValueError(
            f"no eligible fork for routed_blocks={routed_blocks} in {num_frames} frames: a fork needs its "
            f"{span} routed frames inside the stream and one segment, fork >= {earliest}"
            + (f", fork <= {latest}" if max_fork_frame is not None else "")
            + f", and a pool of >= {n} older frames (window_frames={window_frames}, nearest_m={nearest_m}, "
            f"cache_frames={cache_frames}, outside_window={outside_window})")

    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(iteration), int(prompt_index)]))
    fork, lo, hi = eligible[int(rng.integers(len(eligible)))]
    size = hi - lo
    perm = rng.permutation(size)
    branches = [sorted(lo + int(perm[(start + i) % size]) for i in range(n))
                for start in _branch_starts(size, num_branches, n)]
    return RoutingPlan(fork_frame=fork, blocks=routed_blocks, block_frames=block_frames, sink_frames=sink_frames,
                       window_frames=window_frames, nearest_m=nearest_m, positions_per_branch=branches,
                       pool_start=lo, pool_end=hi, eligible_forks=[e[0] for e in eligible])


def _branch_starts(size: int, branches: int, n: int) -> list[int]:
    """Where each branch's window of ``n`` starts on a cyclic permutation of ``size`` entries: the evenly spaced
    starts ``⌊j·size/G⌋``, taken with the stride ``q`` (coprime with ``G``, so each start once) that makes
    consecutive branches share the fewest entries (``q = 1`` when they are disjoint anyway)."""
    def shared(d: int) -> int:                 # entries two windows ``d`` apart share
        d %= size
        return n if d == 0 else max(0, n - d) + max(0, n - (size - d))

    even = [j * size // branches for j in range(branches)]
    best = None
    for q in range(1, branches):
        if math.gcd(q, branches) != 1:
            continue
        starts = [even[g * q % branches] for g in range(branches)]
        cost = [shared(b - a) for a, b in zip(starts, starts[1:])]
        if best is None or (max(cost), sum(cost)) < best[0]:
            best = ((max(cost), sum(cost)), starts)
    return best[1]


def route_fn(plan: RoutingPlan, branch: int | None) -> Route:
    """The route of one branch for ``CausalWan.routed``: during the plan's routed blocks, sink + the branch's older
    frames + the ``nearest_m`` frames before the block; elsewhere (and for ``branch=None``, the reference branch)
    the unrouted sink + window rule. It applies to the write passes of those blocks too, as in the official
    code."""
    if branch is not None and not 0 <= branch < plan.num_branches:
        raise ValueError(f"branch {branch} is not one of the plan's {plan.num_branches} branches")

    def route(frame_offset: int, num_frames: int, cached: list) -> list[int]:
        return plan.context(branch, frame_offset, num_frames, cached)

    return route


def batched_route_fn(plan: RoutingPlan, branches: Sequence[int | None]) -> Route:
    """One route for a batch whose rows are ``branches`` (branch indices; ``None`` rows are the reference branch):
    a ``[B, k]`` LongTensor during the routed blocks (every row attends the same count ``k``), the shared unrouted
    list elsewhere."""
    branches = list(branches)
    if not branches:
        raise ValueError("branches must name at least one row")
    for b in branches:
        if b is not None and not 0 <= b < plan.num_branches:
            raise ValueError(f"branch {b} is not one of the plan's {plan.num_branches} branches")

    def route(frame_offset: int, num_frames: int, cached: list):
        if not plan.is_routed(frame_offset):
            return unrouted_positions(frame_offset, num_frames, cached, plan.sink_frames, plan.window_frames)
        rows = [plan.context(b, frame_offset, num_frames, cached) for b in branches]
        if len({len(r) for r in rows}) > 1:
            raise ValueError(f"rows attend {sorted({len(r) for r in rows})} frames at block {frame_offset}: a "
                             "batched route needs the same count in every row (is the unrouted window full?)")
        return torch.tensor(rows, dtype=torch.long)

    return route


# ------------------------------------------------------------------------------------------- TVE and the policy


def tve_scores(x0_replay: torch.Tensor, x0_recorded: torch.Tensor, sigmas, sigma_floor: float = 1.0) -> torch.Tensor:
    """Each branch's TVE score, ``[G]``: ``Σ_k Σ_j −mean((x̂₀'_{g,k,j} − x̂₀_{g,k,j})²) / (2·max(σ_j, floor)²)``.

    Args:
        x0_replay: ``[G, K, S, ...]`` the clean predictions of the replay (block ``k``, step ``j``; the layout of
            ``StreamTrajectory.x0``); carries the gradient.
        x0_recorded: the same shape, what the branch recorded (no gradient).
        sigmas: ``[S]`` the noise level of each step (every block the same), or ``[K, S]``.
        sigma_floor: ``σ`` below it counts as ``sigma_floor`` (official default 1.0: every step weighs ``1/2``);
            0 gives the plain ``1/(2σ²)``.

    The mean runs over each block's elements (``...``). In the dtype of ``x0_replay`` (at least float32).
    """
    if x0_replay.shape != x0_recorded.shape or x0_replay.ndim < 3:
        raise ValueError(f"x0_replay {tuple(x0_replay.shape)} and x0_recorded {tuple(x0_recorded.shape)} must both "
                         "be [G, K, S, ...]")
    if sigma_floor < 0:
        raise ValueError(f"sigma_floor must be >= 0, got {sigma_floor}")
    dtype = torch.promote_types(x0_replay.dtype, torch.float32)
    g, k, s = x0_replay.shape[:3]
    sig = torch.as_tensor(sigmas, dtype=dtype, device=x0_replay.device)
    if sig.shape not in ((s,), (k, s)):
        raise ValueError(f"sigmas must be [S] = [{s}] or [K, S] = [{k}, {s}], got {tuple(sig.shape)}")
    eff = sig.clamp_min(sigma_floor) if sigma_floor > 0 else sig
    if torch.any(eff <= 0):
        raise ValueError("every step needs sigma > 0 when sigma_floor is 0")
    err = (x0_replay.to(dtype) - x0_recorded.detach().to(dtype)).square()
    mse = err.flatten(3).mean(-1) if err.ndim > 3 else err                       # [G, K, S]
    return -(mse / (2 * eff.square())).sum((1, 2))


def branch_log_policy(scores: torch.Tensor) -> torch.Tensor:
    """``log π(g) = log_softmax`` of the scores over the branches (the last dimension)."""
    return torch.log_softmax(scores, dim=-1)


# ------------------------------------------------------------------------------------------------- advantages


def reference_relative_advantage(rewards: torch.Tensor, reference: torch.Tensor | float, eps: float = 1e-8
                                 ) -> torch.Tensor:
    """One component: ``(r_g − r_ref) / (std([r_1, …, r_G, r_ref]) + eps)``, unbiased std, float64 ``[G]``.
    A branch that scores exactly as the reference branch gets exactly 0."""
    r = torch.as_tensor(rewards).detach().to(torch.float64).cpu()
    if r.ndim != 1 or r.numel() < 1:
        raise ValueError(f"branch rewards must be a 1-D tensor [G], got shape {tuple(r.shape)}")
    ref = torch.as_tensor(reference).detach().to(torch.float64).cpu()
    if ref.numel() != 1:
        raise ValueError(f"the reference reward must be a scalar, got shape {tuple(ref.shape)}")
    ref = ref.reshape(())
    if not (torch.isfinite(r).all() and torch.isfinite(ref)):
        raise ValueError("rewards must be finite")
    spread = torch.cat([r, ref[None]]).std() + eps
    return (r - ref) / spread


def reference_relative_advantages(branch_rewards: Mapping[str, torch.Tensor],
                                  reference_rewards: Mapping[str, torch.Tensor | float],
                                  weights: Mapping[str, float] | None = None, *, eps: float = 1e-8) -> torch.Tensor:
    """``Σ_c w_c·(r_c(g) − r_c(ref)) / (std([r_c(1..G), r_c(ref)]) + eps)``, float32 ``[G]``.

    Args:
        branch_rewards: ``{component: [G]}`` each branch's reward per component.
        reference_rewards: ``{component: scalar}`` the reference branch's.
        weights: ``{component: w_c}`` (default 1 each; the official code uses the raw weights, not normalised).
    """
    if not branch_rewards:
        raise ValueError("branch_rewards must hold at least one component")
    if set(reference_rewards) != set(branch_rewards):
        raise ValueError(f"reference_rewards has components {sorted(reference_rewards)}, branch_rewards "
                         f"{sorted(branch_rewards)}: they must match")
    weights = {c: 1.0 for c in branch_rewards} if weights is None else dict(weights)
    if set(weights) != set(branch_rewards):
        raise ValueError(f"weights has components {sorted(weights)}, branch_rewards {sorted(branch_rewards)}: "
                         "they must match")
    total = None
    for name, rewards in branch_rewards.items():
        adv = float(weights[name]) * reference_relative_advantage(rewards, reference_rewards[name], eps)
        if total is not None and adv.shape != total.shape:
            raise ValueError(f"component {name!r} has {adv.numel()} branch rewards, another {total.numel()}")
        total = adv if total is None else total + adv
    return total.float()


def _std_normalised(adv: torch.Tensor) -> torch.Tensor:
    std = adv.std(unbiased=False)
    return adv if std <= 1e-8 else adv / (std + 1e-8)


def fuse_advantages(local: torch.Tensor | None, global_: torch.Tensor | None, *, w_local: float = 1.0,
                    w_global: float = 0.5, clip: float | None = 2.5) -> torch.Tensor:
    """``clamp(w_local·A_local/std(A_local) + w_global·A_global/std(A_global), −clip, clip)``, float32 ``[G]``.

    Each signal is divided by its biased std over the branches (unchanged when that std is ≤ 1e-8), no mean is
    subtracted (the sign stays relative to the reference branch). Either signal may be ``None`` (not trained);
    ``clip=None`` does not clamp.
    """
    if local is None and global_ is None:
        raise ValueError("fuse_advantages needs at least one of local and global_")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")
    parts = []
    for name, adv, weight in (("local", local, w_local), ("global_", global_, w_global)):
        if adv is None:
            continue
        adv = torch.as_tensor(adv).detach().to(torch.float64)
        if adv.ndim != 1:
            raise ValueError(f"{name} must be a 1-D tensor [G], got shape {tuple(adv.shape)}")
        parts.append(float(weight) * _std_normalised(adv))
    if len(parts) == 2 and parts[0].shape != parts[1].shape:
        raise ValueError(f"local {tuple(parts[0].shape)} and global_ {tuple(parts[1].shape)} must have one value per "
                         "branch each")
    fused = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    if clip is not None:
        fused = fused.clamp(-clip, clip)
    return fused.float()


# ------------------------------------------------------------------------------------------------------- loss


def kvpo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    logp_init: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.1,
    clip_high: float = 0.2,
    kl_coef: float = 10.0,
    any_branch_beats_reference: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KVPO's loss on the branch simplex (module docstring, "Loss").

    Args:
        logp_new: ``[G]`` the current model's scores or log-policy (carries the gradient).
        logp_old: ``[G]`` the rollout (old) policy's; logp_init: ``[G]`` the initial weights' (no gradient).
            All three are normalised on the simplex (``x − logsumexp(x)``), so raw TVE scores do.
        advantages: ``[G]`` (:func:`fuse_advantages`).
        clip_low, clip_high: the ratio is clipped to ``[1 − clip_low, 1 + clip_high]``.
        kl_coef: ``β`` of ``KL(π_θ‖π_init)``.
        any_branch_beats_reference: False halves the loss (the official protection).

    Returns:
        ``(loss, stats)``: ``loss = scale·(−mean min(ρA, clip(ρ)A) + β·KL)`` with ``scale`` 1 or 1/2, and detached
        0-d tensors: ``policy_loss`` and ``kl`` (unscaled), ``loss_scale``, ``protected`` (1.0 when halved),
        ``clip_fraction`` (share of branches whose ρ the clip moves by more than 1e-6, the official measure), ``ratio_mean`` / ``ratio_min`` /
        ``ratio_max``, ``entropy`` (of π_θ), ``pi_max``.
    """
    shape = logp_new.shape
    if logp_new.ndim != 1 or logp_new.numel() < 1 or any(t.shape != shape for t in (logp_old, logp_init, advantages)):
        raise ValueError(f"logp_new {tuple(shape)}, logp_old {tuple(logp_old.shape)}, logp_init "
                         f"{tuple(logp_init.shape)} and advantages {tuple(advantages.shape)} must all be [G]")
    if not 0 < clip_low < 1 or clip_high <= 0:
        raise ValueError(f"clip_low must be in (0, 1) and clip_high > 0, got {clip_low}, {clip_high}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    dtype = torch.promote_types(logp_new.dtype, torch.float32)
    log_pi = branch_log_policy(logp_new.to(dtype))
    log_pi_old = branch_log_policy(logp_old.detach().to(dtype))
    log_pi_init = branch_log_policy(logp_init.detach().to(dtype))
    log_ratio = (log_pi - log_pi_old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(dtype)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    policy_loss = -torch.minimum(ratio * adv, clipped * adv).mean()
    pi = log_pi.exp()
    kl = (pi * (log_pi - log_pi_init)).sum()
    scale = 1.0 if any_branch_beats_reference else 0.5
    loss = scale * (policy_loss + kl_coef * kl)
    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "policy_loss": policy_loss.detach(),
            "kl": kl.detach(),
            "loss_scale": torch.tensor(scale),
            "protected": torch.tensor(0.0 if any_branch_beats_reference else 1.0),
            "clip_fraction": ((r - r.clamp(1.0 - clip_low, 1.0 + clip_high)).abs() > 1e-6).float().mean(),
            "ratio_mean": r.mean(),
            "ratio_min": r.min(),
            "ratio_max": r.max(),
            "entropy": -(pi * log_pi).sum().detach(),
            "pi_max": pi.max().detach(),
        }
    return loss, stats


# ---------------------------------------------------------------------------------------------------- algorithm


def stacked_route_fn(plans: Sequence[RoutingPlan], branches: Sequence[int | None]) -> Route:
    """One route for a batch whose row ``i`` is branch ``branches[i]`` (``None``: a reference run) of
    ``plans[i]``'s stream: rows of several prompts, each with its own fork and selections. The shared unrouted list
    while no row is routed; a ``[B, k]`` LongTensor otherwise (every row attends the same count)."""
    plans, branches = list(plans), list(branches)
    if len(plans) != len(branches) or not plans:
        raise ValueError(f"one plan per row: got {len(plans)} plans for {len(branches)} rows")

    def route(frame_offset: int, num_frames: int, cached: list):
        if not any(b is not None and p.is_routed(frame_offset) for p, b in zip(plans, branches)):
            first = plans[0]
            return unrouted_positions(frame_offset, num_frames, cached, first.sink_frames, first.window_frames)
        rows = [p.context(b, frame_offset, num_frames, cached) for p, b in zip(plans, branches)]
        if len({len(r) for r in rows}) > 1:
            raise ValueError(f"rows attend {sorted({len(r) for r in rows})} frames at block {frame_offset}: a "
                             "batched route needs the same count in every row (is the unrouted window full?)")
        return torch.tensor(rows, dtype=torch.long)

    return route


class BranchedRollout(Rollout):
    """KVPO's rollout (:meth:`KVPO.make_rollout`): each group's reference run (its last row) streams the whole video
    unrouted; its ``G`` branches start from its state at the group's fork block and continue with the same noise
    draws, routed during the plan's blocks. So every branch's blocks before the fork are the reference run's
    (copied, computed once) and a branch differs from it only by what its routed blocks attended (and, after the
    fork, by the float rounding of another batch).

    Records every block's step inputs (``latents``) and clean predictions (``extras["x0"]``), and each group's
    state before its fork (``extras["fork_cond"]``: the replay starts there). Only those states are kept, not one
    per block: at Wan2.1-1.3B size a block's KV cache is gigabytes. Branches stream ``algo.branch_batch`` at a time
    (each holds a KV cache).

    The velocity is the one the update replays with (the training guidance: ``algo.cfg_in_training``), so a
    branch's replay under its own routing reproduces what it recorded. The draws (routing plans, initial noise and
    re-noise) come from the generators an update context gives at inner epoch 0,
    ``(trainer.seed, ALGO_STREAM, iteration, 0, prompt index, k)``.

    Args:
        algorithm: the :class:`KVPO` whose plans it samples (its routing options and ``routing_plan``).
        model, seed, batch_size, between_chunks: :class:`~flowgrpo.rollout.Rollout`'s (the branches are batched by
            ``algo.branch_batch``, not ``batch_size``).
    """

    def __init__(self, algorithm: "KVPO", model: SamplingModel, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.algorithm = algorithm

    def _stream(self):
        adapter = self.model.adapter
        if not getattr(adapter, "chunked", False):
            raise TypeError(f"{type(adapter).__name__} is not a streaming model (model.family=causal_wan)")
        return adapter

    def layout(self) -> dict[str, Any]:
        """The streaming model's geometry: ``block_frames``, ``sink_frames``, ``window_frames``, ``cache_frames``,
        ``recache``."""
        c = self._stream().config
        return {"block_frames": c.block_frames, "sink_frames": c.sink_frames, "window_frames": c.window_frames,
                "cache_frames": c.cache_frames, "recache": c.recache}

    def _generator(self, iteration: int, *keys: int) -> torch.Generator:
        return seeded_generator(self.seed, ALGO_STREAM, iteration, 0, *keys)

    @torch.no_grad()
    def __call__(self, batch: Batch, iteration: int) -> Batch:
        algo = self.algorithm
        adapter = self._stream()
        plan = batch.plan
        G1 = plan.group_size
        G = G1 - 1
        algo._group_size = G1
        layout = self.layout()
        if layout["window_frames"] is None:
            raise ValueError("algo=kvpo routes the frames outside a block's window: the model needs a window "
                             "(model.stream.window_frames)")
        training = algo.cfg.cfg_in_training
        velocity_of = self.model.velocity_fn(None, guidance=None if training else {"guidance_scale": 1.0})
        n = len(batch.prompts)
        groups = n // G1
        K, S = algo.num_chunks, algo.num_steps
        segments = batch.cond.segments
        plans, forks = [], []
        for p in range(groups):
            gid = int(batch.global_rows[p * G1]) // G1
            # the draw depends on the run's seed, the iteration and the prompt's global index alone
            seed = int(torch.randint(2**31 - 1, (1,), generator=self._generator(iteration, gid, 1)))
            rp = algo.routing_plan(layout, segments[p * G1].tolist(), seed=seed, iteration=int(iteration),
                                   prompt_index=gid)
            plans.append(rp)
            forks.append(rp.fork_frame // layout["block_frames"])
        # common random numbers: one draw of every noise per prompt, for all its rows
        gens = [self._generator(iteration, int(batch.global_rows[p * G1]) // G1, 0) for p in range(groups)]
        noise = self.model.noise(len(gens), gens)  # [groups, K, C, F, h, w]
        renoise = torch.stack([torch.randn((K, S - 1, *noise.shape[2:]), generator=g) for g in gens]).to(noise.device)
        sigmas = plan.sigmas[:-1]

        # the reference runs, one per group, unrouted from the first block to the last
        ref_rows = torch.arange(groups) * G1 + G
        current = [batch.cond[ref_rows]]  # the reference runs' state before the block being made
        at_fork = {0: current[0]} if 0 in forks else {}  # ... kept at the blocks where some group forks

        def ref_velocity(x, sigma, k):
            return velocity_of(x, sigma, current[0])

        def ref_commit(x0, k):
            if k + 1 < K:
                current[0] = adapter.commit(x0, current[0])
                if k + 1 in forks:
                    at_fork[k + 1] = current[0]

        ref = stream_rollout(ref_velocity, ref_commit, noise, renoise, sigmas)
        inputs = ref.inputs.repeat_interleave(G1, 0)  # every row starts as its reference run ...
        x0 = ref.x0.repeat_interleave(G1, 0)
        log_probs = ref.log_probs.repeat_interleave(G1, 0)
        # ... and the branches take over from their fork, block by block, at most algo.branch_batch rows at a time
        # (each holds a KV cache); within a chunk, rows join at their own group's fork
        order = sorted((p * G1 + g for p in range(groups) for g in range(G)), key=lambda r: (forks[r // G1], r))
        size = algo.cfg.branch_batch or len(order)
        for chunk in (order[i:i + size] for i in range(0, len(order), size)):
            active: list[int] = []  # branch rows being streamed, in the order of `cond`
            cond = None
            for k in range(forks[chunk[0] // G1], K):
                joining = [r for r in chunk if forks[r // G1] == k]
                if joining:
                    start = at_fork[k][torch.tensor([r // G1 for r in joining])]
                    cond = start if cond is None else type(start).cat([cond, start])
                    active += joining
                idx = torch.tensor(active)
                route = stacked_route_fn([plans[r // G1] for r in active], [r % G1 for r in active])
                state = [cond]

                def velocity(x, sigma, _k):
                    with adapter.wan.routed(route):
                        return velocity_of(x, sigma, state[0])

                def commit(x0_k, _k):
                    if _k + 1 < K:
                        with adapter.wan.routed(route):
                            state.append(adapter.commit(x0_k, state[0]))

                groups_of = idx // G1
                part = stream_rollout(velocity, commit, noise[groups_of, k:k + 1], renoise[groups_of, k:k + 1],
                                      sigmas, start_block=k)
                inputs[idx, k], x0[idx, k], log_probs[idx, k] = part.inputs[:, 0], part.x0[:, 0], part.log_probs[:, 0]
                cond = state[-1]
        batch.latents = torch.cat([inputs, x0[:, :, -1:]], dim=2)
        batch.log_probs = torch.cat([log_probs, torch.zeros_like(log_probs[:, :, :1])], dim=2)
        batch.chunk_conds = None
        batch.nfe = (groups * K + G * sum(K - f for f in forks)) * S
        fork_rows = torch.tensor([forks[r // G1] for r in range(n)], dtype=torch.long)
        batch.extras = {"x0": x0, "routing": plans, "fork_block": fork_rows,
                        "fork_segment": segments[torch.arange(n), fork_rows],
                        "fork_cond": [at_fork[f][p] for p, f in enumerate(forks)]}
        return batch


@dataclass
class KVPOConfig(AlgoConfig):
    """``algo=kvpo``: the official defaults where they carry over to a small model (the routing geometry follows the
    model: ``n = window − block − nearest_m`` older frames per branch). ``trainer.group_size`` = branches + 1: the
    last member of each group is the reference (unrouted) run."""

    routed_blocks: int = knob(2, ge=1)  # P consecutive routed blocks from the fork (fewer where a stream has no room)
    nearest_m: int = knob(1, ge=0)  # frames just before a routed block it keeps attending (official m minus the block)
    outside_window: bool = True  # draw older frames only from outside the fork block's unrouted window
    replay_blocks: int = knob(0, ge=0)  # blocks replayed from the fork for the TVE score; 0 = the routed ones
    grad_steps: int = knob(2, ge=1)  # per replayed block, the first steps that carry the gradient (official 2)
    sigma_floor: float = knob(1.0, ge=0)  # TVE weights 1/(2·max(sigma, floor)^2): the official 1 weighs steps equally
    clip_low: float = knob(0.1, gt=0, le=0.99)  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = knob(0.2, gt=0)  # the asymmetric upper clip
    kl_beta: float = knob(10.0, ge=0)  # weight of the discrete KL(pi_theta || pi_init) on the branch simplex
    w_local: float = knob(1.0, ge=0)  # weight of the fork segment's (local) advantage after std normalisation
    w_global: float = knob(0.5, ge=0)  # weight of the whole stream's (global) advantage after std normalisation
    adv_clip: float = knob(2.5, gt=0)  # fused advantages clamped to +-adv_clip
    local_components: List[str] = field(default_factory=lambda: ["adherence", "direction", "speed"])  # the fork segment's: segment<s>/<name> of the reward
    global_components: List[str] = field(default_factory=lambda: [
        "adherence", "direction", "speed", "identity", "teleport", "smoothness", "recovery", "anti_freeze"])  # the whole stream's reward components
    old_sync_every: int = knob(2, ge=1)  # the rollout (old) policy takes the trained weights every n iterations
    branch_batch: int = knob(0, ge=0)  # branches streamed / replayed together (each holds a KV cache); 0 = all


class KVPO(Algorithm):
    """KVPO on a streaming model (module docstring): the rollout forks each prompt's stream into ``G`` routed
    branches and one reference run sharing every noise draw; the update replays each branch under the unrouted
    context (TVE), and applies PPO on the branch simplex with the KL to the initial policy.

    Phases through the contract: :meth:`plan` (the chunk axis and one update unit per row), :meth:`make_rollout`
    (the branched streams, :class:`BranchedRollout`, with the old policy), :meth:`local_advantages` (relative to each
    group's reference run), :meth:`loss` (per micro-batch: the exact gradient of each group's loss for the branches it
    holds), :meth:`end_iteration` (old-policy sync).
    """

    name = "kvpo"
    config_class = KVPOConfig
    streaming = True

    def __init__(self, base_sigmas: torch.Tensor, **kwargs) -> None:
        super().__init__(base_sigmas, **kwargs)
        from .old_policy import OldPolicy

        self.old = OldPolicy()
        self.iterations_since_sync = 0
        self._cache: dict[tuple, torch.Tensor] = {}

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
        self._group_size = group_size
        K, S = self.num_chunks, self.num_steps
        sde = (self.base_sigmas[1:] > 0).expand(rows, K, S).clone()  # the sampler's re-noise steps (shared noise)
        train = torch.zeros(rows, K, S, dtype=torch.bool)
        train[:, 0, 0] = True  # one update unit per row: its branch (the reference rows weigh nothing)
        return self._make_plan(self.base_sigmas, sde, train, group_size)

    def trained_steps(self) -> tuple[int, str]:
        return 1, ("algo=kvpo: one TVE replay per routed branch (the reference run of each group is the baseline, "
                   "not trained)")

    # ------------------------------------------------------------------------------------------ phase 2
    def routing_plan(self, layout: dict, segments: Sequence[int], *, seed: int, iteration: int,
                     prompt_index: int) -> RoutingPlan:
        """The routing plan of one stream (``segments``: its segment per block): ``algo.routed_blocks`` blocks, or
        the most a stream's segments leave room for."""
        bf = layout["block_frames"]
        starts = [k * bf for k in range(1, len(segments)) if segments[k] != segments[k - 1]]
        blocks = self.cfg.routed_blocks
        while True:
            try:
                return plan_routing(len(segments) * bf, bf, layout["sink_frames"], layout["window_frames"],
                                    num_branches=self.branches, routed_blocks=blocks, nearest_m=self.cfg.nearest_m,
                                    seed=seed, iteration=iteration, prompt_index=prompt_index,
                                    cache_frames=layout["cache_frames"], recache=layout.get("recache", False),
                                    outside_window=self.cfg.outside_window,
                                    segment_starts=starts)
            except ValueError:
                if blocks == 1:
                    raise
                blocks -= 1

    @property
    def branches(self) -> int:
        return self._group_size - 1

    def make_rollout(self, model: SamplingModel, **engine: Any) -> Rollout:
        """Phase 2: the branched streams (:class:`BranchedRollout`), sampled with the old policy."""
        return BranchedRollout(self, model, **engine)

    # ------------------------------------------------------------------------------------------ phase 4
    def local_advantages(self, batch: Batch) -> torch.Tensor:
        G1 = batch.plan.group_size
        G = G1 - 1
        n = len(batch.prompts)
        comps = {k: v.detach().double().cpu() for k, v in batch.components.items()}
        missing = [c for c in self.cfg.global_components if c not in comps]
        if missing:
            raise KeyError(f"algo.global_components names {missing}, which the reward does not return (it returns "
                           f"{sorted(comps)})")
        adv = torch.zeros(n, dtype=torch.float32)
        beats = []
        for p in range(n // G1):
            rows = torch.arange(p * G1, (p + 1) * G1)
            seg = int(batch.extras["fork_segment"][p * G1])
            signals = {}
            for kind, names in (("local", [f"segment{seg}/{c}" for c in self.cfg.local_components]),
                                ("global", list(self.cfg.global_components))):
                values = {c: comps[c][rows] for c in names if c in comps and torch.isfinite(comps[c][rows]).all()}
                if kind == "local" and self.cfg.local_components and not any(c in comps for c in names):
                    raise KeyError(f"algo.local_components: the reward returns none of {names} (per-segment "
                                   f"components, as reward=long_video's segment<k>/<name>)")
                if values:
                    signals[kind] = reference_relative_advantages({c: v[:G] for c, v in values.items()},
                                                                  {c: v[G] for c, v in values.items()})
            local = signals.get("local") if self.cfg.w_local > 0 else None
            global_ = signals.get("global") if self.cfg.w_global > 0 else None
            beats.append(any(s is not None and bool((s > 0).any()) for s in (local, global_)))
            if local is None and global_ is None:
                continue
            adv[rows[:G]] = fuse_advantages(local, global_, w_local=self.cfg.w_local, w_global=self.cfg.w_global,
                                            clip=self.cfg.adv_clip)
        batch.extras["beats_reference"] = torch.tensor(beats)
        return adv

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
        """No-grad TVE scores of a group's ``G`` branches under the old, initial or current weights, once per
        (iteration, epoch, group) — the current ones also per optimizer update."""
        key = (which, int(getattr(ctx, "iteration", 0)), int(getattr(ctx, "epoch", 0)), group,
               int(getattr(ctx, "updates", 0)) if which == "current" else -1)
        if key not in self._cache:
            G1 = batch.plan.group_size
            rows = torch.arange(group * G1, group * G1 + G1 - 1)
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
        G = G1 - 1
        current_iteration = (int(getattr(ctx, "iteration", 0)), int(getattr(ctx, "epoch", 0)))
        self._cache = {k: v for k, v in self._cache.items() if (k[1], k[2]) == current_iteration}
        total, infos = None, []
        groups = [g for g in sorted(set((rows // G1).tolist())) if bool(((rows // G1 == g) & (rows % G1 < G)).any())]
        for group in groups:  # every weight swap (old policy, reference) before any graph is built
            self._group_scores(ctx, batch, group, "old")
            self._group_scores(ctx, batch, group, "init")
            if int(((rows // G1 == group) & (rows % G1 < G)).sum()) < G:
                self._group_scores(ctx, batch, group, "current")
        for group in groups:
            members = rows[(rows // G1 == group) & (rows % G1 < G)]
            old = self._group_scores(ctx, batch, group, "old")
            init = self._group_scores(ctx, batch, group, "init")
            adv = batch.advantages[group * G1: group * G1 + G].detach().float().cpu()
            beats = bool(batch.extras["beats_reference"][group])
            live = self.replay_scores(ctx, batch, members, grad=True)
            idx = (members % G1).tolist()
            if len(members) == G:  # the whole group: its loss directly
                order = torch.tensor(idx).argsort()
                scores = live[order]
                group_loss, info = kvpo_loss(scores, old.to(scores.device), init.to(scores.device),
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
                pi = batch.extras.setdefault("pi", torch.full((len(batch.prompts),), float("nan")))
                pi[group * G1: group * G1 + G] = branch_log_policy(scores).exp()
        if total is None:  # only reference runs in this micro-batch: nothing to train
            zero = sum(p.sum() * 0.0 for p in ctx.params)
            return zero, {}
        info = {k: sum(float(i[k]) for i in infos) / len(infos) for k in infos[0]}
        # the mean over groups of their losses, whatever the micro-batching: each micro-batch weighs its rows' share
        return total / (len(rows) / G1), info

    def gallery_columns(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``kvpo/pi``: each branch's probability under the policy of the update's last loss (NaN for the reference
        runs); ``kvpo/routed_from`` / ``kvpo/routed_to``: the pixel frames its routed blocks cover (NaN for the
        reference runs); ``kvpo/branch``: the branch index (-1: the reference run)."""
        n, G1 = len(batch.prompts), batch.plan.group_size
        pi = batch.extras.get("pi", torch.full((n,), float("nan")))
        start = torch.full((n,), float("nan"))
        end = torch.full((n,), float("nan"))
        branch = torch.tensor([-1.0 if r % G1 == G1 - 1 else float(r % G1) for r in range(n)])
        for r in range(n):
            if r % G1 != G1 - 1:
                plan = batch.extras["routing"][r // G1]
                # latent frame f holds pixel frames 4f-3 .. 4f (frame 0: pixel 0), Wan's temporal factor 4
                start[r] = max(0, 4 * plan.fork_frame - 3)
                end[r] = 4 * (plan.end_frame - 1)
        return {"kvpo/pi": pi, "kvpo/routed_from": start, "kvpo/routed_to": end, "kvpo/branch": branch}

    def gallery_notes(self, batch: Batch) -> list[list[str]]:
        """``branch g  pi 0.312  routed 13-20`` for a branch, ``reference run`` for the unrouted one."""
        columns = self.gallery_columns(batch)
        notes = []
        for r in range(len(batch.prompts)):
            g = int(columns["kvpo/branch"][r])
            if g < 0:
                notes.append(["reference run"])
                continue
            pi = float(columns["kvpo/pi"][r])
            notes.append([f"branch {g}"] + ([] if math.isnan(pi) else [f"pi {pi:.3f}"])
                         + [f"routed {int(columns['kvpo/routed_from'][r])}-{int(columns['kvpo/routed_to'][r])}"])
        return notes

    def gallery_marks(self, batch: Batch) -> torch.Tensor:
        """Each group's routed pixel frames (``kvpo/routed_from`` .. ``kvpo/routed_to``), on its reference run too:
        there they are the same frames generated unrouted, so a group's rows show the same frames side by side."""
        columns = self.gallery_columns(batch)
        G1 = batch.plan.group_size
        marks = torch.stack([columns["kvpo/routed_from"], columns["kvpo/routed_to"]], dim=1)
        for r in range(G1 - 1, len(batch.prompts), G1):
            marks[r] = marks[r - 1]
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

    def describe(self) -> str:
        c = self.cfg
        return (f"kvpo (KVPO): {self.num_chunks} blocks × {self.num_steps} steps; groups of branches + 1 reference "
                f"run with shared noise, {c.routed_blocks} routed blocks (nearest {c.nearest_m}), TVE replay of "
                f"{c.replay_blocks or c.routed_blocks} blocks (gradient through {c.grad_steps} steps each), clip "
                f"[{1 - c.clip_low:g}, {1 + c.clip_high:g}], KL to the initial policy {c.kl_beta:g}, advantages "
                f"local {c.w_local:g} + global {c.w_global:g} (clip ±{c.adv_clip:g}), old policy synced every "
                f"{c.old_sync_every} iterations")
