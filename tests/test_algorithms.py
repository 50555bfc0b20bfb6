"""The algorithm layer of the GRPO trainer against hand computations: group advantages, the PPO-clip loss, and
each algorithm's rollout plan (Flow-GRPO / DanceGRPO, MixGRPO / MixGRPO-Flash, Flash-GRPO), built from the
composed Hydra configs exactly as the trainer builds them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from flowgrpo.advantages import advantage_stats, group_advantages, slas_advantages, weighted_advantages
from flowgrpo.algorithms import (ALGORITHMS, FlashGRPO, GRPO, MixGRPO, RolloutPlan, build_algorithm, ppo_clip_loss,
                                 reduce_log_prob)
from flowgrpo.algorithms.grpo import DanceGRPO, GRPOConfig
from flowgrpo.algorithms.mix_grpo import default_window_size
from flowgrpo.builders import REPO_ROOT, batch_plan, build_sampler
from flowgrpo.config import ConfigError, validate
from samplers import (SDEWindow, compress_tail, flow_sigmas, kernel_lambda, rectification_weights, rollout,
                      sde_step)

CONF = REPO_ROOT / "conf"


@pytest.fixture(scope="module")
def hydra_compose():
    def run(overrides=()):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("train", overrides=list(overrides))

    return run


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------- advantages

REWARDS = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.7, 0.7, 0.7, 0.7, 0.0, 0.0, 1.0, 1.0])  # 3 groups of 4


def test_group_advantages_per_group_std_by_hand():
    adv = group_advantages(REWARDS, 4)
    s0 = math.sqrt(((1.5**2) * 2 + (0.5**2) * 2) / 4)  # population std of 1,2,3,4
    expected = [(-1.5) / (s0 + 1e-4), (-0.5) / (s0 + 1e-4), 0.5 / (s0 + 1e-4), 1.5 / (s0 + 1e-4),
                0, 0, 0, 0,
                -0.5 / 0.5001, -0.5 / 0.5001, 0.5 / 0.5001, 0.5 / 0.5001]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    assert adv.dtype == torch.float32
    # Flow-GRPO's PerPromptStatTracker: np.std (ddof 0) + 1e-4, per prompt
    ref = np.concatenate([(g - g.mean()) / (np.std(g) + 1e-4) for g in REWARDS.double().numpy().reshape(3, 4)])
    np.testing.assert_allclose(adv.numpy(), ref, rtol=1e-6)


def test_group_advantages_global_std_keeps_group_means():
    adv = group_advantages(REWARDS, 4, global_std=True)
    r = REWARDS.double().numpy()
    std = np.std(r)  # over the whole batch, ddof 0 (Flow-GRPO global_std)
    means = r.reshape(3, 4).mean(1).repeat(4)
    expected = (r - means) / (std + 1e-4)
    expected[4:8] = 0.0
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-6)


def test_group_advantages_clip_and_zero_std_groups():
    adv = group_advantages(REWARDS, 4, clip=1.0)
    inner = 0.5 / (math.sqrt(1.25) + 1e-4)
    assert adv[:4].tolist() == pytest.approx([-1.0, -inner, inner, 1.0])
    assert adv.abs().max() <= 1.0
    # A flat group is exactly 0 even where float rounding makes its mean differ from its members
    flat = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.3, 0.3], dtype=torch.float32)
    for global_std in (False, True):
        assert group_advantages(flat, 3, global_std=global_std).tolist() == [0.0] * 6
    assert group_advantages(flat, 3, clip=None, eps=0.0).tolist() == [0.0] * 6


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="trainer.group_size=5"):
        group_advantages(REWARDS, 5)
    with pytest.raises(ValueError, match="non-finite rewards at rows \\[2\\]"):
        group_advantages(torch.tensor([0.0, 1.0, float("nan"), 1.0]), 2)


def test_slas_gamma_zero_is_mean_centring_with_the_batch_std():
    r = REWARDS.double()
    centred = (r.view(3, 4) - r.view(3, 4).mean(1, keepdim=True)).flatten()
    centred[4:8] = 0.0
    expected = (centred / centred.std(correction=0)).float()
    torch.testing.assert_close(slas_advantages(REWARDS, 4, gamma=0.0, clip=None), expected)


@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
def test_slas_shaping_is_super_linear_odd_monotone_and_scale_free(gamma):
    r = torch.rand(48, generator=gen(3)).double()
    r[8:16] = 0.25  # a group with no spread
    adv = slas_advantages(r, 8, gamma=gamma, clip=None).double()
    centred = (r.view(6, 8) - r.view(6, 8).mean(1, keepdim=True)).flatten()
    live = centred.abs() > 1e-9
    # any two samples of the batch: |A1/A2| = |dr1/dr2|^(1+gamma), signs those of dr
    i, j = live.nonzero().flatten()[:2]
    assert float(adv[i] / adv[j]) == pytest.approx(float((centred[i] / centred[j]).abs() ** (1 + gamma)
                                                           * torch.sign(centred[i] * centred[j])), rel=1e-5)
    assert torch.equal(torch.sign(adv[live]), torch.sign(centred[live]))
    assert adv[8:16].tolist() == [0.0] * 8  # exactly 0, not a rounding error
    assert float(adv.pow(2).mean()) == pytest.approx(1.0, rel=1e-5)  # unit RMS whatever gamma
    for g in (0, 2, 3, 4, 5):  # the order inside each group is the rewards' order (group 1 is all ties)
        assert torch.equal(torch.argsort(adv[g * 8:(g + 1) * 8]), torch.argsort(r[g * 8:(g + 1) * 8]))
    torch.testing.assert_close(slas_advantages(-r, 8, gamma=gamma, clip=None), -adv.float())  # odd
    # invariant to the reward's scale and to a constant per group (normalised before the power)
    shifted = 3.0 * r + torch.arange(6, dtype=torch.float64).repeat_interleave(8)
    torch.testing.assert_close(slas_advantages(shifted, 8, gamma=gamma, clip=None), adv.float(), rtol=1e-5, atol=1e-6)
    # small deviations shrink against large ones compared with no shaping
    plain = slas_advantages(r, 8, gamma=0.0, clip=None).double()
    nonzero = live.nonzero().flatten()
    small, large = nonzero[centred[nonzero].abs().argmin()], centred.abs().argmax()
    assert abs(adv[small] / adv[large]) < abs(plain[small] / plain[large])
    assert float(slas_advantages(r, 8, gamma=gamma, clip=0.5).abs().max()) == 0.5


def test_slas_through_the_algorithm_and_its_config_errors(hydra_compose):
    rewards = torch.rand(16, generator=gen(5))
    for option in ("grpo", "mix_grpo", "flash_grpo", "dance_grpo"):
        cfg = hydra_compose([f"algo={option}", "algo.slas_gamma=0.5"])
        algo = build_algorithm(cfg.algo, cfg.sampler, build_sampler(cfg.sampler).sigmas)
        torch.testing.assert_close(algo.reward_advantages(rewards, 4), slas_advantages(rewards, 4, gamma=0.5))
        assert "SLAS, gamma=0.5" in algo.describe()
        plain = build_algorithm(hydra_compose([f"algo={option}"]).algo, cfg.sampler, build_sampler(cfg.sampler).sigmas)
        assert not torch.equal(plain.reward_advantages(rewards, 4), algo.reward_advantages(rewards, 4))
    with pytest.raises(ConfigError, match=r"algo\.slas_gamma=-1"):
        validate(hydra_compose(["algo.slas_gamma=-1"]))
    with pytest.raises(ConfigError, match=r"algo\.slas_gamma=0\.5 .* reward\.aggregate\.name='taros'"):
        validate(hydra_compose(["algo.slas_gamma=0.5", "reward=multi", "reward.aggregate.name=taros"]))
    with pytest.raises(ValueError, match="non-finite rewards"):
        slas_advantages(torch.tensor([0.0, float("inf")]), 2, gamma=0.5)
    assert slas_advantages(torch.ones(4), 2, gamma=0.5).tolist() == [0.0] * 4


def test_weighted_advantages_normalise_the_weights():
    a = torch.tensor([0.0, 1.0, 2.0, 3.0, 5.0, 1.0])
    b = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0])
    got = weighted_advantages({"a": a, "b": b, "logged_only": a}, {"a": 3.0, "b": 1.0}, 3, clip=None)
    expected = 0.75 * group_advantages(a, 3, clip=None) + 0.25 * group_advantages(b, 3, clip=None)
    torch.testing.assert_close(got, expected)
    # only the ratio of the weights matters; clipping happens once, after the sum
    torch.testing.assert_close(weighted_advantages({"a": a, "b": b}, {"a": 6.0, "b": 2.0}, 3, clip=None), got)
    clipped = weighted_advantages({"a": a, "b": b}, {"a": 3.0, "b": 1.0}, 3, clip=0.5)
    torch.testing.assert_close(clipped, expected.clamp(-0.5, 0.5))
    # one component with weight 1 is plain group_advantages; global_std passes through
    torch.testing.assert_close(weighted_advantages({"a": a}, {"a": 2.0}, 3, global_std=True),
                               group_advantages(a, 3, global_std=True))
    with pytest.raises(KeyError, match="'c'"):
        weighted_advantages({"a": a}, {"a": 1.0, "c": 1.0}, 3)
    with pytest.raises(ValueError, match="positive sum"):
        weighted_advantages({"a": a}, {"a": 0.0}, 3)


def test_advantage_stats():
    adv = group_advantages(REWARDS, 4)
    stats = advantage_stats(adv, REWARDS, 4)
    assert stats["zero_std_group_fraction"] == pytest.approx(1 / 3)
    assert stats["reward_group_std_mean"] == pytest.approx((math.sqrt(1.25) + 0 + 0.5) / 3)
    assert stats["adv_abs_max"] == pytest.approx(1.5 / (math.sqrt(1.25) + 1e-4), rel=1e-6)
    assert stats["adv_zero_fraction"] == pytest.approx(4 / 12)
    assert stats["adv_mean"] == pytest.approx(0.0, abs=1e-7)
    assert stats["reward_mean"] == pytest.approx(float(REWARDS.double().mean()))
    assert all(isinstance(v, float) for v in stats.values())


# ------------------------------------------------------------------------------------------- PPO loss


def test_ppo_clip_loss_by_hand_both_sides_and_weights():
    ratios = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.1], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0])
    old = torch.tensor([-3.0, 2.0, 0.5, 0.0, 1.0])
    lp = (old.double() + ratios.log()).float().requires_grad_()
    # per item max(−A·ρ, −A·clip(ρ, 0.8, 1.2)):
    #   ρ=1.5 A=+1 → max(−1.5, −1.2) = −1.2 (clipped, high side)   ρ=0.5 A=+1 → max(−0.5, −0.8) = −0.5
    #   ρ=0.5 A=−1 → max(0.5, 0.8) = 0.8 (clipped, low side)       ρ=1.5 A=−1 → max(1.5, 1.2) = 1.5
    #   ρ=1.1 A=+2 → −2.2 (inside the range)
    loss, stats = ppo_clip_loss(lp, old, adv, clip_range=0.2)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5 - 2.2) / 5, rel=1e-6)
    loss.backward()  # clipped items carry no gradient; others −A·ρ/N
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, -0.5, 0.0, 1.5, -2.2]) / 5, rtol=1e-5, atol=1e-7)
    assert stats["clip_fraction"].item() == pytest.approx(0.8)
    assert stats["clip_fraction_high"].item() == pytest.approx(0.4)
    assert stats["clip_fraction_low"].item() == pytest.approx(0.4)
    assert stats["approx_kl"].item() == pytest.approx(0.5 * float((ratios.log() ** 2).mean()), rel=1e-5)
    assert stats["ratio_mean"].item() == pytest.approx(5.1 / 5, rel=1e-6)
    assert (stats["ratio_min"].item(), stats["ratio_max"].item()) == pytest.approx((0.5, 1.5), rel=1e-6)
    assert not stats["policy_loss"].requires_grad

    w = torch.tensor([1.0, 2.0, 1.0, 0.5, 1.0])
    loss_w, _ = ppo_clip_loss(lp.detach(), old, adv, clip_range=0.2, weights=w)
    assert loss_w.item() == pytest.approx((-1.2 - 1.0 + 0.8 + 0.75 - 2.2) / 5, rel=1e-6)


def test_ppo_ratio_one_gives_minus_mean_weighted_advantage():
    lp = torch.tensor([-1e4, 3.0, 0.25, -7.5], requires_grad=True)
    adv = torch.tensor([0.5, -2.0, 1.0, 3.0])
    w = torch.tensor([0.5, 1.5, 1.0, 1.0])
    loss, stats = ppo_clip_loss(lp, lp.detach().clone(), adv, clip_range=1e-4, weights=w)
    assert loss.item() == pytest.approx(-float((w * adv).mean()))
    assert stats["ratio_mean"].item() == 1.0 and stats["clip_fraction"].item() == 0.0
    assert stats["approx_kl"].item() == 0.0
    loss.backward()  # the policy gradient: −w·A/N per log-prob
    torch.testing.assert_close(lp.grad, -w * adv / 4)


def test_ppo_loss_rejects_mismatched_shapes():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="same shape"):
        ppo_clip_loss(x, torch.zeros(2), x, clip_range=0.1)
    with pytest.raises(ValueError, match="weights"):
        ppo_clip_loss(x, x, x, clip_range=0.1, weights=torch.ones(2))


def test_velocity_kl_is_beta_times_the_mean_squared_velocity_gap_with_its_gradient():
    """The likelihood-free algorithms' regression to the reference: ``loss + β·mean‖v − v_ref‖²`` (mean over every
    element of every sample, logged detached under its key), with gradient ``2β(v − v_ref)/N`` on ``v`` only."""
    from flowgrpo.algorithms.losses import add_velocity_kl

    g = torch.Generator().manual_seed(0)
    v = torch.randn(4, 3, 2, 2, generator=g).requires_grad_()
    v_ref = torch.randn(4, 3, 2, 2, generator=g)
    info: dict = {}
    loss = add_velocity_kl(torch.tensor(1.5), info, v, v_ref, 0.3)
    by_hand = ((v.detach() - v_ref) ** 2).sum() / v.numel()
    torch.testing.assert_close(loss, 1.5 + 0.3 * by_hand)
    torch.testing.assert_close(info["kl"], by_hand)
    assert not info["kl"].requires_grad
    (grad,) = torch.autograd.grad(loss, v)
    torch.testing.assert_close(grad, 2 * 0.3 * (v.detach() - v_ref) / v.numel())
    assert list(add_velocity_kl(torch.tensor(0.0), info, v, v, 1.0, key="ema_kl").shape) == [] and info["ema_kl"] == 0


def test_reduce_log_prob_sum_and_mean():
    s = torch.tensor([-640.0, 64.0])
    assert torch.equal(reduce_log_prob(s, 64, "sum"), s)
    torch.testing.assert_close(reduce_log_prob(s, 64, "mean"), torch.tensor([-10.0, 1.0]))
    # "mean" divides the log-ratio by D: a summed log-ratio of D·ε is a mean-ratio of ≈ 1+ε
    D, eps = 4096, 1e-4
    old, new = torch.tensor([0.0]), torch.tensor([D * eps])
    ratio = torch.exp(reduce_log_prob(new, D, "mean") - reduce_log_prob(old, D, "mean"))
    assert ratio.item() == pytest.approx(1 + eps, rel=1e-6)
    with pytest.raises(ValueError, match="algo.logprob_reduction"):
        reduce_log_prob(s, 64, "max")


# ------------------------------------------------------------------------------------------ algorithms

SIGMAS10 = flow_sigmas(10)


def test_grpo_plan_every_step_sde_and_all_trained():
    algo = GRPO(SIGMAS10)
    plan = algo.plan(3, 4, generator=gen())
    assert isinstance(plan, RolloutPlan)
    assert torch.equal(plan.sigmas, SIGMAS10) and plan.sde_mask.shape == (12, 10)
    assert plan.sde_mask.all() and torch.equal(plan.train_mask, plan.sde_mask)
    assert plan.first_sde_step().tolist() == [0] * 12 and plan.shared_prefix().tolist() == [0, 0, 0]
    assert (plan.solver, plan.kernel, plan.noise_level, plan.group_size) == ("euler", "flow_grpo", 0.7, 4)
    # CPS: the step into sigma'=0 has std 0, so it is ODE
    cps = GRPO(SIGMAS10, kernel="cps").plan(2, 2)
    assert cps.sde_mask[:, :-1].all() and not cps.sde_mask[:, -1].any()
    assert torch.equal(cps.train_mask, cps.sde_mask)


def test_grpo_timestep_fraction_random_subset_per_sample():
    algo = GRPO(flow_sigmas(16), kernel="dance", noise_level=0.3, timestep_fraction=0.6)
    plan = algo.plan(4, 4, generator=gen(1))
    assert plan.train_mask.sum(1).tolist() == [9] * 16  # int(16 * 0.6), as DanceGRPO and batch_plan
    assert not (plan.train_mask & ~plan.sde_mask).any() and plan.sde_mask.all()
    assert len({tuple(r.tolist()) for r in plan.train_mask}) > 1  # drawn per sample
    again = algo.plan(4, 4, generator=gen(1))
    assert torch.equal(again.train_mask, plan.train_mask)  # reproducible from the generator
    first = GRPO(SIGMAS10, timestep_fraction=0.5, timestep_selection="first").plan(1, 2)
    assert first.train_mask.tolist() == [[True] * 5 + [False] * 5] * 2  # Flow-GRPO's first steps
    cps = GRPO(SIGMAS10, kernel="cps", timestep_fraction=0.5).plan(8, 2, generator=gen(2))
    assert cps.train_mask.sum(1).tolist() == [4] * 16 and not cps.train_mask[:, -1].any()  # int(9 * 0.5)


def test_mix_grpo_window_moves_and_resumes():
    sig = flow_sigmas(8)
    algo = MixGRPO(sig, window=SDEWindow(8, size=3, shift_interval=2, stride=2))
    plan = algo.plan(2, 3, generator=gen())
    assert torch.equal(plan.sigmas, sig) and plan.sde_mask.shape == (6, 8)
    assert plan.sde_mask.tolist() == [[True] * 3 + [False] * 5] * 6 and torch.equal(plan.train_mask, plan.sde_mask)
    assert plan.info["window_start"] == 0
    starts = []
    for _ in range(6):
        algo.end_iteration()
        starts.append(algo.plan(1, 2).first_sde_step()[0].item())
    assert starts == [0, 2, 2, 4, 4, 0]  # every 2 iterations by 2; rolls back past T - w = 5

    algo.end_iteration()  # mid-interval: the counter must survive the resume too
    state = algo.state_dict()
    fresh = MixGRPO(sig, window=SDEWindow(8, size=3, shift_interval=2, stride=2))
    fresh.load_state_dict(state)
    for _ in range(3):
        assert torch.equal(fresh.plan(2, 2).sde_mask, algo.plan(2, 2).sde_mask)
        fresh.end_iteration()
        algo.end_iteration()


def test_mix_grpo_flash_compresses_the_tail_and_shares_the_prefix():
    base = flow_sigmas(25)
    algo = MixGRPO(base, window=SDEWindow(25, size=4, shift_interval=1), solver="dpm++2m", compress_ratio=0.4)
    plan = algo.plan(2, 3)
    # window 0..3: tail of 25-1-3 = 21 steps compressed to floor(21*0.4) = 8 → 4 + 8 steps
    assert plan.num_steps == 12 and torch.equal(plan.sigmas, compress_tail(base, 3, 0.4))
    assert torch.equal(plan.sigmas[:5], base[:5]) and plan.solver == "dpm++2m"
    assert plan.sde_mask.shape == (6, 12) and plan.sde_mask[:, :4].all() and not plan.sde_mask[:, 4:].any()
    algo.end_iteration()
    algo.end_iteration()
    plan = algo.plan(2, 3)  # window 2..5: steps before it are never compressed, tail 19 → 7
    assert plan.num_steps == 6 + 7 and torch.equal(plan.sigmas[:7], base[:7])
    assert plan.first_sde_step().tolist() == [2] * 6 and plan.shared_prefix().tolist() == [2, 2]
    assert torch.equal(plan.train_mask, plan.sde_mask)
    # with the sampler's Euler the compressed tail is solved by Euler (coarser, but what the user asked for)
    euler = MixGRPO(base, window=SDEWindow(25, size=4), compress_ratio=0.4).plan(1, 2)
    assert euler.solver == "euler" and euler.num_steps == 12


def test_flash_grpo_one_shared_step_per_prompt_and_rectified_weights():
    algo = FlashGRPO(SIGMAS10)
    plan = algo.plan(8, 4, generator=gen(3))
    assert plan.sde_mask.shape == (32, 10) and plan.sde_mask.sum(1).tolist() == [1] * 32
    assert torch.equal(plan.train_mask, plan.sde_mask)
    k = plan.first_sde_step()
    assert (k.view(8, 4) == k.view(8, 4)[:, :1]).all()  # iso-temporal: one k_p per group
    assert len(set(k[::4].tolist())) > 1 and (k < 5).all()  # differs across prompts, in the first half
    assert torch.equal(plan.info["flash_steps"], k[::4])
    assert torch.equal(algo.plan(8, 4, generator=gen(3)).sde_mask, plan.sde_mask)

    rows, steps = plan.trained_transitions()
    assert torch.equal(steps, k)
    w = algo.loss_weights(plan, rows, steps)
    inv = 1.0 / kernel_lambda(SIGMAS10[k], SIGMAS10[k + 1], kernel="flow_grpo", noise_level=0.7)
    torch.testing.assert_close(w, inv / inv.mean())
    assert w.mean().item() == pytest.approx(1.0) and len(set(w.tolist())) > 1
    torch.testing.assert_close(w, rectification_weights(SIGMAS10, k))
    # a micro-batch, or a process's slice of the groups, gets the batch-wide normalisation, not its own
    torch.testing.assert_close(algo.loss_weights(plan, rows[5:9], steps[5:9]), w[5:9])
    mine = torch.arange(8, 16)  # groups 2 and 3, as one of several processes would hold them
    part = plan.subset(mine)
    assert part.sde_mask.shape == (8, 10) and torch.equal(part.sigmas, plan.sigmas)
    part_rows, part_steps = part.trained_transitions()
    torch.testing.assert_close(algo.loss_weights(part, part_rows, part_steps), w[8:16])
    assert not torch.allclose(w[8:16], rectification_weights(SIGMAS10, k[8:16]))  # which per-slice norm would give
    with pytest.raises(ValueError, match="does not train"):
        algo.loss_weights(plan, torch.tensor([0]), (steps[:1] + 1) % 10)
    off = FlashGRPO(SIGMAS10, rectify=False)
    assert off.loss_weights(plan, rows, steps).tolist() == [1.0] * 32
    # advantages: mean per prompt, std over the whole batch
    r = torch.rand(32, generator=gen(4))
    torch.testing.assert_close(algo.reward_advantages(r, 4), group_advantages(r, 4, global_std=True))


def test_flash_grpo_compressed_tail_is_per_row_and_leaves_the_trained_grid_alone():
    plan = FlashGRPO(SIGMAS10, compress_ratio=0.4).plan(8, 2, generator=gen(3))
    assert plan.tail_ratio == 0.4 and torch.equal(plan.sigmas, SIGMAS10)
    k = plan.first_sde_step()
    assert torch.equal(plan.last_sde_step(), k) and len(set(k.tolist())) > 1
    for l in set(k.tolist()):
        grid = plan.row_sigmas(l)
        assert torch.equal(grid[: l + 2], SIGMAS10[: l + 2]) and grid[-1] == 0
        assert grid.shape[0] - 1 == l + 1 + max(1, int((10 - 1 - l) * 0.4))
    assert torch.equal(plan.subset(torch.arange(4)).row_sigmas(int(k[0])), plan.row_sigmas(int(k[0])))
    assert torch.equal(plan.row_sigmas(-1), SIGMAS10)  # a row without an SDE step keeps the full grid
    assert FlashGRPO(SIGMAS10).plan(8, 2, generator=gen(3)).tail_ratio == 1.0


def test_flash_grpo_rejects_a_cps_step_into_zero():
    with pytest.raises(ValueError, match="algo.max_step"):
        FlashGRPO(SIGMAS10, kernel="cps", max_step=10)
    with pytest.raises(ValueError, match="algo.max_step"):
        FlashGRPO(SIGMAS10, max_step=11)
    assert FlashGRPO(SIGMAS10, kernel="cps", max_step=9).max_step == 9


@pytest.mark.parametrize("algo", [GRPO(SIGMAS10, kernel="cps", timestep_fraction=0.5),
                                  MixGRPO(flow_sigmas(10), window=SDEWindow(10, size=3, start=2), solver="dpm++2m",
                                          compress_ratio=0.5),
                                  FlashGRPO(SIGMAS10)], ids=["grpo", "mix_grpo_flash", "flash_grpo"])
def test_plan_drives_a_rollout_and_rescoring_gives_ratio_one(algo):
    """Phase 1 → 2 → 5 on a toy velocity: the stored trained transitions rescore to ratio exactly 1, so the
    first PPO loss is −mean(w·A)."""
    plan = algo.plan(2, 2, generator=gen(5))
    noise = torch.randn(4, 2, 3, 3, generator=gen(6))
    velocity = lambda x, s: 0.3 * x - 0.5  # noqa: E731
    traj = rollout(velocity, noise, plan.sigmas, plan.sde_mask, kernel=plan.kernel,
                   noise_level=plan.noise_level, solver=plan.solver, generator=gen(7))
    rows, steps = plan.trained_transitions()
    x, x_next = traj.latents[rows, steps], traj.latents[rows, steps + 1]
    sig = plan.sigmas
    out = sde_step(velocity(x, None), x, sig[steps], sig[steps + 1], kernel=plan.kernel,
                   noise_level=plan.noise_level, prev_sample=x_next)
    D = x[0].numel()
    lp = reduce_log_prob(out.log_prob, D, "mean")
    old = reduce_log_prob(traj.log_probs[rows, steps], D, "mean")
    adv = algo.reward_advantages(torch.tensor([0.0, 1.0, 2.0, 0.5]), 2)[rows]
    w = algo.loss_weights(plan, rows, steps)
    loss, stats = ppo_clip_loss(lp, old, adv, clip_range=1e-4, weights=w)
    assert stats["ratio_min"].item() == 1.0 == stats["ratio_max"].item()
    assert loss.item() == pytest.approx(-float((w * adv).mean()), abs=1e-7)


# ------------------------------------------------------------------------------ from the composed config

CONFIGS = [
    (["algo=grpo", "sampler=sde"], GRPO),
    (["algo=grpo", "sampler=dance", "algo.timestep_fraction=0.6"], GRPO),
    (["algo=dance_grpo"], DanceGRPO),
    (["experiment=dance_grpo_shapes"], DanceGRPO),
    (["algo=grpo", "sampler=cps"], GRPO),
    (["algo=grpo", "sampler=dance", "algo.timestep_fraction=0.3", "algo.timestep_selection=first"], GRPO),
    (["algo=grpo", "sampler=mix_sde"], GRPO),
    (["algo=mix_grpo", "sampler=mix_sde"], MixGRPO),
    (["algo=mix_grpo", "sampler=cps"], MixGRPO),
    (["algo=mix_grpo", "sampler=mix_sde_flash", "algo.compress_ratio=0.4"], MixGRPO),
    (["algo=flash_grpo", "sampler=sde"], FlashGRPO),
    (["algo=flash_grpo", "sampler=dance"], FlashGRPO),
    (["experiment=mix_grpo_flash_shapes"], MixGRPO),
    (["experiment=flow_grpo_shapes"], GRPO),
]


def _check_plan(cfg, algo, sigmas):
    N, G = 3, cfg.trainer.group_size
    plan = algo.plan(N, G, generator=gen())
    chunks = (plan.num_chunks,) if plan.sde_mask.ndim == 3 else ()  # a streaming algorithm's plans have a block axis
    assert plan.sde_mask.shape == (N * G, *chunks, plan.num_steps)
    assert (plan.kernel, plan.solver) == (cfg.sampler.kernel, cfg.sampler.solver)
    # the banner's arithmetic (the algorithm's count) and the plan agree
    k, note = algo.trained_steps()
    assert k >= 1 and note and plan.train_mask.flatten(1).sum(1).tolist() == [k] * (N * G)
    assert batch_plan(cfg, trained_steps=algo.trained_steps()).trained_steps == k
    return plan, k


@pytest.mark.parametrize("overrides,cls", CONFIGS, ids=[" ".join(o) for o, _ in CONFIGS])
def test_build_algorithm_from_composed_configs(hydra_compose, overrides, cls):
    cfg = hydra_compose(overrides)
    sampler = build_sampler(cfg.sampler)
    algo = build_algorithm(cfg.algo, cfg.sampler, sampler.sigmas)
    assert type(algo) is cls and algo.name == cfg.algo.name and isinstance(algo.cfg, cls.config_class)
    assert algo.describe().startswith(cfg.algo.name) and "\n" not in algo.describe()
    plan, k = _check_plan(cfg, algo, sampler.sigmas)
    if cls is MixGRPO:
        size = cfg.algo.window.size or default_window_size(cfg.sampler.num_steps)
        assert algo.window.size == size and algo.window.shift_interval == cfg.algo.window.shift_interval
        assert (cfg.algo.compress_ratio < 1) == (plan.num_steps < cfg.sampler.num_steps)
    if cls is not FlashGRPO:
        assert algo.cfg.timestep_selection == cfg.algo.timestep_selection
    if cfg.algo.get("timestep_selection") == "first":  # the noisiest SDE steps, the same for every sample
        assert k < plan.num_steps and plan.train_mask[:, :k].all() and not plan.train_mask[:, k:].any()
    if cls is FlashGRPO:
        assert algo.cfg.global_std and algo.cfg.rectify and algo.max_step == cfg.sampler.num_steps // 2
    assert algo.cfg.global_std == cfg.algo.global_std and algo.cfg.adv_clip == cfg.algo.adv_clip


ALGO_OPTIONS = sorted(p.stem for p in (CONF / "algo").glob("*.yaml"))


@pytest.mark.parametrize("option", ALGO_OPTIONS)
def test_every_algorithm_runs_with_the_default_sampler_and_its_schema_defaults(hydra_compose, option):
    """``python train.py algo=X`` composes, validates and plans with no other override; the option file states only
    what differs from its schema, so the composed node equals the schema's defaults plus that."""
    model = ["model=causal_wan_shapes"] if ALGORITHMS[option].streaming else []  # a streaming algorithm's model
    cfg = hydra_compose([*model, f"algo={option}"])
    # the default sampler, or the one the algorithm was published with (dance_grpo; the streaming sampler); an
    # explicit choice wins
    assert cfg.sampler.name == {"dance_grpo": "dance", "pref_grpo": "dance", "stream_grpo": "stream",
                                "kvpo": "stream", "kvpo_awm": "stream", "stream_awm": "stream"}.get(
                                    option, hydra_compose([]).sampler.name)
    assert hydra_compose([*model, f"algo={option}", "sampler=cps"]).sampler.name == "cps"
    if option == "flow_opd":  # distils earlier runs: without them it stops before anything loads, naming the key
        with pytest.raises(Exception, match="algo.teachers is empty"):
            validate(cfg)
        cfg.algo.teachers = {"t": str(CONF)}  # any existing path passes validation (the checkpoint loads later)
    validate(cfg)
    cls = ALGORITHMS[cfg.algo.name]
    assert OmegaConf.get_type(cfg.algo) is cls.config_class
    defaults = OmegaConf.structured(cls.config_class(name=cfg.algo.name, teachers=dict(cfg.algo.teachers))
                                    if option == "flow_opd" else cls.config_class(name=cfg.algo.name))
    assert OmegaConf.to_container(cfg.algo) == OmegaConf.to_container(defaults)  # nothing restated differently
    algo = build_algorithm(cfg.algo, cfg.sampler, build_sampler(cfg.sampler).sigmas)
    _check_plan(cfg, algo, None)


@pytest.mark.parametrize("option", ["kvpo", "kvpo_awm"])
def test_kvpo_banner_names_where_it_forks_what_the_local_reward_scores_and_the_std_floor(hydra_compose, option):
    """The run's banner line says which fork placement, local reward and advantage floor the branches train with:
    runs that differ only there must not print the same description."""
    base = ["model=causal_wan_shapes", f"algo={option}"]
    changed = [*base, "algo.fork=after_switch", "algo.local_reward=blocks", "algo.adv_std_floor=0.02"]
    lines = []
    for overrides in (base, changed):
        cfg = hydra_compose(overrides)
        lines.append(build_algorithm(cfg.algo, cfg.sampler, build_sampler(cfg.sampler).sigmas).describe())
    assert "fork anywhere" in lines[0] and "(segment)" in lines[0] and "std floor 0)" in lines[0]
    assert "fork after_switch" in lines[1] and "(blocks)" in lines[1] and "std floor 0.02)" in lines[1]


def test_algorithm_options_are_the_registry():
    assert set(ALGO_OPTIONS) == set(ALGORITHMS)
    cs = ConfigStore.instance().repo["algo"]
    assert {f"base_{name}.yaml" for name in ALGORITHMS} <= set(cs)


@pytest.mark.parametrize("overrides,match", [
    (["algo=mix_grpo", "algo.window.size=11"], r"algo\.window\.size=11 exceeds sampler\.num_steps=10"),
    (["algo=flash_grpo", "sampler=cps", "algo.max_step=10"], r"algo\.max_step"),
    (["algo=flash_grpo", "algo.max_step=12"], r"algo\.max_step=12 exceeds"),
    (["algo=grpo", "algo.timestep_selection=last"], r"algo\.timestep_selection='last'"),
])
def test_build_algorithm_errors_name_the_key(hydra_compose, overrides, match):
    cfg = hydra_compose(overrides)
    with pytest.raises(ValueError, match=match):
        build_algorithm(cfg.algo, cfg.sampler, build_sampler(cfg.sampler).sigmas)


def test_algorithm_keywords_are_its_schema():
    with pytest.raises(TypeError, match="GRPO has no option window"):
        GRPO(SIGMAS10, window=3)
    with pytest.raises(ConfigError, match=r"algo\.clip_range=0"):
        FlashGRPO(SIGMAS10, clip_range=0)
    assert GRPO(SIGMAS10).cfg.kl_beta == GRPOConfig().kl_beta == 0.04  # schema defaults are the defaults
    assert GRPO(SIGMAS10).needs.reference and not GRPO(SIGMAS10, kl_beta=0.0).needs.reference  # declared by it


def test_build_algorithm_checks_values_and_schedule(hydra_compose):
    cfg = hydra_compose(["algo=grpo", "sampler=sde", "algo.timestep_fraction=0"])
    with pytest.raises(ConfigError, match=r"algo\.timestep_fraction"):
        build_algorithm(cfg.algo, cfg.sampler, flow_sigmas(10))
    cfg = hydra_compose(["algo=grpo", "sampler=sde"])
    with pytest.raises(ValueError, match=r"sampler\.num_steps=10"):
        build_algorithm(cfg.algo, cfg.sampler, flow_sigmas(12))
