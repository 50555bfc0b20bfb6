"""Pref-GRPO against its defining identities: a judge preferring the higher hidden score gives win rates rank/(G−1)
that sum to G/2, advantages affine in rank and unchanged by monotone transforms of the scores; an all-tie group gets
zero advantages; the verdict judge is lexicographic; the update is GRPO-Guard's (or the plain ratio); one trainer
iteration on the tiny twin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.algorithms import ALGORITHMS, Batch, Scores
from flowgrpo.algorithms.pref_grpo import PrefGRPO, preference_advantages, verdict_preferences, win_rates
from samplers import flow_sigmas

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def test_win_rates_of_a_consistent_judge_are_ranks_and_advantages_ignore_monotone_transforms():
    G = 6
    hidden = torch.randn(G, generator=torch.Generator().manual_seed(0)).double()
    rank = hidden.argsort().argsort().double()
    w = win_rates(verdict_preferences(hidden))
    torch.testing.assert_close(w, rank / (G - 1))
    assert w.sum().item() == pytest.approx(G / 2)
    a = preference_advantages(w, G, clip=5.0).double()
    slope = (a[1] - a[0]) / (rank[1] - rank[0])
    torch.testing.assert_close(a, a.mean() + slope * (rank - rank.mean()), rtol=1e-6, atol=1e-6)  # affine in rank
    assert a.sum().abs() < 1e-6 and slope > 0
    for f in (torch.exp, lambda x: x**3, lambda x: 100 * x - 7):
        torch.testing.assert_close(preference_advantages(win_rates(verdict_preferences(f(hidden))), G, 5.0), a.float())
    # only the upper triangle is asked: a lower triangle that contradicts it changes nothing
    P = verdict_preferences(hidden)
    torch.testing.assert_close(win_rates(torch.triu(P, 1) + 0.5 * torch.tril(torch.ones_like(P))), w)


def test_an_all_tie_group_gets_no_advantage_and_ties_share_the_win():
    assert preference_advantages(win_rates(verdict_preferences(torch.full((4,), 0.7))), 4, 5.0).abs().max() == 0
    # pointwise scores that differ by less than the margin are a tie (group std normalisation would blow them up)
    near = torch.tensor([0.500, 0.501, 0.499, 0.5005])
    assert preference_advantages(win_rates(verdict_preferences(near, margin=0.01)), 4, 5.0).abs().max() == 0
    w = win_rates(verdict_preferences(torch.tensor([1.0, 1.0, 0.0])))
    torch.testing.assert_close(w, torch.tensor([0.75, 0.75, 0.0], dtype=torch.float64))


def test_the_verdict_judge_is_lexicographic():
    scores = torch.tensor([[1.0, 0.50], [1.0, 0.75], [0.0, 1.00], [0.0, 1.00]])  # strict first, then partial
    P = verdict_preferences(scores)
    assert P[1, 0] == 1 and P[0, 2] == 1 and P[1, 3] == 1 and P[2, 3] == 0.5 and P[2, 0] == 0
    torch.testing.assert_close(win_rates(P), torch.tensor([2, 3, 0.5, 0.5], dtype=torch.float64) / 3)
    with pytest.raises(ValueError, match="NaN"):
        verdict_preferences(torch.tensor([0.1, float("nan")]))


class _Cond:
    def __getitem__(self, rows):
        return self


def test_advantages_use_the_named_components_and_name_a_missing_one():
    algo = PrefGRPO(flow_sigmas(10), kernel="dance", noise_level=0.3, judge=["strict", "partial"])
    plan = algo.plan(2, 3, generator=torch.Generator().manual_seed(0))
    batch = Batch(prompts=["p"] * 6, metadata=None, global_rows=torch.arange(6), cond=_Cond(), plan=plan)
    batch.rewards = torch.tensor([0.2, 0.9, 0.5, 0.4, 0.4, 0.4])
    batch.components = {"strict": torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 0.0]),
                        "partial": torch.tensor([0.2, 0.9, 0.5, 0.4, 0.4, 0.4])}
    adv = algo.advantages(Scores(batch))
    # group 1: ranks 0, 2, 1; group 2: the strict verdict decides (partial credits tie) → 1, then a tie
    by_hand = torch.cat([preference_advantages(torch.tensor([0.0, 1.0, 0.5]), 3, 5.0),
                         preference_advantages(torch.tensor([1.0, 0.25, 0.25]), 3, 5.0)])
    torch.testing.assert_close(adv, by_hand)
    reward_only = PrefGRPO(flow_sigmas(10), kernel="dance", noise_level=0.3)  # judge=[]: the reward itself
    assert reward_only.advantages(Scores(batch))[3:].abs().max() == 0  # its group 2 is an all-tie
    batch.components = {"partial": batch.components["partial"]}
    with pytest.raises(KeyError, match="algo.judge names \\['strict'\\]"):
        algo.advantages(Scores(batch))


def test_defaults_and_the_ratio_switch():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=["algo=pref_grpo"])
        preset = compose("train", overrides=["experiment=pref_grpo_shapes"])
    assert cfg.sampler.name == "dance" and cfg.algo.kl_beta == 0 and cfg.algo.timestep_fraction == 0.6
    assert cfg.algo.shared_noise and cfg.algo.ratio_norm and list(preset.algo.judge) == ["strict", "partial"]
    sig = flow_sigmas(10)
    assert PrefGRPO(sig).needs.record_means and not PrefGRPO(sig, ratio_norm=False).needs.record_means
    assert "normalised ratio" in PrefGRPO(sig).describe() and "plain" in PrefGRPO(sig, ratio_norm=False).describe()


def test_one_trainer_iteration_on_the_tiny_twin_learns_from_win_rates(tmp_path):
    from flowgrpo.trainer import Trainer

    overrides = ["model=tiny_sd3", "reward=jpeg_compressibility", "logger=none", "algo=pref_grpo",
                 "sampler.num_steps=4", "sampler.eval_num_steps=2", "trainer.iterations=1",
                 "trainer.prompts_per_iteration=2", "trainer.group_size=3", "trainer.train_batch_size=6",
                 "trainer.gradient_accumulation_steps=1", "algo.timestep_fraction=0.5",
                 "trainer.eval_before=false", "trainer.eval_every=0", "trainer.gallery_every=0",
                 "trainer.checkpoint_every=0", "trainer.lr=3e-2", "trainer.eval_num_prompts=1",
                 "trainer.eval_samples_per_tag=null"]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"trainer.output_dir={tmp_path}"])
    trainer = Trainer(cfg, tmp_path)
    assert isinstance(trainer.algorithm, ALGORITHMS["pref_grpo"])
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    batch = trainer._last_batch
    assert batch.means is not None
    G = 3
    expected = torch.cat([preference_advantages(win_rates(verdict_preferences(batch.rewards[p:p + G].cpu())), G, 5.0)
                          for p in (0, 3)])
    torch.testing.assert_close(batch.advantages.cpu(), expected)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.params))
