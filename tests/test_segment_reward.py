"""``rewards.load("segments", reward=...)``: a clip reward per segment of a stream, against each segment's prompt."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import rewards
from flowgrpo.world.streams import perturb_stream, render_stream

STREAMS = Path(__file__).resolve().parents[1] / "assets" / "prompts" / "streams_val.jsonl"


def _video(meta, seed=0):
    return torch.as_tensor(render_stream(meta, seed=seed)).permute(0, 3, 1, 2).float() / 255


def test_each_segment_is_judged_against_its_own_prompt():
    metas = [json.loads(line) for line in STREAMS.read_text().splitlines()[:40]]
    meta = next(m for m in metas if len(m["segments"]) == 3)
    shorter = next(m for m in metas if len(m["segments"]) == 2)
    wrong = None
    for seed in range(20):  # one object of one segment moves another way
        wrong = perturb_stream(meta, "direction", rng=seed)
        if wrong is not None:
            break
    assert wrong is not None
    bad = next(k for k, (a, b) in enumerate(zip(meta["segments"], wrong["segments"])) if a["include"] != b["include"])
    reward = rewards.load("segments", reward="video_geneval", grace=4)
    videos = torch.stack([_video(meta), _video(wrong), _video(shorter)])
    out = reward(videos, [m["prompt"] for m in (meta, meta, shorter)], [meta, meta, shorter])
    seg = torch.stack([out.components[f"segment{k}/score"] for k in range(3)], 1)
    assert bool((seg[0] >= 0.75).all()), seg[0]  # a clean stream follows every segment's prompt
    assert seg[1, bad] < seg[0, bad] - 0.3  # the segment that moves the wrong way, and only it, loses
    assert torch.allclose(torch.cat([seg[1, :bad], seg[1, bad + 1:]]), torch.cat([seg[0, :bad], seg[0, bad + 1:]]))
    assert math.isnan(float(seg[2, 2])) and not math.isnan(float(seg[2, 1]))  # a 2-segment stream has no third
    assert torch.allclose(out.scores, torch.nanmean(seg, 1)) and torch.equal(out.scores, out.components["score"])
    assert "segment0/motion" in out.components or any(k.startswith("segment0/") and k != "segment0/score"
                                                      for k in out.components)


def test_clips_bounds_and_bad_input():
    reward = rewards.load("segments", reward="video_geneval", grace=4, clip_frames=8)
    assert reward._clip(0, 13) == (4, 12) and reward._clip(13, 49) == (29, 37) and reward._clip(0, 9) == (4, 9)
    meta = {"num_frames": 20, "segments": [{"start": 0, "prompt": "a"}, {"start": 18, "prompt": "b"}]}
    with pytest.raises(ValueError, match="grace period"):
        reward.check_metadata(meta)
    with pytest.raises(ValueError, match="cannot be nested"):
        rewards.load("segments", reward="multi")
    with pytest.raises(ValueError, match="metadata"):
        reward(torch.zeros(1, 20, 3, 8, 8), ["a"], None)
