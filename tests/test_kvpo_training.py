"""KVPO on the embedded streaming model through the trainer: the branched rollout (shared noise, a common prefix,
routed blocks attending exactly the planned frames), identity routing, the TVE replay, ratio 1 right after a sync,
reference-relative advantages and the halving protection, and an update that moves only the LoRA weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.algorithms import Scores
from flowgrpo.algorithms.kvpo import RoutingPlan, kvpo_loss, route_fn, unrouted_positions
from flowgrpo.algorithms.old_policy import OldPolicy
from twins import suite_threads  # tests/twins.py

CONF = str(Path(__file__).resolve().parents[1] / "conf")

BASE = [
    # the guided 10-step model (the preset's is guidance-free): routing is checked on CFG's two streams per row too
    "experiment=kvpo_shapes", "model=causal_wan_shapes", "data=motion_streams", "logger=none",
    "trainer.iterations=1", "trainer.prompts_per_iteration=2", "trainer.group_size=3",
    "trainer.train_batch_size=6", "trainer.gradient_accumulation_steps=1", "trainer.lr=1e-2",
    "trainer.eval_before=false", "trainer.eval_every=0", "trainer.eval_num_prompts=2", "trainer.gallery_every=0",
    "trainer.checkpoint_every=0", "data.max_prompts=8",
]


def make_trainer(out, *overrides):
    from flowgrpo.trainer import Trainer

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[*BASE, f"trainer.output_dir={out}", *overrides])
    return Trainer(cfg, out)


@pytest.fixture(scope="module")
def rolled(tmp_path_factory):
    """One trainer and one scored rollout of 2 prompts × (2 branches + the reference run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(suite_threads())
    out = tmp_path_factory.mktemp("kvpo")
    trainer = make_trainer(out)
    seen = []  # (frame_offset, positions per row) of every routed call, from the model's own route hook
    wan = trainer.adapter.wan
    original = wan._select

    def spy(frame_offset, num_frames):
        chosen = original(frame_offset, num_frames)
        if wan.route is not None and chosen.ndim == 2:
            positions = wan.cache.positions
            seen.append((frame_offset, [[positions[int(i)] for i in row] for row in chosen]))
        return chosen

    wan._select = spy
    batch = trainer.rollout(trainer.plan(0), 0)
    wan._select = original
    trainer.score(batch)
    trainer.advantage(batch)
    yield trainer, batch, seen
    torch.set_num_threads(before)


def test_branches_share_noise_and_prefix_and_attend_exactly_the_planned_frames(rolled):
    trainer, batch, seen = rolled
    plans, forks = batch.extras["routing"], batch.extras["fork_block"]
    assert len(plans) == 2 and batch.latents.shape[:3] == (6, 13, 11)
    # only each group's pre-fork state is kept: the cache its reference run wrote before the fork
    assert [c.block for c in batch.extras["fork_cond"]] == [int(forks[0]), int(forks[3])]
    assert [c.cache.positions for c in batch.extras["fork_cond"]] == [list(range(int(forks[0]))),
                                                                       list(range(int(forks[3])))]
    for p, plan in enumerate(plans):
        rows = range(3 * p, 3 * p + 3)
        fork = int(forks[3 * p])
        assert plan.fork_frame == fork and plan.num_branches == 2
        for r in rows:  # every row's blocks before the fork are the reference run's, bit for bit
            assert torch.equal(batch.latents[r, :fork], batch.latents[3 * p + 2, :fork])
            assert torch.equal(batch.latents[r, :, 0], batch.latents[3 * p + 2, :, 0])  # the same initial noise
        assert not torch.equal(batch.latents[3 * p, fork:], batch.latents[3 * p + 2, fork:])  # routing changed it
    # each routed call: the branch rows streaming at that block (groups join at their fork), CFG's two streams per
    # row, each row on its planned frames during its routed blocks and unrouted elsewhere
    assert seen
    fork_of = [int(forks[3 * p]) for p in range(2)]
    for frame_offset, rows in seen:
        active = [3 * p + g for f in sorted(set(fork_of)) if f <= frame_offset
                  for p in range(2) if fork_of[p] == f for g in range(2)]
        assert len(rows) == 2 * len(active) and rows[:len(active)] == rows[len(active):]
        for r, positions in zip(active, rows[len(active):]):
            plan, branch = plans[r // 3], r % 3
            if plan.is_routed(frame_offset):
                nearest = list(range(frame_offset - plan.nearest_m, frame_offset))
                assert sorted(positions) == sorted([0] + plan.positions_per_branch[branch] + nearest)
            else:
                assert sorted(positions) == unrouted_positions(frame_offset, 1, list(range(frame_offset)),
                                                               plan.sink_frames, plan.window_frames)
    assert {f for f, _ in seen} >= {plan.fork_frame for plan in plans}


def test_streaming_branches_a_few_at_a_time_streams_the_same_branches(rolled):
    """``algo.branch_batch=1`` (one KV cache at a time) makes the same streams: the reference runs and every block
    before a fork bit for bit, the rest to the float rounding of other batch sizes."""
    trainer, batch, _ = rolled
    algo = trainer.algorithm
    algo.cfg.branch_batch = 1
    try:
        again = trainer.rollout(trainer.plan(0), 0)
    finally:
        algo.cfg.branch_batch = 0
    assert torch.equal(again.latents[[2, 5]], batch.latents[[2, 5]])
    for r in (0, 1, 3, 4):
        fork = int(batch.extras["fork_block"][r])
        assert torch.equal(again.latents[r, :fork], batch.latents[r, :fork])
    assert (again.latents - batch.latents).abs().max() < 5e-3


def test_identity_routing_gives_every_branch_the_reference_run(tmp_path, monkeypatch):
    """Branches whose planned frames are exactly the unrouted window stream the reference run: bit for bit before
    the fork (copied), to float rounding after it (another batch: ~1e-3 after several guided blocks), where the
    drawn routing moves them by far more."""
    from flowgrpo.algorithms.kvpo import KVPO

    planned = KVPO.routing_plan

    def identity(self, layout, segments, **kw):
        plan = planned(self, layout, segments, **kw)
        older = [p for p in unrouted_positions(plan.fork_frame, plan.block_frames, list(range(plan.fork_frame)),
                                               plan.sink_frames, plan.window_frames) if p >= plan.sink_frames]
        older = older[: len(older) - plan.nearest_m]
        return RoutingPlan(plan.fork_frame, plan.blocks, plan.block_frames, plan.sink_frames, plan.window_frames,
                           plan.nearest_m, [older] * plan.num_branches, plan.pool_start, plan.pool_end)

    # one routed block: the older frames stay fixed over P blocks, so only the first can equal the window
    overrides = ["trainer.prompts_per_iteration=1", "trainer.train_batch_size=3", "algo.routed_blocks=1"]
    trainer = make_trainer(tmp_path, *overrides)
    drawn = trainer.rollout(trainer.plan(0), 0)
    monkeypatch.setattr(KVPO, "routing_plan", identity)
    batch = trainer.rollout(trainer.plan(0), 0)
    fork = int(batch.extras["fork_block"][0])
    assert torch.equal(batch.latents[:2, :fork], batch.latents[2:, :fork].expand(2, -1, -1, -1, -1, -1, -1))
    same = (batch.latents[:2] - batch.latents[2:]).abs().max()
    moved = (drawn.latents[:2, fork:] - drawn.latents[2:, fork:]).abs().max()
    assert torch.equal(drawn.latents[2], batch.latents[2])  # the reference run does not depend on the plan
    assert same < 5e-3 and moved > 50 * same, (same, moved)


def test_offloaded_fork_states_replay_as_the_kept_ones(rolled):
    """trainer.offload_kept_context=true: each group's state at its fork waits as a host copy (made on the CPU as an
    observer asks, as a plan does), and the replay from it scores the branches bit for bit as from the kept one."""
    from flowgrpo.offload import HostCopy, observe_host_copies

    trainer, batch, _ = rolled
    engine, ctx = trainer.rollout_engine, trainer.policy
    copies = []
    engine.offload_context = True
    try:
        with observe_host_copies(copies.append):
            again = trainer.rollout(trainer.plan(0), 0)
    finally:
        engine.offload_context = False
    states = again.extras["fork_cond"]
    assert copies and all(isinstance(c, HostCopy) for c in states)
    assert [c.parts[0].cache.positions for c in states] == [c.cache.positions for c in batch.extras["fork_cond"]]
    assert torch.equal(again.latents, batch.latents)
    ctx.iteration, ctx.epoch = 0, 0
    rows = torch.tensor([0, 1, 3])
    with torch.no_grad():
        assert torch.equal(trainer.algorithm.replay_scores(ctx, again, rows, grad=False),
                           trainer.algorithm.replay_scores(ctx, batch, rows, grad=False))


def test_replay_policy_ratio_and_update(rolled):
    trainer, batch, _ = rolled
    algo, ctx = trainer.algorithm, trainer.policy
    ctx.iteration, ctx.epoch = 0, 0
    branches = torch.tensor([0, 1])
    # the replay under a branch's own routing reproduces what it recorded; under the unrouted context it does not
    own = []
    for b in (0, 1):
        with ctx.routed(route_fn(batch.extras["routing"][0], b)), torch.no_grad():
            own.append(algo.replay_scores(ctx, batch, torch.tensor([b]), grad=False))
    own = torch.cat(own)
    unrouted = algo.replay_scores(ctx, batch, branches, grad=False)
    assert own.abs().max() < 1e-9 and bool((unrouted < -1e-6).all()), (own, unrouted)
    # right after a sync (iteration 0: the old policy is the live one) the ratio is exactly 1
    old = algo._group_scores(ctx, batch, 0, "old")
    live = algo.replay_scores(ctx, batch, branches, grad=True)
    assert torch.equal(old, live.detach())
    # the loss of the micro-batch is the mean of the groups' KVPO losses; its gradient reaches only LoRA weights
    loss, info = algo.loss(ctx, batch, torch.arange(6), torch.zeros(6, dtype=torch.long))
    expected = []
    for g in range(2):
        scores = algo.replay_scores(ctx, batch, torch.tensor([3 * g, 3 * g + 1]), grad=False)
        value, _ = kvpo_loss(scores, scores, algo._group_scores(ctx, batch, g, "init"), batch.advantages[3 * g:3 * g + 2],
                             kl_coef=algo.cfg.kl_beta,
                             any_branch_beats_reference=bool(batch.extras["beats_reference"][g]))
        expected.append(float(value))
    assert float(loss.detach()) == pytest.approx(sum(expected) / 2, rel=1e-5, abs=1e-7)
    assert info["ratio_mean"] == 1.0 and info["ratio_min"] == 1.0
    # the gallery's columns: each branch's π (a distribution over the group's branches), where its routing ran
    shown = algo.gallery(batch)
    columns = shown.columns
    pi = columns["kvpo/pi"]
    assert torch.isnan(pi[[2, 5]]).all() and torch.allclose(pi[[0, 3]] + pi[[1, 4]], torch.ones(2))
    assert columns["kvpo/branch"].tolist() == [0, 1, -1, 0, 1, -1]
    plan = batch.extras["routing"][0]
    assert columns["kvpo/routed_from"][0] == 4 * plan.fork_frame - 3 and torch.isnan(columns["kvpo/routed_to"][2])
    # the grid's labels and marks: the branch, its π and routed pixel frames; the reference run unmarked
    notes, marks = shown.notes, shown.marks
    assert notes[2] == ["reference run"] and notes[1][0] == "branch 1" and notes[1][1] == f"pi {float(pi[1]):.3f}"
    assert notes[0][-1] == f"routed {4 * plan.fork_frame - 3}-{4 * (plan.end_frame - 1)}"
    assert marks[0].tolist() == marks[2].tolist() == [4 * plan.fork_frame - 3, 4 * (plan.end_frame - 1)]
    loss.backward()
    grads = {n: p.grad for n, p in trainer.unwrapped.named_parameters() if p.grad is not None}
    assert grads and all("lora" in n for n in grads)
    assert any(float(g.abs().max()) > 0 for g in grads.values()) or all(float(a) == 0 for a in batch.advantages)
    trainer.optimizer.zero_grad(set_to_none=True)


def test_split_groups_give_the_whole_groups_gradient(rolled):
    """Micro-batches that cut a group in two give, summed, the gradient of the whole group's loss."""
    trainer, batch, _ = rolled
    algo, ctx = trainer.algorithm, trainer.policy
    ctx.iteration, ctx.epoch = 0, 0
    params = [p for p in trainer.params]
    whole, _ = algo.loss(ctx, batch, torch.arange(3), torch.zeros(3, dtype=torch.long))
    g_whole = torch.autograd.grad(whole, params, allow_unused=True)
    parts = []
    for rows in (torch.tensor([0]), torch.tensor([1, 2])):
        part, _ = algo.loss(ctx, batch, rows, torch.zeros(len(rows), dtype=torch.long))
        # a micro-batch weighs its rows' share of a group: scale back to compare with the whole group's loss
        parts.append(torch.autograd.grad(part * (len(rows) / 3), params, allow_unused=True))
    for a, b, c in zip(g_whole, *parts):
        if a is None:
            continue
        total = (b if b is not None else 0) + (c if c is not None else 0)
        # the same to the float rounding of replays in batches of other sizes
        assert float((a - total).norm()) <= 1e-3 * float(a.norm()) + 1e-12


def test_without_the_kl_term_the_loss_never_reaches_the_reference_policy(rolled):
    """``algo.kl_beta=0`` declares no reference policy (what a fully fine-tuned model, with no LoRA to disable and no
    frozen copy, needs): the loss trains without calling ``ctx.reference()``, which the trainer's context refuses."""
    trainer, batch, _ = rolled
    algo, ctx = trainer.algorithm, trainer.policy
    assert algo.needs.reference  # the preset's KL weight 10
    algo.cfg.kl_beta = 0.0
    try:
        assert not algo.needs.reference
        with pytest.raises(RuntimeError, match="without declaring it needs a reference"):
            with ctx.reference():
                pass
        ctx.iteration, ctx.epoch = 7, 0  # a fresh key: no score cached from the calls above
        loss, info = algo.loss(ctx, batch, torch.arange(6), torch.zeros(6, dtype=torch.long))
        assert torch.isfinite(loss) and "kl" not in info and "policy_loss" in info
    finally:
        algo.cfg.kl_beta = 10.0
        algo._cache = {}
    assert algo.needs.reference


def test_advantages_are_relative_to_the_reference_run(rolled):
    trainer, batch, _ = rolled
    adv = batch.advantages.cpu()
    assert adv[2] == 0 and adv[5] == 0  # the reference runs are the baseline
    assert bool((adv.abs() <= trainer.algorithm.cfg.adv_clip).all())
    # a group where no branch beats the reference on the raw reward (the scalar, and the fork segment's mean
    # component) is flagged: its loss is halved
    comps = {k: v.clone() for k, v in batch.components.items()}
    rewards = batch.rewards.clone()
    for v in (*batch.components.values(), batch.rewards):
        v[0:2] = torch.minimum(v[0:2], v[2]) if torch.isfinite(v[0:3]).all() else v[0:2]
    trainer.algorithm.advantages(Scores(batch))
    assert not bool(batch.extras["beats_reference"][0])
    batch.components.update(comps)
    batch.rewards.copy_(rewards)
    trainer.algorithm.advantages(Scores(batch))



def test_rollouts_sample_with_the_old_policy_unless_asked_for_the_trained_weights(rolled):
    """Between syncs the rollout streams with the old policy, whatever the trained weights are; ``trained_weights``
    streams with the trained ones (what a diagnostic of one update re-rolls)."""
    trainer, batch, _ = rolled
    saved = [p.detach().clone() for p in trainer.params]
    try:
        with torch.no_grad():  # the trained weights move; the old policy (set at the first rollout) does not
            for p in trainer.params:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        assert torch.equal(trainer.rollout(trainer.plan(0), 0).latents, batch.latents)
        moved = trainer.rollout(trainer.plan(0), 0, trained_weights=True).latents
        assert float((moved - batch.latents).abs().max()) > 1e-3
    finally:
        with torch.no_grad():
            for p, v in zip(trainer.params, saved):
                p.copy_(v)


def test_loading_a_state_forgets_the_scores_of_the_old_policy_it_replaces(rolled):
    """Scores are cached per iteration; a loaded state (a resume, a diagnostic's restore) brings another old policy,
    whose scores are computed afresh instead of read from the cache of the one it replaced."""
    trainer, batch, _ = rolled
    algo, ctx = trainer.algorithm, trainer.policy
    ctx.iteration, ctx.epoch = 0, 0
    kept = algo.state_dict()
    before = algo._group_scores(ctx, batch, 0, "old").clone()
    saved = [p.detach().clone() for p in trainer.params]
    try:
        with torch.no_grad():  # another old policy: the trained weights moved, then synced into it
            for p in trainer.params:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        other = OldPolicy()
        other.move(trainer.params)
        algo.load_state_dict({"old": other.state_dict(), "iterations_since_sync": 0})
        after = algo._group_scores(ctx, batch, 0, "old")
        with torch.no_grad():
            fresh = algo.replay_scores(ctx, batch, torch.tensor([0, 1]), grad=False)
        assert torch.equal(after, fresh) and float((after - before).abs().max()) > 1e-6
    finally:
        with torch.no_grad():
            for p, v in zip(trainer.params, saved):
                p.copy_(v)
        algo.load_state_dict(kept)


@pytest.mark.slow  # about a minute on 2 cores: pytest -m slow
def test_a_re_caching_model_streams_branches_whose_routed_blocks_a_switch_re_writes(tmp_path):
    """``model.stream.recache=true`` (LongLive's re-cache at prompt switches) on the guidance-free model: the
    branched rollout runs through forks whose routed blocks end at a switch, where the re-cache re-writes them
    under the new prompt (it re-encodes unrouted, so it never asks for frames it dropped). The branches keep the
    reference run's blocks before the fork and differ from it in the routed ones."""
    import json

    streams = [json.loads(line) for line in (Path(CONF).parent / "assets/prompts/streams_train.jsonl").open()]
    one_switch = [s for s in streams if [seg["start"] for seg in s["segments"]] == [0, 25]]  # latent frame 7
    assert len(one_switch) >= 2
    train = tmp_path / "streams.jsonl"
    train.write_text("".join(json.dumps(s) + "\n" for s in one_switch))
    trainer = make_trainer(tmp_path / "run", "model=causal_wan_shapes_4step", "model.stream.recache=true",
                           f"data.train_file={train}", "trainer.prompts_per_iteration=1",
                           "trainer.train_batch_size=3", "algo.routed_blocks=1", "algo.outside_window=false")
    wan = trainer.adapter.wan
    # blocks of 1 frame, sink 1, window 4: the one fork whose routed block ends at the switch (frame 7) is 6; its
    # pool outside the unrouted window, [1, 3), is the one pair of frames (every branch the same: not eligible), so
    # the pool reaches into the window, [1, 5); the fork is drawn uniformly among the eligible ones
    for iteration in range(40):
        batch = trainer.rollout(trainer.plan(iteration), iteration)
        plan = batch.extras["routing"][0]
        if plan.end_frame == 7:
            break
    else:
        pytest.fail("no rollout in 40 iterations forked right before the switch")
    assert wan.recache_start(7) < plan.end_frame  # the switch's re-cache re-wrote routed frames
    fork = plan.fork_frame
    assert torch.isfinite(batch.latents).all()
    for r in (0, 1):
        assert torch.equal(batch.latents[r, :fork], batch.latents[2, :fork])
        assert not torch.equal(batch.latents[r, fork:plan.end_frame], batch.latents[2, fork:plan.end_frame])


def test_all_linear_lora_wraps_every_linear_of_every_block_and_nothing_else():
    """``model.lora.target_modules=[all-linear]`` (the official KVPO / LongLive LoRA: every linear layer of the
    transformer blocks, rank 256) on the embedded streaming model: each ``nn.Linear`` inside ``transformer.blocks``
    gets an adapter of that rank, and no module outside the blocks does (the embedders and the output projection
    stay frozen)."""
    from peft.tuners.lora import LoraLayer

    from flowgrpo.finetune import prepare_trainable
    from flowgrpo.models import load_stream_pipeline

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[*BASE, "model.lora.target_modules=[all-linear]", "model.lora.rank=256",
                                          "model.lora.alpha=256"])
    transformer = load_stream_pipeline(cfg.model).pipe.transformer
    linears = {n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    in_blocks = {n for n in linears if n.startswith("blocks.")}
    # q, k, v, out of both attentions and the feed-forward's two, per block; embedders and proj_out outside
    assert len(in_blocks) == 10 * len(transformer.blocks) and linears - in_blocks
    params = prepare_trainable(transformer, cfg.model)
    wrapped = {n for n, m in transformer.named_modules() if isinstance(m, LoraLayer)}
    assert wrapped == in_blocks
    for name in wrapped:
        layer = transformer.get_submodule(name)
        assert layer.r["default"] == 256 and layer.lora_A["default"].weight.shape[0] == 256
    trainable = {n for n, p in transformer.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("blocks.") and "lora_" in n for n in trainable)
    assert len(params) == 2 * len(in_blocks)


def test_evaluation_reads_the_ema_weights(tmp_path):
    """With ``trainer.ema.enabled=true`` a KVPO run's held-out evaluation streams with the EMA weights: moving the
    trained weights alone leaves its videos unchanged to the bit (and the trained weights are back afterwards),
    while the same evaluation of the trained weights makes other videos."""
    trainer = make_trainer(tmp_path, "trainer.ema.enabled=true")
    jobs = trainer.eval_jobs()[:2]
    videos = []
    original = trainer.adapter.generate

    def spy(*args, **kwargs):
        videos.append(original(*args, **kwargs))
        return videos[-1]

    trainer.adapter.generate = spy
    try:
        trainer.held_out_samples(jobs)
        with torch.no_grad():  # the trained weights move far; the EMA (the initial weights so far) does not
            for p in trainer.params:
                p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        moved = [p.detach().clone() for p in trainer.params]
        trainer.held_out_samples(jobs)
        assert all(torch.equal(p, m) for p, m in zip(trainer.params, moved))
        ema, trainer.ema = trainer.ema, None
        try:
            trainer.held_out_samples(jobs)
        finally:
            trainer.ema = ema
    finally:
        trainer.adapter.generate = original
    assert len(videos) == 3 and torch.equal(videos[1], videos[0])
    assert float((videos[2] - videos[0]).abs().max()) > 1e-2  # the trained weights make other videos


@torch.no_grad()
def test_teacher_forced_routed_blocks_equal_the_routed_stream(rolled):
    """The teacher-forced forward with a branch's route (what ``algo=kvpo_awm`` trains through) predicts each of its
    routed blocks, and the block after them, as the cached routed stream does at the same σ and input (no
    guidance): the routed blocks' clean and noisy frames attend the planned frames, and the next block attends the
    keys the routed write passes cached. The unrouted mask predicts the routed blocks otherwise."""
    trainer, batch, _ = rolled
    adapter = trainer.adapter
    plan, fork = batch.extras["routing"][0], int(batch.extras["fork_block"][0])
    K, S = batch.latents.shape[1], batch.latents.shape[2] - 1
    sigmas = batch.plan.sigmas
    clean = batch.latents[0:1, :, -1]
    blocks = [k for k in range(fork, plan.end_frame + 1) if k < K]   # the routed blocks and the one after them
    assert len(blocks) >= plan.blocks
    j = S // 2
    noisy = batch.latents[0:1, :, j].clone()
    sigma = torch.full((1, K), float(sigmas[j]))
    route = route_fn(plan, 0)
    forced = adapter.teacher_forced_velocity(clean, noisy, sigma, batch.cond[[0]], routes=[route])
    plain = adapter.teacher_forced_velocity(clean, noisy, sigma, batch.cond[[0]])
    unrouted = adapter.teacher_forced_velocity(clean, noisy, sigma, batch.cond[[0]], routes=[None])
    assert torch.equal(unrouted, plain)
    cond = batch.extras["fork_cond"][0]                             # the group's state before its fork
    for k in blocks:
        with adapter.routed(route):
            streamed = adapter.velocity(noisy[:, k], float(sigmas[j]), cond)
            cond = adapter.commit(clean[:, k], cond)
        assert float((forced[:, k] - streamed).abs().max()) < 1e-4, k
        if k < plan.end_frame:
            assert float((plain[:, k] - streamed).abs().max()) > 1e-3, k
    before = [k for k in range(K) if k < fork]                       # identical before the fork
    assert torch.equal(forced[:, before], plain[:, before])


def test_kvpo_awm_trains_the_routed_branches_by_awm_under_their_routes(rolled, monkeypatch):
    """``algo=kvpo_awm`` on KVPO's rollout: the loss is AWM's on each branch's blocks from its fork, through the
    teacher-forced forward with the branch's route (each branch's own, never a reference run's), weighted by the
    branch's KVPO advantage; a micro-batch of reference runs trains nothing; the gradient reaches only LoRA."""
    from omegaconf import OmegaConf

    from flowgrpo.algorithms import build_algorithm
    from flowgrpo.algorithms.kvpo import KVPOAWM

    trainer, batch, _ = rolled
    algo_cfg = OmegaConf.merge(OmegaConf.structured(KVPOAWM.config_class), {"name": "kvpo_awm", "kl_beta": 0.0})
    algo = build_algorithm(algo_cfg, trainer.cfg.sampler, batch.plan.sigmas, chunks=batch.latents.shape[1])
    assert isinstance(algo, KVPOAWM) and algo.rollout_guidance()
    ctx = trainer.policy
    ctx.iteration, ctx.epoch = 0, 0
    seen = []
    original = ctx.teacher_forced_velocity

    def spy(clean, noisy, sigma, cond, routes=None):
        seen.append([r(plan.fork_frame, 1, list(range(plan.fork_frame))) for r in routes])
        return original(clean, noisy, sigma, cond, routes=routes)

    plan = batch.extras["routing"][0]
    monkeypatch.setattr(ctx, "teacher_forced_velocity", spy)
    zero, info = algo.loss(ctx, batch, torch.tensor([2, 5]), torch.zeros(2, dtype=torch.long))
    assert info == {} and not seen and float(zero) == 0
    algo.ema.move(ctx.params)                                        # the trust region at the live weights
    loss, info = algo.loss(ctx, batch, torch.arange(3), torch.zeros(3, dtype=torch.long))
    # the EMA's forward and the live one, each with the two branches' own routes
    assert len(seen) == 2 and seen[0] == seen[1] == [[0, *plan.positions_per_branch[b], plan.fork_frame - 1]
                                                     for b in (0, 1)]                 # sink, older, nearest
    assert torch.isfinite(loss) and info["ema_kl"] == 0 and "policy_loss" in info
    loss.backward()
    grads = {n: p.grad for n, p in trainer.unwrapped.named_parameters() if p.grad is not None}
    assert grads and all("lora" in n for n in grads)
    assert any(float(g.abs().max()) > 0 for g in grads.values()) or all(float(a) == 0 for a in batch.advantages[:2])
    trainer.optimizer.zero_grad(set_to_none=True)


def test_after_switch_forks_and_the_routed_frames_reward_through_the_trainer(tmp_path):
    """``algo.fork=after_switch algo.local_reward=blocks``: every group forks in the first blocks after a prompt
    switch (its window still holding frames from before it), each row's metadata names the group's routed pixel
    frames, the reward scores them (``window/<name>``) and the local advantage is theirs (the mean of those
    components, ``algo.advantage_from=aggregate``; the global one from the scalar reward)."""
    from flowgrpo.algorithms.kvpo import fuse_advantages, reference_relative_advantage

    trainer = make_trainer(tmp_path, "algo.fork=after_switch", "algo.local_reward=blocks")
    batch = trainer.rollout(trainer.plan(0), 0)
    trainer.score(batch)
    trainer.advantage(batch)
    cfg = trainer.algorithm.cfg
    for p, plan in enumerate(batch.extras["routing"]):
        segments = batch.cond.segments[3 * p].tolist()
        switches = [k for k in range(1, len(segments)) if segments[k] != segments[k - 1]]
        assert any(s <= plan.fork_frame < s + 3 for s in switches), (plan.fork_frame, switches)   # window 4, blocks 1
        for r in range(3 * p, 3 * p + 3):
            assert batch.metadata[r]["window"] == [4 * plan.fork_frame - 3, 4 * (plan.end_frame - 1) + 1]
        comps = {k: v.cpu().double() for k, v in batch.components.items()}
        rows = slice(3 * p, 3 * p + 3)
        window = torch.stack([comps[f"window/{c}"][rows] for c in cfg.local_components]).mean(0)
        scalar = batch.rewards.cpu().double()[rows]
        expected = fuse_advantages(reference_relative_advantage(window[:2], window[2]),
                                   reference_relative_advantage(scalar[:2], scalar[2]), w_local=cfg.w_local,
                                   w_global=cfg.w_global, clip=cfg.adv_clip)
        assert torch.allclose(batch.advantages[3 * p: 3 * p + 2].cpu(), expected, atol=1e-6)
    assert all("window" not in m for m in trainer.train_set.metadata)   # the data's own records are untouched
