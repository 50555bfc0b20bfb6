"""StreamingWanPipeline: causal prefixes, prompt switches, batching, CFG, and the saved stream settings."""

import json

import pytest
import torch

from flowgrpo.models import build_tiny_pipeline
from flowgrpo.models.stream_pipeline import STREAM_CONFIG_NAME, StreamConfig, StreamingWanPipeline
from samplers import stream_noise

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FRAMES = 21  # 6 latent frames: blocks of 1, sink 1, window 3


@pytest.fixture(scope="module")
def pipe():
    config = StreamConfig(block_frames=1, num_steps=3, sink_frames=1, window_frames=3, guidance_scale=2.0,
                          height=32, width=32)
    return StreamingWanPipeline(build_tiny_pipeline("wan"), config)


def draws(batch, seed=0):
    return stream_noise(batch, 6, 3, (16, 1, 4, 4), generator=torch.Generator().manual_seed(seed))


def test_a_later_prompt_never_changes_earlier_blocks(pipe):
    """Causality: blocks before the switch are the same whatever the second prompt, and the same as a stream with
    no switch; the blocks from the switch on follow the second prompt."""
    noise, renoise = draws(1)
    kw = dict(num_frames=FRAMES, noise=noise, renoise=renoise, output_type="latent")
    one = pipe(["a red circle"], **kw).latents
    a = pipe(["a red circle", "a blue square"], switch_frames=[9], **kw)
    b = pipe(["a red circle", "a green triangle"], switch_frames=[9], **kw)
    assert a.switch_blocks == [3] and a.segment_of_block == [0, 0, 0, 1, 1, 1]   # pixel 9 → latent 3
    assert torch.equal(a.latents[:, :, :3], one[:, :, :3]) and torch.equal(a.latents[:, :, :3], b.latents[:, :, :3])
    assert (a.latents[:, :, 3:] - b.latents[:, :, 3:]).abs().max() > 1e-3
    assert (a.latents[:, :, 3:] - one[:, :, 3:]).abs().max() > 1e-3


def test_batched_streams_equal_streams_one_by_one(pipe):
    noise, renoise = draws(2, seed=1)
    prompts = [["a red circle", "a blue square"], ["a yellow square", "a black circle"]]
    both = pipe(prompts, switch_frames=[13], num_frames=FRAMES, noise=noise, renoise=renoise)
    assert both.videos.shape == (2, FRAMES, 3, 32, 32) and 0 <= both.videos.min() and both.videos.max() <= 1
    for row in range(2):
        alone = pipe([prompts[row]], switch_frames=[13], num_frames=FRAMES, noise=noise[row:row + 1],
                     renoise=renoise[row:row + 1], output_type="latent")
        assert (alone.latents - both.latents[row:row + 1]).abs().max() < 1e-5
    # the recorded trajectory is the sampler's: its last states are the blocks
    assert torch.equal(both.trajectory.final[:, 0], both.latents[:, :, :1])


def test_guidance_changes_the_stream(pipe):
    noise, renoise = draws(1, seed=2)
    kw = dict(num_frames=FRAMES, noise=noise, renoise=renoise, output_type="latent")
    guided = pipe(["a red circle"], **kw).latents
    plain = StreamingWanPipeline(pipe.pipe, StreamConfig(**{**pipe.config.__dict__, "guidance_scale": 1.0}))
    assert (plain(["a red circle"], **kw).latents - guided).abs().max() > 1e-3


def test_save_and_load_keep_the_stream_settings(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / STREAM_CONFIG_NAME).read_text())
    assert saved["window_frames"] == 3 and saved["num_steps"] == 3
    loaded = StreamingWanPipeline.from_pretrained(tmp_path, num_steps=2)
    assert loaded.config.num_steps == 2 and loaded.config.window_frames == 3
    (tmp_path / STREAM_CONFIG_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=STREAM_CONFIG_NAME):
        StreamingWanPipeline.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unknown stream settings"):
        StreamConfig.from_dict({"block_size": 3})


def test_bad_layouts_are_refused(pipe):
    with pytest.raises(ValueError, match="switch_frames"):
        pipe(["a", "b"], num_frames=FRAMES)
    with pytest.raises(ValueError, match="at least one block"):
        pipe(["a", "b"], switch_frames=[0], num_frames=FRAMES)
    with pytest.raises(ValueError, match="4·k \\+ 1"):
        pipe(["a"], num_frames=20)
    with pytest.raises(ValueError, match="same number"):
        pipe([["a", "b"], ["c"]], switch_frames=[9], num_frames=FRAMES)


def test_without_recache_a_switch_only_changes_the_prompt(pipe):
    """recache=False keeps the cache as written at a switch: the same blocks before it, different ones after it
    than with the re-cache."""
    noise, renoise = draws(1, seed=3)
    kw = dict(switch_frames=[9], num_frames=FRAMES, noise=noise, renoise=renoise, output_type="latent")
    plain = StreamingWanPipeline(pipe.pipe, StreamConfig(**{**pipe.config.__dict__, "recache": False}))
    kept = plain(["a red circle", "a blue square"], **kw).latents
    rewritten = pipe(["a red circle", "a blue square"], **kw).latents
    assert torch.equal(kept[:, :, :3], rewritten[:, :, :3]) and (kept[:, :, 3:] - rewritten[:, :, 3:]).abs().max() > 1e-4
