"""``long_video`` (version 2): the reward of streams with prompt switches, on rendered streams of the moving-shapes
world -- clean positives score about 1 (>= 0.99), every kind of negative scores clearly lower (<= 0.975, and the
component that judges it is low), also under blur; the ladder "as asked > wrong speed > wrong direction > frozen >
black / noise (0)" on one- and two-object streams; streams made to game the rules score no higher than the honest
stream they imitate; objects that touch or overlap are followed through it -- and on hand-made clips at the
thresholds; its components, input forms and errors."""

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
from flowgrpo.world import (CLASSES, PALETTE, draw_frames, draw_stream, perturb_stream, render_stream,
                            sample_stream_tracks, shape_box)
from flowgrpo.world.motion import UNIT
from flowgrpo.world.render import Shape
from flowgrpo.world.streams import StreamTrack
from rewards.streams import COMPONENTS, NAMES, VERSION, LongVideoReward, segment_asks

ROOT = Path(__file__).resolve().parents[1]
TEST_STREAMS = [json.loads(line) for line in (ROOT / "assets/prompts/streams_val.jsonl").read_text().splitlines()]
POSITIVE = 0.99  # clean rendered positives score at least this (measured: 1.00)
POSITIVE_BLUR = 0.98  # Gaussian blur sigma 1 px (measured: 1.00)
NEGATIVE = 0.98  # every negative scores at most this (measured, 10 per kind: at most 0.979: 1 of 2 objects teleports)
KIND_MEAN = 0.96  # and the mean of each kind at most this (measured: 0.39-0.95)
# each negative kind, the component that judges it and the largest value it may have for the object that fails
# (k: the segment changed); the other objects of a two-object stream are right, so the bound is (most + J - 1) / J
TARGET = {
    "direction": ("segment{k}/direction", 0.0),
    "ignore_switch": ("segment{k}/recovery", 0.0),
    "late": ("segment{k}/recovery", 0.25),
    "teleport": ("teleport", 0.8),
    "recolor": ("identity", 0.6),
    "reclass": ("identity", 0.6),
    "frozen": ("anti_freeze", 0.0),
    "stops": ("anti_freeze", 0.75),
}


@pytest.fixture(scope="module")
def reward():
    torch.set_num_threads(1)
    return LongVideoReward()


def target(kind: str, meta: dict) -> tuple[str, float]:
    """The component judging a negative of ``kind`` and its bound on a stream of ``meta``'s objects."""
    name, most = TARGET[kind]
    objects = len(meta["segments"][0]["include"])
    return name, (most + objects - 1) / objects


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
        name, most = target(kind, meta)
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
        name, most = target(kind, meta)
        assert reward.combine(v.components) <= NEGATIVE and v.components[name.format(k=k)] <= most, (kind, v.reason)


# ----------------------------------------------------------------------------------------- hand-made clips


def _square_clip(turn: int, frames: int = 32, first=(2.0, 0.0), then=(0.0, 2.0), jump_at: tuple[int, ...] = (),
                 freeze_from: int | None = None) -> np.ndarray:
    """A red 10 px square from (8, 12) moving ``first`` (px/frame) until frame ``turn`` (the step into ``turn``
    moves ``then``), then ``then``; 16 px further right from the first frame of ``jump_at`` on, back at the second,
    and so on; or frozen after frame ``freeze_from``."""
    clip = np.full((frames, 64, 64, 3), 255, np.uint8)
    x, y = 8.0, 12.0
    for t in range(frames):
        if t:
            vx, vy = first if t < turn else then
            x, y = x + vx, y + vy
        dx = 16 * (sum(t >= j for j in jump_at) % 2)
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


def test_a_window_scores_its_own_frames_and_changes_nothing_else(reward):
    """A stream's metadata ``window`` [start, end) adds ``window/direction``, ``window/speed``, ``window/adherence``:
    those rules on the window's frames alone, without the grace (the frames a KVPO branch routed); every other
    component is the same as without it, and a batch without any window has no such component."""
    clips = np.stack([_square_clip(16), _square_clip(24)])                  # on time; 8 frames late
    plain = reward(clips, None, [_meta(16)] * 2)
    assert set(plain.components) == set(NAMES)                            # the reward's outputs, unchanged
    early, late = {**_meta(16), "window": [16, 24]}, {**_meta(16), "window": [24, 32]}
    out = reward(np.concatenate([clips, clips]), None, [early, early, late, late])
    for name in NAMES:
        torch.testing.assert_close(out.components[name], torch.cat([plain.components[name]] * 2), rtol=0, atol=0,
                                   equal_nan=True, msg=name)
    assert torch.equal(out.scores, torch.cat([plain.scores] * 2))
    direction = out.components["window/direction"].tolist()
    assert direction == [1.0, 0.0, 1.0, 1.0]        # the late turn: still moving right in [16, 24), down after
    assert out.components["window/adherence"][1] == 0 and out.components["window/adherence"][0] > 0.9
    assert out.components["window/speed"][0] == 1.0 and out.components["window/speed"][1] == 0.0
    mixed = reward(clips, None, [early, _meta(16)])                        # a stream without a window: NaN
    assert mixed.components["window/direction"][0] == 1.0 and math.isnan(mixed.components["window/direction"][1])
    with pytest.raises(ValueError, match="window"):
        reward(clips[:1], None, [{**_meta(16), "window": [30, 31]}])


def test_teleport_smoothness_and_anti_freeze_thresholds(reward):
    meta = _meta(16)
    clips = [_square_clip(16), _square_clip(16, jump_at=(8,)), _square_clip(16, jump_at=(8, 10)),
             _square_clip(16, freeze_from=20)]
    v_clean, v_jump, v_twice, v_frozen = reward.judge(np.stack(clips), [meta] * len(clips))
    assert v_clean.components["teleport"] == v_clean.components["smoothness"] == 1.0
    assert v_clean.components["max_jump_px"] == pytest.approx(2.0) and v_clean.components["jerk_px"] < 1e-6
    # fractions, not the worst step: one 18 px jump in 31 steps costs 1/31 of teleport_fraction (0.1); its two
    # rough frames of the 25 judged for smoothness (30 less the turn's 5) cost 2/25 of smooth_fraction (0.5)
    assert v_jump.components["max_jump_px"] == pytest.approx(18.0)
    assert v_jump.components["teleport"] == pytest.approx(1 - (1 / 31) / 0.1)
    assert v_jump.components["smoothness"] == pytest.approx(1 - (2 / 25) / 0.5)
    assert v_jump.components["identity"] == 1.0  # the same object, seen throughout
    assert v_twice.components["teleport"] == pytest.approx(1 - (2 / 31) / 0.1)  # out and back: two jumps
    # frozen from frame 20: of the 27 frames asked to move (1-15 and 20-31: the grace 16-19 is left out), frames
    # 1-15 move; 20 has its step but no velocity over frames 20-26, and 21-31 have neither
    assert v_frozen.components["anti_freeze"] == pytest.approx(15 / 27)
    still = _meta(16, then="still")
    still["segments"][1]["tag"], still["segments"][1]["prompt"] = "static", "a red square standing still"
    stopped = reward.judge(_square_clip(16, then=(0.0, 0.0))[None], [still])[0]  # stopping as asked is no freeze
    assert stopped.components["anti_freeze"] == 1.0 and reward.combine(stopped.components) >= POSITIVE


def _crossing(order: str = "over", dy: float = 0.0, frames: int = 33) -> np.ndarray:
    """A red square (circumradius 8) moving right at 1.25 px/frame from (12, 32) and a blue circle (8) moving left
    from (52, 32 + dy): they meet in the middle frames; drawn last, the square passes over the circle (``over``)
    or under it."""
    shapes = []
    for t in range(frames):
        a = Shape("square", "red", 12 + 1.25 * t, 32.0, 8.0)
        b = Shape("circle", "blue", 52 - 1.25 * t, 32.0 + dy, 8.0)
        shapes.append([b, a] if order == "over" else [a, b])
    return draw_frames(shapes)


def test_objects_that_touch_or_overlap_are_followed_through_it(reward):
    """Two objects crossing (one hidden under the other for several frames) or touching are followed through it:
    no jump, no swap, no identity lost, each moving as asked."""
    seg = {"start": 0, "tag": "two_object_motion", "prompt": "a red square moving right and a blue circle moving left",
           "include": [{"class": "square", "count": 1, "color": "red", "motion": "right"},
                       {"class": "circle", "count": 1, "color": "blue", "motion": "left"}]}
    meta = {"num_frames": 33, "segments": [seg]}
    cases = {"over": _crossing("over"), "under": _crossing("under"), "touching": _crossing(dy=13.0),
             "grazing": _crossing(dy=8.0)}
    verdicts = reward.judge(np.stack(list(cases.values())), [meta] * len(cases))
    for name, v in zip(cases, verdicts):
        c = v.components
        assert c["identity"] == 1.0 and c["direction"] == pytest.approx(1.0, abs=1e-3), (name, v.reason)
        assert c["teleport"] >= 0.95 and c["smoothness"] >= 0.9 and c["anti_freeze"] >= 0.9, (name, v.reason)
        assert reward.combine(c) >= 0.97, (name, v.reason)
        square, circle = v.trajectories
        for path, x0, vx in ((square, 12.0, 1.25), (circle, 52.0, -1.25)):  # each stays on its own line: no swap
            seen = ~np.isnan(path[:, 0])
            expected = x0 + vx * np.arange(33)[seen]
            assert np.abs(path[seen, 0] - expected).max() < 4.0, (name, path[:, 0])
        if name in ("over", "under"):  # the one underneath is hidden, not lost, while they overlap
            assert np.isnan(square[:, 0]).any() or np.isnan(circle[:, 0]).any(), name


# ----------------------------------------------------------------------------------------- ladder and gaming
# The same held-out prompt sequences rendered as asked and in ways that fail them by degree (the ladder), and
# streams made to game the rules, each against the honest stream it imitates.

LADDER = ("as_asked", "wrong_speed", "wrong_direction", "frozen", "black", "noise")
#: each gaming stream and the honest stream it imitates (it may score at most as much)
GAMING = {"flicker_patch": "frozen",  # a 4 x 4 patch blinking on a frozen frame: pixels change, nothing moves
          "frozen_noise": "frozen",  # a frozen frame under fresh pixel noise (std 8 grey levels) every frame
          "jitter": "frozen",  # every object shaken in place (up to 1.5 px each way)
          "blink": "frozen",  # a frozen frame shown every other frame, blank in between
          "teleport_to_place": "frozen",  # frozen in each segment, jumping at each switch to where it should be
          "reversed": "wrong_direction",  # every motion the opposite way
          "oscillate": "wrong_direction",  # back and forth along the asked direction, 4 px, period 6 frames
          "stepwise": "as_asked"}  # the asked path, but held for 4 frames and then jumped ahead


def _offsets(track: StreamTrack, velocities, frames: int) -> np.ndarray:
    moved = StreamTrack(track.shape, tuple(tuple(v) for v in velocities), track.starts)
    return np.array([moved.offset(f) for f in range(frames)])


def _relaid(tracks, velocities, frames: int, rng: np.random.Generator, tries: int = 400):
    """``tracks`` with other velocities (per object, per segment), at start positions that keep every object
    inside the frame and 4 px from the others in every frame; None when none is found."""
    paths = [_offsets(t, v, frames) for t, v in zip(tracks, velocities)]
    for _ in range(tries):
        centres = []
        for t, p in zip(tracks, paths):
            lo, hi = t.shape.r + 1 - p.min(0), 64 - t.shape.r - 1 - p.max(0)
            if (lo > hi).any():
                return None
            centres.append(rng.uniform(lo, hi) + p)
        if all((np.linalg.norm(centres[a] - centres[b], axis=1) >= tracks[a].shape.r + tracks[b].shape.r + 4).all()
               for a in range(len(tracks)) for b in range(a)):
            return [StreamTrack(replace(t.shape, cx=float(c[0, 0]), cy=float(c[0, 1])), tuple(map(tuple, v)),
                                t.starts) for t, c, v in zip(tracks, centres, velocities)]
    return None


def ladder_and_gaming(meta: dict, rng: np.random.Generator) -> dict[str, np.ndarray] | None:
    """Every stream of :data:`LADDER` and :data:`GAMING` for ``meta`` (None when a layout does not fit).

    ``wrong_speed``: each moving object in its asked direction at a speed outside its band -- ``slowly`` at 2.8
    px/frame, ``quickly`` at 1.2, an unnamed speed at 0.4 (too slow to count as moving; the band starts where
    motion does); ``wrong_direction``: each motion turned by a right angle; ``frozen``: frame 0 throughout."""
    T = meta["num_frames"]
    tracks = sample_stream_tracks(meta, rng)
    asks = [segment_asks(s) for s in meta["segments"]]

    def direction_at(motion, speed):
        return tuple(speed * np.asarray(UNIT[motion])) if motion != "still" else (0.0, 0.0)

    slow = [[direction_at(m, {"slowly": 2.8, "quickly": 1.2, None: 0.4}[w]) for m, w in (a[j] for a in asks)]
            for j in range(len(tracks))]
    layouts = {"as_asked": tracks, "wrong_speed": _relaid(tracks, slow, T, rng),
               "wrong_direction": _relaid(tracks, [[(-vy, vx) for vx, vy in t.velocities] for t in tracks], T, rng),
               "reversed": _relaid(tracks, [[(-vx, -vy) for vx, vy in t.velocities] for t in tracks], T, rng)}
    if any(v is None for v in layouts.values()):
        return None
    out = {name: draw_stream(ts, T) for name, ts in layouts.items()}
    frozen = np.repeat(out["as_asked"][:1], T, axis=0)
    out |= {"frozen": frozen, "black": np.zeros_like(frozen), "noise": rng.integers(0, 256, frozen.shape, np.uint8)}
    first = [t.at(0) for t in tracks]
    patch = frozen.copy()  # in the corner farthest from every object
    corner = max(((2, 2), (2, 58), (58, 2), (58, 58)), key=lambda c: min(math.hypot(c[0] - s.cx, c[1] - s.cy)
                                                                          for s in first))
    patch[::2, corner[1]: corner[1] + 4, corner[0]: corner[0] + 4] = 0
    out["flicker_patch"] = patch
    out["frozen_noise"] = np.clip(frozen + rng.normal(0, 8, frozen.shape), 0, 255).round().astype(np.uint8)
    out["jitter"] = draw_frames([[replace(s, cx=s.cx + rng.uniform(-1.5, 1.5), cy=s.cy + rng.uniform(-1.5, 1.5))
                                  for s in first] for _ in range(T)])
    out["blink"] = frozen.copy()
    out["blink"][1::2] = 255
    starts = [int(s["start"]) for s in meta["segments"]]
    segment = [max(k for k, s in enumerate(starts) if s <= t) for t in range(T)]
    out["teleport_to_place"] = draw_frames([[tr.at(starts[segment[t]]) for tr in tracks] for t in range(T)])
    out["stepwise"] = draw_frames([[tr.at(4 * (t // 4)) for tr in tracks] for t in range(T)])

    def swing(tr, t):
        v = np.asarray(tr.velocities[segment[t]])
        u = v / np.linalg.norm(v) if v.any() else v
        a = 4.0 * math.sin(2 * math.pi * t / 6)
        return replace(tr.at(0), cx=tr.at(0).cx + a * u[0], cy=tr.at(0).cy + a * u[1])

    out["oscillate"] = draw_frames([[swing(tr, t) for tr in tracks] for t in range(T)])
    return out


@pytest.fixture(scope="module")
def ladders(reward):
    """``{tag: [(metadata, {stream name: verdict}), ...]}``: three held-out prompt sequences per tag."""
    out = {}
    for tag, seed in (("one_object_stream", 11), ("two_object_stream", 12)):
        rng = np.random.default_rng(seed)
        pool = [m for m in TEST_STREAMS if m["tag"] == tag]
        cases = []
        for i in rng.permutation(len(pool)):
            streams = ladder_and_gaming(pool[i], rng)
            if streams is None:
                continue
            verdicts = reward.judge(np.stack(list(streams.values())), [pool[i]] * len(streams))
            cases.append((pool[i], dict(zip(streams, verdicts))))
            if len(cases) == 3:
                break
        out[tag] = cases
    return out


@pytest.mark.parametrize("tag", ["one_object_stream", "two_object_stream"])
def test_the_ladder_holds_on_every_stream(reward, ladders, tag):
    """As asked > wrong speed > wrong direction > frozen > black = noise = 0, on every stream, by a margin."""
    cases = ladders[tag]
    assert len(cases) == 3 and len({m["prompt"] for m, _ in cases}) == 3
    for meta, verdicts in cases:
        score = {name: reward.combine(verdicts[name].components) for name in LADDER}
        assert score["as_asked"] >= POSITIVE and score["black"] == score["noise"] == 0.0, (meta["prompt"], score)
        for upper, lower in zip(LADDER, LADDER[1:4]):
            assert score[upper] >= score[lower] + 0.05, (meta["prompt"], upper, lower, score)
        assert score["frozen"] > 0.0
        # a stream that does not move earns no motion-dependent credit where motion is asked
        frozen = verdicts["frozen"].components
        for k, seg in enumerate(meta["segments"]):
            if any(c["motion"] != "still" for c in seg["include"]):
                for name in ("adherence", "direction", "speed"):
                    assert frozen[f"segment{k}/{name}"] == 0.0, (meta["prompt"], k, name)
        assert frozen["recovery"] == 0.0 and frozen["anti_freeze"] == 0.0, meta["prompt"]


@pytest.mark.parametrize("tag", ["one_object_stream", "two_object_stream"])
def test_gaming_scores_no_higher_than_the_honest_stream_it_imitates(reward, ladders, tag):
    for meta, verdicts in ladders[tag]:
        score = {name: reward.combine(v.components) for name, v in verdicts.items()}
        for attack, honest in GAMING.items():
            assert score[attack] <= score[honest] + 1e-6, (meta["prompt"], attack, honest, score)
        assert score["stepwise"] <= score["as_asked"] - 0.1, (meta["prompt"], score)
        # no anti-freeze for pixels that change around objects that do not move
        for attack in ("flicker_patch", "frozen_noise", "blink", "teleport_to_place"):
            assert verdicts[attack].components["anti_freeze"] == 0.0, (meta["prompt"], attack)
        # every motion reversed: no direction, speed, adherence or recovery where motion is asked
        rev = verdicts["reversed"].components
        for k, seg in enumerate(meta["segments"]):
            if all(c["motion"] != "still" for c in seg["include"]):
                assert max(rev[f"segment{k}/{n}"] for n in ("adherence", "direction", "speed")) <= 0.01, (meta, k)
        assert rev["recovery"] <= 0.01, meta["prompt"]


# ----------------------------------------------------------------------------------------- the reward


def test_components_input_forms_scores_and_errors():
    torch.set_num_threads(1)
    metas, clips = positives(2, seed=4)
    clips[1] = np.repeat(clips[1][:1], len(clips[1]), axis=0)  # frozen
    r = rewards.load("long_video")
    assert isinstance(r, LongVideoReward) and r.modality == "video"
    assert r.version == VERSION == 2 and r.describe() == "long_video v2 (score=mean)"  # results name the rules
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
    assert "weights={'anti_freeze': 0.0" in rewards.load("long_video", weights={"anti_freeze": 0.0}).describe()
    for bad in ({"teleport_fraction": 0.0}, {"smooth_fraction": 1.5}, {"freeze_window": 2}, {"gap_radius": -1.0},
                {"velocity_frames": 1}):
        with pytest.raises(ValueError, match=f"long_video {next(iter(bad))}"):
            rewards.load("long_video", **bad)
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
