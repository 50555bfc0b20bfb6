"""KVPO as the official code computes it (arXiv 2605.14278, github.com/Richard-Zhang-AI/KVPO), and its control:
no two branches of a group attend the same frames (a small pool streams fewer branches, which the advantages and
the loss then run over); the loss is halved when no branch beats the reference run on the raw aggregate reward;
the advantage from the aggregate reward (``algo.advantage_from=aggregate``, the default) or from every component
(``aspects``); and ``algo.branch_source=noise``, branches that fork at the same block and differ by a fresh noise
draw instead of their routing, through ``algo=kvpo`` and ``algo=kvpo_awm``."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.algorithms import Scores
from flowgrpo.algorithms.kvpo import (KVPO, fuse_advantages, plan_routing, reference_relative_advantage,
                                      reference_relative_advantages, route_fn, unrouted_positions)
from twins import suite_threads  # tests/twins.py

CONF = str(Path(__file__).resolve().parents[1] / "conf")

# the preset's guidance-free 4-step model and one-object streams, one prompt: a group of 2 branches + the reference
BASE = ["experiment=kvpo_shapes", "logger=none", "trainer.iterations=1", "trainer.prompts_per_iteration=1",
        "trainer.group_size=3", "trainer.train_batch_size=3", "trainer.gradient_accumulation_steps=1",
        "trainer.eval_before=false", "trainer.eval_every=0", "trainer.eval_num_prompts=1", "trainer.gallery_every=0",
        "trainer.checkpoint_every=0", "data.max_prompts=4"]


def make_trainer(out, *overrides):
    from flowgrpo.trainer import Trainer

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[*BASE, f"trainer.output_dir={out}", *overrides])
    return Trainer(cfg, out)


@pytest.fixture(scope="module")
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(suite_threads())
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------ distinct selections


@pytest.mark.parametrize("pool,G,n", [(3, 4, 2), (4, 8, 2), (5, 8, 2), (6, 8, 3), (7, 8, 6), (5, 12, 3),
                                      (9, 8, 4), (18, 20, 9)])
def test_no_two_branches_attend_the_same_frames_and_a_small_pool_gives_fewer(pool, G, n):
    """Every plan's selections are pairwise distinct; a pool of L < G frames first takes each of its L windows once
    (every pool frame n times), then other n-subsets; with fewer than G subsets (C(L, n)) the plan has that many
    branches and says how many it was asked for. (18, 20, 9): 48,620 subsets, drawn by rejection."""
    for it in range(4):
        # block 1, sink 1, window n + 2, nearest 1: n older frames; the fork at 2 + L gives the pool [1, 1 + L)
        plan = plan_routing(2 + pool + 1, 1, 1, n + 2, num_branches=G, routed_blocks=1, nearest_m=1, iteration=it,
                            outside_window=False, min_fork_frame=2 + pool, max_fork_frame=2 + pool)
        assert (plan.pool_start, plan.pool_end) == (1, 1 + pool)
        sets = [tuple(b) for b in plan.positions_per_branch]
        assert all(len(s) == n and list(s) == sorted(set(s)) and 1 <= s[0] and s[-1] <= pool for s in sets)
        assert len(set(sets)) == len(sets) == min(G, math.comb(pool, n))
        assert plan.requested_branches == G and plan.missing_branches == G - len(sets)
        if pool < G:
            uses = [sum(p in s for s in sets[:pool]) for p in range(1, 1 + pool)]
            assert uses == [n] * pool
        again = plan_routing(2 + pool + 1, 1, 1, n + 2, num_branches=G, routed_blocks=1, nearest_m=1, iteration=it,
                             outside_window=False, min_fork_frame=2 + pool, max_fork_frame=2 + pool)
        assert again == plan


def test_the_presets_geometry_always_plans_distinct_branches():
    """kvpo_shapes (13 frames, blocks 1, sink 1, window 4, nearest 1: n = 2) with 4 and 8 branches: over many draws
    every plan's selections are distinct, and the plan keeps min(G, C(L, 2)) of them (fork 7's pool of 3 frames:
    3 selections; with a pool of L >= G, G)."""
    for G in (4, 8):
        short = 0
        for it in range(60):
            plan = plan_routing(13, 1, 1, 4, num_branches=G, routed_blocks=2, nearest_m=1, iteration=it,
                                segment_starts=[7])
            L = plan.pool_end - plan.pool_start
            sets = {tuple(b) for b in plan.positions_per_branch}
            assert len(sets) == plan.num_branches == min(G, math.comb(L, 2))
            short += plan.num_branches < G
        assert short > 0  # the rule is exercised: some forks of this geometry have small pools


# ---------------------------------------------------------------------------------- advantages and halving


def _algo(**options):
    return KVPO(torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]), kernel="cps", noise_level=1.0, chunks=13, **options)


def _batch(rewards, components, group_size, active=None, segment=0):
    """What phase 4 reads of a scored batch: rewards, components, the fork segment, the rows streamed."""
    n = len(rewards)
    extras = {"fork_segment": torch.full((n,), segment, dtype=torch.long)}
    if active is not None:
        extras["active_branch"] = torch.tensor(active, dtype=torch.bool)
    return SimpleNamespace(plan=SimpleNamespace(group_size=group_size), prompts=[""] * n,
                           rewards=torch.tensor(rewards, dtype=torch.float64),
                           components={k: torch.tensor(v, dtype=torch.float64) for k, v in components.items()},
                           extras=extras)


def test_the_halving_rule_compares_the_raw_aggregate_reward():
    """The official rule halves the loss when no branch's raw reward beats the reference run's. Two cases where the
    rule on per-component standardised signals says the opposite (a component of small spread dominates once
    standardised): (1) no branch beats the reference on the aggregate, yet one branch's standardised signal is
    positive: halved; (2) a branch beats it on the aggregate, yet every standardised signal is negative: not
    halved. The same under either advantage_from."""
    # three branches and the reference run (last); a: small spread, b: large spread; the scalar is their mean
    cases = [({"a": [0.51, 0.50, 0.50, 0.50], "b": [0.45, 0.30, 0.35, 0.50]}, False),
             ({"a": [0.49, 0.50, 0.50, 0.50], "b": [0.52, 0.30, 0.35, 0.50]}, True)]
    for comps, beats in cases:
        rewards = [(x + y) / 2 for x, y in zip(comps["a"], comps["b"])]
        standardised = reference_relative_advantages({c: torch.tensor(v[:3]) for c, v in comps.items()},
                                                     {c: v[3] for c, v in comps.items()})
        assert bool((standardised > 0).any()) is not beats  # the per-component rule disagrees
        assert bool((torch.tensor(rewards[:3]) > rewards[3]).any()) is beats
        for source in ("aggregate", "aspects"):
            algo = _algo(advantage_from=source, local_components=[], global_components=["a", "b"], w_local=0.0)
            batch = _batch(rewards, comps, 4)
            algo.advantages(Scores(batch))
            assert batch.extras["beats_reference"].tolist() == [beats], source


def test_the_local_signal_beats_on_its_raw_mean_too():
    """The fork segment's raw local reward (the mean of the local components) counts as the official local signal
    does: a branch beating the reference there alone is not halved, whatever the scalar says; with w_local = 0 it
    does not count."""
    comps = {"segment1/x": [0.6, 0.1, 0.5], "segment1/y": [0.5, 0.1, 0.5], "g": [0.1, 0.1, 0.9]}
    rewards = comps["g"]
    for w_local, beats in ((1.0, True), (0.0, False)):
        algo = _algo(local_components=["x", "y"], global_components=["g"], w_local=w_local)
        batch = _batch(rewards, comps, 3, segment=1)
        algo.advantages(Scores(batch))
        assert batch.extras["beats_reference"].tolist() == [beats]


def test_the_aggregate_advantage_is_the_standardised_aggregate_reward():
    """advantage_from=aggregate (the default): the global signal is the scalar reward relative to the reference
    run, (r_g - r_ref) / std([r, r_ref]), the local one the mean of the fork segment's components; fused as the
    official code fuses them. With the global signal alone (and no clip reached) it is (r_g - r_ref) divided by the
    std of the branches' rewards: the aggregate reward standardised in the group, relative to the reference run.
    aspects standardises every component on its own, which gives other advantages."""
    assert _algo().cfg.advantage_from == "aggregate"
    g = torch.Generator().manual_seed(0)
    G1 = 6
    comps = {f"segment2/{c}": torch.rand(G1, generator=g).tolist() for c in ("adherence", "direction", "speed")}
    comps |= {c: (torch.rand(G1, generator=g) * s).tolist() for c, s in (("identity", 1.0), ("teleport", 0.01))}
    rewards = [(a + b) / 2 for a, b in zip(comps["identity"], comps["teleport"])]
    batch = _batch(rewards, comps, G1, segment=2)
    algo = _algo(global_components=["identity", "teleport"])
    adv = algo.advantages(Scores(batch)).double()
    r = torch.tensor(rewards, dtype=torch.float64)
    local = torch.stack([torch.tensor(v, dtype=torch.float64) for k, v in comps.items() if "segment2" in k]).mean(0)
    expected = fuse_advantages(reference_relative_advantage(local[:5], local[5]),
                               reference_relative_advantage(r[:5], r[5]), w_local=1.0, w_global=0.5, clip=2.5)
    assert torch.allclose(adv[:5], expected.double(), atol=1e-6) and adv[5] == 0
    alone = _algo(w_local=0.0, w_global=1.0, adv_clip=100.0).advantages(Scores(batch)).double()
    assert torch.allclose(alone[:5], (r[:5] - r[5]) / r[:5].std(unbiased=False), atol=1e-5)
    aspects = _algo(advantage_from="aspects", w_local=0.0, w_global=1.0, adv_clip=100.0,
                    global_components=["identity", "teleport"]).advantages(Scores(batch)).double()
    assert not torch.allclose(aspects[:5], alone[:5], atol=1e-2)


def test_a_group_with_fewer_branches_is_standardised_over_those_it_streamed():
    """A group that streamed G' < G branches (its pool's distinct selections): its advantages, halving and std are
    over its G' branches and the reference run; the rows it did not stream (they hold the reference run) get 0."""
    rewards = [0.3, 0.7, 0.2, 0.5, 0.5, 0.4]               # 3 streamed branches, 2 rows not streamed, the reference
    comps = {"segment0/adherence": [0.1, 0.9, 0.3, 0.4, 0.4, 0.4]}
    batch = _batch(rewards, comps, 6, active=[True, True, True, False, False, False])
    algo = _algo(local_components=["adherence"])
    adv = algo.advantages(Scores(batch)).double()
    r = torch.tensor(rewards, dtype=torch.float64)
    local = torch.tensor(comps["segment0/adherence"], dtype=torch.float64)
    kept = [0, 1, 2]
    expected = fuse_advantages(reference_relative_advantage(local[kept], local[5]),
                               reference_relative_advantage(r[kept], r[5]), clip=2.5)
    assert torch.allclose(adv[kept], expected.double(), atol=1e-6)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]
    assert KVPO.group_branches(batch, 0) == 3 and KVPO.short_groups(batch) == 1


# ------------------------------------------------------------------------ fewer branches through the trainer


def test_a_small_pool_streams_and_trains_fewer_branches(tmp_path, threads, monkeypatch, flowgrpo_caplog):
    """4 branches asked, the fork at frame 7 (pool [1, 4): 3 selections of 2 frames): the group streams 3 distinct
    branches; its fourth branch row holds the reference run, costs no forward (NFE), gets advantage 0 and weighs
    nothing in the loss (``algo=kvpo`` and ``algo=kvpo_awm``), which counts the group in ``branches_short``; the
    shortage is logged once, not per rollout; the gallery says the row was not streamed."""
    from flowgrpo.algorithms.kvpo import algorithm as kvpo_algorithm

    monkeypatch.setattr(kvpo_algorithm, "plan_routing",
                        functools.partial(plan_routing, min_fork_frame=7, max_fork_frame=7))
    trainer = make_trainer(tmp_path, "trainer.group_size=5", "trainer.train_batch_size=5", "algo.routed_blocks=1")
    algo, ctx = trainer.algorithm, trainer.policy
    with flowgrpo_caplog.at_level("WARNING", logger="flowgrpo"):
        batch = trainer.rollout(trainer.plan(0), 0)
        plan = batch.extras["routing"][0]
        algo.note_short(plan)                                              # as every later rollout of it would
    notes = [r.getMessage() for r in flowgrpo_caplog.records if "distinct selections" in r.getMessage()]
    assert len(notes) == 1 and "streams 3 branches" in notes[0]
    assert plan.fork_frame == 7 and plan.num_branches == 3 and plan.requested_branches == 4
    assert batch.extras["active_branch"].tolist() == [True, True, True, False, False]
    assert torch.equal(batch.latents[3], batch.latents[4])                 # the row not streamed: the reference run
    for a in range(3):
        assert not torch.equal(batch.latents[a, 7:], batch.latents[4, 7:])
        for b in range(a):
            assert not torch.equal(batch.latents[a, 7:], batch.latents[b, 7:])   # distinct selections, streams
    K, S = batch.latents.shape[1], batch.latents.shape[2] - 1
    assert batch.nfe == (K + 3 * (K - 7)) * S
    # scores as the reward would give them (its values do not matter here)
    g = torch.Generator().manual_seed(1)
    seg = int(batch.extras["fork_segment"][0])
    batch.rewards = torch.rand(5, generator=g)
    batch.components = {f"segment{seg}/{c}": torch.rand(5, generator=g) for c in algo.cfg.local_components}
    batch.rewards[3] = batch.rewards[4]
    trainer.advantage(batch)
    assert batch.advantages[3] == 0 and batch.advantages[4] == 0 and bool((batch.advantages[:3] != 0).any())
    ctx.iteration, ctx.epoch = 0, 0
    zero, info = algo.loss(ctx, batch, torch.tensor([3, 4]), torch.zeros(2, dtype=torch.long))
    assert info == {} and float(zero.detach()) == 0
    loss, info = algo.loss(ctx, batch, torch.arange(5), torch.zeros(5, dtype=torch.long))
    assert torch.isfinite(loss) and info["branches_short"] == 1.0 and info["ratio_mean"] == 1.0
    assert algo._group_scores(ctx, batch, 0, "old").shape == (3,)
    loss.backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    shown = algo.gallery(batch)
    assert shown.notes[3] == ["not streamed"] and shown.notes[4] == ["reference run"]
    assert math.isnan(float(shown.columns["kvpo/branch"][3])) and shown.marks[4].tolist() == shown.marks[0].tolist()
    # kvpo_awm: the rows not streamed are not trained either
    awm = _awm(trainer, batch)
    seen = []
    original = ctx.teacher_forced_velocity
    monkeypatch.setattr(ctx, "teacher_forced_velocity",
                        lambda clean, *a, **kw: seen.append(len(clean)) or original(clean, *a, **kw))
    loss, info = awm.loss(ctx, batch, torch.arange(5), torch.zeros(5, dtype=torch.long))
    assert seen == [3] and torch.isfinite(loss) and info["branches_short"] == 1.0


def _awm(trainer, batch, **options):
    from omegaconf import OmegaConf

    from flowgrpo.algorithms import build_algorithm
    from flowgrpo.algorithms.kvpo import KVPOAWM

    algo_cfg = OmegaConf.merge(OmegaConf.structured(KVPOAWM.config_class),
                               {"name": "kvpo_awm", "kl_beta": 0.0, "ema_kl_beta": 0.0, **options})
    algo = build_algorithm(algo_cfg, trainer.cfg.sampler, batch.plan.sigmas, chunks=batch.latents.shape[1])
    assert isinstance(algo, KVPOAWM)
    return algo


# ------------------------------------------------------------------------------------- the noise control


@pytest.fixture(scope="module")
def both(tmp_path_factory, threads):
    """One trainer; the same plan rolled out with routed branches and with noise branches, recording every
    attention selection the causal Wan made (whether a route was set, and the positions of each row)."""
    trainer = make_trainer(tmp_path_factory.mktemp("kvpo_fidelity"))
    wan = trainer.adapter.wan
    original = wan._select
    out = {}
    for source in ("routed", "noise"):
        seen = []

        def spy(frame_offset, num_frames):
            chosen = original(frame_offset, num_frames)
            rows = chosen if chosen.ndim == 2 else chosen[None]
            seen.append((frame_offset, wan.route is not None,
                         [[wan.cache.positions[int(i)] for i in row] for row in rows]))
            return chosen

        trainer.algorithm.cfg.branch_source = source
        wan._select = spy
        try:
            out[source] = (trainer.rollout(trainer.plan(0), 0), seen)
        finally:
            wan._select = original
            trainer.algorithm.cfg.branch_source = "routed"
    return trainer, out


def test_noise_branches_share_routing_and_differ_in_noise_routed_ones_the_reverse(both):
    """Same fork and same reference run in both. Routed branches: every block's initial noise is the reference
    run's, their routed blocks attend each branch's own planned frames. Noise branches: every selection is the
    unrouted rule (no route is ever set), and each branch draws its own noise in the plan's blocks from the fork
    and shares the group's elsewhere; their streams differ from each other and from the reference run after the
    fork, and are the reference run before it. Replayed under the unrouted context by the rollout policy, a noise
    branch is reproduced (TVE score 0), a routed one is not."""
    trainer, out = both
    routed, seen_routed = out["routed"]
    noise, seen_noise = out["noise"]
    plan = routed.extras["routing"][0]
    assert noise.extras["routing"][0] == plan and torch.equal(noise.extras["fork_block"], routed.extras["fork_block"])
    assert (routed.extras["branch_source"], noise.extras["branch_source"]) == ("routed", "noise")
    assert torch.equal(noise.latents[2], routed.latents[2])              # the reference run
    fork, end = plan.fork_frame, plan.end_frame                           # blocks of one frame
    K = routed.latents.shape[1]
    # routed: identical noise, different routing
    for r in (0, 1):
        assert torch.equal(routed.latents[r, :, 0], routed.latents[2, :, 0])
    routed_rows = [(f, rows) for f, was_routed, rows in seen_routed if was_routed and plan.is_routed(f)]
    assert routed_rows
    for f, rows in routed_rows:
        nearest = list(range(f - plan.nearest_m, f))
        assert [sorted(r) for r in rows] == [sorted([0, *plan.positions_per_branch[b], *nearest]) for b in (0, 1)]
        assert rows[0] != rows[1]
    # noise: identical (unrouted) context, different noise in the plan's blocks only
    assert seen_noise and not any(was_routed for _, was_routed, _ in seen_noise)
    for f, _, rows in seen_noise:
        assert all(sorted(r) == unrouted_positions(f, 1, list(range(f)), plan.sink_frames, plan.window_frames)
                   for r in rows)
    for r in (0, 1):
        assert torch.equal(noise.latents[r, :fork], noise.latents[2, :fork])
        for k in range(K):
            same = torch.equal(noise.latents[r, k, 0], noise.latents[2, k, 0])
            assert same == (not fork <= k < end), (r, k)
        assert not torch.equal(noise.latents[r, fork:], noise.latents[2, fork:])
    assert not torch.equal(noise.latents[0, fork:end, 0], noise.latents[1, fork:end, 0])
    assert noise.nfe == routed.nfe
    algo, ctx = trainer.algorithm, trainer.policy
    ctx.iteration, ctx.epoch = 0, 0
    with torch.no_grad():
        assert float(algo.replay_scores(ctx, noise, torch.tensor([0, 1]), grad=False).abs().max()) < 1e-6
        assert float(algo.replay_scores(ctx, routed, torch.tensor([0, 1]), grad=False).abs().min()) > 1e-6


@pytest.mark.parametrize("source", ["routed", "noise"])
def test_one_iteration_with_each_branch_source(both, source, monkeypatch):
    """One full iteration of ``algo=kvpo`` with ``algo.branch_source`` routed and noise (rollout, reward,
    advantages, update), then ``algo=kvpo_awm``'s loss on its batch: each branch through the teacher-forced forward
    with its own route (routed) or the unrouted context (noise). The banner says which."""
    trainer, _ = both
    algo, ctx = trainer.algorithm, trainer.policy
    assert ("routed blocks" in algo.describe()) and ("noise control" not in algo.describe())
    algo.cfg.branch_source = source
    try:
        assert ("noise control" in algo.describe()) is (source == "noise")
        scalars = trainer.step()
        batch = trainer._last_batch
    finally:
        algo.cfg.branch_source = "routed"
    assert batch.extras["branch_source"] == source and batch.extras["active_branch"].tolist() == [True, True, False]
    assert math.isfinite(scalars["train/loss"]) and scalars["train/branches_short"] == 0.0
    awm = _awm(trainer, batch, branch_source=source)
    calls = []
    original = ctx.teacher_forced_velocity

    def spy(clean, noisy, sigma, cond, routes=None):
        calls.append(list(routes))
        return original(clean, noisy, sigma, cond, routes=routes)

    monkeypatch.setattr(ctx, "teacher_forced_velocity", spy)
    loss, info = awm.loss(ctx, batch, torch.arange(3), torch.zeros(3, dtype=torch.long))
    plan = batch.extras["routing"][0]
    f = plan.fork_frame
    got = [[None if r is None else r(f, 1, list(range(f))) for r in rs] for rs in calls]
    if source == "noise":
        assert got == [[None, None]]
    else:
        assert got == [[[0, *plan.positions_per_branch[b], *range(f - plan.nearest_m, f)] for b in (0, 1)]]
        assert got[0] == [route_fn(plan, b)(f, 1, list(range(f))) for b in (0, 1)]
    assert torch.isfinite(loss) and info["branches_short"] == 0.0
    loss.backward()
    assert any(p.grad is not None and float(p.grad.abs().max()) > 0 for p in trainer.params)
    trainer.optimizer.zero_grad(set_to_none=True)
