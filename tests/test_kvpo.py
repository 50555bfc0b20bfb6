"""KVPO's building blocks (flowgrpo.algorithms.kvpo): the routing plan and its routes on a tiny float64 CausalWan,
TVE scores from replays, the branch policy, reference-relative advantages and the loss with its protection."""

import itertools
import math
from contextlib import nullcontext

import pytest
import torch

from flowgrpo.algorithms import ALGORITHMS
from flowgrpo.algorithms.kvpo import (RoutingPlan, batched_route_fn, branch_log_policy, fuse_advantages, kvpo_loss,
                                      plan_routing, reference_relative_advantage, reference_relative_advantages,
                                      route_fn, stacked_route_fn, tve_scores, unrouted_positions)
from flowgrpo.models import CausalWan
from flowgrpo.models.causal_wan import stream_mask
from samplers import chunked_rollout, stream_noise, stream_sde_mask, stream_sigmas
from test_causal_wan import C, H, W, diff, tiny_wan

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TIGHT = 1e-10
F64 = torch.float64


def _shared(sets, a, b):
    return len(set(sets[a]) & set(sets[b]))


def _bound(pool, n, g):
    """The documented worst pairwise overlap: two windows of n on a cycle of `pool`, floor(pool/G) apart."""
    d = pool // g
    return max(0, n - d) + max(0, n - (pool - d))


# ------------------------------------------------------------------------------------------------- the plan


def test_the_module_registers_kvpo_as_a_streaming_algorithm():
    assert ALGORITHMS["kvpo"].streaming and ALGORITHMS["kvpo"].__module__.startswith("flowgrpo.algorithms.kvpo.")


def test_a_re_caching_model_routes_only_to_frames_it_still_caches():
    """After a switch at s a re-caching model keeps the sink and [s + b - w, s): the pool starts there."""
    kwargs = dict(num_branches=2, routed_blocks=1, nearest_m=1, seed=0, segment_starts=[12])
    after = 0
    for prompt in range(20):
        plain = plan_routing(30, 1, 1, 4, prompt_index=prompt, **kwargs)
        recached = plan_routing(30, 1, 1, 4, prompt_index=prompt, recache=True, **kwargs)
        if recached.fork_frame >= 12:
            after += 1
            assert recached.pool_start == 12 + 1 - 4
            assert all(p >= 9 for branch in recached.positions_per_branch for p in branch)
        if plain.fork_frame >= 12:
            assert plain.pool_start == 1
    assert after >= 5
    assert 12 not in plan_routing(30, 1, 1, 4, prompt_index=0, recache=True, **kwargs).eligible_forks  # pool empty


@torch.no_grad()
def test_a_re_cache_right_after_the_routed_blocks_re_encodes_unrouted():
    """A re-caching model whose switch follows the routed blocks re-writes some of them under the new prompt.
    The re-cache re-encodes those frames with the sink as their context, whatever branch wrote them (the routing
    decides how a routed block is generated, not how a switch re-encodes it), so a branch's stream runs through
    the switch and equals one whose re-cache was run with no route at all; the routed blocks still differ from the
    unrouted stream's."""
    frames, switch = 14, 10
    plans = [plan_routing(frames, 1, 1, 4, num_branches=2, routed_blocks=2, nearest_m=1, seed=0, prompt_index=i,
                          recache=True, segment_starts=[switch]) for i in range(40)]
    plan = next(p for p in plans if p.fork_frame < switch and p.end_frame > switch + 1 - 4)
    wan = CausalWan(tiny_wan(), block_frames=1, sink_frames=1, window_frames=4)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, C, frames, H, W, generator=g, dtype=F64)
    texts = torch.randn(2, 1, 5, 16, generator=g, dtype=F64)
    t = torch.full((1,), 500.0, dtype=F64)

    def stream(route, recache_route):
        wan.reset()
        outs = []
        with wan.routed(route):
            for s in range(frames):
                text = texts[int(s >= switch)]
                outs.append(wan(x[:, :, s:s + 1], t, text, frame_offset=s))
                wan.write(x[:, :, s:s + 1], text, frame_offset=s)
                if s + 1 == switch:
                    start = wan.recache_start(switch)
                    assert start < plan.end_frame                        # the re-cache re-writes routed frames
                    with wan.routed(recache_route) if recache_route != "same" else nullcontext():
                        wan.recache(x[:, :, start:switch], texts[1], frame_offset=start)
        return torch.cat(outs, 2)

    branch = stream(route_fn(plan, 0), "same")
    assert diff(branch, stream(route_fn(plan, 0), None)) == 0
    unrouted = stream(None, None)
    fork = plan.fork_frame
    assert diff(branch[:, :, :fork], unrouted[:, :, :fork]) == 0
    assert diff(branch[:, :, fork:plan.end_frame], unrouted[:, :, fork:plan.end_frame]) > 1e-6


def test_a_stacked_route_gives_each_row_its_own_plans_frames():
    """Rows of two prompts with different forks: unrouted while no row is routed; then each row its branch's
    planned frames (or the unrouted window), one row per stream."""
    a = plan_routing(24, 1, 1, 6, num_branches=2, routed_blocks=2, nearest_m=1, seed=0, prompt_index=0)
    b = plan_routing(24, 1, 1, 6, num_branches=2, routed_blocks=2, nearest_m=1, seed=0, prompt_index=5)
    route = stacked_route_fn([a, a, b], [0, 1, 1])
    before = min(a.fork_frame, b.fork_frame) - 1
    cached = list(range(24))
    assert route(before, 1, cached[:before]) == unrouted_positions(before, 1, cached[:before], 1, 6)
    for f in sorted({a.fork_frame, b.fork_frame}):
        rows = route(f, 1, cached[:f]).tolist()
        assert rows[0] == a.context(0, f, 1, cached[:f]) and rows[1] == a.context(1, f, 1, cached[:f])
        assert rows[2] == b.context(1, f, 1, cached[:f])
    with pytest.raises(ValueError, match="one plan per row"):
        stacked_route_fn([a], [0, 1])


def test_plan_is_deterministic_per_seed_and_varies_across_iterations_and_prompts():
    args = (40, 2, 2, 8)
    kw = dict(num_branches=4, routed_blocks=2, nearest_m=1, seed=3)
    a, b = plan_routing(*args, **kw, iteration=5), plan_routing(*args, **kw, iteration=5)
    assert a == b
    per_iteration = {(p.fork_frame, str(p.positions_per_branch))
                     for p in (plan_routing(*args, **kw, iteration=i) for i in range(10))}
    assert len(per_iteration) >= 8
    per_prompt = {str(plan_routing(*args, **kw, prompt_index=i).positions_per_branch) for i in range(10)}
    assert len(per_prompt) >= 8
    assert plan_routing(*args, **{**kw, "seed": 4}) != plan_routing(*args, **kw)
    # the fork is drawn from every eligible one
    forks = {plan_routing(*args, **kw, iteration=i).fork_frame for i in range(60)}
    assert forks == set(a.eligible_forks)


@pytest.mark.parametrize("outside_window", [True, False])
@pytest.mark.parametrize("geometry", [
    dict(num_frames=40, block_frames=2, sink_frames=2, window_frames=8, nearest_m=1, routed_blocks=2),
    dict(num_frames=60, block_frames=3, sink_frames=3, window_frames=9, nearest_m=1, routed_blocks=3,
         cache_frames=24),
    dict(num_frames=30, block_frames=1, sink_frames=1, window_frames=5, nearest_m=2, routed_blocks=4,
         cache_frames=11),
])
def test_planned_positions_are_older_outside_the_nearest_frames_and_cached(geometry, outside_window):
    g = geometry
    b, s, w, m, P = g["block_frames"], g["sink_frames"], g["window_frames"], g["nearest_m"], g["routed_blocks"]
    for it in range(25):
        plan = plan_routing(**g, num_branches=4, seed=1, iteration=it, outside_window=outside_window)
        f = plan.fork_frame
        assert f % b == 0 and f >= s + w and plan.end_frame <= g["num_frames"]
        for older in plan.positions_per_branch:
            assert len(older) == len(set(older)) == w - b - m and older == sorted(older)
            for p in older:
                assert s <= p < f - m                                  # older, no sink, not a nearest frame
                for k in range(P):                                     # ... of any routed block
                    assert not f + k * b - m <= p < f + k * b
                if outside_window:
                    assert p < f + b - w                               # the reference branch never attends it
                if g.get("cache_frames"):
                    assert p >= f + (P - 1) * b - (g["cache_frames"] - s)   # still cached at the last routed block


def test_segment_starts_and_fork_range_are_respected_and_errors_name_the_argument():
    plans = [plan_routing(60, 3, 3, 9, routed_blocks=3, segment_starts=[21, 39], min_fork_frame=15,
                          max_fork_frame=45, iteration=i) for i in range(30)]
    for plan in plans:
        assert 15 <= plan.fork_frame <= 45
        assert not any(plan.fork_frame < s < plan.end_frame for s in (21, 39))
    assert set(plans[0].eligible_forks) == {21, 24, 27, 30, 39, 42, 45}
    with pytest.raises(ValueError, match="nearest_m"):
        plan_routing(40, 2, 2, 4, nearest_m=2)
    with pytest.raises(ValueError, match="no eligible fork"):
        plan_routing(12, 2, 2, 8, routed_blocks=2)
    with pytest.raises(ValueError, match="num_branches"):
        plan_routing(40, 2, 2, 8, num_branches=1)
    with pytest.raises(ValueError, match="cache_frames"):
        plan_routing(40, 2, 2, 8, cache_frames=9)


def test_no_fork_gives_every_branch_the_same_frames():
    """A pool of exactly n frames is one selection: such forks are not eligible, so every plan's branches differ
    (kvpo_shapes' geometry: blocks 1, sink 1, window 4, nearest 1, n = 2; fork 6's pool [1, 3) is that one
    selection), and a geometry whose every pool is one selection is refused, naming the rule."""
    for starts in ((), (4,), (7,), (4, 8), (3, 6, 9)):
        for m in (0, 1):
            for i in range(30):
                plan = plan_routing(13, 1, 1, 4, num_branches=4, routed_blocks=2, nearest_m=m, iteration=i,
                                    segment_starts=starts)
                assert plan.pool_end - plan.pool_start > plan.num_older
                assert len({tuple(b) for b in plan.positions_per_branch}) >= 2
    assert 6 not in plan_routing(13, 1, 1, 4, routed_blocks=2, nearest_m=1).eligible_forks
    assert 6 in plan_routing(14, 1, 1, 4, routed_blocks=2, nearest_m=0, min_fork_frame=6,
                             outside_window=False).eligible_forks     # [1, 6): 5 frames for branches of 3
    with pytest.raises(ValueError, match="more than n = 2 older frames"):
        plan_routing(7, 1, 1, 4, routed_blocks=1, nearest_m=1)      # its one fork, 6, has the pool [1, 3)


def test_after_switch_forks_only_where_the_window_still_shows_the_old_segment():
    """``fork="after_switch"`` draws among the eligible forks ``s <= f < s + w - b`` after a switch ``s`` (the fork
    block's unrouted window reaches back before it); ``"anywhere"`` is the default and draws exactly as before."""
    geometry = dict(routed_blocks=2, nearest_m=1, segment_starts=[8])   # kvpo_shapes: blocks 1, sink 1, window 4
    default = [plan_routing(13, 1, 1, 4, iteration=i, **geometry) for i in range(20)]
    anywhere = [plan_routing(13, 1, 1, 4, iteration=i, fork="anywhere", **geometry) for i in range(20)]
    assert default == anywhere
    after = [plan_routing(13, 1, 1, 4, iteration=i, fork="after_switch", **geometry) for i in range(40)]
    # 6's pool is its branches' 2 frames (every branch would be the same), 7's routed blocks would cross the switch
    assert set(default[0].eligible_forks) == {8, 9, 10, 11}
    assert set(after[0].eligible_forks) == {8, 9, 10}               # windows [f - 3, f] holding frame 7
    assert {p.fork_frame for p in after} == {8, 9, 10}
    for plan in after:                                             # each branch still attends a full, older pool
        assert all(len(b) == 2 and max(b) < plan.fork_frame - 3 for b in plan.positions_per_branch)
    # blocks of 3, window 9 (LongLive): forks at a switch or one block after it
    assert set(plan_routing(60, 3, 3, 9, routed_blocks=1, segment_starts=[21, 39],
                            fork="after_switch").eligible_forks) == {21, 24, 39, 42}
    with pytest.raises(ValueError, match="fork=after_switch"):
        plan_routing(13, 1, 1, 4, routed_blocks=2, segment_starts=[3], fork="after_switch")   # pool too small there
    with pytest.raises(ValueError, match="fork="):
        plan_routing(13, 1, 1, 4, fork="late")


def test_at_switch_forks_only_at_a_segment_start():
    """``fork="at_switch"``: the first block under a new prompt, nothing else (a switch whose routed blocks would
    cross the next one, or whose window is not yet full, is not eligible). On a resume stream of 13 latent frames
    (segments at 0, 4, 7, 9) with three routed blocks, routing inside the window, the resumed segment's first block
    is the only fork."""
    at = plan_routing(13, 1, 1, 4, routed_blocks=2, nearest_m=1, segment_starts=[8], fork="at_switch")
    assert at.eligible_forks == [8] and at.fork_frame == 8
    resume = dict(routed_blocks=3, nearest_m=1, segment_starts=[4, 7, 9], outside_window=False, fork="at_switch")
    plans = [plan_routing(13, 1, 1, 4, num_branches=4, iteration=i, **resume) for i in range(10)]
    assert {p.fork_frame for p in plans} == {9} and plans[0].eligible_forks == [9]
    assert (plans[0].pool_start, plans[0].pool_end) == (1, 8)  # every frame before the nearest one, window included
    assert set(plan_routing(60, 3, 3, 9, routed_blocks=1, segment_starts=[21, 39],
                            fork="at_switch").eligible_forks) == {21, 39}
    with pytest.raises(ValueError, match="fork=at_switch"):
        plan_routing(13, 1, 1, 4, routed_blocks=2, segment_starts=[3], fork="at_switch")


@pytest.mark.parametrize("pool_g_n", [(14, 8, 5), (12, 8, 5), (10, 8, 5), (20, 4, 5), (15, 4, 5), (6, 4, 4),
                                      (11, 8, 4), (40, 8, 5)])
def test_branch_overlap_is_bounded_as_documented(pool_g_n):
    """Pool of L frames (outside_window=False, no cache: [sink, fork − m)), G branches of n: any two branches share
    at most the documented number (met by some pair), every frame is used ⌊Gn/L⌋ or ⌈Gn/L⌉ times, branches are
    distinct when L ≥ G and disjoint when L ≥ G·n; consecutive branches share less than the closest pairs (with the
    official geometry's pool of 12, at most 1 frame)."""
    L, G, n = pool_g_n
    # block 1, sink 1, window n + 2, m 1 → n older frames; the fork at 1 + L + m gives the pool [1, 1 + L)
    for it in range(5):
        plan = plan_routing(2 + L + 1, 1, 1, n + 2, num_branches=G, routed_blocks=1, nearest_m=1, iteration=it,
                            outside_window=False, min_fork_frame=2 + L, max_fork_frame=2 + L)
        assert (plan.pool_start, plan.pool_end) == (1, 1 + L)
        sets = plan.positions_per_branch
        shared = [_shared(sets, a, b) for a, b in itertools.combinations(range(G), 2)]
        assert max(shared) == _bound(L, n, G)
        uses = [sum(p in s for s in sets) for p in range(1, 1 + L)]
        assert min(uses) >= G * n // L and max(uses) <= -(-G * n // L)
        if L >= G:
            assert len({tuple(s) for s in sets}) == G
        if L >= G * n:
            assert max(shared) == 0
        neighbours = [_shared(sets, g, g + 1) for g in range(G - 1)]
        assert max(neighbours) <= {(12, 8, 5): 1, (14, 8, 5): 0}.get((L, G, n), max(shared))


# ------------------------------------------------------------------------------------ routes on a real cache


def _plan_mask(frames, plan, branch):
    """The frame mask the plan means, built from the plan alone: the stream's sink + window rule, and in every
    routed block: itself, the sink, the branch's older frames and the nearest_m frames before the block."""
    mask = stream_mask(frames, plan.block_frames, sink_frames=plan.sink_frames, window_frames=plan.window_frames)
    if branch is None:
        return mask
    for start in range(plan.fork_frame, plan.end_frame, plan.block_frames):
        rows = slice(start, start + plan.block_frames)
        mask[rows, :start] = False
        attended = (list(range(plan.sink_frames)) + plan.positions_per_branch[branch]
                    + list(range(start - plan.nearest_m, start)))
        mask[rows, attended] = True
    return mask


def _stream_recording(wan, x, t, text, monkeypatch):
    """Stream x block by block (read at t, then write at t) and record the cached positions every read and write
    of each block selected."""
    seen = {}
    select = wan._select

    def spy(offset, frames):
        slots = select(offset, frames)
        rows = slots if slots.ndim == 2 else slots[None]
        seen.setdefault(offset, []).append([[wan.cache.positions[i] for i in row] for row in rows.tolist()])
        return slots

    monkeypatch.setattr(wan, "_select", spy)
    outs = []
    b = wan.block_frames
    for s in range(0, x.shape[2], b):
        outs.append(wan(x[:, :, s:s + b], t, text, frame_offset=s))
        wan.write(x[:, :, s:s + b], text, frame_offset=s, timestep=t)
    monkeypatch.setattr(wan, "_select", select)
    return torch.cat(outs, 2), seen


@pytest.mark.parametrize("cache_frames,frames,min_fork", [(None, 16, None), (12, 20, 14)])
@torch.no_grad()
def test_routed_blocks_attend_exactly_the_planned_absolute_frames(cache_frames, frames, min_fork, monkeypatch):
    """Per branch, streaming under route_fn(plan, g) attends, in every routed block, exactly sink + the planned
    frames + the nearest_m frames before the block (recorded at the cache), and its output equals one full forward
    under the mask built from the plan, also once the cache has evicted frames. The official slot offset (routed
    frames = planned + one block) gives a different stream."""
    b, sink, window = 2, 2, 6
    plan = plan_routing(frames, b, sink, window, num_branches=3, routed_blocks=2, nearest_m=1, seed=7,
                        cache_frames=cache_frames, min_fork_frame=min_fork)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, C, frames, H, W, generator=g, dtype=F64)
    text = torch.randn(1, 5, 16, generator=g, dtype=F64)
    t = torch.full((1,), 600.0, dtype=F64)
    wan = CausalWan(tiny_wan(), block_frames=b, sink_frames=sink, window_frames=window, cache_frames=cache_frames)
    outs = {}
    for branch in range(3):
        wan.reset()
        with wan.routed(route_fn(plan, branch)):
            outs[branch], seen = _stream_recording(wan, x, t, text, monkeypatch)
        for start, selections in seen.items():
            if plan.is_routed(start):
                expected = sorted(list(range(sink)) + plan.positions_per_branch[branch]
                                  + list(range(start - plan.nearest_m, start)))
            else:
                expected = unrouted_positions(start, b, list(range(start)), sink, window)
            assert selections == [[expected]] * 2, (branch, start)          # the read and the write pass
        full = wan.full(x, t, text, mask=_plan_mask(frames, plan, branch))
        assert diff(outs[branch], full) < TIGHT
        late = RoutingPlan(**{**plan.__dict__, "positions_per_branch": [[p + b for p in o]
                                                                       for o in plan.positions_per_branch]})
        assert diff(outs[branch], wan.full(x, t, text, mask=_plan_mask(frames, late, branch))) > 1e-4
    if cache_frames:
        assert wan.cache.positions[:sink] == [0, 1] and len(wan.cache.positions) == cache_frames
        assert plan.fork_frame > cache_frames                                # frames were evicted before the fork
    assert diff(outs[0], outs[1]) > 1e-4                                     # branches differ
    # one batch, rows = branches 0, reference, 2: each row equals its own masked forward
    wan.reset()
    rows = [0, None, 2]
    with wan.routed(batched_route_fn(plan, rows)):
        batched, _ = _stream_recording(wan, x.repeat(3, 1, 1, 1, 1), t.repeat(3), text.repeat(3, 1, 1), monkeypatch)
    masks = torch.stack([_plan_mask(frames, plan, r) for r in rows])
    assert diff(batched, wan.full(x.repeat(3, 1, 1, 1, 1), t.repeat(3), text.repeat(3, 1, 1), mask=masks)) < TIGHT
    assert diff(batched[:1], outs[0]) < TIGHT


def test_unrouted_rule_is_causal_wans():
    wan = CausalWan(tiny_wan(layers=1), block_frames=2, sink_frames=2, window_frames=6)
    cached = list(range(2)) + list(range(5, 14))
    for offset in range(0, 16, 2):
        assert (unrouted_positions(offset, 2, cached, 2, 6)
                == wan.context_positions(offset, 2, [p for p in cached if p < offset]))


BLOCK, SINK, WINDOW, STEPS = 2, 2, 6, 3


def _rollout(wan, text, noise, renoise, sigmas, start_block=0):
    """Self-Forcing's sampler on the wan's blocks from ``start_block`` (the sampler's conditioning is the block
    index); the last block is not written."""
    def commit(x0, k):
        wan.write(x0.double(), text, frame_offset=k * BLOCK)
        return k + 1

    return chunked_rollout(
        lambda x, sigma, k: wan(x.double(), torch.full((x.shape[0],), 1000.0 * sigma, dtype=F64), text,
                                frame_offset=k * BLOCK),
        commit, noise, torch.cat([sigmas, torch.zeros(1)]), stream_sde_mask(sigmas.shape[0]), cond=start_block,
        kernel="cps", noise_level=1.0, step_noise=renoise, record_x0=True)


@pytest.fixture(scope="module")
def streams():
    wan = CausalWan(tiny_wan(), block_frames=BLOCK, sink_frames=SINK, window_frames=WINDOW)
    text = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(2), dtype=F64)
    sigmas = stream_sigmas(STEPS, shift=5.0)
    noise, renoise = stream_noise(1, 8, STEPS, (C, BLOCK, H, W), generator=torch.Generator().manual_seed(3))
    plan = plan_routing(16, BLOCK, SINK, WINDOW, num_branches=3, routed_blocks=2, nearest_m=1, seed=2)
    return wan, text, sigmas, noise, renoise, plan


@torch.no_grad()
def test_identity_routing_gives_a_bit_identical_stream(streams):
    wan, text, sigmas, noise, renoise, plan = streams
    wan.reset()
    reference = _rollout(wan, text, noise, renoise, sigmas)
    f, m = plan.fork_frame, plan.nearest_m
    # a one-block plan whose older frames are exactly what the unrouted window attends there
    identity = RoutingPlan(f, 1, BLOCK, SINK, WINDOW, m, [list(range(f + BLOCK - WINDOW, f - m))], SINK, f - m)
    routes = [lambda o, n, cached: wan.context_positions(o, n, cached), route_fn(identity, 0), route_fn(plan, None),
              batched_route_fn(plan, [None])]
    for route in routes:
        wan.reset()
        with wan.routed(route):
            again = _rollout(wan, text, noise, renoise, sigmas)
        assert torch.equal(again.x0, reference.x0) and torch.equal(again.latents, reference.latents)
    wan.reset()
    with wan.routed(route_fn(plan, 0)):
        routed = _rollout(wan, text, noise, renoise, sigmas)
    fork_block = f // BLOCK
    assert torch.equal(routed.x0[:, :fork_block], reference.x0[:, :fork_block])     # the shared prefix
    assert diff(routed.x0[:, fork_block], reference.x0[:, fork_block]) > 1e-4


@torch.no_grad()
def test_tve_replay_reproduces_a_branch_and_penalises_it_under_the_unrouted_context(streams):
    """Prefix unrouted to the fork, then each branch's P routed blocks recorded; replaying a branch's inputs under
    its own routing gives back its x̂₀ (score 0), under the unrouted context a negative score; the reference
    branch replayed unrouted scores 0."""
    wan, text, sigmas, noise, renoise, plan = streams
    kf, P = plan.fork_frame // BLOCK, plan.blocks
    wan.reset()
    before = _rollout(wan, text, noise[:, :kf], renoise[:, :kf], sigmas)
    wan.write(before.final[:, -1].double(), text, frame_offset=(kf - 1) * BLOCK)
    prefix = wan.save_state()
    span = slice(kf, kf + P)

    def record(branch):
        wan.restore_state(prefix)
        with wan.routed(route_fn(plan, branch)):
            return _rollout(wan, text, noise[:, span], renoise[:, span], sigmas, start_block=kf)

    def replay(traj, branch):
        """The recorded inputs through the model from the prefix; between blocks the branch's recorded block is
        written (under its own routing the replay's last x̂₀ is that block)."""
        wan.restore_state(prefix)
        out = torch.empty_like(traj.x0)
        with wan.routed(route_fn(plan, branch)):
            for k in range(P):
                for j in range(STEPS):
                    x, sigma = traj.latents[:, k, j], float(sigmas[j])
                    v = wan(x.double(), torch.full((1,), 1000.0 * sigma, dtype=F64), text,
                            frame_offset=(kf + k) * BLOCK).float()
                    out[:, k, j] = x - sigma * v
                wan.write(traj.x0[:, k, -1].double(), text, frame_offset=(kf + k) * BLOCK)
        return out

    trajs = {b: record(b) for b in (0, 1, None)}
    for b in (0, 1):
        same = tve_scores(replay(trajs[b], b), trajs[b].x0, sigmas)
        assert same.shape == (1,) and same.item() == 0.0
        unrouted = tve_scores(replay(trajs[b], None), trajs[b].x0, sigmas)
        assert unrouted.item() < -1e-6
    assert tve_scores(replay(trajs[None], None), trajs[None].x0, sigmas).item() == 0.0
    # all branches at once: [G, K, S, ...] → [G]
    stacked = torch.cat([replay(trajs[b], None) for b in (0, 1, None)])
    scores = tve_scores(stacked, torch.cat([trajs[b].x0 for b in (0, 1, None)]), sigmas)
    assert scores.shape == (3,) and scores[2] == 0 and bool((scores[:2] < 0).all())


# ---------------------------------------------------------------------------------------------- TVE and policy


def test_tve_scores_formula_floor_and_gradient():
    g = torch.Generator().manual_seed(0)
    rec = torch.randn(2, 3, 4, 5, 6, generator=g, dtype=F64)
    rep = (rec + 0.1 * torch.randn(rec.shape, generator=g, dtype=F64)).requires_grad_(True)
    sigmas = torch.tensor([1.0, 0.9, 0.6, 0.3], dtype=F64)
    mse = (rep - rec).square().mean((-1, -2))                               # [G, K, S]
    assert torch.allclose(tve_scores(rep, rec, sigmas), -(mse / 2).sum((1, 2)), rtol=0, atol=1e-14)   # floor 1
    plain = tve_scores(rep, rec, sigmas, sigma_floor=0.0)
    assert torch.allclose(plain, -(mse / (2 * sigmas.square())).sum((1, 2)), rtol=0, atol=1e-12)
    plain.sum().backward()
    expected = -(rep.detach() - rec) / (30 * sigmas.square().view(1, 1, 4, 1, 1))   # 30 elements per block
    assert torch.allclose(rep.grad, expected, rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="sigmas"):
        tve_scores(rep, rec, sigmas[:3])
    with pytest.raises(ValueError, match="x0_recorded"):
        tve_scores(rep, rec[:1], sigmas)


def test_branch_policy_is_shift_invariant_and_normalised():
    s = torch.tensor([0.3, -1.2, 2.5, 0.0], dtype=F64)
    logp = branch_log_policy(s)
    assert torch.allclose(branch_log_policy(s + 123.456), logp, rtol=0, atol=1e-12)
    assert abs(logp.exp().sum().item() - 1.0) < 1e-15
    assert not torch.allclose(branch_log_policy(s * 2), logp)


# ------------------------------------------------------------------------------------------------- advantages


def test_reference_relative_advantages_by_hand():
    branch = {"adherence": torch.tensor([1.0, 2.0, 4.0]), "motion": torch.tensor([0.0, 0.0, 3.0])}
    reference = {"adherence": 2.0, "motion": torch.tensor(0.0)}

    def std(values):                                                        # unbiased, by hand
        mean = sum(values) / len(values)
        return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))

    s1, s2 = std([1, 2, 4, 2]), std([0, 0, 3, 0])
    expected = [(1 - 2) / (s1 + 1e-8), 0.0, (4 - 2) / (s1 + 1e-8) + 0.5 * 3 / (s2 + 1e-8)]
    adv = reference_relative_advantages(branch, reference, {"adherence": 1.0, "motion": 0.5})
    assert adv.dtype == torch.float32 and torch.allclose(adv.double(), torch.tensor(expected, dtype=F64), atol=1e-6)
    # a branch equal to the reference gets exactly 0 in every component
    assert reference_relative_advantage(branch["adherence"], 2.0)[1] == 0
    assert reference_relative_advantage(branch["motion"], 0.0)[:2].tolist() == [0.0, 0.0]
    assert adv[1] == 0
    assert reference_relative_advantage(torch.full((4,), 0.7), 0.7).tolist() == [0.0] * 4   # no spread: 0
    with pytest.raises(ValueError, match="weights"):
        reference_relative_advantages(branch, reference, {"adherence": 1.0})
    with pytest.raises(ValueError, match="reference_rewards"):
        reference_relative_advantages(branch, {"adherence": 2.0})


def test_fuse_advantages_by_hand_and_clamped():
    local, global_ = torch.tensor([1.0, -1.0, 3.0]), torch.tensor([0.0, 2.0, -2.0])
    s = math.sqrt(8 / 3)                                                   # both biased stds
    expected = torch.tensor([1 / s, -1 / s + 0.5 * 2 / s, 3 / s - 0.5 * 2 / s], dtype=F64)
    assert torch.allclose(fuse_advantages(local, global_).double(), expected, atol=1e-6)
    big = torch.tensor([10.0, 0.0, 0.0, 0.0])
    assert fuse_advantages(big, big).tolist()[0] == 2.5                    # 10/4.33 + 0.5·10/4.33 = 3.46 → 2.5
    assert fuse_advantages(-big, -big).tolist()[0] == -2.5
    assert fuse_advantages(big, big, clip=None)[0] > 3.4
    assert torch.allclose(fuse_advantages(local, None).double(), local.double() / s, atol=1e-6)
    assert fuse_advantages(torch.tensor([0.3, 0.3]), None).tolist() == pytest.approx([0.3, 0.3])   # zero std: as is
    with pytest.raises(ValueError, match="at least one"):
        fuse_advantages(None, None)


def test_a_std_floor_keeps_near_ties_small_and_leaves_spread_groups_as_official():
    """``std_floor`` divides each component by ``max(std, floor)``; the fused signal is normalised by the std it has
    without the floor. A group spread wider than the floor gets the official advantages; a nearly tied one gets them
    times ``std/floor`` (official: unit size whatever the spread)."""
    ref = {"a": 0.5, "b": 0.2}
    wide = {"a": torch.tensor([0.2, 0.9, 0.4]), "b": torch.tensor([0.5, 0.1, 0.0])}
    tied = {c: ref[c] + 1e-3 * (v - ref[c]) for c, v in wide.items()}   # the same pattern, 1000 times closer
    floor = 0.05

    def fused(branch, std_floor):
        floored = reference_relative_advantages(branch, ref, std_floor=std_floor)
        plain = reference_relative_advantages(branch, ref)
        return fuse_advantages(floored, None, clip=None, local_norm=plain if std_floor else None)

    official_wide, official_tied = fused(wide, 0.0), fused(tied, 0.0)
    assert torch.allclose(official_wide, official_tied, atol=1e-4)          # official: scale-free
    assert torch.equal(fused(wide, floor), official_wide)                  # every std above the floor: unchanged
    # tied: each component's advantage shrinks by its std / floor
    stds = {c: torch.cat([v, torch.tensor([ref[c]])]).double().std() for c, v in tied.items()}
    shrunk = sum((tied[c].double() - ref[c]) / stds[c] * (stds[c] / floor) for c in tied)
    plain = sum((tied[c].double() - ref[c]) / stds[c] for c in tied)
    expected = shrunk / plain.std(unbiased=False)
    assert torch.allclose(fused(tied, floor).double(), expected, rtol=1e-3, atol=1e-6)
    assert float(fused(tied, floor).abs().max()) < 0.01 * float(official_tied.abs().max())
    # the floor of one component, by hand
    assert torch.allclose(reference_relative_advantage(tied["a"], 0.5, std_floor=floor).double(),
                          (tied["a"].double() - 0.5) / (floor + 1e-8), rtol=1e-5)
    with pytest.raises(ValueError, match="std_floor"):
        reference_relative_advantage(tied["a"], 0.5, std_floor=-1.0)
    with pytest.raises(ValueError, match="norm"):
        fuse_advantages(official_wide, None, local_norm=torch.zeros(2))


# ------------------------------------------------------------------------------------------------------ loss


def _analytic_grad(s, logp_init, adv, kl_coef, scale):
    """∂L/∂s at ρ = 1: the unclipped surrogate −(1/G)(A_j − π_j ΣA) plus β·π_j(log π_j − log π0_j − KL)."""
    pi = torch.softmax(s, 0)
    log_ratio_init = torch.log_softmax(s, 0) - torch.log_softmax(logp_init, 0)
    kl = (pi * log_ratio_init).sum()
    return scale * (-(adv - pi * adv.sum()) / s.numel() + kl_coef * pi * (log_ratio_init - kl))


def test_loss_at_ratio_one_is_the_unclipped_surrogate_with_the_analytic_gradient():
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(5, generator=g, dtype=F64)
    logp_init = torch.randn(5, generator=g, dtype=F64)
    adv = torch.tensor([1.5, -0.5, 0.2, -2.0, 0.8], dtype=F64)
    for beats in (True, False):
        s = scores.clone().requires_grad_(True)
        loss, stats = kvpo_loss(s, scores, logp_init, adv, any_branch_beats_reference=beats)
        assert stats["ratio_min"].item() == stats["ratio_max"].item() == 1.0 and stats["clip_fraction"] == 0
        loss.backward()
        assert torch.allclose(s.grad, _analytic_grad(scores, logp_init, adv, 10.0, 1.0 if beats else 0.5),
                              rtol=0, atol=1e-13)
        # the clipped surrogate is the unclipped one here: any clip range gives the same loss and gradient
        s2 = scores.clone().requires_grad_(True)
        wide, _ = kvpo_loss(s2, scores, logp_init, adv, clip_low=0.99, clip_high=100.0,
                            any_branch_beats_reference=beats)
        wide.backward()
        assert wide.item() == loss.item() and torch.equal(s2.grad, s.grad)
    # raw scores or log-policies, old shifted by a constant: the same loss (everything lives on the simplex)
    a, _ = kvpo_loss(scores, scores + 3.0, logp_init, adv, any_branch_beats_reference=True)
    b, _ = kvpo_loss(branch_log_policy(scores), scores, logp_init - 1.0, adv, any_branch_beats_reference=True)
    assert abs(a.item() - b.item()) < 1e-13


def test_loss_value_off_policy_by_hand():
    """G = 3, π_θ = (0.5, 0.3, 0.2), π_old = uniform: ratios 1.5, 0.9, 0.6; A = (1, −1, 1);
    min(ρA, clip(ρ, 0.9, 1.2)A) = (1.2, −0.9, 0.6); π_init = π_old."""
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    uniform = torch.zeros(3, dtype=F64)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=F64)
    loss, stats = kvpo_loss(pi.log(), uniform, uniform, adv, any_branch_beats_reference=True)
    kl = sum(p * math.log(p * 3) for p in (0.5, 0.3, 0.2))
    assert abs(loss.item() - (-(1.2 - 0.9 + 0.6) / 3 + 10 * kl)) < 1e-12
    assert abs(stats["policy_loss"].item() + 0.3) < 1e-12 and abs(stats["kl"].item() - kl) < 1e-12
    assert abs(stats["clip_fraction"].item() - 2 / 3) < 1e-6               # 1.5 and 0.6 lie outside [0.9, 1.2]


def test_protection_halves_the_loss_exactly():
    g = torch.Generator().manual_seed(6)
    scores, old, init = (torch.randn(6, generator=g, dtype=F64) for _ in range(3))
    adv = torch.randn(6, generator=g, dtype=F64)
    grads, losses = [], []
    for beats in (True, False):
        s = scores.clone().requires_grad_(True)
        loss, stats = kvpo_loss(s, old, init, adv, any_branch_beats_reference=beats)
        loss.backward()
        grads.append(s.grad)
        losses.append(loss)
        assert stats["protected"].item() == (0.0 if beats else 1.0)
        assert stats["loss_scale"].item() == (1.0 if beats else 0.5)
    assert torch.equal(losses[1], 0.5 * losses[0]) and torch.equal(grads[1], 0.5 * grads[0])
    # what the official formulation computes: one extra zero logit next to the G log-policies, scale 1 − π_extra
    logits = torch.cat([branch_log_policy(scores), torch.zeros(1, dtype=F64)])
    assert abs(1 - torch.softmax(logits, 0)[-1].item() - 0.5) < 1e-15
    with pytest.raises(ValueError, match="advantages"):
        kvpo_loss(scores, old, init, adv[:3], any_branch_beats_reference=True)


# KVPO at LongLive's geometry (blocks of 3 latent frames, sink 3, window 9 with the block, a 33-frame cache, 5
# routed blocks, nearest 1; 147 latent frames with prompt switches at 39, 75 and 111; conf/experiment/kvpo_longlive.yaml)
LONGLIVE = dict(block_frames=3, sink_frames=3, window_frames=9, cache_frames=33)
LONGLIVE_FRAMES, LONGLIVE_SWITCHES = 147, (39, 75, 111)


@torch.no_grad()
def test_every_fork_at_longlives_geometry_streams_through_its_re_caches():
    """Every fork ``plan_routing`` lists as eligible at LongLive's geometry streams a branch through all three
    re-caches on a tiny float64 model (a re-cache re-encodes unrouted, so frames a re-cache drops are never asked
    for), including the forks whose routed blocks end where a switch's re-cache starts re-writing them; before the
    fork the branch is the unrouted stream, in its routed blocks it is not."""
    b, s, w, cap = (LONGLIVE[k] for k in ("block_frames", "sink_frames", "window_frames", "cache_frames"))
    frames = LONGLIVE_FRAMES
    common = dict(num_branches=2, routed_blocks=5, nearest_m=1, seed=0, cache_frames=cap, recache=True,
                  segment_starts=list(LONGLIVE_SWITCHES))
    forks = plan_routing(frames, b, s, w, **common).eligible_forks
    wan = CausalWan(tiny_wan(rope_max_seq_len=256, layers=1), **LONGLIVE)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, C, frames, H, W, generator=g, dtype=F64)
    texts = torch.randn(len(LONGLIVE_SWITCHES) + 1, 1, 5, 16, generator=g, dtype=F64)
    t = torch.full((1,), 500.0, dtype=F64)

    def stream(route, stop):
        wan.reset()
        outs = []
        with wan.routed(route):
            for f in range(0, stop, b):
                text = texts[sum(f >= sw for sw in LONGLIVE_SWITCHES)]
                outs.append(wan(x[:, :, f:f + b], t, text, frame_offset=f))
                wan.write(x[:, :, f:f + b], text, frame_offset=f)
                if f + b in LONGLIVE_SWITCHES:
                    start = wan.recache_start(f + b)
                    wan.recache(x[:, :, start:f + b], texts[sum(f + b >= sw for sw in LONGLIVE_SWITCHES)],
                                frame_offset=start)
        return torch.cat(outs, 2)

    def next_switch(fork):  # the first switch at or after the routed span's end
        return min((sw for sw in LONGLIVE_SWITCHES if sw >= fork + 5 * b), default=None)

    # the forks whose routed frames the next switch's re-cache re-writes (6 of 22), and the first and last fork
    rewrites = [f for f in forks if next_switch(f) is not None and wan.recache_start(next_switch(f)) < f + 5 * b]
    assert len(forks) == 22 and len(rewrites) == 6
    for fork in sorted({forks[0], forks[-1], *rewrites}):
        plan = plan_routing(frames, b, s, w, min_fork_frame=fork, max_fork_frame=fork, **common)
        assert plan.fork_frame == fork
        nxt = next_switch(fork)
        stop = min(frames, (nxt or frames) + 2 * b)  # through the next switch's re-cache and two blocks past it
        branch = stream(route_fn(plan, 0), stop)
        unrouted = stream(None, stop)
        assert diff(branch[:, :, :fork], unrouted[:, :, :fork]) == 0
        assert diff(branch[:, :, fork:plan.end_frame], unrouted[:, :, fork:plan.end_frame]) > 1e-6


def test_the_ablation_schema_has_kvpos_branches_and_streaming_awms_update():
    """``algo=kvpo_awm``'s schema takes every field KVPO's branches declare from ``BranchingConfig`` and every field
    streaming AWM's update declares from ``AWMUpdateConfig`` (``algo=stream_awm``'s parent), defaults and
    constraints, the rest from ``AlgoConfig``: with two parents a dataclass takes a field from the later one in
    reverse method resolution order, which can silently be a common ancestor's default."""
    import dataclasses

    from flowgrpo.algorithms.kvpo import BranchingConfig, KVPOAWMConfig
    from flowgrpo.algorithms.stream_awm import AWMUpdateConfig, StreamAWMConfig
    from flowgrpo.config import AlgoConfig

    fields = {f.name: f for f in dataclasses.fields(KVPOAWMConfig)}
    owners = {name: schema for schema in (AlgoConfig, BranchingConfig, AWMUpdateConfig)
              for name in vars(schema).get("__annotations__", {})}
    assert {n for n, s in owners.items() if s is BranchingConfig} >= {"adv_clip", "fork", "routed_blocks"}
    assert {n for n, s in owners.items() if s is AWMUpdateConfig} >= {"kl_beta", "cfg_in_training", "group_noise"}
    assert set(fields) == set(owners)
    for name, f in fields.items():
        parent = owners[name].__dataclass_fields__[name]
        assert (f.default, dict(f.metadata)) == (parent.default, dict(parent.metadata)), name
    c = KVPOAWMConfig(name="kvpo_awm")
    assert (c.adv_clip, c.kl_beta, c.cfg_in_training) == (2.5, 0.001, False)
    # streaming AWM keeps the same update knobs
    assert all(StreamAWMConfig.__dataclass_fields__[n].default == AWMUpdateConfig.__dataclass_fields__[n].default
               for n, s in owners.items() if s is AWMUpdateConfig)
