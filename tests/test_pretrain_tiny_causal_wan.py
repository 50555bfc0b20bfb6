"""``scripts/pretrain_tiny_causal_wan.py``: exact resume, an export that streams, and the training layout of
segments = the streaming pipeline's."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgrpo.models import StreamingWanPipeline
from flowgrpo.world.streams import latent_segments, sample_stream_metadata

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pretrain_tiny_causal_wan.py"
_spec = importlib.util.spec_from_file_location("pretrain_tiny_causal_wan", _SCRIPT)
pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _args(tmp_path, *extra):
    return ["--init", "toy", "--steps", "3", "--batch", "2", "--num-frames", "33", "--warmup", "1", "--log-every", "1",
            "--ckpt-every", "1", "--bank-size", "3", "--bank-refresh", "1", "--threads", "1", "--stream-steps", "2",
            "--out", str(tmp_path / "pipe"), "--ckpt-dir", str(tmp_path / "ckpt"), *extra]


def test_resume_is_exact_and_the_export_streams(tmp_path):
    straight = pc.main(_args(tmp_path / "a"))
    pc.main(_args(tmp_path / "b", "--stop-at", "2"))
    resumed = pc.main(_args(tmp_path / "b", "--resume"))
    for p, q in zip(straight.params, resumed.params):
        assert torch.equal(p, q)
    assert [e["loss"] for e in straight.log] == [e["loss"] for e in resumed.log]
    out = tmp_path / "a" / "pipe"
    assert json.loads((out / "pretrain_summary.json").read_text())["step"] == 3
    pipe = StreamingWanPipeline.from_pretrained(out)
    assert pipe.config.recache is False and pipe.config.window_frames == 4      # sampled as trained
    video = pipe(["a red circle moving left", "a red circle standing still"], switch_frames=[17], num_frames=33,
                 generator=torch.Generator().manual_seed(0)).videos
    assert video.shape == (1, 33, 3, 64, 64) and torch.isfinite(video).all()


def test_training_segments_are_the_pipelines_blocks():
    """The prompt each latent frame is trained under (the world's latent_segments) is the prompt the streaming
    pipeline generates that frame under, for switches anywhere the world puts them."""
    from flowgrpo.models import build_tiny_pipeline
    from flowgrpo.models.stream_pipeline import StreamConfig

    pipe = StreamingWanPipeline(build_tiny_pipeline("wan"), StreamConfig(block_frames=1, sink_frames=1))
    rng = np.random.default_rng(0)
    for _ in range(20):
        meta = sample_stream_metadata(rng)
        starts = [s["start"] for s in meta["segments"][1:]]
        _, segment_of_block = pipe.layout(len(meta["segments"]), starts, meta["num_frames"])
        assert segment_of_block == latent_segments(meta)


def test_the_shipped_streaming_asset_loads_offline_and_streams():
    """assets/tiny-causal-wan-shapes: a plain WanPipeline directory (from_pretrained, no extra arguments) plus its
    stream settings, under 30 MB; a short stream with a switch is a video in [0, 1]."""
    from diffusers import WanPipeline

    asset = Path(__file__).resolve().parents[1] / "assets" / "tiny-causal-wan-shapes"
    size = sum(f.stat().st_size for f in asset.rglob("*") if f.is_file())
    assert size < 30 * 2**20, size
    assert isinstance(WanPipeline.from_pretrained(asset), WanPipeline)
    pipe = StreamingWanPipeline.from_pretrained(asset, num_steps=2)
    assert (pipe.config.block_frames, pipe.config.sink_frames, pipe.config.window_frames) == (1, 1, 4)
    assert pipe.config.recache is False                 # trained without re-cache, sampled so
    video = pipe(["a red circle moving left", "a red circle standing still"], switch_frames=[9], num_frames=17,
                 generator=torch.Generator().manual_seed(0)).videos
    assert video.shape == (1, 17, 3, 64, 64) and 0 <= float(video.min()) <= float(video.max()) <= 1
