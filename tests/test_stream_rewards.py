"""``long_video``: the reward of streams with prompt switches, on rendered streams of the moving-shapes world --
clean positives score about 1 (>= 0.99), every kind of negative scores clearly lower (<= 0.975, and the component
that judges it is low), also under blur -- and on hand-made clips at the thresholds; its components, input forms and
errors."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

import rewards
from flowgrpo.world import CLASSES, PALETTE, draw_frames, perturb_stream, render_stream, sample_stream_tracks, shape_box
from rewards.streams import COMPONENTS, NAMES, LongVideoReward

ROOT = Path(__file__).resolve().parents[1]
TEST_STREAMS = [json.loads(line) for line in (ROOT / "assets/prompts/streams_test.jsonl").read_text().splitlines()]
POSITIVE = 0.99  # clean rendered positives score at least this (measured: 1.00)
POSITIVE_BLUR = 0.98  # Gaussian blur sigma 1 px (measured: 1.00)
NEGATIVE = 0.975  # every negative scores at most this (measured, 10 per kind: at most 0.965)
KIND_MEAN = 0.95  # and the mean of each kind at most this (measured: 0.54-0.92)
# each negative kind, the component that judges it and the largest value it may have (k: the segment changed)
TARGET = {
    "direction": ("segment{k}/direction", 0.25),
    "ignore_switch": ("segment{k}/recovery", 0.25),
    "late": ("segment{k}/recovery", 0.375),
    "teleport": ("teleport", 0.25),
    "recolor": ("identity", 0.75),
    "reclass": ("identity", 0.75),
    "frozen": ("anti_freeze", 0.0),
    "stops": ("anti_freeze", 0.75),
}


@pytest.fixture(scope="module")
def reward():
    torch.set_num_threads(1)
    return LongVideoReward()


def blur(clip: np.ndarray, sigma: float = 1.0) -> np.ndarray:
    return np.stack([np.asarray(Image.fromarray(f).filter(ImageFilter.GaussianBlur(sigma))) for f in clip])


def _inside_and_apart(shapes) -> bool:
    for s in shapes:
        x1, y1, x2, y2 = shape_box(s)
        if x1 < 0 or y1 < 0 or x2 > 64 or y2 > 64:
            return False
    return all(math.hypot(a.cx - b.cx, a.cy - b.cy) >= a.r + b.r + 4.0
               for i, a in enumerate(shapes) for b in shapes[:i])


def negative(meta: dict, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, int] | None:
    """A stream failing ``meta`` in one way and the segment that was changed (0 when the whole stream is), or None.

    ``direction`` / ``ignore_switch`` / ``late`` (8 frames): metadata of what the stream shows
    (:func:`perturb_stream`), rendered; ``teleport`` (an object jumps 18 px), ``recolor`` / ``reclass`` (an object
    changes colour / class) from the middle frame on; ``frozen`` (frame 0 throughout); ``stops`` (frozen from the
    first switch to a segment that asks for motion on)."""
    if kind in ("direction", "ignore_switch", "late"):
        shown = perturb_stream(meta, kind, rng)
        if shown is None:
            return None
        k = next(k for k, (a, b) in enumerate(zip(meta["segments"], shown["segments"])) if a != b)
        try:
            return render_stream(shown, rng=rng), k
        except RuntimeError:  # no layout for what the negative shows
            return None
    tracks = sample_stream_tracks(meta, rng)
    T = meta["num_frames"]
    frames = [[t.at(f) for t in tracks] for f in range(T)]
    j, at = int(rng.integers(len(tracks))), T // 2

    def edit(fn):
        return [[fn(s) if (i == j and f >= at) else s for i, s in enumerate(shapes)] for f, shapes in enumerate(frames)]

    if kind == "teleport":
        for angle in rng.uniform(0, 2 * np.pi, 64):
            moved = edit(lambda s: replace(s, cx=s.cx + 18 * math.cos(angle), cy=s.cy + 18 * math.sin(angle)))
            if all(_inside_and_apart(shapes) for shapes in moved):
                return draw_frames(moved), 0
        return None
    if kind in ("recolor", "reclass"):
        field, names = ("color", tuple(PALETTE)) if kind == "recolor" else ("cls", CLASSES)
        used = {getattr(t.shape, field) for t in tracks}
        new = [n for n in names if n not in used][int(rng.integers(len(names) - len(used)))]
        return draw_frames(edit(lambda s: replace(s, **{field: new}))), 0
    if kind == "frozen":
        return draw_frames([frames[0]] * T), 0
    if kind == "stops":  # from the first switch to a segment that asks for motion
        k = next((k for k, s in enumerate(meta["segments"]) if k and any(c["motion"] != "still" for c in s["include"])),
                 None)
        if k is None:
            return None
        start = meta["segments"][k]["start"]
        return draw_frames([frames[min(f, start - 1)] for f in range(T)]), 0
    raise ValueError(kind)


def negatives(kinds, per_kind: int, seed: int):
    """``(metadata, clip, kind, changed segment)``, ``per_kind`` held-out streams per kind."""
    rng = np.random.default_rng(seed)
    out = []
    for kind in kinds:
        found = 0
        for i in rng.permutation(len(TEST_STREAMS)):
            got = negative(TEST_STREAMS[i], kind, rng)
            if got is not None:
                out.append((TEST_STREAMS[i], got[0], kind, got[1]))
                found += 1
            if found == per_kind:
                break
    return out


def positives(n: int, seed: int):
    rng = np.random.default_rng(seed)
    metas = [TEST_STREAMS[i] for i in rng.choice(len(TEST_STREAMS), n, replace=False)]
    return metas, np.stack([render_stream(m, rng=rng) for m in metas])


# ----------------------------------------------------------------------------------------- rendered streams


def test_clean_positives_score_about_one(reward):
    metas, clips = positives(12, seed=0)
    assert {m["tag"] for m in metas} == {"one_object_stream", "two_object_stream"}
    assert {len(m["segments"]) for m in metas} == {2, 3, 4}
    verdicts = reward.judge(clips, metas)
    low = [(m["prompt"], v.reason) for m, v in zip(metas, verdicts) if reward.combine(v.components) < POSITIVE]
    assert not low, low
    for v in verdicts:
        assert all(v.components[name] >= POSITIVE for name in COMPONENTS), v.components
        assert v.components["segments_strict"] == 1.0 and all(lat == 0 for lat in v.latencies), v.latencies
        assert v.components["max_jump_px"] <= 3.2  # the world's fastest motion is 3 px/frame


def test_every_kind_of_negative_scores_clearly_lower(reward):
    items = negatives(TARGET, per_kind=4, seed=1)
    assert {kind for *_, kind, _ in items} == set(TARGET) and len(items) == 4 * len(TARGET)
    verdicts = reward.judge(np.stack([c for _, c, _, _ in items]), [m for m, _, _, _ in items])
    by_kind: dict[str, list[float]] = {}
    for (meta, _, kind, k), v in zip(items, verdicts):
        score = reward.combine(v.components)
        by_kind.setdefault(kind, []).append(score)
        name, most = TARGET[kind]
        value = v.components[name.format(k=k)]
        assert score <= NEGATIVE and value <= most, (kind, meta["prompt"], name.format(k=k), value, score, v.reason)
        assert v.reason  # says why
    means = {kind: float(np.mean(s)) for kind, s in by_kind.items()}
    assert max(means.values()) <= KIND_MEAN, means


def test_verdicts_survive_blur(reward):
    metas, clips = positives(6, seed=2)
    items = negatives(TARGET, per_kind=1, seed=3)
    verdicts = reward.judge(np.stack([blur(c) for c in [*clips, *(c for _, c, _, _ in items)]]),
                            [*metas, *(m for m, _, _, _ in items)])
    pos, neg = verdicts[: len(metas)], verdicts[len(metas):]
    assert min(reward.combine(v.components) for v in pos) >= POSITIVE_BLUR, [v.reason for v in pos]
    for (meta, _, kind, k), v in zip(items, neg):
        name, most = TARGET[kind]
        assert reward.combine(v.components) <= NEGATIVE and v.components[name.format(k=k)] <= most, (kind, v.reason)


# ----------------------------------------------------------------------------------------- hand-made clips


def _square_clip(turn: int, frames: int = 32, first=(2.0, 0.0), then=(0.0, 2.0), jump_at: int | None = None,
                 freeze_from: int | None = None) -> np.ndarray:
    """A red 10 px square from (8, 12) moving ``first`` (px/frame) until frame ``turn`` (the step into ``turn``
    moves ``then``), then ``then``; optionally 16 px further right from frame ``jump_at`` on, or frozen after
    frame ``freeze_from``."""
    clip = np.full((frames, 64, 64, 3), 255, np.uint8)
    x, y = 8.0, 12.0
    for t in range(frames):
        if t:
            vx, vy = first if t < turn else then
            x, y = x + vx, y + vy
        dx = 16 if jump_at is not None and t >= jump_at else 0
        xi, yi = int(round(x)) + dx, int(round(y))
        clip[t, yi - 5: yi + 5, xi - 5: xi + 5] = (220, 30, 30)
    if freeze_from is not None:
        clip[freeze_from + 1:] = clip[freeze_from]
    return clip


def _meta(switch: int, frames: int = 32, first: str = "right", then: str = "down") -> dict:
    def seg(start, motion):
        return {"start": start, "tag": "motion", "prompt": f"a red square moving {motion}",
                "include": [{"class": "square", "count": 1, "color": "red", "motion": motion}]}

    return {"num_frames": frames, "segments": [seg(0, first), seg(switch, then)]}


def test_recovery_counts_the_frames_until_the_new_motion_holds(reward):
    delays = (0, 1, 3, 5, 9)
    clips = np.stack([_square_clip(16 + d) for d in delays])
    verdicts = reward.judge(clips, [_meta(16)] * len(delays))
    assert [v.latencies[0] for v in verdicts] == [0, 0, 2, 4, 8]  # a turn d frames late: d - 1
    assert [v.components["recovery"] for v in verdicts] == [1.0, 1.0, 0.75, 0.5, 0.0]
    assert [v.components["segment1/recovery"] for v in verdicts] == [v.components["recovery"] for v in verdicts]
    never = reward.judge(_square_clip(40, first=(1.0, 0.0))[None], [_meta(16)])[0]  # keeps moving right
    assert never.latencies == [None] and never.components["recovery"] == 0.0
    assert never.components["recovery_frames"] == 16 and never.components["segment1/direction"] == 0.0


def test_teleport_smoothness_and_anti_freeze_thresholds(reward):
    meta = _meta(16)
    clean, jump, frozen = _square_clip(16), _square_clip(16, jump_at=8), _square_clip(16, freeze_from=20)
    v_clean, v_jump, v_frozen = reward.judge(np.stack([clean, jump, frozen]), [meta] * 3)
    assert v_clean.components["teleport"] == v_clean.components["smoothness"] == 1.0
    assert v_clean.components["max_jump_px"] == pytest.approx(2.0)
    assert v_jump.components["max_jump_px"] == pytest.approx(18.0) and v_jump.components["teleport"] == 0.0
    assert v_jump.components["smoothness"] < 1.0 and v_jump.components["identity"] == 1.0  # same object, seen
    # frozen from frame 20: of the 27 frame pairs asked to move (1-15 and 20-31: the grace 16-19 is left out),
    # pairs 21..31 do not change
    assert v_frozen.components["anti_freeze"] == pytest.approx(16 / 27)
    still = _meta(16, then="still")
    still["segments"][1]["tag"], still["segments"][1]["prompt"] = "static", "a red square standing still"
    stopped = reward.judge(_square_clip(16, then=(0.0, 0.0))[None], [still])[0]  # stopping as asked is no freeze
    assert stopped.components["anti_freeze"] == 1.0 and reward.combine(stopped.components) >= POSITIVE


# ----------------------------------------------------------------------------------------- the reward


def test_components_input_forms_scores_and_errors():
    torch.set_num_threads(1)
    metas, clips = positives(2, seed=4)
    clips[1] = np.repeat(clips[1][:1], len(clips[1]), axis=0)  # frozen
    r = rewards.load("long_video")
    assert isinstance(r, LongVideoReward) and r.modality == "video"
    out = r(torch.from_numpy(clips).permute(0, 1, 4, 2, 3).float() / 255, [m["prompt"] for m in metas], metas)
    assert list(out.components) == list(NAMES)
    mean = torch.stack([out.components[n] for n in COMPONENTS]).mean(0)
    assert torch.allclose(out.scores, mean) and out.scores[0] >= POSITIVE and out.scores[1] < NEGATIVE
    for k in range(4):  # per segment values, NaN past the stream's segments
        there = k < len(metas[0]["segments"])
        assert math.isnan(out.components[f"segment{k}/adherence"][0]) != there
    assert math.isnan(out.components["segment0/recovery"][0])
    for form in (torch.from_numpy(clips), list(clips), clips):  # uint8 [B,T,H,W,3], list of [T,H,W,3], numpy
        assert torch.equal(r(form, None, metas).scores, out.scores)
    one = rewards.load("long_video", score="anti_freeze")(clips, None, metas)
    assert one.scores.tolist() == [1.0, 0.0] and torch.equal(one.components["adherence"], out.components["adherence"])
    weighted = rewards.load("long_video", weights={"anti_freeze": 0.0, "recovery": 0.0})(clips, None, metas)
    others = [n for n in COMPONENTS if n not in ("anti_freeze", "recovery")]
    assert torch.allclose(weighted.scores, torch.stack([out.components[n] for n in others]).mean(0))

    blank = np.full_like(clips[:1], 255)  # degenerate: every scored component 0
    dead = r(blank, None, metas[:1])
    assert dead.scores.item() == 0.0 and all(dead.components[n].item() == 0.0 for n in COMPONENTS)
    with pytest.raises(ValueError, match="score="):
        rewards.load("long_video", score="teleports")
    with pytest.raises(ValueError, match="weights"):
        rewards.load("long_video", weights={"speeds": 1.0})
    with pytest.raises(ValueError, match=r"metadata\[0\]\.num_frames is 49 but the videos have 48"):
        r(clips[:1, :48], None, metas[:1])
    with pytest.raises(ValueError, match=r"metadata\[0\]\.segments\[1\]\.include\[0\]\.motion"):
        bad = json.loads(json.dumps(metas[0]))
        bad["segments"][1]["include"][0]["motion"] = "sideways"
        r(clips[:1], None, [bad])
    with pytest.raises(ValueError, match="2 metadata"):
        r(clips[:1], None, metas)
    with pytest.raises(ValueError, match="long_video"):
        nan = torch.from_numpy(clips[:1]).float() / 255
        nan[0, 3, 0, 0, 0] = math.nan
        r(nan, None, metas[:1])
    with pytest.raises(ValueError, match=r"record\.segments"):
        r.check_metadata({"num_frames": 49, "segments": []})
