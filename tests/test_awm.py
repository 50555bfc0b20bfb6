"""AWM against its defining identities: the policy term's value is −Â and its gradient Â·∇w (the ratio is 1); with
uniform weighting and zero-sum advantages the gradient does not depend on v_θ; the ghuber weight's gradient is
σ(ℓ+1e-10)^{p−1}∇ℓ; the loss equals the formula by hand; stratified levels, the EMA schedule and its resume; one trainer
iteration on the tiny twin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.algorithms import ALGORITHMS, Batch
from flowgrpo.algorithms.awm import AWM, awm_weight, ema_decay, stratified_levels
from samplers import flow_sigmas
from doubles import Cond, ToyContext  # tests/doubles.py

CONF = str(Path(__file__).resolve().parents[1] / "conf")
SIGMAS = flow_sigmas(10)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_batch(algo: AWM, rewards: torch.Tensor, G: int, dim: int = 3) -> Batch:
    n = rewards.shape[0]
    plan = algo.plan(n // G, G, generator=gen(1))
    latents = torch.randn(n, plan.num_steps + 1, dim, 2, 2, generator=gen(2))
    batch = Batch(prompts=["p"] * n, metadata=None, global_rows=torch.arange(n), cond=Cond(), plan=plan,
                  latents=latents, log_probs=torch.zeros(n, plan.num_steps))
    batch.advantages = algo.reward_advantages(rewards, G)
    return batch


def test_stratified_levels_one_per_stratum_and_the_plan_is_an_ode():
    idx = stratified_levels(14, 6, 0.9, True, 500, gen(0))  # the authors' grid: strata [1,2,4,6,8,10,12)
    lower, upper = torch.tensor([1, 2, 4, 6, 8, 10]), torch.tensor([2, 4, 6, 8, 10, 12])
    assert bool(((idx >= lower) & (idx < upper)).all()) and idx.min() == 1 and idx.max() == 11
    assert all(len(set(col.tolist())) == int(u - l) for col, l, u in zip(idx.T, lower, upper))  # each index occurs
    assert stratified_levels(14, 6, 0.9, False, 50, gen(0)).min() == 0
    with pytest.raises(ValueError, match="algo.train_timesteps"):
        stratified_levels(10, 9, 0.9, True, 1)
    algo = AWM(SIGMAS)
    plan = algo.plan(3, 4, generator=gen(3))
    assert not plan.sde_mask.any() and plan.train_mask.sum(1).tolist() == [6] * 12 == [algo.trained_steps()[0]] * 12
    assert not plan.train_mask[:, 0].any() and not plan.train_mask[:, 9].any()  # σ = 1 and past int(10·0.9)
    assert algo.cfg.global_std and algo.cfg.weighting == "ghuber" and algo.cfg.kl_beta == 0.001 and algo.cfg.ema_kl_beta == 1.0
    assert not algo.needs.training_guidance  # the flow-matching loss is the conditional velocity's


def test_ghuber_gradient_is_sigma_times_the_power_of_the_error():
    loss = torch.tensor([1e-3, 0.2, 1.0, 7.5], dtype=torch.float64, requires_grad=True)
    sigma = torch.tensor([0.9, 0.5, 0.3, 0.1], dtype=torch.float64)
    for p in (0.25, 0.5):
        (g,) = torch.autograd.grad(awm_weight(loss, sigma, "ghuber", p).sum(), loss)
        torch.testing.assert_close(g, sigma * (loss.detach() + 1e-10) ** (p - 1))
    assert awm_weight(torch.zeros(1), torch.ones(1), "ghuber").abs().item() < 1e-12  # w(0) = 0
    (g,) = torch.autograd.grad(awm_weight(loss, sigma, "huber").sum(), loss)
    torch.testing.assert_close(g, sigma / (2 * (loss.detach() + 1e-10).sqrt()))
    torch.testing.assert_close(awm_weight(loss, sigma, "t2"), sigma**2 * loss)


def test_uniform_weighting_with_zero_sum_advantages_has_a_gradient_independent_of_v():
    """The policy term is linear in v_θ: Σ A_i ℓ_i with ΣA = 0 loses the quadratic part (why AWM needs its EMA term)."""
    algo = AWM(SIGMAS, weighting="uniform", kl_beta=0.0, ema_kl_beta=0.0, global_std=False)
    batch = make_batch(algo, torch.tensor([0.0, 1.0, 3.0, 2.0, 2.0, 5.0]), 3)
    batch.advantages = batch.advantages.clamp(-4, 4)  # zero-sum per group, inside the clip
    assert abs(float(batch.advantages.sum())) < 1e-6
    rows = torch.arange(6)
    steps = batch.plan.train_mask.to(torch.uint8).argmax(1)
    grads = []
    for seed in (0, 1):
        ctx = ToyContext(seed=seed)
        loss, info = algo.loss(ctx, batch, rows, steps)
        loss.backward()
        grads.append(ctx.theta.grad.clone())
        assert loss.item() == pytest.approx(-float(algo.policy_advantages(batch.advantages).mean()), abs=1e-6)
    torch.testing.assert_close(grads[0], grads[1])
    ctx = ToyContext(seed=0)  # and it is not identically zero
    algo.loss(ctx, batch, rows, steps)[0].backward()
    assert ctx.theta.grad.abs().max() > 1e-3


def test_loss_on_a_constructed_batch_equals_the_formula_by_hand():
    G, dim = 3, 3
    algo = AWM(SIGMAS, kl_beta=0.2, ema_kl_beta=0.7)
    ctx = ToyContext(dim)
    rewards = torch.tensor([0.0, 1.0, 3.0, 2.0, 2.0, 5.0])
    batch = make_batch(algo, rewards, G, dim)
    ctx.updates = 100  # d = 0.1
    algo.end_iteration(ctx)  # θ_ema = θ (first use), then moved towards θ: still θ
    with torch.no_grad():
        ctx.theta.add_(0.1)  # the live weights move away from the EMA
    rows = torch.arange(6)
    steps = batch.plan.train_mask.to(torch.uint8).argmax(1)
    loss, info = algo.loss(ctx, batch, rows, steps)
    loss.backward()

    x0 = batch.latents[:, -1].double()
    sig = SIGMAS[steps].double()
    eps = torch.stack([torch.randn(dim, 2, 2, generator=ctx.generator(int(r), int(s))) for r, s in zip(rows, steps)]).double()
    xt = (1 - sig.view(-1, 1, 1, 1)) * x0 + sig.view(-1, 1, 1, 1) * eps
    theta = ctx.theta.detach().double().view(1, -1, 1, 1).requires_grad_()
    v = theta + 0.5 * xt
    v_ema = (theta.detach() - 0.1) + 0.5 * xt
    v_ref = 0.5 * xt
    A = (rewards - rewards.view(2, 3).mean(1).repeat_interleave(3)) / (rewards.std(unbiased=False) + 1e-4)
    A_hat = A.clamp(-5, 5).double() / 5
    ell = (v - (eps - x0)).pow(2).mean((1, 2, 3))
    w = sig * ((ell + 1e-10) ** 0.25 - 1e-10**0.25) / 0.25
    sq = lambda d: d.pow(2).mean((1, 2, 3)).mean()  # noqa: E731
    by_hand = (-A_hat * torch.exp(w.detach() - w)).mean() + 0.7 * sq(v - v_ema) + 0.2 * sq(v - v_ref)
    by_hand.backward()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    torch.testing.assert_close(ctx.theta.grad.double(), theta.grad.view(-1), rtol=1e-4, atol=1e-6)
    assert info["ema_kl"].item() == pytest.approx(0.01, rel=1e-5) and "kl" in info


def test_ema_schedule_moves_after_each_iteration_and_resumes():
    assert [ema_decay(u, 0.3) for u in (0, 100, 299, 10_000)] == [0.0, pytest.approx(0.1), pytest.approx(0.299), 0.3]
    algo = AWM(SIGMAS)
    ctx = ToyContext()
    start = ctx.theta.detach().clone()
    algo.end_iteration(ctx)  # u = 0: d = 0, the EMA is θ
    with torch.no_grad():
        ctx.theta.add_(1.0)
    ctx.updates = 200  # d = 0.2
    algo.end_iteration(ctx)
    with algo.ema.swapped_in(ctx.params):
        torch.testing.assert_close(ctx.theta.detach(), 0.2 * start + 0.8 * (start + 1))
    assert torch.equal(ctx.theta.detach(), start + 1)  # the live weights come back
    fresh = AWM(SIGMAS)
    fresh.load_state_dict(algo.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.ema.weights, algo.ema.weights))


def test_a_grid_too_short_for_the_levels_is_refused_naming_the_keys():
    from flowgrpo.config import validate

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=["algo=awm", "sampler.num_steps=6"])  # [1, 5) holds 4 levels, not 6
    with pytest.raises(Exception, match="algo.train_timesteps.*sampler.num_steps=6"):
        validate(cfg)


def test_one_trainer_iteration_on_the_tiny_twin_moves_the_weights_and_resumes(tmp_path):
    from flowgrpo.trainer import Trainer

    overrides = ["model=tiny_sd3", "reward=jpeg_compressibility", "logger=none", "algo=awm",
                 "algo.train_timesteps=2", "sampler.num_steps=4", "sampler.eval_num_steps=2", "trainer.iterations=2",
                 "trainer.prompts_per_iteration=2", "trainer.group_size=2", "trainer.train_batch_size=4",
                 "trainer.gradient_accumulation_steps=1",
                 "trainer.eval_before=false", "trainer.eval_every=0", "trainer.gallery_every=0",
                 "trainer.checkpoint_every=1", "trainer.keep_checkpoints=5", "trainer.lr=3e-2",
                 "trainer.eval_num_prompts=1", "trainer.eval_samples_per_tag=null"]

    def make(out, *extra):
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose("train", overrides=[*overrides, f"trainer.output_dir={out}", *extra])
        return Trainer(cfg, out)

    trainer = make(tmp_path / "a")
    assert isinstance(trainer.algorithm, ALGORITHMS["awm"]) and trainer.batch.trained_steps == 2
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    assert trainer.updates == 2 and all(torch.isfinite(torch.tensor(v)) for v in trainer.history[-1].values())
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.params))
    assert {"train/policy_loss", "train/ema_kl", "train/kl", "train/fm_loss"} <= set(trainer.history[-1])
    resumed = make(tmp_path / "b", f"trainer.resume={trainer.ckpt.root / 'checkpoint-000001'}")
    resumed.fit()
    for a, b in zip(trainer.params, resumed.params):
        assert torch.equal(a, b)
