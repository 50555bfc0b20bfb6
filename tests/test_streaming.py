"""The streaming sampler with Self-Forcing's settings: few-step block generation over CausalWan, exact re-noise
log-probs, explicit common random numbers, and the teacher-forcing forward that trains what it samples."""

import math

import pytest
import torch

from flowgrpo.models import CausalWan
from flowgrpo.models.causal_wan import teacher_forcing_mask
from samplers import chunked_rollout, sde_step, stream_noise, stream_sde_mask, stream_sigmas
from test_causal_wan import C, H, W, diff, tiny_wan

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TIGHT = 1e-10
BLOCK, BLOCKS, STEPS = 2, 3, 4


def test_stream_sigmas_are_the_warped_step_list():
    sigmas = stream_sigmas(4, shift=5.0)
    # [1000, 750, 500, 250] warped by 5: 5t / (1 + 4t)
    expected = [5 * t / (1 + 4 * t) for t in (1.0, 0.75, 0.5, 0.25)]
    assert torch.allclose(sigmas.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-7)
    assert stream_sigmas(1).tolist() == [1.0]
    with pytest.raises(ValueError, match="num_steps"):
        stream_sigmas(0)


def test_the_renoise_step_is_cps_at_noise_level_one_with_the_exact_gaussian_density():
    """Self-Forcing's re-noise ``x' ~ N((1 − σ')·x̂₀, σ'²·I)`` is the cps kernel at noise level 1: its mean, its
    log-density against the analytic Gaussian, and the log-density's gradient in the velocity."""
    g = torch.Generator().manual_seed(0)
    x, v, nxt = (torch.randn(3, 2, 5, generator=g) for _ in range(3))
    sigma, sigma_next = torch.tensor([1.0, 0.8, 0.3]), torch.tensor([0.9, 0.5, 0.1])
    s, s_next = sigma.view(3, 1, 1), sigma_next.view(3, 1, 1)
    x0 = x - s * v
    ref = torch.distributions.Normal((1 - s_next) * x0, s_next).log_prob(nxt).sum((1, 2))
    step = sde_step(v, x, sigma, sigma_next, kernel="cps", noise_level=1.0, prev_sample=nxt)
    assert torch.allclose(step.mean, (1 - s_next) * x0, atol=1e-6) and torch.allclose(step.std, sigma_next)
    assert torch.allclose(step.log_prob, ref, atol=1e-4)
    # its gradient in v, through x̂₀ = x − σ·v: −σ·(1 − σ')·(x' − (1 − σ')·x̂₀)/σ'²
    v.requires_grad_(True)
    sde_step(v, x, 0.8, 0.5, kernel="cps", noise_level=1.0, prev_sample=nxt).log_prob.sum().backward()
    x0 = x - 0.8 * v.detach()
    assert torch.allclose(v.grad, -0.8 * 0.5 * (nxt - 0.5 * x0) / 0.25, atol=1e-5)
    with pytest.raises(ValueError, match="σ' = 0"):
        sde_step(v, x, 0.5, 0.0, kernel="cps", noise_level=1.0, prev_sample=nxt)


def _stream(wan, text, noise, renoise, sigmas):
    """Self-Forcing's sampler on the wan's blocks (the sampler's conditioning is the block index)."""
    def commit(x0, k):
        wan.write(x0.double(), text, frame_offset=k * BLOCK)
        return k + 1

    wan.reset()
    return chunked_rollout(
        lambda x, sigma, k: wan(x.double(), torch.full((x.shape[0],), 1000.0 * sigma, dtype=torch.float64), text,
                                frame_offset=k * BLOCK),
        commit, noise, torch.cat([sigmas, torch.zeros(1)]), stream_sde_mask(sigmas.shape[0]), cond=0, kernel="cps",
        noise_level=1.0, step_noise=renoise, record_x0=True)


def _video(blocks):
    """Blocks ``[B, K, C, F, h, w]`` joined along the frame axis: ``[B, C, K·F, h, w]``."""
    return torch.cat(blocks.unbind(1), 2)


@torch.no_grad()
def test_the_stream_equals_teacher_forcing_forward_and_rescores_exactly():
    wan = CausalWan(tiny_wan(), block_frames=BLOCK, sink_frames=2, window_frames=4)
    text = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sigmas = stream_sigmas(STEPS, shift=5.0)
    noise, renoise = stream_noise(2, BLOCKS, STEPS, (C, BLOCK, H, W), generator=torch.Generator().manual_seed(3))
    traj = _stream(wan, text, noise, renoise, sigmas)
    assert traj.latents.shape == (2, BLOCKS, STEPS + 1, C, BLOCK, H, W) and traj.x0.shape == (2, BLOCKS, STEPS, C,
                                                                                             BLOCK, H, W)
    assert traj.log_probs.shape == (2, BLOCKS, STEPS) and torch.all(traj.log_probs[:, :, -1] == 0)
    assert traj.nfe == BLOCKS * STEPS and torch.equal(traj.latents[:, :, 0], noise)
    # the last step's prediction is the block
    assert torch.equal(traj.final, traj.x0[:, :, -1])
    # each re-noise transition is (1 − σ')·x̂₀ + σ'·ε with the given draw, and its log-prob is the Gaussian's
    for j in range(STEPS - 1):
        s = float(sigmas[j + 1])
        assert torch.allclose(traj.latents[:, :, j + 1], (1 - s) * traj.x0[:, :, j] + s * renoise[:, :, j], atol=1e-6)
        z = renoise[:, :, j].flatten(2).double()
        d = z.shape[-1]
        expected = -0.5 * z.square().sum(-1) - d * (math.log(s) + 0.5 * math.log(2 * math.pi))
        assert torch.allclose(traj.log_probs[:, :, j].double(), expected, atol=1e-3)
    # every recorded prediction == one teacher-forcing forward: [clean blocks ; the recorded input of each block]
    clean = _video(traj.final).double()
    mask = teacher_forcing_mask(BLOCKS * BLOCK, BLOCK, sink_frames=2, window_frames=4)
    for j in range(STEPS):
        noisy = _video(traj.latents[:, :, j]).double()
        t = torch.cat([torch.zeros(2, BLOCKS * BLOCK, dtype=torch.float64),
                       torch.full((2, BLOCKS * BLOCK), 1000.0 * float(sigmas[j]), dtype=torch.float64)], 1)
        v = wan.full(torch.cat([clean, noisy], 2), t, text, mask=mask, frame_positions=list(range(BLOCKS * BLOCK)) * 2)
        x0 = noisy - float(sigmas[j]) * v[:, :, BLOCKS * BLOCK:]
        assert diff(x0, _video(traj.x0[:, :, j]).double()) < 1e-5   # float32 recording
    # the same tensors give the same stream (common random numbers); other draws a different one
    again = _stream(wan, text, noise, renoise, sigmas)
    assert torch.equal(again.x0, traj.x0)
    other = _stream(wan, text, noise, torch.randn_like(renoise), sigmas)
    assert torch.equal(other.x0[:, 0, 0], traj.x0[:, 0, 0]) and diff(other.final, traj.final) > 1e-3


@torch.no_grad()
def test_batched_stream_rows_are_independent():
    wan = CausalWan(tiny_wan(), block_frames=BLOCK, sink_frames=2, window_frames=4)
    text = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    sigmas = stream_sigmas(3, shift=3.0)
    noise, renoise = stream_noise(3, BLOCKS, 3, (C, BLOCK, H, W), generator=torch.Generator().manual_seed(5))
    batched = _stream(wan, text, noise, renoise, sigmas)
    for row in range(3):
        single = _stream(wan, text[row:row + 1], noise[row:row + 1], renoise[row:row + 1], sigmas)
        assert diff(single.x0, batched.x0[row:row + 1]) < 1e-5


def test_given_noise_is_the_generators_arithmetic():
    """The same draws, given as tensors or drawn from per-row generators, give the same stream bit for bit."""
    sigmas = torch.cat([stream_sigmas(3, shift=3.0), torch.zeros(1)])
    noise = torch.randn(2, 2, 3, 4, generator=torch.Generator().manual_seed(0))
    velocity = lambda x, s, k: torch.sin(x + s + k)  # noqa: E731
    commit = lambda x0, k: k + 1  # noqa: E731
    kw = dict(cond=0, kernel="cps", noise_level=1.0)
    drawn = chunked_rollout(velocity, commit, noise, sigmas, stream_sde_mask(3),
                            generator=[torch.Generator().manual_seed(b) for b in range(2)], **kw)
    # per-row generators draw block by block, step by step
    gens = [torch.Generator().manual_seed(b) for b in range(2)]
    renoise = torch.stack([torch.stack([torch.stack([torch.randn(1, 3, 4, generator=g)[0] for _ in range(2)])
                                        for _ in range(2)]) for g in gens])
    given = chunked_rollout(velocity, commit, noise, sigmas, stream_sde_mask(3), step_noise=renoise, **kw)
    assert torch.equal(given.latents, drawn.latents) and torch.equal(given.log_probs, drawn.log_probs)


def test_the_stream_refuses_bad_schedules_and_noise():
    noise, renoise = stream_noise(1, 1, 2, (1, 1), generator=torch.Generator().manual_seed(0))
    noop = lambda x0, k: k + 1  # noqa: E731
    kw = dict(cond=0, kernel="cps", noise_level=1.0)
    with pytest.raises(ValueError, match="decreasing"):
        chunked_rollout(lambda x, s, k: x, noop, noise, torch.tensor([0.5, 0.9, 0.0]), stream_sde_mask(2),
                        step_noise=renoise, **kw)
    with pytest.raises(ValueError, match="a later step is an SDE step"):
        chunked_rollout(lambda x, s, k: x, noop, noise, torch.tensor([1.0, 0.5, 0.0]), stream_sde_mask(2),
                        step_noise=renoise[:, :, :0], **kw)
    with pytest.raises(ValueError, match="step_noise must be"):
        chunked_rollout(lambda x, s, k: x, noop, noise, torch.tensor([1.0, 0.5, 0.0]), stream_sde_mask(2),
                        step_noise=renoise[:, :, :, :0], **kw)
    with pytest.raises(ValueError, match="not both"):
        chunked_rollout(lambda x, s, k: x, noop, noise, torch.tensor([1.0, 0.5, 0.0]), stream_sde_mask(2),
                        step_noise=renoise, generator=[torch.Generator()], **kw)
