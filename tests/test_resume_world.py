"""Resume streams: an object moves, turns, pauses and is told only to move "again" (flowgrpo.world.resume), and the
long_video reward's resume components. The world must be solvable only from the frames before the pause, and its
reward must not be won by the older, wrong motion, by standing still or by never pausing."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import rewards
from flowgrpo.world import (
    DIRECTIONS,
    RESUME_PAUSE,
    render_stream,
    resume_layouts,
    resume_prompt_for,
    sample_resume_metadata,
    sequence_key,
    split_resume_prompts,
)
from flowgrpo.world.streams import _min_spans
from rewards.streams import RESUME_NAMES, segment_asks, validate_stream_metadata

ROOT = Path(__file__).resolve().parents[1]
WORDS = set(DIRECTIONS) | {"slowly", "quickly", "still", "left", "right", "up", "down"}


def test_resume_streams_ask_the_motion_shown_before_the_pause_and_do_not_name_it():
    for seed in range(40):
        meta = sample_resume_metadata(seed)
        before, last, pause, again = meta["segments"]
        assert validate_stream_metadata(meta) and meta["tag"] == "one_object_stream"
        assert tuple(s["start"] for s in meta["segments"][1:]) in resume_layouts()
        assert again["start"] - pause["start"] == RESUME_PAUSE and meta["num_frames"] - again["start"] >= 12
        assert segment_asks(pause) == (("still", None),)
        assert again["resume"] is True and segment_asks(again) == segment_asks(last)
        assert segment_asks(before)[0][0] != segment_asks(last)[0][0] != "still"  # the older frames mislead
        assert again["prompt"] == resume_prompt_for(last) and again["prompt"].endswith(" moving again")
        assert not WORDS & set(again["prompt"].split())  # no direction, no speed, in the resume prompt
        assert all(max(span) <= 32.0 for span in _min_spans(meta))
    assert sample_resume_metadata(3) == sample_resume_metadata(3)
    # with blocks of one latent frame and a window of 4, the first resumed block's window holds a frame of `last`
    for last, pause, again in resume_layouts():
        block = (again - 1) // 4 + 1  # latent frame of the first resumed pixel frame
        window = range(block - 3, block)  # the 3 latent frames before it
        assert any(4 * (j - 1) + 1 >= last and 4 * j < pause for j in window)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["segments"][3].update(resume="yes"), "segments\\[3\\].resume: expected true or false"),
    (lambda m: m["segments"][1].update(resume=True), "segments\\[1\\].resume: a resumed segment follows"),
    (lambda m: m["segments"][2]["include"][0].update(motion=m["segments"][1]["include"][0]["motion"]),
     "segments\\[3\\].resume: a resumed segment follows a segment standing still"),
    (lambda m: m["segments"][3]["include"][0].update(motion=m["segments"][0]["include"][0]["motion"]),
     "segments\\[3\\].resume: a resumed segment asks the motion shown before the pause"),
])
def test_resume_metadata_that_asks_something_else_is_refused_naming_the_key(edit, message):
    meta = copy.deepcopy(sample_resume_metadata(0))
    edit(meta)
    with pytest.raises(ValueError, match=message):
        validate_stream_metadata(meta, require_switches=False)


def test_resume_splits_are_disjoint_seeded_and_written():
    train, val, test = split_resume_prompts()
    keys = [{sequence_key(m) for m in part} for part in (train, val, test)]
    assert [len(k) for k in keys] == [300, 100, 100]
    assert not (keys[0] & keys[1]) and not (keys[0] & keys[2]) and not (keys[1] & keys[2])
    for part, rows in zip(("train", "val", "test"), (train, val, test)):
        written = [json.loads(line) for line in (ROOT / f"assets/prompts/resume_{part}.jsonl").read_text().splitlines()]
        assert written == rows, part  # scripts/make_prompts.py --check holds the same


def _shown(meta: dict, k: int, motion: str) -> dict:
    """What a failing stream shows: segment ``k``'s object doing ``motion``."""
    out = copy.deepcopy(meta)
    for seg in out["segments"]:
        seg.pop("resume", None)
    clause = out["segments"][k]["include"][0]
    clause["motion"] = motion
    if motion == "still":
        clause.pop("speed", None)
    return out


@pytest.fixture(scope="module")
def scored():
    """long_video on rendered resume streams (4 prompts) as asked and as a model could get them wrong."""
    torch.set_num_threads(1)
    reward = rewards.load("long_video")
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    out: dict[str, list[dict]] = {}
    for seed in range(4):
        meta = sample_resume_metadata(seed)
        before, last = (segment_asks(s)[0][0] for s in meta["segments"][:2])
        shown = {"as asked": meta, "resumes the older motion": _shown(meta, 3, before),
                 "resumes the opposite way": _shown(meta, 3, opposite[last]),
                 "stays still after the pause": _shown(meta, 3, "still"), "never pauses": _shown(meta, 2, last)}
        for name, what in shown.items():
            clip = render_stream(what, rng=np.random.default_rng(100 + seed))
            video = torch.from_numpy(clip).permute(0, 3, 1, 2)[None].float() / 255
            result = reward(video, metadata=[meta])
            out.setdefault(name, []).append({"score": float(result.scores[0])}
                                            | {k: float(v[0]) for k, v in result.components.items()})
        black = reward(torch.zeros(1, 49, 3, 64, 64), metadata=[meta])
        out.setdefault("black", []).append({"score": float(black.scores[0])}
                                           | {k: float(black.components[k][0]) for k in RESUME_NAMES})
    return out


def test_the_resume_ladder_holds_on_every_stream(scored):
    """As asked > the older (wrong) motion or the opposite way > standing still > black, on the scalar reward of
    every stream; the resume components give full credit as asked and none to a wrong or missing resume."""
    for i in range(4):
        row = {name: rows[i] for name, rows in scored.items()}
        asked = row["as asked"]
        assert asked["score"] > 0.99 and all(asked[k] > 0.99 for k in RESUME_NAMES)
        for wrong in ("resumes the older motion", "resumes the opposite way", "stays still after the pause"):
            assert row[wrong]["resume/direction"] < 0.01 and row[wrong]["resume/adherence"] < 0.01, wrong
            assert row[wrong]["score"] < asked["score"] - 0.1, wrong
        for wrong in ("resumes the older motion", "resumes the opposite way"):
            assert row[wrong]["score"] > row["stays still after the pause"]["score"], wrong
        assert row["black"]["score"] == 0.0 and all(row["black"][k] == 0.0 for k in RESUME_NAMES)


def test_never_pausing_does_not_pay(scored):
    """Moving straight through the pause gets the resumed motion right but loses the pause: below as asked."""
    for asked, through in zip(scored["as asked"], scored["never pauses"]):
        assert through["resume/direction"] > 0.99
        assert through["score"] < asked["score"] - 0.1 and through["segment2/direction"] < 0.01


def test_resume_components_only_where_a_stream_resumes():
    reward = rewards.load("long_video")
    plain = {"num_frames": 49, "segments": [
        {"start": 0, "tag": "motion", "prompt": "a red circle moving left",
         "include": [{"class": "circle", "count": 1, "color": "red", "motion": "left"}]},
        {"start": 25, "tag": "static", "prompt": "a red circle standing still",
         "include": [{"class": "circle", "count": 1, "color": "red", "motion": "still"}]}]}
    video = torch.zeros(1, 49, 3, 64, 64)
    assert not set(RESUME_NAMES) & set(reward(video, metadata=[plain]).components)
    both = reward(torch.zeros(2, 49, 3, 64, 64), metadata=[plain, sample_resume_metadata(0)]).components
    assert torch.isnan(both["resume/direction"][0]) and both["resume/direction"][1] == 0.0


def test_the_caption_flaw_resumes_from_the_motion_shown_before_the_pause():
    from flowgrpo.world import corrupt_stream

    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    for seed in range(10):
        meta = sample_resume_metadata(seed)
        rng = np.random.default_rng(seed)
        clean = corrupt_stream(meta, rng, 0.0, 0.0)
        assert [segment_asks(s) for s in clean["segments"]] == [segment_asks(s) for s in meta["segments"]]
        flipped = corrupt_stream(meta, rng, 1.0, 0.0)  # every motion shown the other way ...
        last = segment_asks(flipped["segments"][1])[0][0]
        assert last == opposite[segment_asks(meta["segments"][1])[0][0]]
        assert segment_asks(flipped["segments"][3])[0][0] == opposite[last]  # ... the resume of the shown one too
        frozen = corrupt_stream(meta, rng, 0.0, 1.0)
        assert all(segment_asks(s)[0][0] == "still" for s in frozen["segments"])
        validate_stream_metadata(flipped, require_switches=False)  # renderable metadata (no resume flag left)
        render_stream(frozen, rng=rng)


def test_pretraining_draws_the_asked_share_of_resume_streams_and_none_held_out():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from pretrain_tiny_causal_wan import render_streams

    from flowgrpo.world import resume_held_out_sequences

    held_out = resume_held_out_sequences()
    x, metas = render_streams(np.random.default_rng(0), 6, set(held_out), 49, 0.25, 0.15, resume_share=0.5)
    assert x.shape == (6, 3, 49, 64, 64) and -1.0 <= float(x.min()) and float(x.max()) <= 1.0
    resumed = [m for m in metas if any(s.get("resume") for s in m["segments"])]
    assert 0 < len(resumed) < 6 and not {sequence_key(m) for m in resumed} & held_out
    _, plain = render_streams(np.random.default_rng(0), 3, set(), 49, 0.25, 0.15)
    _, again = render_streams(np.random.default_rng(0), 3, set(), 49, 0.25, 0.15, resume_share=0.0)
    assert plain == again and not any(s.get("resume") for m in plain for s in m["segments"])
