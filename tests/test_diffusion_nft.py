"""DiffusionNFT against hand computations: its loss on a constructed batch, the closed-form optimum of the
flow-matching (v-space) loss, zero gradient for an all-equal-reward group, the old policy (sampling, decay, resume),
and one real trainer iteration on the tiny twin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.algorithms import ALGORITHMS, Batch
from flowgrpo.algorithms.diffusion_nft import DiffusionNFT, old_policy_decay, optimality_probability
from samplers import flow_sigmas
from doubles import Cond, ToyContext  # tests/doubles.py

CONF = str(Path(__file__).resolve().parents[1] / "conf")
SIGMAS = flow_sigmas(10)


def make_batch(algo: DiffusionNFT, rewards: torch.Tensor, G: int, dim: int = 3) -> Batch:
    n = rewards.shape[0]
    plan = algo.plan(n // G, G, generator=torch.Generator().manual_seed(1))
    latents = torch.randn(n, plan.num_steps + 1, dim, 2, 2, generator=torch.Generator().manual_seed(2))
    batch = Batch(prompts=["p"] * n, metadata=None, global_rows=torch.arange(n), cond=Cond(n), plan=plan,
                  latents=latents, log_probs=torch.zeros(n, plan.num_steps))
    batch.advantages = algo.reward_advantages(rewards, G)
    return batch


def test_plan_is_an_ode_rollout_training_k_of_t_noise_levels_per_sample():
    algo = DiffusionNFT(SIGMAS)
    plan = algo.plan(4, 3, generator=torch.Generator().manual_seed(0))
    assert not plan.sde_mask.any() and plan.first_sde_step().tolist() == [10] * 12
    assert plan.train_mask.sum(1).tolist() == [9] * 12 == [algo.trained_steps()[0]] * 12  # int(10 * 0.99)
    assert len({tuple(r.tolist()) for r in plan.train_mask}) > 1  # drawn per sample
    assert algo.cfg.global_std and algo.cfg.kl_beta == 1e-4 and algo.cfg.beta == 1.0 and algo.cfg.decay_type == 1


def test_optimality_probability_and_decay_schedules():
    a = torch.tensor([-7.0, -5.0, -2.5, 0.0, 2.5, 5.0, 9.0])
    assert optimality_probability(a, 5.0).tolist() == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert optimality_probability(a, 5.0, "positive_only").tolist() == [0.5, 0.5, 0.5, 0.5, 0.75, 1.0, 1.0]
    assert optimality_probability(a, 5.0, "binary").tolist() == pytest.approx([0.4, 0.4, 0.4, 0.5, 0.6, 0.6, 0.6])
    assert [old_policy_decay(u, 1) for u in (0, 100, 600)] == [0.0, pytest.approx(0.1), 0.5]
    assert [old_policy_decay(u, 2) for u in (0, 74, 75, 100, 300)] == [0.0, 0.0, 0.0, pytest.approx(0.1875), 0.999]
    assert old_policy_decay(10**6, 0) == 0.0


@pytest.mark.parametrize("space", ["x0", "v"])
def test_loss_on_a_constructed_batch_equals_the_formula_by_hand(space):
    G, dim = 3, 3
    algo = DiffusionNFT(SIGMAS, loss_space=space, beta=0.3, kl_beta=0.2)
    ctx = ToyContext(dim, a=0.5, salt=17)
    rewards = torch.tensor([0.0, 1.0, 3.0, 2.0, 2.0, 5.0])
    batch = make_batch(algo, rewards, G, dim)
    algo.end_iteration(ctx)  # θ_old = θ at update 0 ...
    with torch.no_grad():  # ... then the live weights move away from it
        ctx.theta.add_(0.1)
    rows = torch.arange(6)
    steps = batch.plan.train_mask.to(torch.uint8).argmax(1)  # each row's first trained noise level
    loss, info = algo.loss(ctx, batch, rows, steps)

    # by hand
    x0 = batch.latents[:, -1].double()
    sig = SIGMAS[steps].double().view(-1, 1, 1, 1)
    eps = torch.stack([torch.randn(dim, 2, 2, generator=ctx.generator(int(r), int(s))) for r, s in zip(rows, steps)]).double()
    xt = (1 - sig) * x0 + sig * eps
    theta, old = ctx.theta.detach().double().view(1, -1, 1, 1), (ctx.theta.detach() - 0.1).double().view(1, -1, 1, 1)
    v, v_old, v_ref = theta + 0.5 * xt, old + 0.5 * xt, 0.5 * xt
    A = ((rewards - rewards.view(2, 3).mean(1).repeat_interleave(3)) / (rewards.std(unbiased=False) + 1e-4)).double()
    r = (A.clamp(-5, 5) / 10 + 0.5).clamp(0, 1)
    vp, vn = 0.3 * v + 0.7 * v_old, 1.3 * v_old - 0.3 * v
    if space == "x0":
        def ell(w):
            e = xt - sig * w - x0
            return (e**2 / e.abs().mean(dim=(1, 2, 3), keepdim=True)).mean(dim=(1, 2, 3))
    else:
        def ell(w):
            return ((w - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    expected = 5 * ((r * ell(vp) + (1 - r) * ell(vn)) / 0.3).mean() + 0.2 * ((v - v_ref) ** 2).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert info["kl"].item() == pytest.approx(((v - v_ref) ** 2).mean().item(), rel=1e-5)


def test_minimising_the_flow_matching_loss_reaches_the_closed_form_optimum():
    """``v_θ`` a free vector (the same at every ``x_σ``): the minimiser of the v-space loss over the batch is
    ``v_old + mean[(2r−1)(v − v_old)] / β`` with ``v = ε − x₀`` of each (sample, noise level)."""
    G, dim, beta = 4, 3, 0.5
    algo = DiffusionNFT(SIGMAS, loss_space="v", beta=beta, kl_beta=0.0)
    ctx = ToyContext(dim, a=0.0, salt=17)
    rewards = torch.tensor([0.0, 1.0, 3.0, 2.0, 2.0, 5.0, 1.0, 1.5])
    batch = make_batch(algo, rewards, G, dim)
    algo.end_iteration(ctx)
    v_old = ctx.theta.detach().clone()
    rows, steps = batch.plan.trained_transitions()
    opt = torch.optim.LBFGS([ctx.theta], lr=1, max_iter=200, tolerance_grad=1e-12, tolerance_change=1e-15,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss, _ = algo.loss(ctx, batch, rows, steps)
        loss.backward()
        return loss

    opt.step(closure)
    x0 = batch.latents[rows, -1]
    eps = torch.stack([torch.randn(dim, 2, 2, generator=ctx.generator(int(r), int(s))) for r, s in zip(rows, steps)])
    v = (eps - x0).mean(dim=(2, 3))  # v_θ is constant over space: only the spatial mean of the target matters
    r = optimality_probability(batch.advantages[rows], 5.0)
    expected = v_old + ((2 * r - 1).unsqueeze(1) * (v - v_old)).mean(0) / beta
    torch.testing.assert_close(ctx.theta.detach(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("space", ["x0", "v"])
def test_an_all_equal_reward_group_gives_zero_advantage_and_zero_gradient(space):
    algo = DiffusionNFT(SIGMAS, loss_space=space)
    ctx = ToyContext(3, a=0.5, salt=17)
    batch = make_batch(algo, torch.full((4,), 0.7), 4)
    assert batch.advantages.abs().max() == 0
    algo.end_iteration(ctx)  # θ_old = θ
    ctx.ref = ctx.theta.detach().clone()  # and the reference too: the KL term is at its minimum
    rows, steps = batch.plan.trained_transitions()
    loss, _ = algo.loss(ctx, batch, rows, steps)
    assert torch.isfinite(loss)
    (grad,) = torch.autograd.grad(loss, ctx.theta)
    assert grad.abs().max().item() < 1e-6, grad


def test_first_step_gradient_is_advantage_weighted_flow_matching():
    """At ``θ = θ_old`` the v-space gradient per term is ``2(2r−1)(v_old − v)`` (times the loss's scale)."""
    algo = DiffusionNFT(SIGMAS, loss_space="v", kl_beta=0.0)
    ctx = ToyContext(3, a=0.0, salt=17)
    batch = make_batch(algo, torch.tensor([0.0, 1.0, 4.0, 2.0]), 4)
    algo.end_iteration(ctx)
    rows, steps = batch.plan.trained_transitions()
    loss, _ = algo.loss(ctx, batch, rows, steps)
    (grad,) = torch.autograd.grad(loss, ctx.theta)
    x0 = batch.latents[rows, -1]
    eps = torch.stack([torch.randn(3, 2, 2, generator=ctx.generator(int(r), int(s))) for r, s in zip(rows, steps)])
    r = optimality_probability(batch.advantages[rows], 5.0).view(-1, 1, 1, 1)
    per = 2 * (2 * r - 1) * (ctx.theta.detach().view(1, -1, 1, 1) - (eps - x0))  # d/dv of r|v+-v|²+(1-r)|v--v|², β=1
    expected = 5 * per.mean(dim=(2, 3)).mean(0) / 3  # adv_clip · mean over samples of the per-element mean (3 channels)
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-5)


def test_old_policy_samples_decays_and_resumes():
    algo = DiffusionNFT(SIGMAS, decay_type=1)
    ctx = ToyContext(3, a=0.0, salt=17)
    start = ctx.theta.detach().clone()
    with algo.sampling_policy(ctx):
        assert torch.equal(ctx.theta.detach(), start)  # θ_old = θ at the start
    with torch.no_grad():
        ctx.theta.add_(1.0)
    ctx.updates = 100  # η = 0.1
    with algo.sampling_policy(ctx):
        assert torch.equal(ctx.theta.detach(), start)  # rollouts use the old weights ...
    assert torch.equal(ctx.theta.detach(), start + 1)  # ... and the live ones come back
    algo.end_iteration(ctx)
    with algo.sampling_policy(ctx):
        torch.testing.assert_close(ctx.theta.detach(), 0.1 * start + 0.9 * (start + 1))
    fresh = DiffusionNFT(SIGMAS, decay_type=1)
    fresh.load_state_dict(algo.state_dict())
    with fresh.sampling_policy(ctx), torch.no_grad():
        resumed = ctx.theta.detach().clone()
    with algo.sampling_policy(ctx):
        assert torch.equal(ctx.theta.detach(), resumed)


def test_one_trainer_iteration_on_the_tiny_twin_moves_the_weights_and_resumes(tmp_path):
    from flowgrpo.trainer import Trainer

    overrides = ["model=tiny_sd3", "reward=jpeg_compressibility", "logger=none", "algo=diffusion_nft",
                 "sampler.num_steps=4", "sampler.eval_num_steps=2", "trainer.iterations=2",
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
    assert isinstance(trainer.algorithm, ALGORITHMS["diffusion_nft"]) and trainer.batch.trained_steps == 3
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    assert trainer.updates == 2 and all(torch.isfinite(torch.tensor(v)) for v in trainer.history[-1].values())
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.params))
    assert "train/policy_loss" in trainer.history[-1] and "train/kl" in trainer.history[-1]
    resumed = make(tmp_path / "b", f"trainer.resume={trainer.ckpt.root / 'checkpoint-000001'}")
    resumed.fit()
    for a, b in zip(trainer.params, resumed.params):
        assert torch.equal(a, b)
