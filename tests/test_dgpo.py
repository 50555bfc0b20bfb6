"""DGPO against its defining identities: the loss's gradient is that of −log σ(−z_g) over β_dpo·B/G; zero advantages
give no gradient; at the reference each group weighs ½; the DSM clip's direction; the loss on a constructed batch by
hand (one noise per group); the trainer keeps groups whole at one step; one trainer iteration and its exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.algorithms import ALGORITHMS, Batch
from flowgrpo.algorithms.dgpo import DGPO, dgpo_policy_loss, dsm_clip_mask
from samplers import flow_sigmas
from doubles import Cond, ToyContext  # tests/doubles.py

CONF = str(Path(__file__).resolve().parents[1] / "conf")
SIGMAS = flow_sigmas(10)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_gradient_is_the_group_dpo_gradient_over_beta():
    G, groups, beta = 4, 3, 50.0
    B = G * groups
    loss = torch.rand(B, generator=gen(0), dtype=torch.float64).requires_grad_()
    ref = torch.rand(B, generator=gen(1), dtype=torch.float64)
    adv = torch.randn(B, generator=gen(2), dtype=torch.float64)
    code, z = dgpo_policy_loss(loss, ref, adv, G, beta)
    (g_code,) = torch.autograd.grad(code, loss)
    zg = (beta / G * adv * (loss - ref)).view(groups, G).sum(1)
    torch.testing.assert_close(z, zg.detach())
    (g_dpo,) = torch.autograd.grad(-torch.nn.functional.logsigmoid(-zg).sum(), loss)
    torch.testing.assert_close(g_code * beta * B / G, g_dpo)
    # zero advantages: no gradient; at the reference (ℓ = ℓ_ref) every group weighs σ(0) = ½
    (g0,) = torch.autograd.grad(dgpo_policy_loss(loss, ref, torch.zeros(B, dtype=torch.float64), G, beta)[0], loss)
    assert g0.abs().max() == 0
    (g_ref,) = torch.autograd.grad(dgpo_policy_loss(loss, loss.detach(), adv, G, beta)[0], loss)
    torch.testing.assert_close(g_ref, 0.5 * adv / B)
    with pytest.raises(ValueError, match="whole groups"):
        dgpo_policy_loss(loss[:5], ref[:5], adv[:5], G, beta)


def test_dsm_clip_stops_the_gradient_in_the_advantage_direction_only():
    loss = torch.tensor([1.0, 1.0, 1.0, 1.0])
    old = torch.tensor([1.1, 0.9, 1.1, 0.9])  # ρ = e^{0.1} > 1 + ε, e^{−0.1} < 1 − ε
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    assert dsm_clip_mask(loss, old, adv, 0.01).tolist() == [True, False, False, True]
    assert not dsm_clip_mask(loss, old, adv, 0.5).any()


def make_batch(algo: DGPO, rewards: torch.Tensor, G: int) -> Batch:
    n = rewards.shape[0]
    plan = algo.plan(n // G, G, generator=gen(1))
    latents = torch.randn(n, plan.num_steps + 1, 3, 2, 2, generator=gen(2))
    batch = Batch(prompts=["p"] * n, metadata=None, global_rows=torch.arange(n), cond=Cond(), plan=plan,
                  latents=latents, log_probs=torch.zeros(n, plan.num_steps))
    batch.advantages = algo.reward_advantages(rewards, G)
    return batch


def test_plan_trains_the_same_high_noise_levels_for_the_batch():
    algo = DGPO(SIGMAS)
    plan = algo.plan(3, 4, generator=gen(0))
    assert not plan.sde_mask.any() and (plan.train_mask == plan.train_mask[0]).all()
    assert plan.train_mask[0].sum() == 4 == algo.trained_steps()[0] and not plan.train_mask[:, 5:].any()
    assert algo.needs.whole_groups and not algo.needs.training_guidance and algo.cfg.beta_dpo == 100 and algo.cfg.kl_beta == 0.02
    with pytest.raises(ValueError, match="algo.train_timesteps=6"):
        DGPO(SIGMAS, train_timesteps=6)


def test_loss_on_a_constructed_batch_equals_the_formula_by_hand():
    G = 3
    algo = DGPO(SIGMAS, beta_dpo=20.0, kl_beta=0.3, clip_dsm=False)
    ctx = ToyContext(salt=31)
    rewards = torch.tensor([0.0, 1.0, 3.0, 2.0, 2.5, 5.0])
    batch = make_batch(algo, rewards, G)
    rows = torch.arange(6)
    steps = torch.stack([batch.plan.train_mask[0].nonzero().flatten()[1]] * 6)
    loss, info = algo.loss(ctx, batch, rows, steps)
    loss.backward()

    x0 = batch.latents[:, -1].double()
    sig = SIGMAS[steps].double().view(-1, 1, 1, 1)
    eps = torch.stack([torch.randn(3, 2, 2, generator=ctx.generator(g, int(steps[0]))) for g in (0, 1)]).double()
    eps = eps.repeat_interleave(G, dim=0)  # one noise per group
    xt = (1 - sig) * x0 + sig * eps
    theta = ctx.theta.detach().double().view(1, -1, 1, 1).requires_grad_()
    v, v_ref = theta + 0.5 * xt, 0.5 * xt
    target = eps - x0
    ell = (target - v).pow(2).mean((1, 2, 3))
    ell_ref = (target - v_ref).pow(2).mean((1, 2, 3))
    mean = rewards.view(2, 3).mean(1, keepdim=True)
    A = ((rewards.view(2, 3) - mean) / (rewards.view(2, 3).std(1, unbiased=False, keepdim=True) + 1e-4)).flatten().double()
    z = (20.0 / G * A * (ell - ell_ref)).detach().view(2, 3).sum(1)
    by_hand = (torch.sigmoid(z).repeat_interleave(G) * A * ell).mean() + 0.3 * (v - v_ref).pow(2).mean((1, 2, 3)).mean()
    by_hand.backward()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    torch.testing.assert_close(ctx.theta.grad.double(), theta.grad.view(-1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(info["margin"].double(), z.mean(), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="whole groups"):  # a group split across loss calls is refused
        algo.loss(ctx, batch, rows[1:4], steps[1:4])


def test_the_slow_copy_follows_every_update_and_resumes():
    algo = DGPO(SIGMAS)
    ctx = ToyContext(salt=31)
    batch = make_batch(algo, torch.tensor([0.0, 1.0, 3.0, 2.0]), 2)
    rows, steps = torch.arange(4), torch.stack([batch.plan.train_mask[0].nonzero().flatten()[0]] * 4)
    algo.loss(ctx, batch, rows, steps)  # the copy starts at θ
    start = ctx.theta.detach().clone()
    with torch.no_grad():
        ctx.theta.add_(1.0)
    ctx.updates = 2  # two updates since: d = 0.001, then 0.002
    fresh = DGPO(SIGMAS)
    fresh.load_state_dict(algo.state_dict())
    for a in (algo, fresh):
        a.loss(ctx, batch, rows, steps)
    after_one = 0.001 * start + 0.999 * (start + 1)
    expected = 0.002 * after_one + 0.998 * (start + 1)
    for a in (algo, fresh):
        torch.testing.assert_close(a.ema.weights[0], expected)
        assert a.state_dict()["moved_at"] == 2


def test_the_trainer_keeps_groups_whole_and_one_iteration_resumes_exactly(tmp_path, monkeypatch):
    from flowgrpo.trainer import Trainer

    overrides = ["model=tiny_sd3", "reward=jpeg_compressibility", "logger=none", "algo=dgpo",
                 "algo.train_timesteps=2", "sampler.num_steps=4", "sampler.eval_num_steps=2", "trainer.iterations=2",
                 "trainer.prompts_per_iteration=2", "trainer.group_size=2", "trainer.train_batch_size=2",
                 "trainer.gradient_accumulation_steps=1",
                 "trainer.eval_before=false", "trainer.eval_every=0", "trainer.gallery_every=0",
                 "trainer.checkpoint_every=1", "trainer.keep_checkpoints=5", "trainer.lr=3e-2",
                 "trainer.eval_num_prompts=1", "trainer.eval_samples_per_tag=null"]

    def make(out, *extra):
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose("train", overrides=[*overrides, f"trainer.output_dir={out}", *extra])
        return Trainer(cfg, out)

    with monkeypatch.context() as m, pytest.raises(ValueError, match="trainer.group_size=3"):
        m.setattr("flowgrpo.trainer.build_adapter", lambda *a, **k: pytest.fail("the model loaded before the check"))
        make(tmp_path / "odd", "trainer.group_size=3", "trainer.prompts_per_iteration=2", "trainer.train_batch_size=2")
    trainer = make(tmp_path / "a")
    assert isinstance(trainer.algorithm, ALGORITHMS["dgpo"])
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    steps = trainer.transitions(trainer._last_batch, 1, 0)
    assert torch.equal(steps[0], steps[1]) and torch.equal(steps[2], steps[3])  # each group visits steps together
    assert trainer.updates == 4 and all(torch.isfinite(torch.tensor(v)) for v in trainer.history[-1].values())
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.params))
    assert {"train/policy_loss", "train/kl", "train/clip_fraction", "train/group_weight"} <= set(trainer.history[-1])
    resumed = make(tmp_path / "b", f"trainer.resume={trainer.ckpt.root / 'checkpoint-000001'}")
    resumed.fit()
    for a, b in zip(trainer.params, resumed.params):
        assert torch.equal(a, b)
