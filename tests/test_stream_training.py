"""Training a streaming model: the trainer's block-by-block rollout is the streaming pipeline's sampler, its
re-noise log-probs are rescored exactly under each block's own cache, config pairs streaming models with streaming
algorithms, and a streaming run resumes exactly. On the embedded streaming model (assets/tiny-causal-wan-shapes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.config import ConfigError, validate
from twins import suite_threads  # tests/twins.py

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
ASSET = ROOT / "assets" / "tiny-causal-wan-shapes"

BASE = [  # the guided 10-step model (CFG paths); the presets train the guidance-free 4-step one
    "experiment=stream_grpo_shapes", "model=causal_wan_shapes", "logger=none",
    "trainer.iterations=2", "trainer.prompts_per_iteration=2", "trainer.group_size=2",
    "trainer.train_batch_size=4", "trainer.gradient_accumulation_steps=1", "trainer.lr=1e-2",
    "trainer.eval_before=false", "trainer.eval_every=0", "trainer.gallery_every=0", "trainer.checkpoint_every=0",
    "trainer.eval_num_prompts=2", "data.max_prompts=8",
]


def make_cfg(out, *overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train", overrides=[*BASE, f"trainer.output_dir={out}", *overrides])


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(suite_threads())
    yield
    torch.set_num_threads(before)


def test_the_adapter_rollout_is_the_streaming_pipeline():
    """``chunked_rollout`` over ``StreamAdapter`` (cps at noise level 1, SDE on every step but the last) samples what
    ``StreamingWanPipeline`` samples from the same draws, prompt switch included; and every block's kept
    conditioning holds exactly the frames written before it."""
    from diffusers.utils.torch_utils import randn_tensor

    from flowgrpo.models import StreamAdapter, StreamingWanPipeline
    from samplers import chunked_rollout, stream_sde_mask

    pipe = StreamingWanPipeline.from_pretrained(str(ASSET))
    adapter = StreamAdapter(pipe)
    c = pipe.config
    meta = {"num_frames": 13, "segments": [{"start": 0, "prompt": "a red circle moving left"},
                                           {"start": 5, "prompt": "a blue square moving up"}]}
    sigmas = adapter.sigmas(c.num_steps)
    cond = adapter.encode_prompts(["stream"], "", guidance_scale=c.guidance_scale,
                                  max_sequence_length=c.max_sequence_length, metadata=[meta], num_frames=13)
    assert cond.segments.tolist() == [[0, 0, 1, 1]]  # latent frames 0-3; the switch at pixel 5 starts block 2
    noise = adapter.prepare_noise(1, height=64, width=64, num_frames=13, generator=[torch.Generator().manual_seed(3)])
    gen = torch.Generator().manual_seed(3)
    shape = tuple(adapter.join_chunks(noise).shape)  # [1, C, 4, h, w]
    full = randn_tensor(shape, generator=[gen], dtype=torch.float32)
    assert torch.equal(adapter.join_chunks(noise), full)
    blocks, steps = 4, c.num_steps
    block = (1, shape[1], 1, *shape[3:])
    renoise = torch.stack([torch.stack([torch.randn(block, generator=gen) for _ in range(steps - 1)], 1)
                           for _ in range(blocks)], 1)
    with torch.no_grad():
        traj = chunked_rollout(lambda x, s, k: adapter.velocity(x, s, k, guidance_scale=c.guidance_scale),
                               adapter.commit, noise, sigmas, stream_sde_mask(steps), cond=cond, kernel="cps",
                               noise_level=1.0, generator=[torch.Generator().manual_seed(99)])
    # the pipeline, from the draws the adapter's generator made (its re-noise draws reproduced in order)
    gen_b = torch.Generator().manual_seed(3)
    torch.randn(shape, generator=gen_b)
    with torch.no_grad():
        traj_b = chunked_rollout(lambda x, s, k: adapter.velocity(x, s, k, guidance_scale=c.guidance_scale),
                                 adapter.commit, noise, sigmas, stream_sde_mask(steps), cond=cond, kernel="cps",
                                 noise_level=1.0, generator=[gen_b])
        out = pipe([m["prompt"] for m in meta["segments"]], switch_frames=[5], num_frames=13, height=64, width=64,
                   noise=torch.stack(full.split(1, dim=2), 1), renoise=renoise, output_type="latent")
        late = pipe([m["prompt"] for m in meta["segments"]], switch_frames=[9], num_frames=13, height=64, width=64,
                    noise=torch.stack(full.split(1, dim=2), 1), renoise=renoise, output_type="latent")
    # the same sampler on the same draws: bit for bit; a switch one block late moves the last blocks by ~1
    ours = adapter.join_chunks(traj_b.final)
    assert torch.equal(ours, out.latents)
    assert torch.equal(ours[:, :, :2], late.latents[:, :, :2])
    assert (ours[:, :, 2:] - late.latents[:, :, 2:]).abs().max() > 0.1
    assert not torch.allclose(traj.final, traj_b.final, atol=1e-2)  # other re-noise draws, another stream
    assert traj_b.nfe == blocks * steps
    assert [k.cache.positions for k in traj_b.conds] == [[], [0], [0, 1], [0, 1, 2]]
    assert [k.block for k in traj_b.conds] == [0, 1, 2, 3]
    assert torch.all(traj_b.log_probs[:, :, -1] == 0) and torch.all(traj_b.log_probs[:, :, :-1] != 0)


def test_held_out_streams_keep_no_block_context():
    """Held-out streams need only their samples: ``StreamAdapter.generate`` keeps no block's conditioning (its KV
    cache) past the block after it, none is alive while the videos decode, and the samples are those of the rollout
    that keeps every block's."""
    import gc
    import weakref

    from flowgrpo.models import StreamAdapter, StreamingWanPipeline
    from samplers import chunked_rollout, stream_sde_mask

    adapter = StreamAdapter(StreamingWanPipeline.from_pretrained(str(ASSET)))
    c = adapter.config
    meta = {"num_frames": 13, "segments": [{"start": 0, "prompt": "a red circle moving left"}]}
    size = {"height": 64, "width": 64, "num_frames": 13}
    model_kw = {"guidance": {"guidance_scale": c.guidance_scale}, "size": size, "negative_prompt": "",
                "max_sequence_length": c.max_sequence_length}
    written, alive = [], []
    commit, decode = adapter.commit, adapter.decode

    def tracked_commit(x0, cond):
        nxt = commit(x0, cond)
        written.append(weakref.ref(nxt.cache.keys[0]))
        return nxt

    def tracked_decode(latents):
        gc.collect()
        alive.append(sum(ref() is not None for ref in written))
        return decode(latents)

    adapter.commit, adapter.decode = tracked_commit, tracked_decode
    sigmas = adapter.sigmas(c.num_steps)
    video = adapter.generate(["s"], [meta], [torch.Generator().manual_seed(5)], sigmas=sigmas, model_kw=model_kw)
    assert len(written) == 3 and alive == [0]  # three blocks written after; not one cache left at the decode
    gen = torch.Generator().manual_seed(5)
    cond = adapter.encode_prompts(["s"], "", guidance_scale=c.guidance_scale,
                                  max_sequence_length=c.max_sequence_length, metadata=[meta], num_frames=13)
    with torch.no_grad():
        traj = chunked_rollout(lambda x, s, k: adapter.velocity(x, s, k, guidance_scale=c.guidance_scale), commit,
                               adapter.prepare_noise(1, generator=[gen], **size), sigmas,
                               stream_sde_mask(c.num_steps), cond=cond, kernel="cps", noise_level=1.0, generator=[gen])
        expected = decode(adapter.join_chunks(traj.final)).float().clamp(0, 1)
    assert len(traj.conds) == 4 and torch.equal(video, expected)


def test_stream_grpo_rescores_every_trained_transition_exactly(tmp_path):
    """With unchanged weights the update's log π of every trained re-noise transition, rescored under the cache its
    block was sampled with, is the rollout's (CFG and KL term included): to float rounding, as a micro-batch's rows
    are rescored block by block in sub-batches whose size differs from the rollout's (CPU matmuls round by batch
    size), so the per-element ratio is 1 within 1e-6. With trainer.offload_kept_context=true the kept context waits
    as host copies (made here on the CPU because an observer asks for them, as a plan does) and is rescored bit for
    bit as in place. After one update the LoRA weights have moved and so have the log-probs."""
    from flowgrpo.offload import HostCopy, observe_host_copies
    from flowgrpo.trainer import Trainer

    trainer = Trainer(make_cfg(tmp_path, "algo.kl_beta=0.01", "trainer.offload_kept_context=true"), tmp_path)
    assert trainer.rollout_engine.offload_context
    assert "reward: long_video v2 (score=mean);" in trainer.banner()  # the log names the reward's rules
    jobs = trainer.eval_jobs()
    key = trainer.held_out_key(jobs)
    identity = trainer.run_identity()
    assert identity["reward_version"] == 2
    trainer.reward.version = 1  # the same config under other rules: held-out scores are not shared, and a run
    assert trainer.held_out_key(jobs) != key  # scored so is another experiment for trainer.resume=auto
    assert trainer.run_identity() == {**identity, "reward_version": 1}
    del trainer.reward.version
    batch = trainer.rollout(trainer.plan(0), 0)
    plan = batch.plan
    assert plan.sde_mask.ndim == 3 and plan.num_chunks == 13 and plan.sigmas.shape[0] == 11
    assert batch.latents.shape[:3] == (4, 13, 11) and len(batch.chunk_conds) == 13
    # a block's context (its KV cache) is kept for the rows that train a step of it, and only for them
    kept = torch.stack([r >= 0 for r in batch.chunk_rows], 1)
    assert torch.equal(kept, plan.train_mask.any(-1)) and not bool(kept.all())
    assert [None if c is None else len(c) for c in batch.chunk_conds] == [int(k.sum()) or None for k in kept.T]
    flat = plan.train_mask.flatten(1)
    assert flat.sum(1).tolist() == [11] * 4  # 10 % of 13 × 9 re-noise transitions
    assert torch.all(batch.log_probs[~plan.sde_mask] == 0)
    steps = trainer.transitions(batch, 0, 0)
    rows = torch.arange(4)
    again = torch.stack([trainer.algorithm.transition_log_prob(trainer.policy, batch, rows, steps[:, j])
                         for j in range(steps.shape[1])], 1)
    stored = batch.log_probs.flatten(1).gather(1, steps)
    numel = batch.latents[0, 0, 0].numel()
    assert torch.allclose(torch.exp((again - stored) / numel), torch.ones_like(again), rtol=0, atol=1e-6)
    copies = []
    with observe_host_copies(copies.append):
        copied = trainer.rollout(trainer.plan(0), 0)
    held = [c for c in copied.chunk_conds if c is not None]
    assert held and all(isinstance(c, HostCopy) for c in held)
    assert all(t.device.type == "cpu" for t in copies) and len(copies) >= sum(
        2 * len(p.cache.keys) for c in held for p in c.parts if p.cache.keys[0] is not None)  # keys and values
    assert torch.equal(copied.latents, batch.latents) and torch.equal(torch.stack(
        [trainer.algorithm.transition_log_prob(trainer.policy, copied, rows, steps[:, j])
         for j in range(steps.shape[1])], 1), again)
    trainer.score(batch)
    assert batch.images.shape == (4, 49, 3, 64, 64)
    before = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if p.requires_grad}
    trainer.advantage(batch)
    scalars = trainer.update(batch, 0)
    assert trainer.updates == 1 and scalars["train/kl"] >= 0
    moved = [n for n, p in trainer.unwrapped.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved and all("lora" in n for n in moved)
    after = torch.stack([trainer.algorithm.transition_log_prob(trainer.policy, batch, rows, steps[:, j])
                         for j in range(steps.shape[1])], 1)
    assert (after - stored).abs().max() > 1e3 * (again - stored).abs().max()


def test_a_streaming_run_resumes_exactly(tmp_path):
    """Two iterations straight == one, a checkpoint, a resume and one more (LoRA weights and rewards). Kept cheap:
    one prompt per iteration, 4 steps per block without CFG, and the runs step without fit() (whose resume path the
    image runs test), so no evaluation of 49-frame streams is spent."""
    from flowgrpo.trainer import Trainer

    small = ["trainer.prompts_per_iteration=1", "trainer.train_batch_size=2", "model.guidance_scale=1.0",
             "model.stream.num_steps=4", "sampler.num_steps=4", "sampler.eval_num_steps=4"]
    straight = Trainer(make_cfg(tmp_path / "a", *small), tmp_path / "a")
    start = [p.detach().clone() for p in straight.params]
    rewards = [straight.step()["reward/mean"] for _ in range(2)]
    assert straight.updates == 2 and not all(torch.equal(p, q) for p, q in zip(start, straight.params))
    first = Trainer(make_cfg(tmp_path / "b", *small), tmp_path / "b")
    resumed_rewards = [first.step()["reward/mean"]]
    assert first.save_checkpoint() is not None
    resumed = Trainer(make_cfg(tmp_path / "b", *small, "trainer.resume=auto"), tmp_path / "b")
    resumed.maybe_resume()
    assert resumed.iteration == 1
    resumed_rewards.append(resumed.step()["reward/mean"])
    assert resumed.iteration == 2
    for (name, p), (_, q) in zip(straight.unwrapped.named_parameters(), resumed.unwrapped.named_parameters()):
        assert torch.equal(p, q), name
    assert rewards == resumed_rewards


@pytest.mark.parametrize("overrides, message", [
    (["model=causal_wan_shapes", "algo=grpo"], "is a streaming model"),
    (["model=sd3_shapes", "algo=stream_grpo"], "algo=stream_grpo trains a streaming model"),
    (["experiment=stream_grpo_shapes", "sampler.num_steps=10"], r"sampler.num_steps=10: .* model.stream.num_steps=4"),
    (["experiment=stream_grpo_shapes", "model=causal_wan_shapes", "sampler.num_steps=4"],
     r"sampler.num_steps=4: .* model.stream.num_steps=10"),
    (["experiment=stream_grpo_shapes", "sampler=sde"], "sampler.kernel='flow_grpo'"),
    (["experiment=stream_grpo_shapes", "sampler.shift=3.0"], "sampler.shift=3.0"),
    (["trainer.offload_kept_context=true"], r"trainer.offload_kept_context=true: only a streaming model .* "
                                             r"model.family='sd3' keeps none"),
])
def test_streaming_models_train_only_with_streaming_algorithms(overrides, message):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


@pytest.mark.parametrize("overrides, asset", [
    (["experiment=stream_grpo_shapes"], "tiny-causal-wan-shapes-4step"),
    (["experiment=stream_awm_shapes"], "tiny-causal-wan-shapes-4step"),
    (["experiment=kvpo_shapes"], "tiny-causal-wan-shapes-4step"),
    (["experiment=stream_grpo_shapes", "model=causal_wan_shapes"], "tiny-causal-wan-shapes"),
])
def test_the_streaming_presets_compose_to_their_assets_own_settings(overrides, asset):
    import json

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    validate(cfg)
    assert Path(cfg.model.pretrained).name == asset
    saved = json.loads((ROOT / "assets" / asset / "stream_config.json").read_text())
    for key in ("block_frames", "num_steps", "shift", "sink_frames", "window_frames", "cache_frames", "recache"):
        assert cfg.model.stream[key] == saved[key], key
    for key in ("guidance_scale", "max_sequence_length", "height", "width"):
        assert cfg.model[key] == saved[key], key
    assert cfg.sampler.num_steps == cfg.sampler.eval_num_steps == saved["num_steps"]
    assert (cfg.sampler.kernel, cfg.sampler.noise_level) == ("cps", 1.0)
