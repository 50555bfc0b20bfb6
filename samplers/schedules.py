"""Sigma schedules of rectified-flow samplers (notation as in ``samplers/steps.py``).

``flow_sigmas`` reproduces ``FlowMatchEulerDiscreteScheduler.set_timesteps`` exactly, including diffusers'
habit of shifting the scheduler's ``sigma_min`` twice, so a rollout over our sigmas visits the very same
timesteps as ``pipe(...)``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["flow_sigmas", "shift_sigmas", "time_shift_exponential"]


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Static timestep shift of SD3 / Wan: ``σ ← s·σ / (1 + (s−1)·σ)``."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def time_shift_exponential(sigmas: torch.Tensor, mu: float) -> torch.Tensor:
    """FLUX's resolution-dependent shift: ``σ ← e^μ / (e^μ + (1/σ − 1))`` (σ > 0)."""
    return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))


def flow_sigmas(
    num_steps: int,
    shift: float = 3.0,
    *,
    mu: float | None = None,
    num_train_timesteps: int = 1000,
) -> torch.Tensor:
    """Decreasing float32 sigmas ``[num_steps + 1]`` from 1 to 0 (the terminal 0 appended).

    Without ``mu`` this equals ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(num_steps)``'s
    ``scheduler.sigmas``. With ``mu`` it is FLUX's schedule: ``linspace(1, 1/N, N)`` under the exponential
    time shift (what ``FluxPipeline`` passes to its dynamically shifted scheduler); ``shift`` is then unused.

    >>> flow_sigmas(4, shift=1.0)
    tensor([1.0000, 0.6670, 0.3340, 0.0010, 0.0000])
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    # Computed in float64 then cast, as the scheduler computes in numpy float64/float32 and stores float32.
    if mu is not None:
        # FluxPipeline hands float64 linspace values that the scheduler casts to float32 before shifting.
        base = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64).float()
        sigmas = time_shift_exponential(base, mu)
    else:
        if shift <= 0:
            raise ValueError(f"shift must be > 0, got {shift}")
        # The scheduler's training grid ends at t=1/1000, shifted once at construction ...
        sigma_min = float(shift_sigmas(torch.tensor(1.0 / num_train_timesteps, dtype=torch.float32), shift))
        # ... and set_timesteps interpolates in t-space between 1 and that value, then shifts again.
        ts = torch.linspace(num_train_timesteps * 1.0, num_train_timesteps * sigma_min, num_steps, dtype=torch.float64)
        sigmas = shift_sigmas(ts / num_train_timesteps, shift)
    return torch.cat([sigmas.float(), torch.zeros(1)])
