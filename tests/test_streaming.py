"""The streaming sampler: Self-Forcing's few-step block generation over CausalWan, exact re-noise log-probs,
explicit common random numbers, and the teacher-forcing forward that trains what it samples."""

import math

import pytest
import torch

from flowgrpo.models import CausalWan
from flowgrpo.models.causal_wan import teacher_forcing_mask
from samplers import renoise_log_prob, stream_noise, stream_rollout, stream_sigmas
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


def test_renoise_log_prob_is_the_exact_gaussian_density():
    g = torch.Generator().manual_seed(0)
    x0, nxt = torch.randn(3, 2, 5, generator=g), torch.randn(3, 2, 5, generator=g)
    sigma = torch.tensor([0.9, 0.5, 0.1])
    ref = torch.distributions.Normal((1 - sigma.view(3, 1, 1)) * x0, sigma.view(3, 1, 1)).log_prob(nxt).sum((1, 2))
    assert torch.allclose(renoise_log_prob(x0, nxt, sigma), ref, atol=1e-4)
    # its gradient in x̂₀: (1 − σ')·(x' − (1 − σ')·x̂₀)/σ'²
    x0.requires_grad_(True)
    renoise_log_prob(x0, nxt, 0.5).sum().backward()
    assert torch.allclose(x0.grad, 0.5 * (nxt - 0.5 * x0.detach()) / 0.25, atol=1e-5)
    with pytest.raises(ValueError, match="sigma_next > 0"):
        renoise_log_prob(x0, nxt, 0.0)


def _stream(wan, text, noise, renoise, sigmas):
    wan.reset()
    return stream_rollout(
        lambda x, sigma, k: wan(x.double(), torch.full((x.shape[0],), 1000.0 * sigma, dtype=torch.float64), text,
                                frame_offset=k * BLOCK),
        lambda x0, k: wan.write(x0.double(), text, frame_offset=k * BLOCK),
        noise, renoise, sigmas)


@torch.no_grad()
def test_stream_rollout_equals_teacher_forcing_forward_and_rescores_exactly():
    wan = CausalWan(tiny_wan(), block_frames=BLOCK, sink_frames=2, window_frames=4)
    text = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sigmas = stream_sigmas(STEPS, shift=5.0)
    noise, renoise = stream_noise(2, BLOCKS, STEPS, (C, BLOCK, H, W), generator=torch.Generator().manual_seed(3))
    traj = _stream(wan, text, noise, renoise, sigmas)
    assert traj.inputs.shape == (2, BLOCKS, STEPS, C, BLOCK, H, W) and traj.log_probs.shape == (2, BLOCKS, STEPS - 1)
    assert traj.nfe == BLOCKS * STEPS and traj.video().shape == (2, C, BLOCKS * BLOCK, H, W)
    assert torch.equal(traj.inputs[:, :, 0], noise)
    # each re-noise transition is (1 − σ')·x̂₀ + σ'·ε with the given draw, and its log-prob is the Gaussian's
    for j in range(STEPS - 1):
        s = float(sigmas[j + 1])
        assert torch.allclose(traj.inputs[:, :, j + 1], (1 - s) * traj.x0[:, :, j] + s * renoise[:, :, j], atol=1e-6)
        z = renoise[:, :, j].flatten(2).double()
        d = z.shape[-1]
        expected = -0.5 * z.square().sum(-1) - d * (math.log(s) + 0.5 * math.log(2 * math.pi))
        assert torch.allclose(traj.log_probs[:, :, j].double(), expected, atol=1e-3)
    # every recorded prediction == one teacher-forcing forward: [clean blocks ; the recorded input of each block]
    clean = traj.video().double()
    mask = teacher_forcing_mask(BLOCKS * BLOCK, BLOCK, sink_frames=2, window_frames=4)
    for j in range(STEPS):
        noisy = torch.cat(traj.inputs[:, :, j].double().unbind(1), 2)
        t = torch.cat([torch.zeros(2, BLOCKS * BLOCK, dtype=torch.float64),
                       torch.full((2, BLOCKS * BLOCK), 1000.0 * float(sigmas[j]), dtype=torch.float64)], 1)
        v = wan.full(torch.cat([clean, noisy], 2), t, text, mask=mask, frame_positions=list(range(BLOCKS * BLOCK)) * 2)
        x0 = noisy - float(sigmas[j]) * v[:, :, BLOCKS * BLOCK:]
        assert diff(x0, torch.cat(traj.x0[:, :, j].double().unbind(1), 2)) < 1e-5   # float32 recording
    # the same tensors give the same stream (common random numbers); other draws a different one
    again = _stream(wan, text, noise, renoise, sigmas)
    assert torch.equal(again.x0, traj.x0)
    other = _stream(wan, text, noise, torch.randn_like(renoise), sigmas)
    assert torch.equal(other.x0[:, 0, 0], traj.x0[:, 0, 0]) and diff(other.blocks, traj.blocks) > 1e-3


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


def test_stream_rollout_refuses_bad_schedules_and_shapes():
    noise, renoise = stream_noise(1, 1, 2, (1, 1), generator=torch.Generator().manual_seed(0))
    noop = lambda *a: None  # noqa: E731
    with pytest.raises(ValueError, match="decrease"):
        stream_rollout(lambda x, s, k: x, noop, noise, renoise, torch.tensor([0.5, 0.9]))
    with pytest.raises(ValueError, match="renoise"):
        stream_rollout(lambda x, s, k: x, noop, noise, renoise[:, :, :0], torch.tensor([1.0, 0.5]))
