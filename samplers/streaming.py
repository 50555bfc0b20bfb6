r"""Few-step streaming generation block by block (Self-Forcing's sampler), with the exact log-probability of
every stochastic transition.

A streaming model makes a video one block of latent frames at a time. Each block starts from Gaussian noise and
takes ``S`` steps over decreasing sigmas ``σ_0 = 1 > σ_1 > … > σ_{S-1}``: at step ``j`` the model predicts
the clean block ``x̂₀ = x_j − σ_j·v(x_j, σ_j)``; before the last step the prediction is re-noised to the next
level, ``x_{j+1} = (1 − σ_{j+1})·x̂₀ + σ_{j+1}·ε_j`` with fresh ``ε_j``; after the last step ``x̂₀`` is the
block. Its clean latents are then committed to the model's state (a KV-cache write pass) and the next block
starts. (Self-Forcing, arXiv 2506.08009; CausVid, arXiv 2412.07772; the step list [1000, 750, 500, 250]
warped by a shift, see :func:`stream_sigmas`.)

The re-noise transition is exactly ``x_{j+1} ~ N((1 − σ_{j+1})·x̂₀, σ_{j+1}²·I)``: a Gaussian whose mean depends on
the model, so its log-density under new weights is exact and cheap (CM-GRPO, arXiv 2605.15190) and PPO-style
updates apply to streaming as to the SDE samplers (:func:`renoise_log_prob`).

All noise is explicit: the initial noise of every block and every re-noise draw are tensors the caller passes
(:func:`stream_noise` draws them). Running several branches on the same tensors is common random numbers by
construction, with no RNG state to save and restore.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .schedules import shift_sigmas

__all__ = ["StreamTrajectory", "stream_sigmas", "stream_noise", "stream_rollout", "renoise_log_prob"]

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def stream_sigmas(num_steps: int, shift: float = 5.0) -> torch.Tensor:
    """The ``num_steps`` noise levels of a block, ``[S]`` float32 from 1 down: the uniform timesteps
    ``1000·(1 − j/S)`` warped by the static ``shift`` (Self-Forcing: 4 steps, shift 5 → 1, 0.9375, 0.8333, 0.625).

    >>> stream_sigmas(4, shift=5.0)
    tensor([1.0000, 0.9375, 0.8333, 0.6250])
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    base = 1.0 - torch.arange(num_steps, dtype=torch.float64) / num_steps
    return shift_sigmas(base, shift).float()


def stream_noise(batch: int, blocks: int, steps: int, block_shape, *, generator: torch.Generator | None = None,
                 device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every draw a stream needs: ``noise`` ``[B, K, *block_shape]`` (each block's start) and ``renoise``
    ``[B, K, S−1, *block_shape]`` (the re-noise draws), float32."""
    shape = (batch, blocks, *block_shape)
    noise = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
    renoise = torch.randn((batch, blocks, max(steps - 1, 0), *block_shape), generator=generator,
                          dtype=torch.float32, device=device)
    return noise, renoise


def renoise_log_prob(x0_pred: torch.Tensor, next_sample: torch.Tensor, sigma_next) -> torch.Tensor:
    """``log N(next_sample; (1 − σ')·x̂₀, σ'²·I)`` summed over non-batch dimensions, ``[B]`` float32; ``sigma_next``
    a float or ``[B]``. Differentiable in ``x0_pred``."""
    x0_pred, next_sample = x0_pred.float(), next_sample.float()
    batch = x0_pred.shape[0]
    sigma = torch.as_tensor(sigma_next, dtype=torch.float32, device=x0_pred.device)
    if sigma.ndim == 0:
        sigma = sigma.expand(batch)
    if torch.any(sigma <= 0):
        raise ValueError("a re-noise step needs sigma_next > 0")
    view = sigma.view(-1, *([1] * (x0_pred.ndim - 1)))
    z = (next_sample - (1 - view) * x0_pred) / view
    per_dim = x0_pred[0].numel()
    return -0.5 * z.square().flatten(1).sum(1) - per_dim * (torch.log(sigma) + _LOG_SQRT_2PI)


@dataclass
class StreamTrajectory:
    """What a streaming rollout records, per batch row ``B``, block ``K`` and step ``S``.

    Attributes:
        inputs: ``[B, K, S, ...]`` the state each model call saw (``inputs[:, k, 0]`` is the block's noise).
        x0: ``[B, K, S, ...]`` the model's clean prediction at each call.
        log_probs: ``[B, K, S−1]`` exact log-density of each re-noise transition ``inputs[:, k, j+1]`` given
            ``x0[:, k, j]``.
        sigmas: ``[S]`` the noise levels of every block.
        renoise: ``[B, K, S−1, ...]`` the re-noise draws used (the caller's tensor).
        blocks: ``[B, K, ...]`` the clean blocks (``x0[:, k, -1]``), the stream's latents block by block.
        nfe: model calls per row, write passes excluded (``K·S``).
    """

    inputs: torch.Tensor
    x0: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    renoise: torch.Tensor
    nfe: int

    @property
    def blocks(self) -> torch.Tensor:
        return self.x0[:, :, -1]

    def video(self, frame_dim: int = 2) -> torch.Tensor:
        """The clean blocks joined along the frame axis (``frame_dim`` of one block's ``[C, F, h, w]`` + batch):
        ``[B, C, K·F, h, w]`` for Wan latents."""
        blocks = self.blocks
        return torch.cat(blocks.unbind(1), dim=frame_dim)


@torch.no_grad()
def stream_rollout(
    velocity_fn: Callable[[torch.Tensor, float, int], torch.Tensor],
    commit_fn: Callable[[torch.Tensor, int], None],
    noise: torch.Tensor,
    renoise: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    start_block: int = 0,
) -> StreamTrajectory:
    """Generate ``K`` blocks one after another (no grad).

    Args:
        velocity_fn: ``velocity_fn(x, sigma, k) -> v`` for block ``k`` (absolute block index, from
            ``start_block``), reading the model's state.
        commit_fn: ``commit_fn(x0, k)``: write the finished block ``k`` into the model's state (the KV-cache
            write pass; switch prompts, re-cache, whatever the stream needs before block ``k + 1``).
        noise: ``[B, K, ...]`` each block's initial noise.
        renoise: ``[B, K, S−1, ...]`` the re-noise draws.
        sigmas: ``[S]`` decreasing noise levels in (0, 1] (:func:`stream_sigmas`).
        start_block: index of the first block (continuing a stream).
    """
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32).cpu()
    steps = sigmas.shape[0]
    if sigmas.ndim != 1 or steps < 1:
        raise ValueError("sigmas must be a 1-D schedule of at least one noise level")
    if torch.any(sigmas[1:] >= sigmas[:-1]) or sigmas[-1] <= 0 or sigmas[0] > 1:
        raise ValueError(f"sigmas must decrease strictly within (0, 1], got {sigmas.tolist()}")
    batch, blocks = noise.shape[:2]
    if renoise.shape != (batch, blocks, steps - 1, *noise.shape[2:]):
        raise ValueError(f"renoise must be [B, K, S-1, ...] = {(batch, blocks, steps - 1, *noise.shape[2:])}, "
                         f"got {tuple(renoise.shape)}")
    inputs, preds, log_probs = [], [], []
    for k in range(blocks):
        x = noise[:, k].float()
        block_in, block_x0, block_lp = [], [], []
        for j in range(steps):
            sigma = float(sigmas[j])
            v = velocity_fn(x, sigma, start_block + k).float()
            x0 = x - sigma * v
            block_in.append(x)
            block_x0.append(x0)
            if j + 1 < steps:
                nxt = float(sigmas[j + 1])
                x = (1 - nxt) * x0 + nxt * renoise[:, k, j].float()
                block_lp.append(renoise_log_prob(x0, x, nxt))
        commit_fn(block_x0[-1], start_block + k)
        inputs.append(torch.stack(block_in, 1))
        preds.append(torch.stack(block_x0, 1))
        log_probs.append(torch.stack(block_lp, 1) if block_lp else torch.zeros(batch, 0))
    return StreamTrajectory(inputs=torch.stack(inputs, 1), x0=torch.stack(preds, 1),
                            log_probs=torch.stack(log_probs, 1), sigmas=sigmas, renoise=renoise,
                            nfe=blocks * steps)
