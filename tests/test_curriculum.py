"""CGPO's curriculum against hand computations: per-prompt probabilities from group variances (cap, min–max, floor,
exploration, smoothing over up to three raw values), category weights (running pairwise average, mean 1 + λ/C before
the EMA), draws that follow the acceptance, its resume; and in the trainer: the same prompts and tables on 2 processes
as on 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from twins import run_processes  # tests/twins.py
from flowgrpo.curriculum import CGPOCurriculum

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def test_prompt_probabilities_from_variances_exploration_and_smoothing():
    cur = CGPOCurriculum(["a"] * 6)
    ids = [0, 1, 2]
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0],      # variance 0
                            [0.0, 1.0, 0.0, 1.0],      # 1/3
                            [0.0, 0.0, 0.0, 1.0]])     # 1/4
    cur.update(ids, rewards)
    var = torch.tensor([0.0, 1 / 3, 0.25], dtype=torch.float64)
    drawn = (var - var.min()) / (var.max() - var.min())
    expected = torch.cat([drawn.clamp(min=0.1), torch.ones(3, dtype=torch.float64)])  # 1 + 3/6 capped at 1
    torch.testing.assert_close(cur.p, expected)  # no history yet: the raw values
    # second iteration: prompts 3, 4 drawn with equal variance (½ each), the others explore from their raw value
    cur.update([3, 4], torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    raw2 = torch.tensor([0.1 + 2 / 6, 1 + 2 / 6, 0.75 + 2 / 6, 0.5, 0.5, 1.0], dtype=torch.float64).clamp(max=1)
    torch.testing.assert_close(cur.raw, raw2)
    torch.testing.assert_close(cur.p, ((raw2 + expected) / 2).clamp(0.1, 1))
    # third: averaged with the last two raw values (three in all)
    cur.update([5], torch.tensor([[0.2, 0.9]]))
    raw3 = cur.raw
    torch.testing.assert_close(cur.p, ((raw3 + raw2 + expected) / 3).clamp(0.1, 1))
    assert cur.past.shape[1] == 2 and bool(((cur.p >= 0.1) & (cur.p <= 1)).all())
    # a variance above the cap counts as the cap
    capped = CGPOCurriculum(["a"] * 2, variance_cap=0.1)
    capped.update([0, 1], torch.tensor([[0.0, 1.0], [0.0, 0.5]]))  # 0.5 and 0.125, both capped: a tie → ½
    torch.testing.assert_close(capped.p, torch.full((2,), 0.5, dtype=torch.float64))


def test_category_weights_favour_low_reward_categories():
    names = ["one", "two", "three"]
    cur = CGPOCurriculum([n for n in names for _ in range(4)])
    # category "one" sees prompt means 0.2, 0.6, 0.7 in that order: running pairwise average ((0.2+0.6)/2+0.7)/2
    # = 0.55 (not their mean, 0.5)
    rewards = torch.tensor([[0.2, 0.2], [0.6, 0.6], [0.7, 0.7], [0.8, 0.8], [0.1, 0.1]], dtype=torch.float64)
    cur.update([0, 1, 2, 4, 8], rewards)
    rbar = torch.tensor([0.55, 0.8, 0.1], dtype=torch.float64)
    new = 1 + 10 * (1 / rbar) / (1 / rbar).sum()
    assert new.mean().item() == pytest.approx(1 + 10 / 3)  # Σ v_c = 1
    torch.testing.assert_close(cur.w, 0.5 * new + 0.5)
    assert cur.w.mean().item() == pytest.approx(1 + 5 / 3) and cur.w.argmax() == 2
    # a category whose prompts all scored 0 keeps its weight
    before = cur.w.clone()
    cur.update([9, 10], torch.zeros(2, 2))
    torch.testing.assert_close(cur.w, before)


def test_draws_are_distinct_deterministic_and_follow_the_acceptance():
    cur = CGPOCurriculum(["a"] * 20)
    cur.p[:10] = 0.1  # p·w = 0.1 for half the prompts, 1 for the others
    draws = [cur.draw(4, torch.Generator().manual_seed(s)) for s in range(400)]
    assert all(len(set(d)) == 4 for d in draws)
    assert draws[7] == cur.draw(4, torch.Generator().manual_seed(7))
    low = sum(i < 10 for d in draws for i in d)
    assert low < 0.2 * 1600  # acceptance 0.1 vs 1
    with pytest.raises(ValueError, match="prompts_per_iteration=21"):
        cur.draw(21, torch.Generator())


def test_state_round_trips_and_refuses_another_training_set():
    cur = CGPOCurriculum(["a", "b", "a"])
    cur.update([0, 1], torch.tensor([[0.0, 1.0], [0.5, 0.5]]))
    again = CGPOCurriculum(["a", "b", "a"])
    again.load_state_dict(cur.state_dict())
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    assert again.draw(2, g()) == cur.draw(2, g()) and torch.equal(again.w, cur.w)
    with pytest.raises(ValueError, match="data.train_file"):
        CGPOCurriculum(["a", "c", "a"]).load_state_dict(cur.state_dict())


BASE = ["model=tiny_sd3", "reward=jpeg_compressibility", "logger=none", "data.sampling=cgpo",
        "sampler.num_steps=4", "sampler.eval_num_steps=2", "algo=grpo", "sampler=sde",
        "trainer.iterations=3", "trainer.prompts_per_iteration=4", "trainer.group_size=2",
        "trainer.train_batch_size=8", "trainer.gradient_accumulation_steps=1", "trainer.eval_before=false",
        "trainer.eval_every=0", "trainer.eval_num_prompts=1", "trainer.eval_samples_per_tag=null",
        "trainer.gallery_every=0", "trainer.checkpoint_every=0", "trainer.lr=3e-2"]


def _cfg(out):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train", overrides=[*BASE, f"trainer.output_dir={out}"])


def _brightness(images, prompts, metadata=None):
    from rewards.base import RewardOutput

    return RewardOutput(scores=images.float().mean(dim=(1, 2, 3)), components={})


def _run(trainer):
    trainer.reward = _brightness
    prompts = []
    for _ in range(3):
        scalars = trainer.step()
        prompts.append(list(trainer._last_batch.extras["prompt_ids"]))
    return prompts, trainer.curriculum.state_dict(), scalars


def _two_process_worker(tmp_path):
    from accelerate import Accelerator

    from flowgrpo.trainer import Trainer

    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    assert acc.num_processes == 2
    prompts, state, _ = _run(Trainer(_cfg(tmp_path / "two"), tmp_path / "two", accelerator=acc))
    torch.save({"prompts": prompts, "state": state}, tmp_path / f"two{acc.process_index}.pt")


def test_two_processes_draw_the_prompts_and_keep_the_tables_of_one(tmp_path):
    """The tables move with the gathered rewards, identically on every process: iteration 2's prompts (drawn from
    tables two updates old) and the final tables are those of a 1-process run."""
    from flowgrpo.trainer import Trainer

    one = Trainer(_cfg(tmp_path / "one"), tmp_path / "one")
    prompts, state, scalars = _run(one)
    assert any(k.startswith("curriculum/weight/") for k in scalars) and "curriculum/p_mean" in scalars
    assert not torch.equal(state["p"], torch.ones_like(state["p"]))  # the curriculum moved
    run_processes(_two_process_worker, tmp_path)
    ranks = [torch.load(tmp_path / f"two{rank}.pt") for rank in (0, 1)]
    for two in ranks:
        assert two["prompts"] == prompts
        # the batch split changes the rewards by float-order noise (~1e-6), which the min-max map magnifies
        for k in ("p", "w", "raw"):
            torch.testing.assert_close(two["state"][k], state[k], rtol=1e-4, atol=1e-4)
    assert all(torch.equal(ranks[0]["state"][k], ranks[1]["state"][k]) for k in ("p", "w", "raw", "past"))
