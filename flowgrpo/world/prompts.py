"""GenEval prompts and metadata for the shapes world.

The six GenEval tags with GenEval's own templates and metadata layout (github djghosh13/geneval,
``prompts/create_prompts.py``), over the three shape classes and the six palette colours:

================  ==============================================  =====================================
tag               prompt                                          include (and exclude)
================  ==============================================  =====================================
single_object     a photo of a circle                             [circle x1]
two_object        a photo of a circle and a square                [circle x1, square x1]
counting          a photo of three squares                        [square x3], exclude [square x4]
colors            a photo of a red circle                         [red circle x1]
position          a photo of a circle left of a triangle          [triangle x1, circle x1 ("left of", 0)]
color_attr        a photo of a blue square and a yellow circle    [blue square x1, yellow circle x1]
================  ==============================================  =====================================

Counts are 2-4, relations ``left of / right of / above / below``; two-object tags use two different
classes and ``color_attr`` two different colours, as in GenEval. That gives 3 + 6 + 9 + 18 + 24 + 180 =
240 distinct prompts (:func:`all_metadata`), split into fixed train / held-out test sets by
:func:`split_prompts` (``scripts/make_prompts.py`` writes them to ``assets/prompts/``).

:func:`perturb` makes the negatives the tests judge: the metadata of a scene that must *fail* the original
prompt (wrong class, count, colour, colour binding or relation).
"""

from __future__ import annotations

import copy
import itertools

import numpy as np

from .render import CLASSES, PALETTE

__all__ = [
    "COUNT_WORDS",
    "COUNTS",
    "PERTURBATIONS",
    "RELATIONS",
    "TAGS",
    "all_metadata",
    "metadata_for",
    "perturb",
    "prompt_for",
    "split_prompts",
]

TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
COUNTS: tuple[int, ...] = (2, 3, 4)
COUNT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
PERTURBATIONS: tuple[str, ...] = ("class", "count", "color", "binding", "relation")


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _plural(name: str) -> str:
    return f"{name}es" if name.endswith("s") else f"{name}s"


def prompt_for(metadata: dict) -> str:
    """The GenEval template sentence of a metadata dict (also valid for perturbed metadata)."""
    tag, inc = metadata["tag"], metadata["include"]
    if tag == "single_object":
        return f"a photo of {_a(inc[0]['class'])}"
    if tag == "two_object":
        return f"a photo of {_a(inc[0]['class'])} and {_a(inc[1]['class'])}"
    if tag == "counting":
        n = inc[0]["count"]
        noun = inc[0]["class"] if n == 1 else _plural(inc[0]["class"])
        return f"a photo of {COUNT_WORDS[n]} {noun}"
    if tag == "colors":
        return f"a photo of {_a(inc[0]['color'])} {inc[0]['class']}"
    if tag == "position":
        return f"a photo of {_a(inc[1]['class'])} {inc[1]['position'][0]} {_a(inc[0]['class'])}"
    if tag == "color_attr":
        return f"a photo of {_a(inc[0]['color'])} {inc[0]['class']} and {_a(inc[1]['color'])} {inc[1]['class']}"
    raise ValueError(f"metadata field 'tag' is {tag!r}; expected one of {TAGS}")


def metadata_for(
    tag: str,
    classes: str | tuple[str, ...],
    colors: str | tuple[str, ...] | None = None,
    count: int | None = None,
    relation: str | None = None,
) -> dict:
    """Build one GenEval metadata dict (key order and layout as GenEval's ``evaluation_metadata.jsonl``).

    ``position``: ``classes=(A, B)`` means "a photo of an A <relation> a B"; ``color_attr``:
    ``classes=(A, B), colors=(cA, cB)``.
    """
    classes = (classes,) if isinstance(classes, str) else tuple(classes)
    colors = (colors,) if isinstance(colors, str) else tuple(colors or ())
    for c in classes:
        if c not in CLASSES:
            raise ValueError(f"class {c!r} is not a shapes-world class {CLASSES}")
    for c in colors:
        if c not in PALETTE:
            raise ValueError(f"colour {c!r} is not a palette colour {tuple(PALETTE)}")
    meta: dict = {"tag": tag}
    if tag == "single_object":
        meta["include"] = [{"class": classes[0], "count": 1}]
    elif tag == "two_object":
        meta["include"] = [{"class": classes[0], "count": 1}, {"class": classes[1], "count": 1}]
    elif tag == "counting":
        if count is None:
            raise ValueError("tag 'counting' needs count=")
        meta["include"] = [{"class": classes[0], "count": int(count)}]
        meta["exclude"] = [{"class": classes[0], "count": int(count) + 1}]
    elif tag == "colors":
        meta["include"] = [{"class": classes[0], "count": 1, "color": colors[0]}]
    elif tag == "position":
        if relation not in RELATIONS:
            raise ValueError(f"tag 'position' needs relation= one of {RELATIONS}, got {relation!r}")
        meta["include"] = [{"class": classes[1], "count": 1}, {"class": classes[0], "count": 1, "position": [relation, 0]}]
    elif tag == "color_attr":
        meta["include"] = [
            {"class": classes[0], "count": 1, "color": colors[0]},
            {"class": classes[1], "count": 1, "color": colors[1]},
        ]
    else:
        raise ValueError(f"unknown tag {tag!r}; expected one of {TAGS}")
    meta["prompt"] = prompt_for(meta)
    return meta


def all_metadata(tag: str | None = None) -> list[dict]:
    """Every distinct prompt of one tag (or of all six), in a fixed order."""
    tags = TAGS if tag is None else (tag,)
    pairs = list(itertools.permutations(CLASSES, 2))
    out: list[dict] = []
    for t in tags:
        if t == "single_object":
            out += [metadata_for(t, c) for c in CLASSES]
        elif t == "two_object":
            out += [metadata_for(t, p) for p in pairs]
        elif t == "counting":
            out += [metadata_for(t, c, count=n) for c in CLASSES for n in COUNTS]
        elif t == "colors":
            out += [metadata_for(t, c, colors=k) for c in CLASSES for k in PALETTE]
        elif t == "position":
            out += [metadata_for(t, p, relation=r) for p in pairs for r in RELATIONS]
        elif t == "color_attr":
            out += [metadata_for(t, p, colors=k) for p in pairs for k in itertools.permutations(PALETTE, 2)]
        else:
            raise ValueError(f"unknown tag {t!r}; expected one of {TAGS}")
    return out


def _attributes(meta: dict) -> set[tuple[str, object]]:
    attrs: set[tuple[str, object]] = set()
    for clause in meta["include"]:
        attrs.add(("class", clause["class"]))
        if "color" in clause:
            attrs.add(("color", clause["color"]))
        if clause["count"] != 1:
            attrs.add(("count", clause["count"]))
        if "position" in clause:
            attrs.add(("relation", clause["position"][0]))
    return attrs


def split_prompts(seed: int = 0, test_fraction: float = 1 / 3, tries: int = 1000) -> tuple[list[dict], list[dict]]:
    """Disjoint (train, test) split of :func:`all_metadata`, stratified by tag and seeded.

    Per tag, ``round(n * test_fraction)`` prompts (at least one) are held out. Among seeded random
    permutations the first whose train part contains every class / colour / count / relation of that tag
    is taken (held-out prompts are new *combinations*, never unseen words), or the best-covering one where
    full coverage is impossible (``single_object`` has only three prompts, so one class is test-only there).
    """
    rng = np.random.default_rng(seed)
    train: list[dict] = []
    test: list[dict] = []
    for tag in TAGS:
        items = all_metadata(tag)
        n_test = min(len(items) - 1, max(1, int(round(len(items) * test_fraction))))
        required = set().union(*(_attributes(m) for m in items))
        best, best_cover = None, -1
        for _ in range(tries):
            order = rng.permutation(len(items))
            covered = set().union(*(_attributes(items[i]) for i in order[n_test:]))
            if len(covered & required) > best_cover:
                best, best_cover = order, len(covered & required)
            if best_cover == len(required):
                break
        test_idx = sorted(best[:n_test].tolist())
        train_idx = sorted(best[n_test:].tolist())
        train += [items[i] for i in train_idx]
        test += [items[i] for i in test_idx]
    return train, test


def perturb(metadata: dict, kind: str, rng: np.random.Generator | int | None = None) -> dict | None:
    """Metadata of a scene that fails ``metadata`` in one way, or ``None`` if ``kind`` does not apply.

    Kinds: ``class`` (one include clause gets a class absent from the metadata), ``count`` (counting:
    n -> n +- 1), ``color`` (one coloured clause gets another colour), ``binding`` (color_attr: the two
    colours swapped), ``relation`` (position: another relation, the opposite or a perpendicular one).
    The prompt is regenerated; the tag is kept.
    """
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    meta = copy.deepcopy(metadata)
    inc = meta["include"]
    if kind == "class":
        i = int(rng.integers(len(inc)))
        old = inc[i]["class"]
        used = {c["class"] for c in inc}
        choices = [c for c in CLASSES if c not in used] or [c for c in CLASSES if c != old]
        new = choices[int(rng.integers(len(choices)))]
        inc[i]["class"] = new
        for clause in meta.get("exclude", []):
            if clause["class"] == old:
                clause["class"] = new
    elif kind == "count":
        if meta["tag"] != "counting":
            return None
        n = inc[0]["count"]
        options = [m for m in (n - 1, n + 1) if m >= 1]
        m = options[int(rng.integers(len(options)))]
        inc[0]["count"] = m
        for clause in meta.get("exclude", []):
            if clause["class"] == inc[0]["class"]:
                clause["count"] = m + 1
    elif kind == "color":
        coloured = [c for c in inc if "color" in c]
        if not coloured:
            return None
        clause = coloured[int(rng.integers(len(coloured)))]
        others = [k for k in PALETTE if k != clause["color"]]
        clause["color"] = others[int(rng.integers(len(others)))]
    elif kind == "binding":
        coloured = [c for c in inc if "color" in c]
        if len(coloured) != 2 or coloured[0]["color"] == coloured[1]["color"]:
            return None
        coloured[0]["color"], coloured[1]["color"] = coloured[1]["color"], coloured[0]["color"]
    elif kind == "relation":
        positioned = [c for c in inc if "position" in c]
        if not positioned:
            return None
        clause = positioned[0]
        others = [r for r in RELATIONS if r != clause["position"][0]]
        clause["position"] = [others[int(rng.integers(len(others)))], clause["position"][1]]
    else:
        raise ValueError(f"unknown perturbation {kind!r}; expected one of {PERTURBATIONS}")
    meta["prompt"] = prompt_for(meta)
    return meta

