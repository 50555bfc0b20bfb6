"""GenEval's summary from per-sample components."""

from __future__ import annotations

import math

import pytest
import torch

import rewards
from rewards.geneval.rules import TAGS

NAN = math.nan


def geneval_components(strict, partial, tags, prefix=""):
    """Components shaped as a GenEval reward returns them (per-tag columns NaN outside their tag)."""
    strict, partial = torch.tensor(strict), torch.tensor(partial)
    comps = {f"{prefix}partial": partial, f"{prefix}strict": strict, f"{prefix}exact": strict.clone()}
    for tag in TAGS:
        mine = torch.tensor([t == tag for t in tags])
        comps[f"{prefix}strict/{tag}"] = torch.where(mine, strict, torch.full_like(strict, NAN))
        comps[f"{prefix}partial/{tag}"] = torch.where(mine, partial, torch.full_like(partial, NAN))
    return comps


def test_geneval_summary_is_the_mean_over_tags_of_per_tag_means():
    tags = ["colors", "colors", "colors", "colors", "position", "counting", "counting"]
    strict = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    partial = [1.0, 1.0, 0.5, 1.0, 0.25, 1.0, -0.5]  # Flow-GRPO's count credit can go below 0
    meta = [{"tag": t} for t in tags]
    s = rewards.geneval_summary(geneval_components(strict, partial, tags), meta)
    assert list(s["per_tag"]) == ["colors", "position", "counting"]  # first-seen order; absent tags left out
    assert s["per_tag"]["colors"] == {"strict": 0.75, "partial": 0.875, "n": 4}
    assert s["per_tag"]["position"] == {"strict": 0.0, "partial": 0.25, "n": 1}
    assert s["per_tag"]["counting"] == {"strict": 0.5, "partial": 0.25, "n": 2}
    # tags weigh equally: not 4/7, the mean over samples
    assert s["overall"] == pytest.approx((0.75 + 0.0 + 0.5) / 3)
    assert s["overall_partial"] == pytest.approx((0.875 + 0.25 + 0.25) / 3)

    # Without metadata the tags come from the per-tag columns; a tag whose column is all NaN is absent.
    alone = rewards.geneval_summary(geneval_components(strict, partial, tags))
    assert list(alone["per_tag"]) == ["counting", "colors", "position"]  # GenEval's tag order
    assert alone["overall"] == s["overall"] and alone["overall_partial"] == s["overall_partial"]
    comps = geneval_components(strict, partial, tags)
    comps["strict/position"] = torch.full((7,), NAN)
    assert set(rewards.geneval_summary(comps)["per_tag"]) == {"colors", "counting"}
    assert rewards.geneval_summary(comps)["overall"] == pytest.approx((0.75 + 0.5) / 2)
    # a NaN verdict is skipped, like torch.nanmean over the per-tag columns
    comps = geneval_components([1.0, NAN, 0.0], [1.0, NAN, 0.5], ["colors", "colors", "position"])
    s = rewards.geneval_summary(comps, [{"tag": "colors"}, {"tag": "colors"}, {"tag": "position"}])
    assert s["per_tag"]["colors"] == {"strict": 1.0, "partial": 1.0, "n": 1}
    assert s["overall"] == 0.5 and s["overall_partial"] == 0.75
    nothing = rewards.geneval_summary(geneval_components([NAN], [NAN], ["colors"]))
    assert nothing["per_tag"] == {} and math.isnan(nothing["overall"]) and math.isnan(nothing["overall_partial"])


def test_geneval_summary_finds_geneval_inside_reward_multi():
    tags = ["single_object", "two_object", "two_object"]
    comps = {**geneval_components([1.0, 0.0, 0.0], [1.0, 0.5, 0.0], tags, prefix="geneval/"),
             "geneval": torch.tensor([1.0, 0.5, 0.0]), "jpeg_compressibility": torch.tensor([-1.0, -2.0, -3.0]),
             "jpeg_compressibility/jpeg_kb": torch.tensor([1.0, 2.0, 3.0])}
    assert rewards.geneval_prefixes(comps) == ["geneval/"]
    s = rewards.geneval_summary(comps, [{"tag": t} for t in tags], prefix="geneval/")
    assert s["per_tag"] == {"single_object": {"strict": 1.0, "partial": 1.0, "n": 1},
                            "two_object": {"strict": 0.0, "partial": 0.25, "n": 2}}
    assert s["overall"] == 0.5 and s["overall_partial"] == 0.625
    assert rewards.geneval_prefixes({"strict": torch.zeros(1), "partial": torch.zeros(1)}) == []  # not GenEval's set

    # the real rewards' components, bare and inside reward=multi
    meta = [{"tag": "colors", "include": [{"class": "square", "count": 1, "color": "red"}]}]
    white = torch.ones(1, 3, 64, 64)
    bare = rewards.load("geneval", detector="shapes")(white, ["a photo of a red square"], meta)
    assert rewards.geneval_prefixes(bare.components) == [""]
    multi = rewards.load("multi", components=[{"name": "geneval", "kwargs": {"detector": "shapes"}},
                                              {"name": "jpeg_compressibility", "weight": 0.1}])
    out = multi(white, ["a photo of a red square"], meta)
    assert rewards.geneval_prefixes(out.components) == ["geneval/"]
    assert rewards.geneval_summary(out.components, meta, prefix="geneval/") == rewards.geneval_summary(bare.components, meta)
