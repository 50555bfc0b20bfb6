"""The moving-shapes world: paths inside the frame, no overlap in any frame, velocities as the metadata says, and
the prompt split (disjoint, every word of a tag trained, committed files current)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flowgrpo.world import (
    CLASSES,
    DIRECTIONS,
    MOTION_PERTURBATIONS,
    MOTION_TAGS,
    NUM_FRAMES,
    PALETTE,
    SPEEDS,
    all_motion_metadata,
    draw,
    draw_clip,
    motion_metadata_for,
    motion_prompt_for,
    perturb_motion,
    render_clip,
    sample_tracks,
    shape_box,
    split_motion_prompts,
)
from flowgrpo.world.motion import SPEED_RANGES, UNIT

ROOT = Path(__file__).resolve().parents[1]
SIZE, GAP = 64, 4.0


def _objects(meta: dict) -> list[dict]:
    return [c for c in meta["include"] for _ in range(c["count"])]


def _sampled(per_tag: int = 12, seed: int = 0):
    """(metadata, tracks) for ``per_tag`` prompts of every tag, each laid out from its own seed."""
    rng = np.random.default_rng(seed)
    for tag in MOTION_TAGS:
        items = all_motion_metadata(tag)
        for k in rng.choice(len(items), min(per_tag, len(items)), replace=False):
            yield items[k], sample_tracks(items[k], rng)


def test_tracks_stay_inside_the_frame_never_overlap_and_move_as_the_metadata_says():
    n_clips = 0
    for meta, tracks in _sampled(per_tag=40):
        n_clips += 1
        objects = _objects(meta)
        assert len(tracks) == len(objects), meta["prompt"]
        # the tracks are the clauses' objects, in clause order, with their class and colour
        assert [(t.shape.cls, t.shape.color) for t in tracks] == [(c["class"], c["color"]) for c in objects]
        for f in range(NUM_FRAMES):
            shapes = [t.at(f) for t in tracks]
            for s in shapes:  # the whole shape, not just its centre, is inside the frame in every frame
                x1, y1, x2, y2 = shape_box(s)
                assert 0 <= x1 and x2 <= SIZE and 0 <= y1 and y2 <= SIZE, (meta["prompt"], f, s)
                assert 6.0 - 1e-9 <= s.r <= 12.0 + 1e-9
            for i in range(len(shapes)):
                for j in range(i):  # circumcircles at least GAP apart: no overlap, whatever the class
                    a, b = shapes[i], shapes[j]
                    assert math.hypot(a.cx - b.cx, a.cy - b.cy) >= a.r + b.r + GAP - 1e-9, (meta["prompt"], f)
        for clause, t in zip(objects, tracks):
            motion, speed = clause.get("motion"), clause.get("speed")
            if motion == "still":
                assert (t.vx, t.vy) == (0.0, 0.0)
                continue
            lo, hi = SPEED_RANGES[speed]
            assert lo <= t.speed <= hi, (meta["prompt"], t.speed)
            ux, uy = t.vx / t.speed, t.vy / t.speed
            if motion is None:  # colors / counting: a random one of the four directions
                assert (round(ux), round(uy)) in {UNIT[d] for d in DIRECTIONS}
            else:
                assert (ux, uy) == pytest.approx(UNIT[motion]), meta["prompt"]
    assert n_clips > 150


def test_rendered_frames_show_disjoint_objects_on_white():
    """Pixel check on drawn frames: every object's own pixels stay clear of every other's, and nothing else is
    drawn (the frame is the union of the objects drawn alone)."""
    for meta, tracks in _sampled(per_tag=3, seed=1):
        clip = draw_clip(tracks)
        assert clip.shape == (NUM_FRAMES, SIZE, SIZE, 3) and clip.dtype == np.uint8
        for f in (0, NUM_FRAMES // 2, NUM_FRAMES - 1):
            alone = [draw([t.at(f)]) for t in tracks]
            masks = [np.any(a != 255, axis=-1) for a in alone]
            assert np.sum(masks, axis=0).max() <= 1, (meta["prompt"], f)
            assert np.array_equal(np.any(clip[f] != 255, axis=-1), np.any(masks, axis=0))
    a, b = render_clip(all_motion_metadata("counting")[0], seed=3), render_clip(all_motion_metadata("counting")[0], seed=3)
    assert np.array_equal(a, b)  # seeded


def test_speed_ranges_are_disjoint_and_inside_the_unnamed_range():
    assert SPEED_RANGES["slowly"][1] < SPEED_RANGES["quickly"][0]
    assert SPEED_RANGES[None][0] <= SPEED_RANGES["slowly"][0] and SPEED_RANGES["quickly"][1] <= SPEED_RANGES[None][1]
    assert set(SPEEDS) == {"slowly", "quickly"} and set(DIRECTIONS) == {"left", "right", "up", "down"}
    assert UNIT["up"] == (0.0, -1.0)  # y grows downwards


def test_prompts_and_metadata():
    counts = {t: len(all_motion_metadata(t)) for t in MOTION_TAGS}
    assert counts == {"motion": 72, "two_object_motion": 120, "counting": 54, "colors": 18, "speed": 144, "static": 18}
    every = all_motion_metadata()
    assert len({m["prompt"] for m in every}) == len(every) == 426
    assert all(motion_prompt_for(m) == m["prompt"] for m in every)
    two = all_motion_metadata("two_object_motion")
    for m in two:  # two different classes and two different colours
        (a, b) = m["include"]
        assert a["class"] != b["class"] and a["color"] != b["color"]
    assert motion_metadata_for("speed", "square", "black", "right", speed="quickly")["prompt"] == (
        "a black square moving quickly to the right")
    assert motion_metadata_for("static", "triangle", "purple", "still")["prompt"] == "a purple triangle standing still"
    c = motion_metadata_for("counting", "circle", "green", count=3)
    assert c["prompt"] == "three green circles" and c["exclude"] == [{"class": "circle", "count": 4}]


def test_perturbations_say_what_the_clip_shows():
    rng = np.random.default_rng(0)
    applicable = {kind: 0 for kind in MOTION_PERTURBATIONS}
    for m in all_motion_metadata()[::7]:
        for kind in MOTION_PERTURBATIONS:
            w = perturb_motion(m, kind, rng)
            if w is None:
                continue
            applicable[kind] += 1
            assert w["tag"] == m["tag"] and w["prompt"] == motion_prompt_for(w) and w["prompt"] != m["prompt"]
            assert w["include"] != m["include"]
            for clause in w["include"]:
                assert clause["class"] in CLASSES and clause["color"] in PALETTE
    assert all(applicable.values()), applicable


def test_split_is_disjoint_covers_every_word_in_train_and_is_committed():
    train, test = split_motion_prompts(seed=0)
    prompts_train, prompts_test = {m["prompt"] for m in train}, {m["prompt"] for m in test}
    assert not prompts_train & prompts_test
    assert len(prompts_train | prompts_test) == len(train) + len(test) == 426
    assert {m["tag"] for m in test} == set(MOTION_TAGS)

    def words(rows, tag):
        out = set()
        for m in rows:
            if m["tag"] != tag:
                continue
            for c in m["include"]:
                out |= {("class", c["class"]), ("color", c["color"]), ("count", c["count"])}
                out |= {(k, c[k]) for k in ("motion", "speed") if k in c}
        return out

    for tag in MOTION_TAGS:  # every class, colour, direction, speed and count of a tag is trained on
        assert words(train, tag) == words(all_motion_metadata(tag), tag), tag
    for name, rows in (("motion_train.jsonl", train), ("motion_held_out.jsonl", test)):
        on_disk = [json.loads(line) for line in (ROOT / "assets" / "prompts" / name).read_text().splitlines()]
        assert on_disk == rows, f"assets/prompts/{name} is stale: run python scripts/make_prompts.py"
    done = subprocess.run([sys.executable, "scripts/make_prompts.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
