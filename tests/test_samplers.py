"""Samplers against analytic references: diffusers' schedule, Gaussian data with a closed-form velocity,
exact Gaussian log-densities and the closed-form gradient / KL identities of ``samplers/steps.py``."""

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

import samplers
from samplers import (
    SDEWindow,
    compress_tail,
    flash_plan,
    flow_sigmas,
    kernel_lambda,
    ode_step,
    ragged_rollout,
    rectification_weights,
    rollout,
    sde_kl,
    sde_step,
    single_step_mask,
)

KERNEL_LEVELS = [("flow_grpo", 0.7), ("dance", 0.3), ("cps", 0.7)]
DATA_MEAN, DATA_STD = 0.7, 0.5


def gaussian_velocity(x, sigma):
    """Exact v(x, σ) = E[ε − x₀ | x_σ = x] for x₀ ~ N(DATA_MEAN, DATA_STD²), ε ~ N(0, 1), per element."""
    a = 1 - sigma
    var = a * a * DATA_STD**2 + sigma * sigma
    return (sigma - a * DATA_STD**2) / var * (x - a * DATA_MEAN) - DATA_MEAN


def final_error(solver, steps, shift, noise):
    sig = flow_sigmas(steps, shift)
    final = rollout(gaussian_velocity, noise, sig, torch.zeros(steps, dtype=torch.bool), solver=solver).final
    return abs(final.mean().item() - DATA_MEAN), abs(final.std().item() - DATA_STD)


# --------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("num_steps", [1, 2, 4, 10, 25, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_flow_sigmas_equal_diffusers_scheduler(num_steps, shift):
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(num_steps)
    ours = flow_sigmas(num_steps, shift)
    assert ours.shape == (num_steps + 1,)
    assert ours[0] == 1.0 and ours[-1] == 0.0
    assert torch.all(ours[1:] < ours[:-1])
    torch.testing.assert_close(ours, sched.sigmas, rtol=0, atol=0)


@pytest.mark.parametrize("num_steps", [4, 28])
@pytest.mark.parametrize("mu", [0.5, 1.15])
def test_flow_sigmas_flux_dynamic_shift(num_steps, mu):
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    torch.testing.assert_close(flow_sigmas(num_steps, mu=mu), sched.sigmas, rtol=0, atol=1e-7)


# --------------------------------------------------------------------------- ODE on Gaussian data
def test_euler_ode_converges_to_data_distribution():
    noise = torch.randn(50_000, 1, generator=torch.Generator().manual_seed(0))
    errs = [final_error("euler", t, 1.0, noise) for t in (25, 50, 100)]
    for mean_err, _ in errs:
        assert mean_err < 0.01  # Monte-Carlo error of the mean ~ 0.5/sqrt(5e4) = 0.002
    std_errs = [e[1] for e in errs]
    # First-order method: halving the step roughly halves the error.
    assert std_errs[1] < 0.6 * std_errs[0] and std_errs[2] < 0.6 * std_errs[1], std_errs
    assert std_errs[2] < 0.01


@pytest.mark.parametrize("shift,steps", [(1.0, 10), (1.0, 25), (3.0, 25), (3.0, 50), (5.0, 50)])
def test_dpm_solver_2m_clearly_more_accurate_than_euler(shift, steps):
    noise = torch.randn(20_000, 1, generator=torch.Generator().manual_seed(1))
    _, euler = final_error("euler", steps, shift, noise)
    mean_err, dpm = final_error("dpm++2m", steps, shift, noise)
    assert mean_err < 0.01
    assert dpm < 0.5 * euler, (dpm, euler)


def test_dpm_first_order_is_euler():
    x = torch.randn(3, 4)
    v = torch.randn(3, 4)
    for sigma, sigma_next in [(1.0, 0.8), (0.6, 0.3), (0.2, 0.0)]:
        dpm = samplers.dpm_solver_2m_step(x, x - sigma * v, sigma, sigma_next)
        torch.testing.assert_close(dpm, ode_step(v, x, sigma, sigma_next).prev_sample, atol=1e-6, rtol=1e-6)


def test_ode_step_equals_diffusers_euler_step():
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(6)
    x = torch.randn(2, 4, 8, 8)
    ours = x.clone()
    for i, t in enumerate(sched.timesteps):
        v = torch.randn_like(x)
        x = sched.step(v, t, x).prev_sample
        ours = ode_step(v, ours, sched.sigmas[i], sched.sigmas[i + 1]).prev_sample
        assert torch.equal(ours, x)


# --------------------------------------------------------------------------- SDE on Gaussian data
@pytest.mark.parametrize("kernel,level", [("flow_grpo", 0.7), ("dance", 0.3)])
def test_sde_kernels_reach_data_distribution(kernel, level):
    noise = torch.randn(50_000, 1, generator=torch.Generator().manual_seed(2))
    errs = []
    for steps in (25, 100):
        sig = flow_sigmas(steps, 1.0)
        gen = torch.Generator().manual_seed(3)
        final = rollout(gaussian_velocity, noise, sig, torch.ones(steps, dtype=torch.bool), kernel=kernel,
                        noise_level=level, generator=gen).final
        errs.append((abs(final.mean().item() - DATA_MEAN), abs(final.std().item() - DATA_STD)))
    assert errs[1][0] < 0.01 and errs[1][1] < 0.015, errs
    assert errs[1][1] < errs[0][1], errs  # discretisation error shrinks with the step size


def test_cps_mean_matches_data_over_a_full_rollout():
    # CPS re-noises from x̂₀ at every step, so only its mean (not its spread) converges on Gaussian data
    # with the posterior-mean velocity; its guarantee is the per-step one tested below.
    noise = torch.randn(50_000, 1, generator=torch.Generator().manual_seed(4))
    sig = flow_sigmas(50, 1.0)
    mask = torch.ones(50, dtype=torch.bool)
    mask[-1] = False
    final = rollout(gaussian_velocity, noise, sig, mask, kernel="cps", generator=torch.Generator().manual_seed(5)).final
    assert abs(final.mean().item() - DATA_MEAN) < 0.01


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.7, 0.4), (0.3, 0.05)])
def test_cps_keeps_exact_marginal_for_one_step(sigma, sigma_next):
    gen = torch.Generator().manual_seed(6)
    n = 200_000
    x0 = DATA_MEAN + DATA_STD * torch.randn(n, 1, generator=gen)
    eps = torch.randn(n, 1, generator=gen)
    x = (1 - sigma) * x0 + sigma * eps
    v = eps - x0  # the exact velocity of this sample
    out = sde_step(v, x, sigma, sigma_next, kernel="cps", noise_level=0.7, generator=gen)
    # x' must be (1−σ')·x₀ + σ'·ε' with ε' ~ N(0, 1) independent of x₀.
    resid = (out.prev_sample - (1 - sigma_next) * x0) / sigma_next
    assert abs(resid.mean().item()) < 0.01
    assert abs(resid.std().item() - 1.0) < 0.01
    assert abs(torch.corrcoef(torch.cat([resid, x0], 1).T)[0, 1].item()) < 0.01
    # The Flow-GRPO kernel does not have this one-step property at a coarse step (sanity of the test).
    if sigma - sigma_next >= 0.25:
        other = sde_step(v, x, sigma, sigma_next, kernel="flow_grpo", generator=gen)
        other_resid = (other.prev_sample - (1 - sigma_next) * x0) / sigma_next
        assert abs(other_resid.std().item() - 1.0) > 0.05


# --------------------------------------------------------------------------- exact log-probs
@pytest.mark.parametrize("kernel,level", KERNEL_LEVELS)
@pytest.mark.parametrize("shape", [(3, 4, 8, 8), (2, 4, 3, 6, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_prob_is_exact_gaussian_density(kernel, level, shape, dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    sigma = torch.tensor([0.9, 0.5, 0.2][: shape[0]])
    sigma_next = sigma - 0.1
    out = sde_step(v, x, sigma, sigma_next, kernel=kernel, noise_level=level, generator=gen)
    assert out.prev_sample.dtype == torch.float32 and out.log_prob.shape == (shape[0],)
    std = out.std.view(-1, *([1] * (len(shape) - 1))).expand(shape)
    ref = torch.distributions.Normal(out.mean.double(), std.double()).log_prob(out.prev_sample.double())
    torch.testing.assert_close(out.log_prob.double(), ref.flatten(1).sum(1), rtol=1e-5, atol=1e-3)
    # Rescoring the stored transition reproduces the log-prob exactly.
    again = sde_step(v, x, sigma, sigma_next, kernel=kernel, noise_level=level, prev_sample=out.prev_sample)
    assert torch.equal(again.log_prob, out.log_prob)


def test_flow_grpo_kernel_matches_reference_formulas():
    x, v = torch.randn(2, 16), torch.randn(2, 16)
    sigma, sigma_next, a = 0.6, 0.45, 0.7
    delta = sigma - sigma_next
    s = a * math.sqrt(sigma / (1 - sigma))
    eps_hat = x + (1 - sigma) * v
    out = sde_step(v, x, sigma, sigma_next, kernel="flow_grpo", noise_level=a)
    torch.testing.assert_close(out.mean, x - delta * (v + s**2 * eps_hat / (2 * sigma)))
    torch.testing.assert_close(out.std, torch.full((2,), s * math.sqrt(delta)))
    # At σ = 1 the denominator uses σ' (the schedule's second sigma), as the reference code does.
    first = sde_step(v, x, 1.0, 0.9, kernel="flow_grpo", noise_level=a)
    torch.testing.assert_close(first.std, torch.full((2,), a * math.sqrt(1 / 0.1) * math.sqrt(0.1)))
    cps = sde_step(v, x, sigma, sigma_next, kernel="cps", noise_level=a)
    std = sigma_next * math.sin(a * math.pi / 2)
    ref = (1 - sigma_next) * (x - sigma * v) + math.sqrt(sigma_next**2 - std**2) * eps_hat
    torch.testing.assert_close(cps.mean, ref)


@pytest.mark.parametrize("kernel,level", KERNEL_LEVELS)
def test_rollout_log_probs_rescore_exactly(kernel, level):
    steps = 8
    sig = flow_sigmas(steps, 3.0)
    mask = torch.zeros(4, steps, dtype=torch.bool)
    mask[0, :3] = True
    mask[1, 2:6] = True
    mask[2, 5] = True  # row 3 stays deterministic
    noise = torch.randn(4, 4, 6, 6, generator=torch.Generator().manual_seed(8))
    traj = rollout(gaussian_velocity, noise, sig, mask, kernel=kernel, noise_level=level,
                   generator=torch.Generator().manual_seed(9))
    assert traj.latents.shape == (4, steps + 1, 4, 6, 6) and traj.log_probs.shape == (4, steps)
    assert traj.nfe == steps
    assert torch.all(traj.log_probs[~mask] == 0) and torch.all(traj.log_probs[mask] != 0)
    for i in range(steps):
        rows = mask[:, i]
        if not rows.any():
            continue
        x = traj.latents[rows, i]
        v = gaussian_velocity(x, float(sig[i]))
        out = sde_step(v, x, sig[i], sig[i + 1], kernel=kernel, noise_level=level, prev_sample=traj.latents[rows, i + 1])
        assert torch.equal(out.log_prob, traj.log_probs[rows, i])
    # The deterministic row equals a plain ODE rollout.
    ode = rollout(gaussian_velocity, noise[3:], sig, torch.zeros(steps, dtype=torch.bool))
    assert torch.equal(ode.latents, traj.latents[3:])


def test_rollout_rejects_bad_masks_and_solvers():
    sig = flow_sigmas(4)
    noise = torch.randn(2, 3)
    with pytest.raises(ValueError, match="sde_mask"):
        rollout(gaussian_velocity, noise, sig, torch.zeros(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="solver"):
        rollout(gaussian_velocity, noise, sig, torch.zeros(4, dtype=torch.bool), solver="heun")
    with pytest.raises(ValueError, match="kernel"):
        sde_step(noise, noise, 0.5, 0.4, kernel="ddim")
    with pytest.raises(ValueError, match="CPS"):
        rollout(gaussian_velocity, noise, sig, torch.ones(4, dtype=torch.bool), kernel="cps")


# --------------------------------------------------------------------------- gradient and KL identities
@pytest.mark.parametrize("kernel,level", KERNEL_LEVELS)
@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.93), (0.6, 0.5), (0.15, 0.05)])
def test_log_prob_gradient_matches_closed_form_lambda(kernel, level, sigma, sigma_next):
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(3, 2, 5, 5, generator=gen)
    v = torch.randn(3, 2, 5, 5, generator=gen, requires_grad=True)
    sample = sde_step(v.detach(), x, sigma, sigma_next, kernel=kernel, noise_level=level, generator=gen)
    out = sde_step(v, x, sigma, sigma_next, kernel=kernel, noise_level=level, prev_sample=sample.prev_sample)
    (grad,) = torch.autograd.grad(out.log_prob.sum(), v)
    xi = (sample.prev_sample - out.mean.detach()) / out.std.view(-1, 1, 1, 1)
    lam = kernel_lambda(sigma, sigma_next, kernel=kernel, noise_level=level)
    torch.testing.assert_close(grad, -lam * xi, rtol=1e-4, atol=1e-4)
    if kernel == "flow_grpo":
        delta = sigma - sigma_next
        s = level * math.sqrt(sigma / (1 - (sigma_next if sigma == 1.0 else sigma)))
        closed = math.sqrt(delta) / s + s * math.sqrt(delta) * (1 - sigma) / (2 * sigma)
        assert abs(float(lam) - closed) < 1e-5 * closed


@pytest.mark.parametrize("kernel,level", KERNEL_LEVELS)
def test_sde_kl_is_exact_gaussian_kl(kernel, level):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 3, 4, 4, generator=gen)
    v, v_ref = torch.randn(2, 4, 3, 4, 4, generator=gen)
    sigma = torch.tensor([0.9, 0.7, 0.4, 0.2])
    sigma_next = sigma - 0.1
    p = sde_step(v, x, sigma, sigma_next, kernel=kernel, noise_level=level, generator=gen)
    q = sde_step(v_ref, x, sigma, sigma_next, kernel=kernel, noise_level=level, prev_sample=p.prev_sample)
    std = p.std.view(-1, 1, 1, 1).expand_as(x)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(p.mean, std), torch.distributions.Normal(q.mean, std))
    kl = sde_kl(v, v_ref, sigma, sigma_next, kernel=kernel, noise_level=level)
    torch.testing.assert_close(kl, ref.flatten(1).sum(1), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- MixGRPO window
def test_progressive_window_moves_every_interval_and_rolls_back():
    w = SDEWindow(num_steps=10, size=4, shift_interval=3, stride=2)
    starts = []
    for _ in range(15):
        starts.append(w.start)
        assert w.positions == list(range(w.start, w.start + 4))
        assert w.mask().sum() == 4 and w.mask()[w.start]
        w.advance()
    # moves at iterations 3, 6, 9, 12: 0 → 2 → 4 → 6 → (8 > 10−4) roll back to 0
    assert starts == [0] * 3 + [2] * 3 + [4] * 3 + [6] * 3 + [0] * 3


def test_random_window_is_seeded_and_in_range():
    a = SDEWindow(num_steps=12, size=3, shift_interval=1, schedule="random", seed=5)
    b = SDEWindow(num_steps=12, size=3, shift_interval=1, schedule="random", seed=5)
    seen = set()
    for _ in range(50):
        a.advance(), b.advance()
        assert a.start == b.start and 0 <= a.start <= 9
        seen.add(a.start)
    assert len(seen) > 5


@pytest.mark.parametrize("schedule", ["linear_decay", "exp_decay"])
def test_decay_schedules_shrink_the_interval_past_threshold(schedule):
    w = SDEWindow(num_steps=25, size=4, shift_interval=20, schedule=schedule, decay_rate=0.5 if schedule == "exp_decay" else 5,
                  decay_threshold=2, min_interval=2)
    intervals = {}
    moves = 0
    while moves < 8:
        intervals.setdefault(w.start, w.interval())
        moves += w.advance()
    assert intervals[0] == intervals[2] == 20
    vals = [intervals[k] for k in sorted(intervals)]
    assert all(b <= a for a, b in zip(vals, vals[1:])) and vals[-1] == 2


def test_frozen_window_never_moves():
    w = SDEWindow(num_steps=25, size=4, schedule="frozen", shift_interval=1)
    for _ in range(10):
        assert not w.advance()
    assert w.start == 0


@pytest.mark.parametrize("schedule", ["progressive", "random", "exp_decay"])
def test_window_state_round_trip_resumes_identically(schedule):
    w = SDEWindow(num_steps=16, size=4, shift_interval=2, schedule=schedule, seed=3)
    for _ in range(7):
        w.advance()
    state = w.state_dict()
    resumed = SDEWindow(num_steps=16, size=4, shift_interval=2, schedule=schedule, seed=99)
    resumed.load_state_dict(state)
    for _ in range(20):
        w.advance(), resumed.advance()
        assert w.start == resumed.start


def test_window_rejects_bad_settings():
    with pytest.raises(ValueError, match="schedule"):
        SDEWindow(num_steps=10, schedule="sideways")
    with pytest.raises(ValueError, match="size"):
        SDEWindow(num_steps=3, size=4)


@pytest.mark.parametrize("last_sde", [0, 3, 10, 22, 23])
def test_compress_tail_keeps_prefix_and_compresses_after_window(last_sde):
    sig = flow_sigmas(25, 3.0)
    new = compress_tail(sig, last_sde, ratio=0.4)
    tail = 25 - 1 - last_sde
    expected_tail = max(1, math.floor(tail * 0.4)) if tail > 1 else tail
    assert new.shape[0] - 1 == last_sde + 1 + expected_tail
    assert torch.equal(new[: last_sde + 2], sig[: last_sde + 2])
    assert new[-1] == 0 and torch.all(new[1:] < new[:-1])


@pytest.mark.parametrize("last_sde", [3, 6])
def test_flash_tail_beats_full_euler_with_fewer_steps(last_sde):
    # MixGRPO-Flash: DPM-Solver++(2M) on the compressed tail is more accurate than the full 25-step Euler
    # rollout while spending about half the NFE, and clearly better than Euler on the same short grid.
    noise = torch.randn(20_000, 1, generator=torch.Generator().manual_seed(12))
    sig = flow_sigmas(25, 3.0)
    full = rollout(gaussian_velocity, noise, sig, torch.zeros(25, dtype=torch.bool)).final
    short = compress_tail(sig, last_sde=last_sde)
    mask = torch.zeros(short.shape[0] - 1, dtype=torch.bool)
    mask[last_sde - 2 : last_sde + 1] = True  # a window ending at last_sde, as MixGRPO-Flash samples it
    gen = torch.Generator().manual_seed(14)
    fast = rollout(gaussian_velocity, noise, short, mask, solver="dpm++2m", generator=gen)
    euler = rollout(gaussian_velocity, noise, short, mask, solver="euler", generator=torch.Generator().manual_seed(14))
    assert fast.nfe <= 15
    err_fast = abs(fast.final.std().item() - DATA_STD)
    assert err_fast < abs(full.std().item() - DATA_STD)
    assert err_fast < 0.5 * abs(euler.final.std().item() - DATA_STD)
    # The steps up to the window's end are identical whatever the solver after it.
    assert torch.equal(fast.latents[:, : last_sde + 2], euler.latents[:, : last_sde + 2])


# --------------------------------------------------------------------------- Flash-GRPO plan
def test_flash_plan_and_single_step_mask():
    gen = torch.Generator().manual_seed(13)
    k = flash_plan(200, 10, generator=gen)
    assert k.dtype == torch.long and k.min() >= 0 and k.max() <= 4 and len(set(k.tolist())) == 5
    mask = single_step_mask(k[:3], 10, group_size=4)
    assert mask.shape == (12, 10) and torch.all(mask.sum(1) == 1)
    assert torch.equal(mask.float().argmax(1), k[:3].repeat_interleave(4))


@pytest.mark.parametrize("kernel,level", KERNEL_LEVELS)
def test_rectification_weights_are_normalised_inverse_lambda(kernel, level):
    sig = flow_sigmas(10, 3.0)
    k = torch.tensor([0, 1, 2, 4, 4])
    w = rectification_weights(sig, k, kernel=kernel, noise_level=level)
    lam = torch.stack([kernel_lambda(sig[i], sig[i + 1], kernel=kernel, noise_level=level) for i in k])
    torch.testing.assert_close(w, (1 / lam) / (1 / lam).mean())
    assert abs(w.mean().item() - 1) < 1e-6


def test_per_sample_generators_make_rows_independent_of_batch_split():
    steps = 6
    sig = flow_sigmas(steps, 3.0)
    mask = torch.zeros(4, steps, dtype=torch.bool)
    mask[0, 1] = mask[1, 1:3] = mask[2, 4] = mask[3, :] = True
    noise = torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(15))

    def gens(rows):
        return [torch.Generator().manual_seed(100 + r) for r in rows]

    whole = rollout(gaussian_velocity, noise, sig, mask, generator=gens(range(4)))
    for part in ([0, 2], [1], [3]):
        sub = rollout(gaussian_velocity, noise[part], sig, mask[part], generator=gens(part))
        assert torch.equal(sub.latents, whole.latents[part]) and torch.equal(sub.log_probs, whole.log_probs[part])
    with pytest.raises(ValueError, match="generators"):
        rollout(gaussian_velocity, noise, sig, mask, generator=gens(range(3)))


def _toy_velocity(offsets):
    """A velocity with per-row conditioning: v = (0.5 + σ)·x + offset[row] (float32 σ per row)."""
    def velocity(x, sigma, rows):
        s = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1, *([1] * (x.ndim - 1)))
        return (0.5 + s) * x + offsets[rows]
    return velocity


@pytest.mark.parametrize("solver", ["euler", "dpm++2m"])
def test_ragged_rollout_equals_rollout_row_by_row_and_shares_prefixes(solver):
    G, T = 4, 10
    base = samplers.flow_sigmas(T, shift=3.0)
    k = torch.tensor([0, 3, 1])                                  # one SDE step per group (Flash-GRPO)
    noise = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(0)).repeat_interleave(G, 0)
    offsets = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(1)).repeat_interleave(G, 0)
    grids, masks = [], []
    for p in range(3):
        for g in range(G):
            grid = compress_tail(base, int(k[p]), 0.4) if g % 2 else base   # compressed tail on half the rows
            mask = torch.zeros(grid.shape[0] - 1, dtype=torch.bool)
            mask[k[p]] = True
            grids.append(grid)
            masks.append(mask)
    velocity = _toy_velocity(offsets)
    gens = lambda: [torch.Generator().manual_seed(100 + r) for r in range(3 * G)]  # noqa: E731
    leaders = torch.arange(3 * G) // G * G
    for lead in (None, leaders):
        traj = ragged_rollout(velocity, noise, grids, masks, leaders=lead, solver=solver, generator=gens())
        ref_gens = gens()
        for r in range(3 * G):
            rows = torch.tensor([r])
            ref = rollout(lambda x, s: velocity(x, torch.full((1,), s), rows), noise[rows], grids[r], masks[r],
                          solver=solver, generator=[ref_gens[r]])
            n = grids[r].shape[0] - 1
            assert int(traj.lengths[r]) == n
            assert torch.equal(traj.latents[r, : n + 1], ref.latents[0]), (lead is None, r)
            assert torch.equal(traj.log_probs[r, :n], ref.log_probs[0])
            assert torch.isnan(traj.latents[r, n + 1:]).all() and torch.equal(traj.final[r], ref.final[0])
        longest = max(g.shape[0] - 1 for g in grids)
        assert traj.calls == longest
        full = sum(g.shape[0] - 1 for g in grids)
        # a shared group runs its prefix before k_p and the velocity at k_p once instead of G times
        assert traj.nfe == (full if lead is None else full - (G - 1) * int((k + 1).sum()))


def test_ragged_rollout_rejects_rows_that_cannot_follow_their_leader():
    base = samplers.flow_sigmas(6)
    masks = [torch.tensor([False, False, True, False, False, False])] * 2
    noise = torch.randn(2, 3)
    velocity = _toy_velocity(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="row 1 differs from its leader 0"):
        ragged_rollout(velocity, noise, [base, base], masks, leaders=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="leaders must map"):
        ragged_rollout(velocity, noise, [base, base], masks, leaders=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="row 0: sde_mask has 6 steps but its sigmas describe 3"):
        ragged_rollout(velocity, noise, [base[:4], base], masks)


def test_sde_bounds_first_and_last_stochastic_step_per_row():
    from samplers import sde_bounds

    mask = torch.tensor([[False, True, True, False], [False] * 4, [True, False, False, True]])
    first, last = sde_bounds(mask)
    assert first.tolist() == [1, 4, 0] and last.tolist() == [2, -1, 3]
