"""The shapes world: renderer spec, prompt sets, and the `shapes` detector + GenEval rules on rendered scenes."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np
import pytest

from flowgrpo.world import (
    CLASSES,
    PALETTE,
    TAGS,
    Shape,
    all_metadata,
    draw,
    metadata_for,
    perturb,
    prompt_for,
    render,
    render_array,
    sample_scene,
    shape_box,
    split_prompts,
)
from rewards.geneval import ShapesDetector, judge, relative_position
from rewards.geneval import shapes as shapes_module

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- renderer


def test_palette_and_classes_match_the_spec_and_the_detector():
    assert PALETTE == {
        "red": (220, 30, 30),
        "yellow": (240, 200, 20),
        "green": (30, 160, 50),
        "blue": (30, 70, 220),
        "purple": (140, 50, 180),
        "black": (20, 20, 20),
    }
    assert CLASSES == ("circle", "square", "triangle")
    # the renderer and the detector share one definition of the spec
    assert shapes_module.PALETTE is PALETTE and shapes_module.CLASSES is CLASSES


def test_render_follows_the_spec():
    rng = np.random.default_rng(0)
    for meta in all_metadata():
        shapes = sample_scene(meta, rng)
        assert len(shapes) == sum(c["count"] for c in meta["include"])
        for i, s in enumerate(shapes):
            assert 6.0 <= s.r <= 12.0
            assert s.r <= s.cx <= 64 - s.r and s.r <= s.cy <= 64 - s.r  # inside the canvas
            for t in shapes[i + 1 :]:  # circumcircles apart: no overlap
                assert math.hypot(s.cx - t.cx, s.cy - t.cy) >= s.r + t.r
        for clause in meta["include"]:
            drawn = [s for s in shapes if s.cls == clause["class"]]
            assert len(drawn) >= clause["count"]
            if "color" in clause:
                assert all(s.color == clause["color"] for s in drawn)
    img = render(metadata_for("colors", "square", colors="blue"), seed=3)
    arr = np.asarray(img)
    assert img.size == (64, 64) and img.mode == "RGB" and arr.dtype == np.uint8
    assert tuple(arr[0, 0]) == (255, 255, 255)


def test_draw_geometry_exact_colours_and_antialiasing():
    # One shape per class at a known place: interior pixels carry the exact RGB, edges are blends with white.
    for cls, colour in zip(CLASSES, ("red", "green", "black")):
        shape = Shape(cls, colour, 32.4, 31.7, 10.0)
        arr = draw([shape])
        rgb = np.array(PALETTE[colour])
        exact = np.all(arr == rgb, axis=-1)
        white = np.all(arr == 255, axis=-1)
        blend = ~exact & ~white
        assert exact[32, 32] and white[0, 0] and blend.sum() >= 20
        # blended pixels lie on the segment white -> colour (anti-aliasing, no other colour)
        d = (arr[blend].astype(float) - 255.0) @ (rgb - 255.0) / ((rgb - 255.0) @ (rgb - 255.0))
        residual = np.linalg.norm(arr[blend] - (255.0 + d[:, None] * (rgb - 255.0)), axis=1)
        assert residual.max() < 2.0
        area = (1 - np.mean((arr.astype(float) - rgb) / (255.0 - rgb + 1e-9), axis=-1).clip(0, 1)).sum()
        expected = {"circle": math.pi, "square": 2.0, "triangle": 3 * math.sqrt(3) / 4}[cls] * 100
        assert abs(area - expected) < 0.03 * expected, (cls, area, expected)
        ys, xs = np.nonzero(~white)
        x1, y1, x2, y2 = shape_box(shape)
        assert abs(xs.min() - x1) <= 1 and abs(xs.max() + 1 - x2) <= 1
        assert abs(ys.min() - y1) <= 1 and abs(ys.max() + 1 - y2) <= 1
    # upright triangle: apex at the top -> the top row is narrower than the bottom row
    arr = draw([Shape("triangle", "red", 32.0, 32.0, 12.0)])
    rows = [int((~np.all(arr[i] == 255, axis=-1)).sum()) for i in range(64)]
    filled = [i for i, w in enumerate(rows) if w]
    assert rows[filled[0]] < rows[filled[-1]]


def test_position_scenes_hold_their_relation_exclusively():
    rng = np.random.default_rng(1)
    opposite = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
    for meta in all_metadata("position"):
        for _ in range(3):
            target, mover = sample_scene(meta, rng)
            relations = relative_position(shape_box(mover), shape_box(target))
            relation = meta["include"][1]["position"][0]
            assert relations == {relation}, (meta["prompt"], relations)
            assert relative_position(shape_box(target), shape_box(mover)) == {opposite[relation]}


def test_render_is_seeded_and_rejects_contradictions():
    meta = metadata_for("counting", "circle", count=3)
    assert np.array_equal(render_array(meta, seed=7), render_array(meta, seed=7))
    assert not np.array_equal(render_array(meta, seed=7), render_array(meta, seed=8))
    bad = {"tag": "counting", "include": [{"class": "circle", "count": 3}], "exclude": [{"class": "circle", "count": 3}]}
    with pytest.raises(ValueError, match="contradictory"):
        render_array(bad, seed=0)
    with pytest.raises(ValueError, match=r"include\[0\]\.class"):
        render_array({"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, seed=0)


# -------------------------------------------------------------------------------------------- prompts


def test_prompts_use_geneval_templates_and_metadata():
    assert metadata_for("colors", "circle", colors="red")["prompt"] == "a photo of a red circle"
    assert metadata_for("counting", "square", count=3) == {
        "tag": "counting",
        "include": [{"class": "square", "count": 3}],
        "exclude": [{"class": "square", "count": 4}],
        "prompt": "a photo of three squares",
    }
    assert metadata_for("position", ("circle", "triangle"), relation="left of") == {
        "tag": "position",
        "include": [{"class": "triangle", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}],
        "prompt": "a photo of a circle left of a triangle",
    }
    assert metadata_for("color_attr", ("square", "circle"), colors=("blue", "yellow"))["prompt"] == (
        "a photo of a blue square and a yellow circle"
    )
    assert metadata_for("two_object", ("circle", "square"))["prompt"] == "a photo of a circle and a square"
    assert metadata_for("single_object", "triangle")["prompt"] == "a photo of a triangle"
    counts = collections.Counter(m["tag"] for m in all_metadata())
    assert counts == {"single_object": 3, "two_object": 6, "counting": 9, "colors": 18, "position": 24, "color_attr": 180}
    assert len({m["prompt"] for m in all_metadata()}) == 240
    assert all(prompt_for(m) == m["prompt"] for m in all_metadata())


def test_prompt_sets_are_disjoint_seeded_and_committed():
    train, test = split_prompts(seed=0)
    prompts_train, prompts_test = {m["prompt"] for m in train}, {m["prompt"] for m in test}
    assert not prompts_train & prompts_test
    assert len(train) == 160 and len(test) == 80 and len(prompts_train | prompts_test) == 240
    assert {m["tag"] for m in test} == set(TAGS)
    for tag in ("counting", "colors", "position", "color_attr"):  # held-out prompts are new combinations
        words = lambda rows: {(k, c.get(k)) for m in rows if m["tag"] == tag for c in m["include"] for k in ("class", "color")}  # noqa: E731
        assert words(test) <= words(train)
    for name, rows in (("shapes_train.jsonl", train), ("shapes_held_out.jsonl", test)):
        on_disk = [json.loads(line) for line in (ROOT / "assets" / "prompts" / name).read_text().splitlines()]
        assert on_disk == rows, f"assets/prompts/{name} is stale: run python scripts/make_prompts.py"


def test_perturbations_change_what_they_say():
    rng = np.random.default_rng(0)
    m = metadata_for("color_attr", ("square", "circle"), colors=("blue", "yellow"))
    assert perturb(m, "binding", rng)["prompt"] == "a photo of a yellow square and a blue circle"
    assert perturb(m, "count", rng) is None and perturb(m, "relation", rng) is None
    c = perturb(metadata_for("counting", "circle", count=2), "count", rng)
    assert c["include"][0]["count"] in (1, 3) and c["exclude"][0]["count"] == c["include"][0]["count"] + 1
    k = perturb(metadata_for("counting", "circle", count=2), "class", rng)
    assert k["include"][0]["class"] != "circle" and k["exclude"][0]["class"] == k["include"][0]["class"]
    p = perturb(metadata_for("position", ("circle", "square"), relation="above"), "relation", rng)
    assert p["include"][1]["position"][0] != "above"


# ------------------------------------------------------------------------ detector + rules, end to end


def _blur(x: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur of ``[H, W, C]`` with reflected borders (numpy: tiny tensors are slow in torch)."""
    radius = int(math.ceil(3 * sigma))
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    taps /= taps.sum()
    for axis in (0, 1):
        pad = [(0, 0)] * x.ndim
        pad[axis] = (radius, radius)
        padded = np.pad(x, pad, mode="reflect")
        n = x.shape[axis]
        x = sum(w * np.take(padded, np.arange(i, i + n), axis=axis) for i, w in enumerate(taps))
    return x


def _degrade(img: np.ndarray, sigma: float, noise: float, rng: np.random.Generator, artefacts: bool = False) -> np.ndarray:
    x = img.astype(np.float64)
    if artefacts:  # off-white background, colour bleeding (shifted red channel), small specks
        x = x * 0.96 + 2.0
        x[..., 0] = np.roll(x[..., 0], 1, axis=1)
        pal = np.array(list(PALETTE.values()), dtype=np.float64)
        for _ in range(4):
            i, j = rng.integers(0, 62, 2)
            h, w = rng.integers(1, 3, 2)
            x[i : i + h, j : j + w] = pal[rng.integers(len(pal))]
    if sigma > 0:
        x = _blur(x, sigma)
    if noise > 0:
        x = x + rng.normal(0.0, noise, x.shape)
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


CONDITIONS = {  # name: (blur sigma in px, noise std in 0..255, artefacts)
    "clean": (0.0, 0.0, False),
    "blur0.75+noise": (0.75, 4.0, False),
    "blur1.25+noise": (1.25, 4.0, False),
    "blur1+artefacts": (1.0, 4.0, True),
}
NEGATIVE_KINDS = {
    "single_object": ("class",),
    "two_object": ("class",),
    "counting": ("class", "count"),
    "colors": ("class", "color"),
    "position": ("class", "relation"),
    "color_attr": ("class", "color", "binding"),
}


def test_shapes_detector_verdicts_on_rendered_positives_and_negatives():
    """>= 98% correct GenEval verdicts on positives AND negatives, for every tag, clean and degraded.

    A positive renders the prompt's own metadata (must pass); a negative renders a perturbed metadata (wrong
    class / count / colour / binding / relation) and is judged against the original (must fail).
    """
    per_cell = 25  # positives and negatives per (tag, condition): 6 tags x 4 conditions x 50 = 1200 images
    detector = ShapesDetector()
    rng = np.random.default_rng(2024)
    by_tag = {t: all_metadata(t) for t in TAGS}
    hits: dict[tuple[str, str, str], list[bool]] = collections.defaultdict(list)
    partial_ok: list[bool] = []
    failures = []
    for tag in TAGS:
        for cond, (sigma, noise, artefacts) in CONDITIONS.items():
            for n in range(per_cell):
                meta = by_tag[tag][rng.integers(len(by_tag[tag]))]
                img = _degrade(render_array(meta, rng=rng), sigma, noise, rng, artefacts)
                verdict = judge(detector.detect(img), meta)
                hits[(tag, cond, "pos")].append(verdict.strict)
                partial_ok.append(verdict.exact and verdict.partial == 1.0)
                if not verdict.strict:
                    failures.append(f"{cond} + {meta['prompt']}: {verdict.reason}")
                kind = NEGATIVE_KINDS[tag][n % len(NEGATIVE_KINDS[tag])]
                wrong = perturb(meta, kind, rng)
                img = _degrade(render_array(wrong, rng=rng), sigma, noise, rng, artefacts)
                verdict = judge(detector.detect(img), meta)
                hits[(tag, cond, "neg")].append(not verdict.strict)
                if verdict.strict:
                    failures.append(f"{cond} - {meta['prompt']} drawn as {wrong['prompt']!r}: passed")
    table = ["tag            " + "  ".join(f"{c:>18s}" for c in CONDITIONS) + "   (pos/neg accuracy)"]
    worst = 1.0
    for tag in TAGS:
        cells = []
        for cond in CONDITIONS:
            p, q = np.mean(hits[(tag, cond, "pos")]), np.mean(hits[(tag, cond, "neg")])
            cells.append(f"{p:8.2f}/{q:<9.2f}")
        for pol in ("pos", "neg"):
            acc = np.mean([h for cond in CONDITIONS for h in hits[(tag, cond, pol)]])
            worst = min(worst, acc)
        table.append(f"{tag:15s}" + "  ".join(f"{c:>18s}" for c in cells))
    report = "\n".join(table) + f"\nFlow-GRPO exact & partial==1 on positives: {np.mean(partial_ok):.3f}\n" + "\n".join(failures[:10])
    print(report)
    for tag in TAGS:
        for pol in ("pos", "neg"):
            acc = np.mean([h for cond in CONDITIONS for h in hits[(tag, cond, pol)]])
            assert acc >= 0.98, f"{tag} {pol} accuracy {acc:.3f} < 0.98\n{report}"
    assert np.mean(partial_ok) >= 0.98, report


def test_specks_and_empty_images_give_no_confident_detections():
    rng = np.random.default_rng(5)
    detector = ShapesDetector()
    blank = np.full((64, 64, 3), 255, np.uint8)
    assert detector.detect(blank) == {}
    noisy = _degrade(blank, 0.0, 6.0, rng, artefacts=True)
    assert all(d.score <= 0.3 for ds in detector.detect(noisy).values() for d in ds)
