"""GenEval reward: the rule engine on hand-made detections, the reward wrapper, the `real` detector's
plumbing on tiny random twins, and the `python -m rewards geneval` CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import rewards
from flowgrpo.world import metadata_for, perturb, render, render_array
from rewards.geneval import Detection, judge, relative_position, select_detections, validate_metadata
from rewards.geneval.rules import TAGS, position_direction
from twins import save_tiny_clip  # tests/twins.py

ROOT = Path(__file__).resolve().parents[1]


def D(x1, y1, x2, y2, score=0.95, color=None):
    return Detection((x1, y1, x2, y2), score, color)


# ---------------------------------------------------------------------------------- position rule


def test_position_basic_directions_y_down():
    a, b = (0, 0, 10, 10), (30, 0, 40, 10)
    assert relative_position(a, b) == {"left of"} and relative_position(b, a) == {"right of"}
    top, bottom = (0, 0, 10, 10), (0, 30, 10, 40)
    assert relative_position(top, bottom) == {"above"} and relative_position(bottom, top) == {"below"}


def test_position_overlap_margin_gives_no_relation():
    # centres 1.5 px apart, margin 0.1 * (10 + 10) = 2 px: the revised offset is 0 -> no relation at all
    assert position_direction((0, 0, 10, 10), (1.5, 0, 11.5, 10)) is None
    assert relative_position((0, 0, 10, 10), (1.5, 0, 11.5, 10)) == set()
    # 2.5 px apart: revised offset -0.5, normalised by |offset| = 2.5 -> dx = -0.2: a direction, no relation
    assert position_direction((0, 0, 10, 10), (2.5, 0, 12.5, 10)) == pytest.approx((-0.2, 0.0))
    assert relative_position((0, 0, 10, 10), (2.5, 0, 12.5, 10)) == set()
    # far enough: dx = (10 - 2) / 10 = -0.8
    assert relative_position((0, 0, 10, 10), (10, 0, 20, 10)) == {"left of"}


def test_position_exact_half_threshold_is_not_a_relation():
    # offset -2, margin 0.1 * (5 + 5) = 1 -> revised -1, |offset| 2 -> dx = -0.5 exactly: "< -0.5" is false
    a, b = (0, 0, 5, 2), (2, 0, 7, 2)
    assert position_direction(a, b) == (-0.5, 0.0)
    assert relative_position(a, b) == set()
    assert relative_position(a, (2.01, 0, 7.01, 2)) == {"left of"}  # just past the threshold
    # the same on the vertical axis
    assert relative_position((0, 0, 2, 5), (0, 2, 2, 7)) == set()
    assert relative_position((0, 0, 2, 5), (0, 2.01, 2, 7.01)) == {"above"}


def test_position_diagonal_holds_two_relations_and_tiny_offsets_none():
    assert relative_position((0, 0, 2, 2), (20, 20, 22, 22)) == {"left of", "above"}
    assert relative_position((20, 0, 22, 2), (0, 20, 2, 22)) == {"right of", "above"}
    # zero-size boxes (no margin): offset (4, 3) -> (0.8, 0.6), both; offset (8, 3) -> (0.94, 0.35), one
    assert relative_position((4, 3, 4, 3), (0, 0, 0, 0)) == {"right of", "below"}
    assert relative_position((8, 3, 8, 3), (0, 0, 0, 0)) == {"right of"}
    # |revised| < 1e-3 on both axes -> no relation, even for zero-size boxes
    assert relative_position((0, 0, 0, 0), (0.0005, 0, 0.0005, 0)) == set()
    assert relative_position((0, 0, 0, 0), (0.002, 0, 0.002, 0)) == {"left of"}


# ---------------------------------------------------------------------------- thresholds, selection


def test_select_thresholds_are_strict_sorted_and_capped():
    dets = {"circle": [D(0, 0, 1, 1, s) for s in (0.85, 0.3, 0.95, 0.31, 0.9)]}
    assert [d.score for d in select_detections(dets, "counting")["circle"]] == [0.95]  # 0.9 is not > 0.9
    assert [d.score for d in select_detections(dets, "colors")["circle"]] == [0.95, 0.9, 0.85, 0.31]  # 0.3 dropped
    many = {"square": [D(0, 0, 1, 1, 0.5 + i / 100) for i in range(20)]}
    kept = select_detections(many, "single_object")["square"]
    assert len(kept) == 16 and kept[0].score == pytest.approx(0.69) and kept[-1].score == pytest.approx(0.54)
    assert select_detections({"circle": [D(0, 0, 1, 1, 0.2)]}, "two_object") == {}


def test_counting_uses_the_09_threshold_and_the_exclude_clause():
    meta = metadata_for("counting", "circle", count=2)
    two = {"circle": [D(0, 0, 5, 5, 0.95), D(10, 0, 15, 5, 0.92), D(20, 0, 25, 5, 0.85)]}
    v = judge(two, meta)  # the 0.85 one does not count for counting
    assert (v.strict, v.exact, v.partial) == (True, True, 1.0)
    three = {"circle": [D(0, 0, 5, 5, 0.95), D(10, 0, 15, 5, 0.92), D(20, 0, 25, 5, 0.91)]}
    v = judge(three, meta)  # exclude clause {circle, 3} fires
    assert not v.strict and "expected circle<3" in v.reason
    assert not v.exact and v.partial == pytest.approx(0.5)
    v = judge({"circle": three["circle"][:1]}, meta)
    assert not v.strict and v.partial == pytest.approx(0.5)
    # exclude counts only what survives selection: at most 16 detections, so "exclude 17" can never fire
    crowd = {"circle": [D(i, 0, i + 1, 1, 0.95) for i in range(20)]}
    meta16 = {"tag": "counting", "include": [{"class": "circle", "count": 16}], "exclude": [{"class": "circle", "count": 17}]}
    assert judge(crowd, meta16).strict


def test_geneval_allows_extras_outside_counting_but_flowgrpo_exact_does_not():
    meta = metadata_for("single_object", "circle")
    v = judge({"circle": [D(0, 0, 5, 5, 0.95), D(10, 0, 15, 5, 0.85)]}, meta)
    assert v.strict and not v.exact and v.partial == 0.0  # 1 - |1 - 2| / 1
    v = judge({"circle": [D(0, 0, 5, 5, 0.95)] * 3}, meta)
    assert v.strict and v.partial == -1.0  # reference: count credit not clipped
    assert judge({"circle": [D(0, 0, 5, 5, 0.95)] * 3}, meta, partial_credit="clipped").partial == 0.0
    v = judge({"square": [D(0, 0, 5, 5, 0.95)]}, meta)
    assert not v.strict and not v.exact and v.partial == 0.0


def test_colour_is_judged_on_the_top_count_detections():
    meta = metadata_for("colors", "circle", colors="red")
    v = judge({"circle": [D(0, 0, 5, 5, 0.9, "blue"), D(10, 0, 15, 5, 0.8, "red")]}, meta)
    assert not v.strict and "expected red circle" in v.reason  # the best circle is blue
    assert not v.exact and v.partial == 0.0  # [count 0, 0 for the colour clause]
    v = judge({"circle": [D(0, 0, 5, 5, 0.9, "red"), D(10, 0, 15, 5, 0.8, "blue")]}, meta)
    assert v.strict and not v.exact  # GenEval looks only at the best one
    v = judge({"circle": [D(0, 0, 5, 5, 0.9, "red")]}, meta)
    assert (v.strict, v.exact, v.partial) == (True, True, 1.0)
    attr = metadata_for("color_attr", ("square", "circle"), colors=("blue", "yellow"))
    v = judge({"square": [D(0, 0, 5, 5, 0.9, "blue")], "circle": [D(20, 0, 25, 5, 0.9, "red")]}, attr)
    assert not v.strict and v.partial == pytest.approx(0.75)  # [1, 1, 1, 0]
    with pytest.raises(ValueError, match="colour"):
        judge({"circle": [D(0, 0, 5, 5, 0.9)]}, meta)


def test_position_clause_uses_top_count_and_matched_targets():
    meta = metadata_for("position", ("circle", "square"), relation="left of")  # include: [square, circle left of 0]
    square = D(30, 0, 40, 10, 0.9)
    v = judge({"square": [square], "circle": [D(0, 0, 10, 10, 0.9)]}, meta)
    assert (v.strict, v.exact, v.partial) == (True, True, 1.0)
    # a second, weaker circle on the wrong side: GenEval checks only the top one; Flow-GRPO sees 2 circles
    v = judge({"square": [square], "circle": [D(0, 0, 10, 10, 0.9), D(60, 0, 64, 10, 0.5)]}, meta)
    assert v.strict and not v.exact and v.partial == pytest.approx(1 / 3)  # [1, 0, 0]
    # wrong side: the reference appends 0 and then 1 -> 0.75; the clipped variant gives 2/3
    wrong = {"square": [square], "circle": [D(50, 0, 60, 10, 0.9)]}
    v = judge(wrong, meta)
    assert not v.strict and "expected left of target, found right of" in v.reason
    assert not v.exact and v.partial == pytest.approx(0.75)
    assert judge(wrong, meta, partial_credit="clipped").partial == pytest.approx(2 / 3)
    # overlapping boxes: no relation at all
    assert not judge({"square": [square], "circle": [D(31, 0, 41, 10, 0.9)]}, meta).strict
    # the target clause failed: "no target"
    v = judge({"circle": [D(0, 0, 10, 10, 0.9)]}, meta)
    assert not v.strict and "no target" in v.reason and v.partial == pytest.approx(1 / 3)  # [0, 1, 0]


def test_validate_metadata_names_the_field():
    good = metadata_for("position", ("circle", "square"), relation="above")
    assert validate_metadata(good, classes=("circle", "square", "triangle")) == good
    cases = [
        ({"include": [{"class": "circle", "count": 1}]}, r"metadata\.tag"),
        ({"tag": "colors"}, r"metadata\.include"),
        ({"tag": "colors", "include": [{"class": "circle", "count": "1"}]}, r"include\[0\]\.count"),
        ({"tag": "colors", "include": [{"class": "circle", "count": 0}]}, r"include\[0\]\.count"),
        ({"tag": "colors", "include": [{"class": "dog", "count": 1}]}, r"include\[0\]\.class.*circle"),
        ({"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "teal"}]}, r"include\[0\]\.color"),
        ({"tag": "position", "include": [{"class": "circle", "count": 1, "position": ["near", 0]}]}, r"include\[0\]\.position\[0\]"),
        ({"tag": "position", "include": [{"class": "circle", "count": 1, "position": ["above", 0]}]}, r"include\[0\]\.position\[1\]"),
        ({"tag": "counting", "include": [{"class": "circle", "count": 2}], "exclude": [{"class": "circle"}]}, r"exclude\[0\]\.count"),
        # a misspelt key is refused, not ignored (the clause would be judged as an uncoloured circle)
        ({"tag": "colors", "include": [{"class": "circle", "count": 1, "colour": "red"}]},
         r"include\[0\]: unknown key 'colour' \(did you mean 'color'\?\)"),
        ({"tag": "counting", "include": [{"class": "circle", "count": 2}],
          "exclude": [{"class": "circle", "count": 3, "color": "red"}]}, r"exclude\[0\]: unknown key 'color'"),
    ]
    for meta, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            validate_metadata(meta, classes=("circle", "square", "triangle"), colors=("red", "blue"))


# --------------------------------------------------------------------------------------- the reward


def test_geneval_reward_components_and_input_forms():
    metas = [
        metadata_for("colors", "circle", colors="red"),
        metadata_for("counting", "square", count=3),
        metadata_for("position", ("triangle", "circle"), relation="below"),
    ]
    wrong = perturb(metas[0], "color", 0)
    pils = [render(m, seed=i) for i, m in enumerate(metas)] + [render(wrong, seed=9)]
    metas = metas + [metas[0]]
    reward = rewards.load("geneval", detector="shapes")
    out = reward(pils, [m["prompt"] for m in metas], metas)
    assert out.scores.tolist() == [1.0, 1.0, 1.0, 0.5]  # wrong colour: [count 1, colour 0]
    assert out.components["strict"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert out.components["exact"].tolist() == [1.0, 1.0, 1.0, 0.0]
    expected_keys = {"partial", "strict", "exact"} | {f"{k}/{t}" for k in ("strict", "partial") for t in TAGS}
    assert set(out.components) == expected_keys
    colors = out.components["strict/colors"]
    assert colors[0] == 1.0 and colors[3] == 0.0 and torch.isnan(colors[1:3]).all()
    assert torch.isnan(out.components["strict/two_object"]).all()
    assert torch.nanmean(out.components["strict/counting"]).item() == 1.0
    uint8 = torch.stack([torch.from_numpy(np.array(p)).permute(2, 0, 1) for p in pils])
    for images in (uint8, uint8.float() / 255.0, [np.asarray(p) for p in pils]):
        again = reward(images, None, metas)
        assert torch.equal(again.scores, out.scores)
    for score in ("strict", "exact"):  # the training scalar can be another component; all are still returned
        other = rewards.load("geneval", detector="shapes", score=score)(pils, None, metas)
        assert torch.equal(other.scores, out.components[score]) and torch.equal(other.components["partial"], out.scores)


def test_geneval_reward_errors_are_clear():
    reward = rewards.load("geneval")
    img = torch.ones(1, 3, 64, 64)
    with pytest.raises(ValueError, match="metadata"):
        reward(img, ["a photo of a circle"], None)
    with pytest.raises(ValueError, match="1 images but 2 metadata"):
        reward(img, None, [metadata_for("single_object", "circle")] * 2)
    with pytest.raises(ValueError, match=r"metadata\[0\]\.include\[0\]\.class"):
        reward(img, None, [{"tag": "single_object", "include": [{"class": "dog", "count": 1}]}])
    with pytest.raises(ValueError, match="videos"):
        reward(torch.ones(1, 2, 3, 64, 64), None, [metadata_for("single_object", "circle")])
    with pytest.raises(ValueError, match="unknown GenEval detector"):
        rewards.load("geneval", detector="owlvit")
    with pytest.raises(ValueError, match="score='verdict' is not one of partial, strict, exact"):
        rewards.load("geneval", score="verdict")


# ------------------------------------------------------------------------ real detector, tiny twins


@pytest.fixture(scope="module")
def tiny_real_checkpoints(tmp_path_factory):
    """Random-initialised Mask2Former + CLIP twins saved like hub checkpoints (a few MB, CPU seconds)."""
    from transformers import (
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        Mask2FormerImageProcessor,
        SwinConfig,
    )

    root = tmp_path_factory.mktemp("real")
    torch.manual_seed(0)
    labels = ["circle", "square", "triangle", "mouse"]  # "mouse" is GenEval's "computer mouse"
    swin = SwinConfig(image_size=64, patch_size=4, embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=4,
                      out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(backbone_config=swin, feature_size=32, mask_feature_size=32, hidden_dim=32, encoder_feedforward_dim=32,
                               encoder_layers=1, decoder_layers=2, num_attention_heads=2, dim_feedforward=32, num_queries=8,
                               id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    Mask2FormerForUniversalSegmentation(config).save_pretrained(root / "m2f")
    Mask2FormerImageProcessor(size={"shortest_edge": 64, "longest_edge": 96}, size_divisor=32).save_pretrained(root / "m2f")
    save_tiny_clip(root / "clip")
    return root / "m2f", root / "clip"


def test_real_detector_plumbing_on_tiny_twins(tiny_real_checkpoints):
    from rewards.geneval.real import GENEVAL_COLORS

    m2f, clip = tiny_real_checkpoints
    reward = rewards.load("geneval", detector="real", detector_path=str(m2f), clip_path=str(clip), device="cpu",
                          color_min_score=0.0)  # random weights score low: colour every detection
    detector = reward.detector
    assert detector.classes == ("circle", "square", "triangle", "computer mouse")
    metas = [metadata_for("color_attr", ("square", "circle"), colors=("blue", "yellow")), metadata_for("counting", "triangle", count=2)]
    # different sizes: the processor resizes and pads the 64 x 48 one; masks come back at each image's size
    images = [render_array(metas[0], seed=0), np.ascontiguousarray(render_array(metas[1], seed=1)[:, :48])]
    dets = detector(images, metas)
    assert len(dets) == 2
    for image, per_image, meta in zip(images, dets, metas):
        height, width = image.shape[:2]
        flat = [(cls, d) for cls, ds in per_image.items() for d in ds]
        assert len(flat) == 8 * 4  # top-100 over (queries x classes) = all 32 pairs here
        for cls, d in flat:
            assert cls in detector.classes and 0.0 <= d.score <= 1.0
            x1, y1, x2, y2 = d.box
            assert 0 <= x1 <= x2 <= width and 0 <= y1 <= y2 <= height and d.mask.shape == (height, width)
        coloured = {c["class"] for c in meta["include"] if "color" in c}
        for cls, d in flat:
            assert (d.color in GENEVAL_COLORS) if cls in coloured else d.color is None
    out = reward(images, None, metas)
    assert out.scores.shape == (2,) and torch.isfinite(out.scores).all()
    assert set(out.components["strict"].tolist()) <= {0.0, 1.0}


def test_real_detector_without_weights_says_what_to_set(tiny_real_checkpoints, tmp_path):
    m2f, clip = tiny_real_checkpoints
    with pytest.raises(OSError, match=r"facebook/mask2former-swin-small-coco-instance.*detector_path="):
        rewards.load("geneval", detector="real", device="cpu")  # offline, not cached
    missing = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(OSError, match=r"no-such-checkpoint.*detector_path="):
        rewards.load("geneval", detector="real", detector_path=missing, clip_path=str(clip), device="cpu")
    with pytest.raises(OSError, match=r"no-such-checkpoint.*clip_path="):
        rewards.load("geneval", detector="real", detector_path=str(m2f), clip_path=missing, device="cpu")


# ---------------------------------------------------------------------------------------------- CLI


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_cli_scores_a_folder(tmp_path):
    metas = [metadata_for("single_object", "triangle"), metadata_for("position", ("square", "circle"), relation="right of"),
             metadata_for("color_attr", ("circle", "triangle"), colors=("green", "purple"))]
    _write_jsonl(tmp_path / "meta.jsonl", metas)
    images = tmp_path / "images"
    images.mkdir()
    for i, meta in enumerate(metas):  # two samples per prompt, the second one wrong
        render(meta, seed=i).save(images / f"{i:05d}_0.png")
        render(perturb(meta, "class", i), seed=i).save(images / f"{i:05d}_1.png")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "rewards", "geneval", "--images", str(images), "--metadata", str(tmp_path / "meta.jsonl")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    by_file = {r["file"]: r for r in result["images"]}
    assert len(by_file) == 6
    for i, meta in enumerate(metas):
        assert by_file[f"{i:05d}_0.png"]["strict"] is True and by_file[f"{i:05d}_0.png"]["index"] == i
        assert by_file[f"{i:05d}_1.png"]["strict"] is False and by_file[f"{i:05d}_1.png"]["tag"] == meta["tag"]
    summary = result["summary"]
    assert summary["n"] == 6 and summary["strict"] == 0.5 and summary["geneval"] == 0.5
    assert summary["per_tag"]["position"] == {"n": 2, "strict": 0.5, "exact": 0.5, "partial": pytest.approx(0.5 * (1 + 1 / 3))}


def test_cli_pairing_modes_and_errors(tmp_path, capsys):
    from rewards.__main__ import main

    metas = [metadata_for("colors", "square", colors="yellow"), metadata_for("two_object", ("circle", "square"))]
    _write_jsonl(tmp_path / "meta.jsonl", metas)
    plain = tmp_path / "plain"
    plain.mkdir()
    render(metas[0], seed=0).save(plain / "a.png")  # no index in the names: sorted order = line order
    render(metas[1], seed=1).save(plain / "b.png")
    assert main(["geneval", "--images", str(plain), "--metadata", str(tmp_path / "meta.jsonl"), "--out", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert [(r["file"], r["index"], r["strict"]) for r in result["images"]] == [("a.png", 0, True), ("b.png", 1, True)]
    capsys.readouterr()
    # GenEval's own layout: <index>/metadata.jsonl + <index>/samples/*.png
    layout = tmp_path / "layout"
    for i, meta in enumerate(metas):
        (layout / f"{i:05d}" / "samples").mkdir(parents=True)
        _write_jsonl(layout / f"{i:05d}" / "metadata.jsonl", [meta])
        render(meta, seed=i).save(layout / f"{i:05d}" / "samples" / "0000.png")
    assert main(["geneval", "--images", str(layout)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["summary"]["strict"] == 1.0 and result["summary"]["n"] == 2
    # count mismatch without indices, and invalid metadata, fail with a message
    render(metas[0], seed=3).save(plain / "c.png")
    with pytest.raises(SystemExit, match="3 images .* 2 metadata lines"):
        main(["geneval", "--images", str(plain), "--metadata", str(tmp_path / "meta.jsonl")])
    _write_jsonl(tmp_path / "bad.jsonl", [{"tag": "colors", "include": [{"class": "square", "count": 1, "color": "teal"}]}] * 3)
    assert main(["geneval", "--images", str(plain), "--metadata", str(tmp_path / "bad.jsonl")]) == 2
    assert "include[0].color" in capsys.readouterr().err


def test_detector_components_match_a_flood_fill_numbered_in_raster_order():
    """The detector's 4-connected components (optionally only between pixels of the same colour key) against a plain
    flood fill whose labels follow the raster order of each component's first pixel."""
    from rewards.geneval.shapes import _components

    def flood(mask, key):
        h, w = mask.shape
        out, n = np.zeros((h, w), dtype=np.int64), 0
        for i in range(h):
            for j in range(w):
                if not mask[i, j] or out[i, j]:
                    continue
                n += 1
                out[i, j], todo = n, [(i, j)]
                while todo:
                    a, b = todo.pop()
                    for c, d in ((a + 1, b), (a - 1, b), (a, b + 1), (a, b - 1)):
                        if 0 <= c < h and 0 <= d < w and mask[c, d] and not out[c, d] \
                                and (key is None or key[c, d] == key[a, b]):
                            out[c, d] = n
                            todo.append((c, d))
        return out, n

    rng = np.random.default_rng(0)
    for trial in range(300):
        h, w = rng.integers(1, 16, size=2)
        mask = rng.random((h, w)) < rng.random()
        key = rng.integers(0, 3, size=(h, w)) if trial % 2 else None
        labels, n = _components(mask, key)
        ref, m = flood(mask, key)
        assert n == m and np.array_equal(labels, ref), trial
