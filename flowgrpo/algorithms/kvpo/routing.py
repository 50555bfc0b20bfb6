r"""KVPO's routing geometry: where a stream forks, which older cached frames each branch attends, and the
routes ``CausalWan.routed`` takes.

**Routing plan** (:func:`plan_routing`, :class:`RoutingPlan`, :func:`route_fn`, :func:`batched_route_fn`). With
blocks of ``b`` frames, ``s`` sink frames, a window of ``w`` frames (the newest, the block's own included: the
meaning of ``CausalWan``'s ``window_frames``) and ``m`` nearest frames, a block in the routed span attends to

    sink ``[0, s)`` + the branch's ``n`` older frames + the ``m`` frames just before the block ``[f − m, f)``,

with ``n = w − b − m``: the same number of frames as the unrouted context (sink + the ``w − b`` frames before
the block), so every row of a batch attends the same count and routing changes *which* frames, not how many.
Positions are absolute frame positions, by which CausalWan's cache addresses its frames, so the planned frames
are the frames attended, whatever the cache has evicted. The fork ``f₀`` (a block start) is eligible when the ``P`` routed
blocks ``[f₀, f₀ + P·b)`` fit in the stream and do not cross a segment start, ``f₀ ≥ s + w`` (a full window
behind it), and the pool of older frames holds more than ``n`` frames. The pool is ``[lo, hi)`` with

* ``hi = f₀ + b − w`` (default, ``outside_window=True``): only frames the unrouted window of the fork block does
  not attend, so every branch attends ``n`` frames the reference branch does not; with ``outside_window=False``,
  ``hi = f₀ − m``: every frame before the nearest ones;
* ``lo = s``, or with a bounded cache (``cache_frames = C``) ``lo = max(s, f₀ + (P − 1)·b − (C − s))``: the
  oldest frame still cached when the last routed block reads (CausalWan evicts the oldest non-sink frames first).

A pool of exactly ``n`` frames is one selection: every branch would attend the same frames and stream the same
video, so the group's branches tie, their TVE scores are equal and the group's gradient is exactly zero (a group of
streams rolled out, decoded and scored for nothing). The official rule lists such forks (its pool needs ``n``
frames); on a short stream they are a large share of the eligible ones (with 13 frames, sink 1, window 4 and
``m = 1``, one fork in six), so they are left out here.

The official rule (``plan_perturbation``) has the same ``lo`` and ``hi = f₀ − m_official``, where its
``m_official`` counts the block itself (its nearest slice ends at the end of the block): ``m_official = m + b``.
Its pool therefore stops ``b`` frames before the nearest ones (frames no branch attends) and holds ``w − 2b − m``
frames of the unrouted window (2 with its defaults), which ``outside_window`` leaves out. Its budget
``n = local_attn − sink − m_official`` is ours, as its ``local_attn`` counts the sink (``local_attn = s + w``).

With ``fork="after_switch"`` only the eligible forks in the first ``w − b`` frames of a segment after a prompt
switch ``s`` count (``s ≤ f₀ < s + w − b``): the fork block's unrouted window still holds frames made before the
switch, so its context shows the old motion while its prompt asks the new one (the probes behind arXiv 2605.14278's
"semantic" exploration: a branch then changes how the stream turns). The official code draws among every eligible
fork (``fork="anywhere"``, the default).

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

**No two branches attend the same frames.** Windows of ``n < L`` entries at different starts are different sets, so
with ``L ≥ G`` the ``G`` windows are ``G`` distinct selections (the official pool, 14 frames for ``K = 8``, always
has ``L ≥ G``). A pool smaller than ``G`` has only ``L`` distinct windows: the plan takes each once (starts
``0 … L − 1``, the same stride rule), then more selections of ``n`` pool frames, each drawn uniformly among the
``n``-subsets no branch has yet, until ``G`` branches or all ``C(L, n)`` subsets are taken. When ``C(L, n) < G`` the
plan has fewer branches than asked (:attr:`RoutingPlan.requested_branches` keeps the number asked): two branches
with the same selection would stream the same video, tie in every reward and TVE score, and only dilute the group
(the official code, whose pools are never smaller than ``K``, never has two). The frame-use and overlap bounds above
hold for ``L ≥ G``.

The official code maps planned frames to ring-buffer slots one block late once the buffer has rolled (the routed
frames are the planned ones plus ``b``); addressing by position has no such offset, which the tests check.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = ["FORKS", "Route", "RoutingPlan", "plan_routing", "route_fn", "batched_route_fn", "stacked_route_fn",
           "unrouted_positions"]

#: where a stream may fork (:func:`plan_routing`'s ``fork``)
FORKS = ("anywhere", "after_switch", "at_switch")

#: ``route(frame_offset, num_frames, cached_positions) -> positions`` (``CausalWan.routed``'s hook).
Route = Callable[[int, int, list], "list[int] | torch.Tensor"]


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
        requested_branches: the ``G`` asked for; more than :attr:`num_branches` when the pool holds fewer distinct
            selections than that (0: as many as the plan has).
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
    requested_branches: int = 0

    @property
    def end_frame(self) -> int:
        """One past the last routed frame."""
        return self.fork_frame + self.blocks * self.block_frames

    @property
    def num_branches(self) -> int:
        return len(self.positions_per_branch)

    @property
    def missing_branches(self) -> int:
        """Branches asked for that the pool could not give distinct selections (0 almost always)."""
        return max(0, self.requested_branches - self.num_branches)

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
    fork: str = "anywhere",
) -> RoutingPlan:
    """Draw a fork block and ``G`` branch selections of older frames (the module docstring gives every rule).

    Args:
        num_frames: latent frames of the stream.
        block_frames, sink_frames, window_frames: the stream's geometry (``CausalWan``'s arguments; the window
            counts the newest frames including the block).
        num_branches: ``G``: distinct selections asked for (fewer when the pool has fewer ``n``-subsets).
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
        fork: which eligible forks the fork is drawn from: ``"anywhere"`` (every one) or ``"after_switch"``
            (those at a segment start ``s`` or just after it, ``s <= fork < s + window_frames - block_frames``:
            the fork block's unrouted window still holds frames made before the switch, so its context shows the
            old motion while its prompt asks the new one), or ``"at_switch"`` (those at a segment start: the
            first block under a new prompt, where a stream takes it up from what its context shows).

    Returns:
        the :class:`RoutingPlan`: ``min(G, C(L, n))`` pairwise distinct selections (``L``: the pool's size).
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
    if fork not in FORKS:
        raise ValueError(f"fork={fork!r} is not one of {FORKS}")
    span = routed_blocks * block_frames
    starts = sorted(int(s) for s in segment_starts)

    after = window_frames - block_frames  # fork="after_switch": forks whose window reaches back past a switch

    eligible: list[tuple[int, int, int]] = []
    for f in range(0, num_frames - span + 1, block_frames):
        if f < earliest or f > latest or any(f < s < f + span for s in starts):
            continue
        if fork == "after_switch" and not any(s <= f < s + max(after, 1) for s in starts if s > 0):
            continue
        if fork == "at_switch" and f not in starts[starts[0] == 0:]:
            continue
        lo = sink_frames
        if cache_frames is not None:
            lo = max(lo, f + span - block_frames - (cache_frames - sink_frames))
        if recache:
            switched = [s for s in starts if s <= f]
            if switched:  # CausalWan.recache_start of the latest switch: earlier non-sink frames were dropped
                lo = max(lo, min(sink_frames, switched[-1]), switched[-1] + block_frames - window_frames)
        hi = f + block_frames - window_frames if outside_window else f - nearest_m
        if hi - lo > n:  # a pool of exactly n frames gives every branch the same frames (module docstring)
            eligible.append((f, lo, hi))
    if not eligible:
        raise ValueError(
            f"no eligible fork for routed_blocks={routed_blocks} in {num_frames} frames: a fork needs its "
            f"{span} routed frames inside the stream and one segment, fork >= {earliest}"
            + (f", fork <= {latest}" if max_fork_frame is not None else "")
            + (f", within {max(after, 1)} frames after a segment start of {starts} (fork=after_switch)"
               if fork == "after_switch" else "")
            + (f", at a segment start of {starts} (fork=at_switch)" if fork == "at_switch" else "")
            + f", and a pool of more than n = {n} older frames, so that branches can differ "
            f"(window_frames={window_frames}, nearest_m={nearest_m}, "
            f"cache_frames={cache_frames}, outside_window={outside_window}, recache={recache})")

    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(iteration), int(prompt_index)]))
    fork, lo, hi = eligible[int(rng.integers(len(eligible)))]
    size = hi - lo
    perm = rng.permutation(size)
    # windows of the permutation: min(G, L) distinct selections (module docstring, "No two branches ...")
    branches = [sorted(lo + int(perm[(start + i) % size]) for i in range(n))
                for start in _branch_starts(size, min(num_branches, size), n)]
    if num_branches > size:  # a pool smaller than G: other distinct n-subsets, drawn after the permutation
        branches += [[lo + i for i in chosen] for chosen in
                     _more_selections(rng, size, n, num_branches - size, [[p - lo for p in b] for b in branches])]
    return RoutingPlan(fork_frame=fork, blocks=routed_blocks, block_frames=block_frames, sink_frames=sink_frames,
                       window_frames=window_frames, nearest_m=nearest_m, positions_per_branch=branches,
                       pool_start=lo, pool_end=hi, eligible_forks=[e[0] for e in eligible],
                       requested_branches=num_branches)


#: up to this many n-subsets of a pool are listed and drawn from; a larger pool is drawn from by rejection
_LISTED_SUBSETS = 20_000


def _more_selections(rng: np.random.Generator, size: int, n: int, wanted: int,
                     taken: Sequence[Sequence[int]]) -> list[list[int]]:
    """Up to ``wanted`` more ascending ``n``-subsets of ``range(size)``, none in ``taken`` nor repeated, each drawn
    uniformly among those left (all of them when fewer are left)."""
    have = {tuple(sorted(t)) for t in taken}
    left = math.comb(size, n) - len(have)
    wanted = min(wanted, left)
    if wanted <= 0:
        return []
    if math.comb(size, n) <= _LISTED_SUBSETS:
        rest = [c for c in itertools.combinations(range(size), n) if c not in have]
        return [list(rest[int(i)]) for i in rng.choice(len(rest), size=wanted, replace=False)]
    out: list[list[int]] = []
    while len(out) < wanted:  # far more subsets than branches: a repeat is rare
        c = tuple(sorted(int(i) for i in rng.choice(size, size=n, replace=False)))
        if c not in have:
            have.add(c)
            out.append(list(c))
    return out


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

