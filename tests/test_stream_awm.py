"""Streaming AWM (``algo=stream_awm``): the teacher-forced forward of the update reproduces, block by block, the
velocity the cached stream computes (prompt switches, sink, window and re-cache included); the stratified noise
levels cover every stratum; zero advantages give a zero policy gradient; per-segment advantages reach the blocks of
their segment only; and one iteration on the embedded streaming model trains, and resumes exactly.

The unit tests run a tiny random-initialised causal Wan in float64 whose weights are scaled up so every layer
matters (as tests/test_causal_wan.py); the end-to-end test runs the embedded model (assets/tiny-causal-wan-shapes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.algorithms import ALGORITHMS, Batch, Scores, UpdateContext
from flowgrpo.algorithms.stream_awm import (StreamAWM, schedule_shift, segment_advantages, sigma_cdf,
                                            stratified_sigmas)
from flowgrpo.models import StreamAdapter, StreamingWanPipeline, build_tiny_pipeline
from flowgrpo.models.stream_pipeline import StreamConfig
from samplers import chunked_rollout, stream_sde_mask, stream_sigmas
from doubles import keyed_generator  # tests/doubles.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
STEPS = 3


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def meta(*starts: int, frames: int = 25) -> dict:
    """A stream of ``frames`` pixel frames (25: 7 latent frames) whose segments start at ``starts``."""
    prompts = ["a red circle moving left", "a blue square moving up", "a green triangle standing still",
               "a red circle moving right"]
    return {"num_frames": frames, "segments": [{"start": s, "prompt": prompts[k]} for k, s in enumerate(starts)]}


@pytest.fixture(scope="module")
def tiny_pipe():
    """A tiny random Wan pipeline in float64, its transformer's weights scaled up (every layer matters)."""
    pipe = build_tiny_pipeline("wan", torch_dtype=torch.float64)
    g = gen(0)
    with torch.no_grad():
        for p in pipe.transformer.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return pipe


def make_adapter(pipe, **stream) -> StreamAdapter:
    cfg = StreamConfig(**{**dict(block_frames=1, num_steps=STEPS, shift=3.0, sink_frames=1, window_frames=3,
                                 recache=True, guidance_scale=1.0, max_sequence_length=8, height=32, width=32),
                          **stream})
    return StreamAdapter(StreamingWanPipeline(pipe, cfg))


def roll(adapter: StreamAdapter, metas: list[dict], seed: int = 1):
    """Each stream rolled out alone (rows that re-cache must switch together): block-0 conditioning of all rows,
    every block's conditioning per row, and the committed clean blocks ``[n, K, ...]``."""
    per_block, finals = [], []
    everyone = adapter.encode_prompts(["s"] * len(metas), "", guidance_scale=1.0, max_sequence_length=8,
                                      metadata=metas, num_frames=metas[0]["num_frames"])
    for i, m in enumerate(metas):
        cond = everyone[i]
        noise = adapter.prepare_noise(1, height=32, width=32, num_frames=m["num_frames"], generator=[gen(seed + i)])
        with torch.no_grad():
            traj = chunked_rollout(lambda x, s, k: adapter.velocity(x, s, k), adapter.commit, noise,
                                   adapter.sigmas(adapter.config.num_steps),
                                   stream_sde_mask(adapter.config.num_steps), cond=cond, kernel="cps",
                                   noise_level=1.0, generator=[gen(100 + seed + i)])
        per_block.append(traj.conds)
        finals.append(traj.latents[:, :, -1])
    return everyone, per_block, torch.cat(finals)


def noised(x0: torch.Tensor, seed: int = 5):
    g = gen(seed)
    sigma = torch.rand(x0.shape[:2], generator=g)
    eps = torch.randn(x0.shape, generator=g)
    s = sigma.view(*sigma.shape, *[1] * (x0.ndim - 2))
    return (1 - s) * x0 + s * eps, sigma


# ------------------------------------------------------------------------------------- the teacher-forced forward

LAYOUTS = {
    # blocks of 1, sink 1, window 3, re-cache at each switch: three runs per stream; rows with other switches
    "recache": (dict(), [meta(0, 9, 17), meta(0, 13)]),
    # the embedded model's rule: no re-cache, so one run over the whole stream whatever the switches
    "no_recache": (dict(recache=False, window_frames=4), [meta(0, 9, 17), meta(0, 5)]),
    # blocks of 2 latent frames (29 pixel frames: 4 blocks), plain block-causal without sink or window; a re-cache
    # re-writes every frame before the switch
    "blocks_of_2": (dict(block_frames=2, sink_frames=0, window_frames=None), [meta(0, 9, frames=29),
                                                                               meta(0, 17, frames=29)]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_teacher_forced_velocity_of_every_block_is_the_cached_streams(tiny_pipe, name):
    """One teacher-forced forward per stream gives every block the velocity the cached stream computes for it at
    the same σ and input; the same forward with one prompt for the whole stream, or (with re-cache) without the
    re-written window, does not."""
    stream, metas = LAYOUTS[name]
    adapter = make_adapter(tiny_pipe, **stream)
    cond, per_block, x0 = roll(adapter, metas)
    x_t, sigma = noised(x0)
    K = x0.shape[1]
    with torch.no_grad():
        forced = adapter.teacher_forced_velocity(x0, x_t, sigma, cond)
        cached = torch.stack([torch.cat([adapter.velocity(x_t[i:i + 1, k], sigma[i:i + 1, k], per_block[i][k])
                                         for i in range(len(metas))]) for k in range(K)], 1)
    assert forced.shape == x0.shape and forced.dtype == torch.float32
    assert (forced - cached).abs().max() < 1e-5 * cached.abs().max(), name
    switched = cond.segments != cond.segments[:, :1]
    with torch.no_grad():
        one_prompt = adapter.teacher_forced_velocity(x0, x_t, sigma, dataclasses.replace(
            cond, segments=torch.zeros_like(cond.segments)))
    gap = (one_prompt - cached).flatten(2).abs().amax(2)
    assert bool((gap[switched] > 1e-3).all()) and bool((gap[~switched] < 1e-5).all())
    if adapter.config.recache:
        adapter.config = dataclasses.replace(adapter.config, recache=False)
        with torch.no_grad():
            stale = adapter.teacher_forced_velocity(x0, x_t, sigma, cond)
        assert (stale - cached).abs().max() > 1e-3
        runs = [make_adapter(tiny_pipe, **stream).forcing_runs(row.tolist()) for row in cond.segments]
        assert all(len(r) == len(set(row.tolist())) for r, row in zip(runs, cond.segments))


def test_forcing_runs_of_a_re_caching_stream():
    """Blocks of 1, sink 1, window 3: a switch at block 3 re-writes frames [1, 3) under the new prompt, a switch at
    block 5 frames [3, 5); the sink keeps its first prompt."""
    adapter = make_adapter(build_tiny_pipeline("wan"))
    runs = adapter.forcing_runs([0, 0, 0, 1, 1, 2, 2])
    assert [(r.clean, r.clean_text, r.blocks) for r in runs] == [
        ((0, 1, 2), (0, 0, 0), (0, 1, 2)),
        ((0, 1, 2, 3, 4), (0, 1, 1, 1, 1), (3, 4)),
        ((0, 3, 4, 5, 6), (0, 2, 2, 2, 2), (5, 6)),
    ]
    adapter.config = dataclasses.replace(adapter.config, recache=False)
    assert [(r.clean, r.clean_text, r.blocks) for r in adapter.forcing_runs([0, 0, 0, 1, 1, 2, 2])] == [
        (tuple(range(7)), (0, 0, 0, 1, 1, 2, 2), tuple(range(7)))]
    adapter.config = dataclasses.replace(adapter.config, window_frames=None, cache_frames=4)
    with pytest.raises(NotImplementedError, match="model.stream.window_frames"):
        adapter.forcing_runs([0, 0, 1])


# ------------------------------------------------------------------------------------------ noise levels


@pytest.mark.parametrize("count", [1, 4, 13])
def test_stratified_sigmas_cover_every_stratum_in_a_random_order(count):
    orders = set()
    for seed in range(20):
        for shift, mean, std in ((3.0, 0.0, 1.0), (5.0, 0.5, 0.8)):
            sigma = stratified_sigmas(count, shift=shift, logit_mean=mean, logit_std=std, generator=gen(seed))
            assert sigma.shape == (count,) and bool(((sigma > 0) & (sigma < 1)).all())
            stratum = (count * sigma_cdf(sigma, shift=shift, logit_mean=mean, logit_std=std)).floor().long()
            assert sorted(stratum.tolist()) == list(range(count))
            orders.add(tuple(stratum.tolist()))
    assert len(orders) >= (1 if count == 1 else 10)  # the strata are dealt to the blocks in a random order
    assert torch.equal(stratified_sigmas(count, shift=3.0, generator=gen(7)),
                       stratified_sigmas(count, shift=3.0, generator=gen(7)))


def test_the_default_shift_is_the_models_own():
    for steps, shift in ((10, 3.0), (4, 5.0), (2, 1.0)):
        sigmas = torch.cat([stream_sigmas(steps, shift), torch.zeros(1)])
        assert schedule_shift(sigmas) == pytest.approx(shift, rel=1e-5)
        assert StreamAWM(sigmas, kernel="cps", chunks=3).time_shift == pytest.approx(shift, rel=1e-5)
    one = torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match="algo.shift"):
        StreamAWM(one, kernel="cps", chunks=3)
    assert StreamAWM(one, kernel="cps", chunks=3, shift=5.0).time_shift == 5.0


# ------------------------------------------------------------------------------------------ the loss


class StreamCtx(UpdateContext):
    """The update's view of a tiny streaming adapter; ``seen`` keeps every trained teacher-forced output, with its
    gradient retained."""

    def __init__(self, adapter: StreamAdapter):
        self.adapter = adapter
        self.params = [p for p in adapter.pipe.transformer.parameters()]
        for p in self.params:
            p.requires_grad_(True)
        self.updates = 0
        self.seen: list[torch.Tensor] = []

    def teacher_forced_velocity(self, clean, noisy, sigma, cond):
        v = self.adapter.teacher_forced_velocity(clean, noisy, sigma, cond)
        if v.requires_grad:
            v.retain_grad()
            self.seen.append(v)
        return v

    def reference(self):
        return contextlib.nullcontext()

    def generator(self, *keys):
        return keyed_generator(23, *keys)


@pytest.fixture(scope="module")
def rolled(tiny_pipe):
    """Two groups of two streams (a switch at block 3, and at blocks 2 and 5), rolled out by the tiny model."""
    adapter = make_adapter(tiny_pipe, recache=False, window_frames=4)
    metas = [meta(0, 13), meta(0, 13), meta(0, 9, 21), meta(0, 9, 21)]
    cond, _, x0 = roll(adapter, metas)
    return adapter, cond, x0


def make_batch(adapter, cond, x0, algo: StreamAWM) -> Batch:
    n, K = x0.shape[:2]
    plan = algo.plan(n // 2, 2, generator=gen(1))
    assert plan.sde_mask.ndim == 3 and plan.num_chunks == K and plan.trained_per_row == 1
    latents = x0.unsqueeze(2).expand(n, K, STEPS + 1, *x0.shape[2:])  # only the final state is read
    return Batch(prompts=["s"] * n, metadata=None, global_rows=torch.arange(n), cond=cond, plan=plan,
                 latents=latents.contiguous())


def grads(ctx: StreamCtx) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in ctx.params]


def test_zero_advantages_give_zero_policy_gradient(rolled):
    adapter, cond, x0 = rolled
    ctx = StreamCtx(adapter)
    for betas in (dict(ema_kl_beta=0.0, kl_beta=0.0), dict(ema_kl_beta=1.0, kl_beta=0.0)):
        algo = StreamAWM(adapter.sigmas(STEPS), kernel="cps", chunks=x0.shape[1], **betas)
        batch = make_batch(adapter, cond, x0, algo)
        rows, steps = batch.plan.trained_transitions()
        for advantages, zero in ((torch.zeros(4), True), (torch.tensor([1.0, -1.0, 0.5, -0.5]), False)):
            batch.advantages = advantages
            for p in ctx.params:
                p.grad = None
            loss, info = algo.loss(ctx, batch, rows, steps)
            loss.backward()
            norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads(ctx)))
            assert torch.isfinite(loss) and (float(norm) == 0.0) == zero, (betas, advantages, float(norm))
            assert {"policy_loss", "fm_loss", "weighted_fm", "sigma_mean"} <= set(info)
            assert ("ema_kl" in info) == (betas["ema_kl_beta"] > 0)
        # one teacher-forced forward for the trained weights per loss call (plus the EMA's, without gradient)
        assert len(ctx.seen) == 2
        ctx.seen.clear()


def test_group_noise_shares_the_draws_of_a_group_so_identical_members_cancel(rolled):
    """With algo.group_noise the members of a group are re-noised with the same levels and noise: two members that
    committed the same blocks then give the same loss gradient, and opposite advantages cancel it exactly; with a
    draw per stream they do not."""
    adapter, cond, x0 = rolled
    twins = x0.clone()
    twins[1], twins[3] = twins[0], twins[2]           # each group's second stream repeats its first
    norms = {}
    for group_noise in (True, False):
        ctx = StreamCtx(adapter)
        algo = StreamAWM(adapter.sigmas(STEPS), kernel="cps", chunks=x0.shape[1], ema_kl_beta=0.0, kl_beta=0.0,
                         group_noise=group_noise)
        batch = make_batch(adapter, cond, twins, algo)
        batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
        rows, steps = batch.plan.trained_transitions()
        for p in ctx.params:
            p.grad = None
        loss, info = algo.loss(ctx, batch, rows, steps)
        loss.backward()
        norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads(ctx))))
        v = ctx.seen[-1].detach()
        same_input = torch.equal(v[0], v[1]) and torch.equal(v[2], v[3])
        assert same_input == group_noise, group_noise
        norms[group_noise] = norm
    assert norms[True] < 1e-6 * norms[False], norms   # cancelled up to float rounding of a batched forward


def test_per_segment_advantages_reach_the_blocks_of_their_segment_only(rolled):
    adapter, cond, x0 = rolled
    ctx = StreamCtx(adapter)
    algo = StreamAWM(adapter.sigmas(STEPS), kernel="cps", chunks=x0.shape[1], advantage="segment",
                     ema_kl_beta=0.0, kl_beta=0.0)
    batch = make_batch(adapter, cond, x0, algo)
    nan = float("nan")
    # group 0 (2 segments) differs only in segment 1, group 1 (3 segments) only in segment 2
    batch.components = {
        "segment0/adherence": torch.tensor([0.5, 0.5, 0.2, 0.2]), "segment0/speed": torch.tensor([1.0, 1.0, 0.0, 0.0]),
        "segment0/recovery": torch.tensor([nan, nan, nan, nan]),
        "segment1/adherence": torch.tensor([0.9, 0.1, 0.4, 0.4]), "segment1/speed": torch.tensor([1.0, 0.0, 0.3, 0.3]),
        "segment1/recovery": torch.tensor([1.0, 0.0, 0.5, 0.5]),
        "segment2/adherence": torch.tensor([nan, nan, 0.0, 1.0]), "segment2/speed": torch.tensor([nan, nan, 0.0, 0.6]),
        "segment2/recovery": torch.tensor([nan, nan, 0.0, 1.0]),
    }
    batch.rewards = torch.zeros(4)  # the stream's reward is not read: the segments' components are
    per_row = algo.advantages(Scores(batch))
    per_segment = batch.extras["segment_advantages"]
    assert per_segment.shape == (4, 3)
    assert per_segment[:2, 0].abs().max() == 0 and per_segment[2:, :2].abs().max() == 0
    assert per_segment[0, 1] > 0 > per_segment[1, 1] and per_segment[2, 2] < 0 < per_segment[3, 2]
    assert torch.allclose(per_row, per_segment.gather(1, cond.segments).mean(1))
    batch.advantages = per_row
    rows, steps = batch.plan.trained_transitions()
    loss, _ = algo.loss(ctx, batch, rows, steps)
    loss.backward()
    v = ctx.seen[-1]                                            # [4, K, C, F, h, w]: the blocks of the streams
    reached = v.grad.view(4, x0.shape[1], -1).abs().amax(2) > 0
    own = torch.tensor([[1], [1], [2], [2]]) == cond.segments   # the segment that differs in each group
    assert torch.equal(reached, own), (reached, cond.segments)
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in ctx.params)


def test_stream_plus_segment_advantages_add_the_streams_to_its_segments(rolled):
    adapter, cond, x0 = rolled
    algo = StreamAWM(adapter.sigmas(STEPS), kernel="cps", chunks=x0.shape[1], advantage="stream+segment",
                     ema_kl_beta=0.0, kl_beta=0.0)
    batch = make_batch(adapter, cond, x0, algo)
    nan = float("nan")
    batch.components = {  # segment 1 differs in group 0, segment 2 in group 1
        "segment0/adherence": torch.tensor([0.5, 0.5, 0.2, 0.2]),
        "segment1/adherence": torch.tensor([0.9, 0.1, 0.4, 0.4]),
        "segment2/adherence": torch.tensor([nan, nan, 0.0, 1.0]),
    }
    algo.cfg.segment_components = ["adherence"]
    batch.rewards = torch.tensor([0.3, 0.7, 0.1, 0.2])
    # the stream advantages come from the whole reward
    torch.testing.assert_close(algo.advantages(Scores(batch)), algo.reward_advantages(batch.rewards, 2))
    per_segment = batch.extras["segment_advantages"]
    batch.advantages = torch.tensor([-1.0, 1.0, 0.5, -0.5])
    rows = torch.arange(4)
    blocks = algo.block_advantages(batch, rows)
    expected = batch.advantages[:, None] + per_segment.gather(1, cond.segments)
    assert torch.equal(blocks, expected)
    # a block of a segment that ties within its group carries the stream's advantage alone
    tied = per_segment.gather(1, cond.segments) == 0
    assert tied.any() and torch.equal(blocks[tied], batch.advantages[:, None].expand_as(blocks)[tied])
    # the members' segment advantages oppose their stream advantages in group 0's segment 1: they cancel there
    assert blocks[0][cond.segments[0] == 1].abs().max() < 1.0


def test_segment_advantages_by_hand_and_errors_name_the_key():
    segments = torch.tensor([[0, 0, 1], [0, 0, 1]])
    comps = {"segment0/a": torch.tensor([1.0, 3.0]), "segment0/b": torch.tensor([1.0, 1.0]),
             "segment1/a": torch.tensor([2.0, 2.0]), "segment1/b": torch.tensor([float("nan"), 1.0])}
    adv = segment_advantages(comps, segments, 2, ["a", "b"], clip=5.0)
    # segment 0: rewards (1+1)/2, (3+1)/2 = 1, 2: ±0.5/(0.5+1e-4); segment 1: b is not finite for every member, a ties
    assert torch.allclose(adv[:, 0], torch.tensor([-0.5, 0.5]) / (0.5 + 1e-4)) and adv[:, 1].abs().max() == 0
    with pytest.raises(KeyError, match="algo.advantage=segment"):
        segment_advantages({"adherence": torch.zeros(2)}, segments, 2, ["a"], clip=5.0)


# ------------------------------------------------------------------------------------------ through the trainer

BASE = [
    "experiment=stream_awm_shapes", "logger=none",
    "trainer.iterations=2", "trainer.prompts_per_iteration=1", "trainer.group_size=2",
    "trainer.train_batch_size=2", "trainer.gradient_accumulation_steps=1", "trainer.lr=1e-2",
    "trainer.eval_before=false", "trainer.eval_every=0", "trainer.gallery_every=0", "trainer.checkpoint_every=0",
    "trainer.eval_num_prompts=2", "data.max_prompts=8",
    # kept cheap: 4 steps per block without CFG
    "model.guidance_scale=1.0", "model.stream.num_steps=4", "sampler.num_steps=4", "sampler.eval_num_steps=4",
]


def make_cfg(out, *overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train", overrides=[*BASE, f"trainer.output_dir={out}", *overrides])


def test_the_module_registers_a_streaming_algorithm_and_its_preset_trains_one_object_streams():
    assert ALGORITHMS["stream_awm"].streaming and ALGORITHMS["stream_awm"].__module__.endswith(".stream_awm")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        ours = compose("train", overrides=["experiment=stream_awm_shapes"])
        grpo = compose("train", overrides=["experiment=stream_grpo_shapes"])
    flowgrpo.config.validate(ours)
    assert ours.algo.name == "stream_awm" and not ours.algo.cfg_in_training and ours.algo.group_noise
    for group in ("model", "sampler", "reward"):  # streaming GRPO's model, sampler and reward ...
        assert ours[group] == grpo[group], group
    # ... on one-object streams: trained on those of the streams training file, held out on their own file
    assert ours.data.train_file == grpo.data.train_file and list(ours.data.train_tags) == ["one_object_stream"]
    held_out = [json.loads(line) for line in (ROOT / ours.data.val_file).read_text().splitlines()]
    assert len(held_out) == 100 and {m["tag"] for m in held_out} == {"one_object_stream"}
    t = ours.trainer
    assert t.prompts_per_iteration * t.group_size == t.train_batch_size * t.gradient_accumulation_steps
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        bad = compose("train", overrides=["experiment=stream_awm_shapes", "algo.cfg_in_training=true"])
    with pytest.raises(flowgrpo.config.ConfigError, match="algo.cfg_in_training"):
        flowgrpo.config.validate(bad)


def test_one_iteration_trains_and_a_run_resumes_exactly(tmp_path):
    """On the embedded streaming model: an iteration has a finite loss, moves the LoRA weights, and runs one
    teacher-forced forward of the trained weights per stream (plus the EMA's and the reference's, without
    gradient); two iterations straight == one, a checkpoint, a resume and one more."""
    from flowgrpo.trainer import Trainer

    TERMS = ("algo.ema_kl_beta=1.0", "algo.kl_beta=0.001")  # the preset has neither; both are exercised here

    straight = Trainer(make_cfg(tmp_path / "a", *TERMS), tmp_path / "a")
    assert isinstance(straight.algorithm, StreamAWM) and straight.batch.trained_steps == 1
    assert straight.algorithm.time_shift == pytest.approx(3.0, rel=1e-5)
    calls = []
    forward = straight.adapter.teacher_forced_velocity

    def counted(clean, noisy, sigma, cond, **kw):
        calls.append((clean.shape[0], torch.is_grad_enabled()))
        return forward(clean, noisy, sigma, cond, **kw)

    straight.adapter.teacher_forced_velocity = counted
    start = [p.detach().clone() for p in straight.params]
    first = straight.step()
    assert calls == [(2, False), (2, False), (2, True)]  # EMA, reference, trained: each one forward of 2 streams
    assert all(torch.isfinite(torch.tensor(first[k])) for k in ("train/loss", "train/policy_loss", "train/fm_loss"))
    assert {"train/ema_kl", "train/kl", "train/sigma_mean"} <= set(first)
    assert straight.updates == 1 and not all(torch.equal(p, q) for p, q in zip(start, straight.params))
    rewards = [first["reward/mean"], straight.step()["reward/mean"]]

    other = Trainer(make_cfg(tmp_path / "b", *TERMS), tmp_path / "b")
    resumed_rewards = [other.step()["reward/mean"]]
    assert other.save_checkpoint() is not None
    resumed = Trainer(make_cfg(tmp_path / "b", *TERMS, "trainer.resume=auto"), tmp_path / "b")
    resumed.maybe_resume()
    assert resumed.iteration == 1 and resumed.algorithm.ema.weights is not None
    resumed_rewards.append(resumed.step()["reward/mean"])
    for (name, p), (_, q) in zip(straight.unwrapped.named_parameters(), resumed.unwrapped.named_parameters()):
        assert torch.equal(p, q), name
    assert rewards == resumed_rewards


def test_per_segment_advantages_through_the_trainer(tmp_path):
    """``algo.advantage=segment`` on the embedded model: phase 4 forms per-segment advantages from the long-video
    reward's ``segment<k>/...`` components, each stream's advantage is the mean of its blocks', and the update is
    finite."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(make_cfg(tmp_path, "algo.advantage=segment", "trainer.iterations=1"), tmp_path)
    batch = trainer.score(trainer.rollout(trainer.plan(0), 0))
    trainer.advantage(batch)
    per_segment = batch.extras["segment_advantages"]
    segments = batch.cond.segments
    assert per_segment.shape == (2, int(segments.max()) + 1) and bool(torch.isfinite(per_segment).all())
    assert torch.allclose(batch.advantages.cpu(), per_segment.gather(1, segments).mean(1))
    scalars = trainer.update(batch, 0)
    assert trainer.updates == 1 and all(torch.isfinite(torch.tensor(v)) for v in scalars.values())


def test_taros_on_the_long_video_aspects_through_the_trainer(tmp_path):
    """``reward.aggregate.name=taros`` with the long-video reward: phase 4 is TaRoS (the paper's, at its defaults) over
    the reward's eight weighted aspects (its score is their weighted mean), computed from the batch's components (the
    update reads advantages whatever made them); a long-video reward that scores one aspect has nothing to take apart
    and is refused, before and after it is built."""
    import rewards
    from flowgrpo.builders.reward import build_aggregator
    from flowgrpo.trainer import Trainer
    from rewards.aggregate import TaRoS
    from rewards.streams import COMPONENTS

    trainer = Trainer(make_cfg(tmp_path, "reward.aggregate.name=taros", "trainer.iterations=1"), tmp_path)
    assert set(trainer.aggregator.weights) == set(COMPONENTS) and len(COMPONENTS) == 8
    batch = trainer.score(trainer.rollout(trainer.plan(0), 0))
    trainer.advantage(batch)
    assert trainer.aggregator.components == list(trainer.aggregator.weights)  # no order given: the reward's
    reference = TaRoS(trainer.aggregator.components)  # beta 0.3, every tau calibrated (median of the group means)
    expected = reference({k: batch.components[k] for k in COMPONENTS}, group_size=batch.plan.group_size)
    assert torch.equal(batch.global_advantages.cpu(), expected)
    assert torch.allclose(batch.rewards.cpu(), torch.stack([batch.components[k].cpu() for k in COMPONENTS]).mean(0))

    one = make_cfg(tmp_path / "one", "reward.aggregate.name=taros", "reward.kwargs.score=recovery")
    with pytest.raises(flowgrpo.config.ConfigError, match=r"reward.aggregate.name='taros'.*score=mean"):
        flowgrpo.config.validate(one)
    with pytest.raises(ValueError, match="scores one component"):
        build_aggregator(one, rewards.load("long_video", score="recovery"))
