"""Streams of the moving-shapes world: the generator (frame counts, switch frames, segment lengths, switches that
ask a change, paths that fit), the renderer (objects inside the frame and apart in every frame, the same objects
throughout, every segment's velocity as its prompt asks, no jump at a switch), metadata errors that name the key,
negatives and caption noise, and the committed train / held-out prompt files."""

from __future__ import annotations

import collections
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgrpo.world import (
    CLASSES,
    DIRECTIONS,
    PALETTE,
    STREAM_NUM_FRAMES,
    STREAM_PERTURBATIONS,
    StreamTrack,
    corrupt_stream,
    draw_stream,
    frame_segments,
    latent_segments,
    motion_metadata_for,
    one_object_held_out,
    perturb_stream,
    render_stream,
    sample_stream_metadata,
    sample_stream_tracks,
    shape_box,
    split_stream_prompts,
    stream_fits,
    stream_metadata_for,
    stream_training_samples,
)
from flowgrpo.world.motion import SPEED_RANGES, UNIT
from flowgrpo.world.streams import MAX_SPAN, MIN_SEGMENT, _min_spans, sequence_key
from rewards.streams import LongVideoReward, asks_differ, segment_asks, segment_bounds, validate_stream_metadata

ROOT = Path(__file__).resolve().parents[1]
SIZE, GAP = 64, 4.0


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "assets" / "prompts" / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def split():
    return split_stream_prompts()


def _check_tracks(meta: dict, tracks: list[StreamTrack]) -> None:
    """Every geometric promise of the renderer, frame by frame."""
    T = meta["num_frames"]
    objects = [(c["class"], c["color"]) for c in meta["segments"][0]["include"]]
    assert [(t.shape.cls, t.shape.color) for t in tracks] == objects, meta["prompt"]
    bounds = segment_bounds(meta)
    for f in range(T):
        shapes = [t.at(f) for t in tracks]
        for s, (cls, color) in zip(shapes, objects):  # the same objects in every frame, wholly inside it
            assert (s.cls, s.color) == (cls, color) and 6.0 - 1e-9 <= s.r <= 12.0 + 1e-9
            x1, y1, x2, y2 = shape_box(s)
            assert 0 <= x1 and x2 <= SIZE and 0 <= y1 and y2 <= SIZE, (meta["prompt"], f, s)
        for i in range(len(shapes)):
            for j in range(i):  # circumcircles at least GAP apart: no overlap, whatever the class
                a, b = shapes[i], shapes[j]
                assert math.hypot(a.cx - b.cx, a.cy - b.cy) >= a.r + b.r + GAP - 1e-9, (meta["prompt"], f)
    for k, ((start, end), seg) in enumerate(zip(bounds, meta["segments"])):
        for t, (motion, speed) in zip(tracks, segment_asks(seg)):
            # every step of the segment, the step into its first frame included, moves with its velocity
            for f in range(max(start, 1), end):
                a, b = t.at(f - 1), t.at(f)
                assert (b.cx - a.cx, b.cy - a.cy) == pytest.approx(t.velocities[k], abs=1e-9), (meta["prompt"], f)
            vx, vy = t.velocities[k]
            if motion == "still":
                assert (vx, vy) == (0.0, 0.0), (meta["prompt"], k)
                continue
            lo, hi = SPEED_RANGES[speed]
            v = math.hypot(vx, vy)
            assert lo - 1e-9 <= v <= hi + 1e-9, (meta["prompt"], k, v)
            assert (vx / v, vy / v) == pytest.approx(UNIT[motion]), (meta["prompt"], k)


# ------------------------------------------------------------------------------------------------ renderer


def test_rendered_streams_satisfy_their_metadata(split):
    train, test = split
    rng = np.random.default_rng(0)
    metas = [train[i] for i in rng.choice(len(train), 30, replace=False)] + test[:15]
    metas += [sample_stream_metadata(rng, n) for n in (33, 37, 61, 61)]  # other frame counts
    assert {m["tag"] for m in metas} == {"one_object_stream", "two_object_stream"}
    for meta in metas:
        _check_tracks(meta, sample_stream_tracks(meta, rng))


def test_rendering_is_seeded_and_draws_the_tracks(split):
    meta = split[1][0]
    a = render_stream(meta, seed=3)
    assert a.shape == (STREAM_NUM_FRAMES, SIZE, SIZE, 3) and a.dtype == np.uint8
    assert np.array_equal(a, render_stream(meta, seed=3)) and not np.array_equal(a, render_stream(meta, seed=4))
    tracks = sample_stream_tracks(meta, np.random.default_rng(3))
    assert np.array_equal(a, draw_stream(tracks, meta["num_frames"]))
    # explicit tracks: a switch drawn 4 frames late keeps the old velocity through the prompt's switch frame
    s1 = meta["segments"][1]["start"]
    late = StreamTrack(tracks[0].shape, tracks[0].velocities, (0, s1 + 4, *tracks[0].starts[2:]))
    assert late.velocity(s1 + 3) == tracks[0].velocities[0] and late.velocity(s1 + 4) == tracks[0].velocities[1]
    assert tracks[0].velocity(s1) == tracks[0].velocities[1]
    with pytest.raises(ValueError, match="starts"):
        StreamTrack(tracks[0].shape, tracks[0].velocities, (1, s1))


def test_a_path_that_cannot_fit_is_refused_with_the_object_named():
    seg = motion_metadata_for("speed", "circle", "red", "left", speed="quickly")
    other = motion_metadata_for("speed", "circle", "red", "left", speed="slowly")
    meta = stream_metadata_for([seg, other], [0, 25], num_frames=49)  # 24 steps at >= 2.6, then 24 more left
    assert not stream_fits(meta)
    with pytest.raises(ValueError, match=r"include\[0\] \(red circle\).*along x"):
        render_stream(meta, seed=0)


# ------------------------------------------------------------------------------------------------ generator


def test_generator_frames_switches_segments_and_fit():
    rng = np.random.default_rng(1)
    switches = collections.Counter()
    for i in range(150):
        T = (49, 33, 45, 61)[i % 4]
        meta = sample_stream_metadata(rng, T)
        validate_stream_metadata(meta)
        assert meta["num_frames"] == T and len(meta["segments"]) >= 2
        starts = [s["start"] for s in meta["segments"]]
        assert starts[0] == 0 and all(s % 4 == 1 for s in starts[1:]), starts  # first pixel frame of a latent
        assert all(b - a >= MIN_SEGMENT for a, b in segment_bounds(meta)), starts
        switches[len(starts) - 1] += 1
        for a, b in zip(meta["segments"], meta["segments"][1:]):  # every switch asks a visible change
            assert asks_differ(segment_asks(a), segment_asks(b))
        objects = {tuple((c["class"], c["color"]) for c in s["include"]) for s in meta["segments"]}
        assert len(objects) == 1
        assert all(max(span) <= MAX_SPAN for span in _min_spans(meta)) and stream_fits(meta)
        assert meta["prompt"] == "; then ".join(s["prompt"] for s in meta["segments"])
        per_latent = latent_segments(meta)
        assert len(per_latent) == (T - 1) // 4 + 1 and per_latent == sorted(per_latent)
        assert frame_segments(meta)[starts[-1]] == len(starts) - 1
    assert set(switches) == {1, 2, 3}, switches
    a, b = sample_stream_metadata(7), sample_stream_metadata(7)
    assert a == b  # seeded
    assert sample_stream_metadata(7, objects=2, switches=3)["tag"] == "two_object_stream"
    with pytest.raises(ValueError, match="num_frames=50"):
        sample_stream_metadata(0, 50)
    with pytest.raises(ValueError, match="num_frames=29"):
        sample_stream_metadata(0, 29)
    with pytest.raises(ValueError, match="switches=3"):
        sample_stream_metadata(0, 33, switches=3)  # 33 frames hold at most one switch of 12-frame segments


def test_metadata_errors_name_the_key():
    base = sample_stream_metadata(3, objects=2, switches=2)

    def broken(edit):
        meta = json.loads(json.dumps(base))
        edit(meta)
        return meta

    cases = [
        (lambda m: m.pop("num_frames"), r"metadata\.num_frames"),
        (lambda m: m.update(segments=[]), r"metadata\.segments"),
        (lambda m: m["segments"][0].update(start=2), r"segments\[0\]\.start"),
        (lambda m: m["segments"][2].update(start=m["segments"][1]["start"]), r"segments\[2\]\.start"),
        (lambda m: m["segments"][2].update(start=99), r"segments\[2\]\.start.*num_frames"),
        (lambda m: m["segments"][1]["include"][1].update(color="pink"), r"segments\[1\]\.include\[1\]\.color"),
        (lambda m: m["segments"][1]["include"][0].update(motion="sideways"), r"segments\[1\]\.include\[0\]\.motion"),
        (lambda m: m["segments"][1]["include"][0].pop("motion"), r"segments\[1\]\.include\[0\]\.motion"),
        (lambda m: m["segments"][1]["include"][0].update(count=2), r"segments\[1\]\.include\[0\]\.count"),
        (lambda m: m["segments"][2]["include"][1].update(color=m["segments"][2]["include"][1]["color"] == "red"
                                                         and "blue" or "red"), r"segments\[2\]\.include\[1\]"),
        (lambda m: m["segments"][1].update(tag="counting"), r"segments\[1\]\.tag"),
        (lambda m: m.update(tag="stream"), r"metadata\.tag"),
        (lambda m: m["segments"][1].update(include=m["segments"][0]["include"]), r"segments\[1\]: asks the same"),
    ]
    for edit, match in cases:
        with pytest.raises(ValueError, match=match):
            validate_stream_metadata(broken(edit), CLASSES, tuple(PALETTE))
    # the same motion twice is what a negative stream may show, not what a prompt may ask
    same = broken(lambda m: m["segments"][1].update(include=m["segments"][0]["include"]))
    assert validate_stream_metadata(same, require_switches=False)["num_frames"] == base["num_frames"]
    bad = broken(lambda m: m["segments"][1].update(start=m["segments"][1]["start"] + 1))
    with pytest.raises(ValueError, match=r"segments\[1\]\.start=.*latent"):
        latent_segments(bad)


# ------------------------------------------------------------------------------------------------ prompt sets


def test_split_is_disjoint_covers_every_word_in_train_and_is_committed(split):
    train, test = split
    assert (len(train), len(test)) == (300, 100)
    keys_train, keys_test = {sequence_key(m) for m in train}, {sequence_key(m) for m in test}
    assert len(keys_train) == 300 and len(keys_test) == 100 and not keys_train & keys_test

    def words(rows):
        out = set()
        for m in rows:
            out.add(("switches", len(m["segments"]) - 1))
            for s in m["segments"]:
                out.add(("tag", s["tag"]))
                for c in s["include"]:
                    out |= {("class", c["class"]), ("color", c["color"]), ("motion", c["motion"])}
                    out |= {("speed", c["speed"])} if "speed" in c else set()
        return out

    assert words(train) >= words(test) and {("motion", d) for d in (*DIRECTIONS, "still")} <= words(train)
    assert {m["tag"] for m in test} == {"one_object_stream", "two_object_stream"}
    for name, rows in (("streams_train.jsonl", train), ("streams_val.jsonl", test)):
        assert _rows(name) == rows, f"assets/prompts/{name} is stale: run python scripts/make_prompts.py"
    done = subprocess.run([sys.executable, "scripts/make_prompts.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def test_one_object_held_out_set_is_outside_both_streams_files_and_committed(split):
    train, test = split
    rows = one_object_held_out(100, seed=1, exclude=train + test)
    keys = {sequence_key(m) for m in rows}
    assert len(rows) == 100 and len(keys) == 100
    assert not keys & {sequence_key(m) for m in train + test}
    assert {m["tag"] for m in rows} == {"one_object_stream"}
    assert {len(m["segments"]) for m in rows} == {2, 3, 4}
    for m in rows:
        validate_stream_metadata(m)
        assert all(len(s["include"]) == 1 for s in m["segments"])
    assert _rows("streams_one_object_val.jsonl") == rows, \
        "assets/prompts/streams_one_object_val.jsonl is stale: run python scripts/make_prompts.py"
    # the exclusion is honoured: excluding the first draws changes the set
    again = one_object_held_out(10, seed=1, exclude=train + test + rows[:5])
    assert not {sequence_key(m) for m in again} & {sequence_key(m) for m in rows[:5]}


# ------------------------------------------------------------------------------------------ negatives, caption noise


def test_perturbations_say_what_the_stream_shows(split):
    rng = np.random.default_rng(2)
    applied = collections.Counter()
    for meta in split[1][:40]:
        for kind in STREAM_PERTURBATIONS:
            shown = perturb_stream(meta, kind, rng)
            if shown is None:
                continue
            applied[kind] += 1
            validate_stream_metadata(shown, require_switches=False)
            assert shown != meta and stream_fits(shown)
            changed = [k for k, (a, b) in enumerate(zip(meta["segments"], shown["segments"])) if a != b]
            assert len(changed) == 1, (kind, changed)  # one segment differs
            k = changed[0]
            before, after = meta["segments"][k], shown["segments"][k]
            if kind == "late":
                assert after["start"] == before["start"] + 8 and segment_asks(after) == segment_asks(before)
            elif kind == "ignore_switch":
                assert k >= 1 and segment_asks(after) == segment_asks(meta["segments"][k - 1])
            else:
                assert after["start"] == before["start"] and segment_asks(after) != segment_asks(before)
                assert after["prompt"] != before["prompt"]
    assert set(applied) == set(STREAM_PERTURBATIONS), applied
    with pytest.raises(ValueError, match="unknown perturbation"):
        perturb_stream(split[1][0], "teleport", rng)


def test_caption_noise_and_training_samples(split):
    train, test = split
    rng = np.random.default_rng(4)
    flipped = still = total = 0
    for meta in train:
        shown = corrupt_stream(meta, rng, opposite=0.2, still=0.1)
        assert shown["prompt"] == meta["prompt"] and [s["start"] for s in shown["segments"]] == [
            s["start"] for s in meta["segments"]]
        for a, b in zip(meta["segments"], shown["segments"]):
            for (m0, _), (m1, _) in zip(segment_asks(a), segment_asks(b)):
                if m0 in DIRECTIONS:
                    total += 1
                    flipped += m1 != m0 and m1 != "still"
                    still += m1 == "still"
    assert flipped / total == pytest.approx(0.2, abs=0.03) and still / total == pytest.approx(0.1, abs=0.03)

    held_out = {sequence_key(m) for m in test}
    samples = list(stream_training_samples(6, seed=5, opposite=0.5, still=0.0))
    again = list(stream_training_samples(6, seed=5, opposite=0.5, still=0.0))
    assert len(samples) == 6
    for (meta, clip), (meta2, clip2) in zip(samples, again):  # seeded
        assert meta == meta2 and np.array_equal(clip, clip2)
        assert sequence_key(meta) not in held_out
        assert clip.shape == (meta["num_frames"], SIZE, SIZE, 3) and clip.dtype == np.uint8
    pooled = list(stream_training_samples(3, seed=0, pool=test[:2], num_frames=49))
    assert all(m in test[:2] for m, _ in pooled)
    torch.set_num_threads(1)
    # the clip shows its caption without noise, and every direction reversed with opposite=1 (judged by long_video)
    meta = next(m for m in test if m["tag"] == "two_object_stream")
    (_, clean), (_, flipped) = (next(stream_training_samples(1, seed=9, pool=[meta], opposite=p)) for p in (0.0, 1.0))
    scores = LongVideoReward(score="direction")(np.stack([clean, flipped]), None, [meta, meta]).scores.tolist()
    assert scores[0] >= 0.99 and scores[1] <= 0.1, scores
    with pytest.raises(ValueError, match="opposite"):
        next(stream_training_samples(1, seed=0, opposite=0.8, still=0.4))
