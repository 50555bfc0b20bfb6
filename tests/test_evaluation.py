"""One held-out protocol: GenEval's summary from per-sample components, and the trainer's evaluation and
``scripts/eval_geneval.py`` scoring the very same samples."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

import rewards
from rewards.geneval.rules import TAGS
from twins import run_processes  # tests/twins.py

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.usefixtures("one_thread")
def test_the_trainer_and_the_script_score_the_same_held_out_samples(tmp_path, monkeypatch):
    """The shipped asset on 6 held-out prompts (3 tags), 2+ images per tag in batches of 4, a 4-step ODE: the
    trainer's evaluation and ``scripts/eval_geneval.py`` generate and score the very same samples."""
    from hydra import compose, initialize_config_dir

    import flowgrpo.config  # noqa: F401
    from flowgrpo.trainer import Trainer

    overrides = ["trainer.eval_num_prompts=6", "trainer.eval_samples_per_tag=2", "trainer.rollout_batch_size=4",
                 "sampler.eval_num_steps=4"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, "logger=none", f"trainer.output_dir={tmp_path}",
                                          "trainer.gallery_every=0"])
    trainer = Trainer(cfg, tmp_path)
    seen = []
    real = trainer.reward
    trainer.reward = lambda images, prompts, metadata=None: seen.append(real(images, prompts, metadata)) or seen[-1]
    result = trainer.evaluate()
    assert [len(o.scores) for o in seen] == [4, 3]  # 2 single_object + 2×1 two_object + 3×1 counting

    spec = importlib.util.spec_from_file_location("eval_geneval", ROOT / "scripts" / "eval_geneval.py")
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    scored, build = [], ev.build_reward

    def recording(node):
        reward = build(node)
        return lambda images, prompts, metadata=None: scored.append(reward(images, prompts, metadata)) or scored[-1]

    monkeypatch.setattr(ev, "build_reward", recording)
    report = ev.main([f"--set={o}" for o in overrides] + ["--threads", "1", "--per-prompt"])

    def same(a, b):
        torch.testing.assert_close(torch.cat(a), torch.cat(b), rtol=0, atol=0, equal_nan=True)

    same([o.scores for o in seen], [o.scores for o in scored])
    assert seen[0].components.keys() == scored[0].components.keys()
    for key in seen[0].components:
        same([o.components[key] for o in seen], [o.components[key] for o in scored])
    assert report["images"] == 7 and set(report["per_tag"]) == {"single_object", "two_object", "counting"}
    assert len({v["partial"] for v in report["per_tag"].values()}) > 1  # real verdicts, not all alike
    assert report["overall"] == round(result["eval/geneval"], 4)
    assert report["overall_partial"] == round(result["eval/geneval_partial"], 4)
    for tag, v in report["per_tag"].items():
        assert v["strict"] == round(result[f"eval/strict/{tag}"], 4) and v["n"] >= 2
    assert [r["n"] for r in report["per_prompt"]] == [2, 1, 1, 1, 1, 1]


TWO = ["logger=none", "trainer.eval_num_prompts=7", "trainer.eval_samples_per_tag=3", "sampler.eval_num_steps=4",
       "trainer.rollout_batch_size=4", "trainer.gallery_every=0"]  # 13 jobs: one process gets a padding job


def _held_out(out):
    from hydra import compose, initialize_config_dir

    import flowgrpo.config  # noqa: F401

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=[*TWO, f"trainer.output_dir={out}"])


def _two_process_eval(out):
    import json

    from accelerate import Accelerator

    from flowgrpo.trainer import Trainer

    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    assert acc.num_processes == 2
    result = Trainer(_held_out(out), out, accelerator=acc).evaluate()
    if acc.is_main_process:
        (out / "eval.json").write_text(json.dumps(result))


@pytest.mark.usefixtures("one_thread")
def test_two_processes_score_the_held_out_jobs_of_one(tmp_path):
    """Jobs dealt round-robin to 2 processes (one padded) and gathered back into job order give 1 process's
    evaluation exactly: per-tag means pair each verdict with its own prompt's tag."""
    import json

    from flowgrpo.trainer import Trainer

    one = Trainer(_held_out(tmp_path / "one"), tmp_path / "one").evaluate()
    run_processes(_two_process_eval, tmp_path / "two")
    two = json.loads((tmp_path / "two" / "eval.json").read_text())
    assert list(two) == list(one)
    for key, value in one.items():
        assert two[key] == value or (math.isnan(value) and math.isnan(two[key])), key
    tags = [k for k in one if k.startswith("eval/strict/") and not math.isnan(one[k])]
    assert len(tags) == 4 and one["eval/geneval"] == pytest.approx(sum(one[k] for k in tags) / 4)


def test_eval_scalars_report_the_reward_per_metadata_tag():
    """Held-out rows of several tags (one- and two-object streams): the reward per tag beside the overall mean,
    computed over that tag's rows only; one tag, or no metadata: no per-tag keys."""
    from flowgrpo.builders import PromptSet
    from flowgrpo.evaluation import EvalSamples

    tags = ["one", "two", "one", "two", "one"]
    prompts = PromptSet([f"p{i}" for i in range(5)], [{"tag": t} for t in tags], "mem", list(range(5)))
    scores = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.0])
    samples = EvalSamples(jobs=[(i, 0) for i in range(5)], prompts=prompts, scores=scores, components={})
    assert samples.rows_by_tag() == {"one": [0, 2, 4], "two": [1, 3]}
    out = samples.scalars()
    assert out["eval/by_tag/one/reward"] == pytest.approx(0.5)
    assert out["eval/by_tag/two/reward"] == pytest.approx(0.1)
    assert out["eval/reward"] == pytest.approx(float(scores.mean()))
    single = EvalSamples(jobs=[(0, 0)], prompts=PromptSet(["p"], [{"tag": "one"}], "mem", [0]),
                         scores=torch.ones(1), components={})
    assert not any("by_tag" in k for k in single.scalars())
