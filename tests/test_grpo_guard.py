"""GRPO-Guard against its defining identities: the normalised log-ratio is s·(log r + mean(d²)/(2s²)) = mean(z⊙d),
zero-mean where the plain one is biased by −mean(d²)/(2s²); with the 1/|Δσ| weight the gradient through v carries
(1 + g²(1−σ)/(2σ)) per step; the rollout records the means it is computed from; one trainer iteration learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.algorithms import ALGORITHMS, Batch
from flowgrpo.algorithms.grpo_guard import GRPOGuard, normalized_log_ratio
from samplers import flow_sigmas, ragged_rollout, sde_step
from doubles import Cond, ToyContext  # tests/doubles.py

CONF = str(Path(__file__).resolve().parents[1] / "conf")
SIGMAS = flow_sigmas(10)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("kernel", ["flow_grpo", "dance", "cps"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_normalised_ratio_is_the_recentred_plain_ratio_and_equals_z_dot_d(kernel, reduction):
    B, D = 4, 3 * 2 * 2
    x = torch.randn(B, 3, 2, 2, generator=gen(0))
    v_old = torch.randn(B, 3, 2, 2, generator=gen(1))
    v = (v_old + 0.2 * torch.randn(B, 3, 2, 2, generator=gen(2))).requires_grad_()
    s, s_next = SIGMAS[[0, 2, 5, 8]], SIGMAS[[1, 3, 6, 9]]
    old = sde_step(v_old, x, s, s_next, kernel=kernel, noise_level=0.7, generator=gen(3))
    new = sde_step(v, x, s, s_next, kernel=kernel, noise_level=0.7, prev_sample=old.prev_sample)
    scale = 1.0 if reduction == "sum" else 1.0 / D
    log_r = (new.log_prob - old.log_prob) * scale
    d = new.mean - old.mean
    bias = d.pow(2).flatten(1).sum(1) * scale / (2 * old.std**2)
    got = normalized_log_ratio(new.mean, old.mean, old.prev_sample, old.std, reduction)
    torch.testing.assert_close(got, old.std * (log_r + bias), atol=2e-6, rtol=1e-4)  # RatioNorm as written
    z = (old.prev_sample - old.mean) / old.std.view(-1, 1, 1, 1)
    torch.testing.assert_close(got, (z * d).flatten(1).sum(1) * scale)
    # its gradient through v: z·∂μ/∂v (the bias keeps its gradient: the same as differentiating the RatioNorm form)
    (grad,) = torch.autograd.grad(got.sum(), v, retain_graph=True)
    (grad_form,) = torch.autograd.grad((old.std * (log_r + bias)).sum(), v)
    torch.testing.assert_close(grad, grad_form, atol=1e-5, rtol=1e-4)
    dmu = sde_step(torch.ones_like(x), x, s, s_next, kernel=kernel).mean - sde_step(torch.zeros_like(x), x, s, s_next, kernel=kernel).mean
    torch.testing.assert_close(grad, z * dmu * scale)


def test_plain_log_ratio_is_biased_left_and_the_normalised_one_is_centred():
    """Monte Carlo over the rollout noise z at a fixed policy change d: E[log r] = −mean(d²)/(2s²) < 0, E[log r̂] = 0."""
    M = 20000
    x = torch.randn(1, 4, 2, 2, generator=gen(0)).expand(M, -1, -1, -1)
    v_old = torch.randn(1, 4, 2, 2, generator=gen(1)).expand(M, -1, -1, -1)
    v = v_old + 0.3 * torch.randn(1, 4, 2, 2, generator=gen(2))
    s, s_next = torch.full((M,), float(SIGMAS[7])), torch.full((M,), float(SIGMAS[8]))  # a low-noise step
    old = sde_step(v_old, x, s, s_next, generator=gen(3))
    new = sde_step(v, x, s, s_next, prev_sample=old.prev_sample)
    D = 16
    log_r = (new.log_prob - old.log_prob) / D
    bias = ((new.mean - old.mean).pow(2).flatten(1).mean(1) / (2 * old.std**2))[0]
    hat = normalized_log_ratio(new.mean, old.mean, old.prev_sample, old.std)
    se_r, se_hat = log_r.std() / M**0.5, hat.std() / M**0.5
    assert bias > 20 * se_r  # the bias is far outside the Monte Carlo error ...
    assert abs(log_r.mean() + bias) < 4 * se_r  # ... and is what the plain ratio's mean is
    assert abs(hat.mean()) < 4 * se_hat


def rolled_batch(algo: GRPOGuard, ctx: ToyContext, P: int = 2, G: int = 3) -> Batch:
    plan = algo.plan(P, G, generator=gen(4))
    n = P * G
    noise = torch.randn(n, 3, 2, 2, generator=gen(5))
    with torch.no_grad():
        traj = ragged_rollout(lambda x, s, rows: ctx.velocity(x, s, None), noise, [plan.sigmas] * n,
                              list(plan.sde_mask), kernel=plan.kernel, noise_level=plan.noise_level,
                              generator=[gen(10 + r) for r in range(n)], record_means=True)
    batch = Batch(prompts=["p"] * n, metadata=None, global_rows=torch.arange(n), cond=Cond(), plan=plan,
                  latents=traj.latents, log_probs=traj.log_probs, means=traj.means)
    batch.advantages = algo.reward_advantages(torch.tensor([0.0, 1.0, 0.5, 2.0, 0.0, 1.0]), G)
    return batch


def test_rollout_records_the_sampling_means_and_the_loss_starts_at_ratio_one_with_the_step_weighted_gradient():
    algo = GRPOGuard(SIGMAS, kl_beta=0.0, timestep_fraction=0.3, timestep_selection="first")
    ctx = ToyContext(seed=9)
    batch = rolled_batch(algo, ctx)
    assert torch.isnan(batch.means).sum() == 0  # every step of a Flow-GRPO rollout is an SDE step
    rows, steps = batch.plan.trained_transitions()
    x = batch.latents[rows, steps]
    sig = batch.plan.sigmas
    with torch.no_grad():
        again = sde_step(ctx.velocity(x, None, None), x, sig[steps], sig[steps + 1], prev_sample=batch.latents[rows, steps + 1])
    torch.testing.assert_close(batch.means[rows, steps], again.mean, rtol=0, atol=0)

    loss, info = algo.loss(ctx, batch, rows, steps)
    assert info["ratio_min"].item() == 1.0 == info["ratio_max"].item() and info["clip_fraction"].item() == 0
    dt = (sig[steps] - sig[steps + 1]).abs()
    A = batch.advantages[rows]
    torch.testing.assert_close(loss, -(A / dt).mean())
    loss.backward()
    # d loss / d θ_c = −mean_i A_i/|Δσ_i| · mean_{elements of c}(z)·∂μ/∂v/D·(elements of c)
    #               = mean_i A_i · (1 + g²(1−σ)/(2σ)) · sum_{c}(z)/D   (∂μ/∂v = −Δσ·(1 + g²(1−σ)/(2σ)))
    s = sig[steps]
    g2 = 0.7**2 * s / (1 - torch.where(s >= 1, sig[steps + 1], s))  # g at σ = 1 uses σ' in its denominator
    z = (batch.latents[rows, steps + 1] - batch.means[rows, steps]) / again.std.view(-1, 1, 1, 1)
    expected = (A * (1 + g2 * (1 - s) / (2 * s))).view(-1, 1) * z.sum((2, 3)) / 12
    torch.testing.assert_close(ctx.theta.grad, expected.mean(0), rtol=1e-4, atol=1e-6)


def test_without_step_reweight_the_weight_is_one_and_a_batch_without_means_is_refused():
    algo = GRPOGuard(SIGMAS, kl_beta=0.0, step_reweight=False, timestep_fraction=0.3, timestep_selection="first")
    ctx = ToyContext(seed=9)
    batch = rolled_batch(algo, ctx)
    rows, steps = batch.plan.trained_transitions()
    loss, _ = algo.loss(ctx, batch, rows, steps)
    torch.testing.assert_close(loss, -batch.advantages[rows].mean())
    batch.means = None
    with pytest.raises(ValueError, match="Batch.means"):
        algo.loss(ctx, batch, rows, steps)


def test_one_trainer_iteration_records_means_and_moves_the_weights(tmp_path):
    from flowgrpo.trainer import Trainer

    overrides = ["model=tiny_sd3", "reward=jpeg_compressibility", "logger=none", "algo=grpo_guard",
                 "sampler.num_steps=4", "sampler.eval_num_steps=2", "trainer.iterations=1",
                 "trainer.prompts_per_iteration=2", "trainer.group_size=2", "trainer.train_batch_size=4",
                 "trainer.gradient_accumulation_steps=1", "algo.timestep_fraction=0.5",
                 "trainer.eval_before=false", "trainer.eval_every=0", "trainer.gallery_every=0",
                 "trainer.checkpoint_every=0", "trainer.lr=3e-2", "trainer.eval_num_prompts=1",
                 "trainer.eval_samples_per_tag=null"]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"trainer.output_dir={tmp_path}"])
    trainer = Trainer(cfg, tmp_path)
    assert isinstance(trainer.algorithm, ALGORITHMS["grpo_guard"]) and trainer.algorithm.needs.record_means
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    batch = trainer._last_batch
    assert batch.means is not None and batch.means.shape == batch.latents[:, 1:].shape
    assert torch.isfinite(batch.means[batch.plan.sde_mask]).all()
    row = trainer.history[-1]
    assert row["train/ratio_min"] == 1.0 == row["train/ratio_max"]  # one update: every micro-batch at θ_old
    assert all(torch.isfinite(torch.tensor(v)) for v in row.values())
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.params))
