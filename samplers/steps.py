"""One transition of a rectified-flow sampler, deterministic or stochastic, with its exact log-density.

Notation: ``x_σ = (1−σ)·x₀ + σ·ε``, velocity ``v = ε − x₀``, one step goes ``σ → σ'`` with
``Δ = σ − σ' > 0``; from a velocity ``x̂₀ = x − σ·v`` and ``ε̂ = x + (1−σ)·v``.

SDE kernels (each transition is ``x' ~ N(μ, std²·I)``):

* ``"flow_grpo"`` — Flow-GRPO, arXiv 2505.05470: ``s = a·sqrt(σ/(1−σ))`` (at σ = 1 the denominator uses σ',
  which is the schedule's second sigma, as the reference code does), ``μ = x − Δ·[v + s²·ε̂/(2σ)]``,
  ``std = s·√Δ``.
* ``"dance"`` — DanceGRPO, arXiv 2505.07818: the same drift with a constant ``η`` in place of ``s``,
  ``std = η·√Δ``.
* ``"cps"`` — Coefficients-Preserving Sampling, arXiv 2509.05952: ``std = σ'·sin(a·π/2)``,
  ``μ = (1−σ')·x̂₀ + sqrt(σ'² − std²)·ε̂``.

``log_prob`` is the exact Gaussian log-density **summed** over the non-batch dimensions (the reference codes
average over elements and drop constants; averaging, if wanted, is the trainer's choice). All math runs in
float32 whatever the input dtype, and ``prev_sample`` is returned in float32 so that rescoring the stored
sample reproduces the rollout's value bit for bit.

Every kernel's mean is affine in ``v``: ``μ = c(x) − λ·std·v``. Hence ``∂ log π / ∂v = −λ·ξ`` with
``ξ = (x' − μ)/std`` the standardised noise, and ``KL(π_θ ‖ π_ref) = (λ²/2)·‖v_θ − v_ref‖²`` — the
identity behind Flash-GRPO's temporal gradient rectification (arXiv 2605.15980). ``kernel_lambda`` gives λ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch

__all__ = ["KERNELS", "StepOutput", "sde_step", "ode_step", "kernel_std", "kernel_lambda", "sde_kl"]

KERNELS = ("flow_grpo", "dance", "cps")
SigmaLike = Union[float, torch.Tensor]
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOutput:
    """Result of one transition.

    Args:
        prev_sample: the next state ``x'`` (float32).
        log_prob: exact ``log N(x'; mean, std²·I)`` summed over non-batch dims, shape ``[B]``;
            ``None`` for deterministic steps.
        mean: the transition mean ``μ`` (float32, same shape as the sample).
        std: the transition standard deviation per sample, shape ``[B]`` (zeros for deterministic steps).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor | None
    mean: torch.Tensor
    std: torch.Tensor


def randn(shape, generator: torch.Generator | list[torch.Generator] | None, device) -> torch.Tensor:
    """Standard normal float32 noise of ``shape`` on ``device``, drawn on each generator's own device; with a list,
    row ``b`` comes from ``generator[b]`` alone."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
        rows = [torch.randn((1, *shape[1:]), generator=g, dtype=torch.float32, device=g.device) for g in generator]
        return torch.cat([r.to(device) for r in rows])
    gen_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, dtype=torch.float32, device=gen_device).to(device)


def _per_sample(value: SigmaLike, batch: int, device: torch.device) -> torch.Tensor:
    """A float or ``[B]`` tensor as a float32 ``[B]`` tensor."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.ndim == 0:
        return t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"sigma must be a float or a tensor of shape [{batch}], got {tuple(t.shape)}")
    return t


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B]`` → ``[B, 1, 1, ...]`` to broadcast against a sample."""
    return t.view(-1, *([1] * (like.ndim - 1)))


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"unknown SDE kernel {kernel!r}; choose one of {KERNELS}")


def _flow_grpo_scale(sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float) -> torch.Tensor:
    """``s = a·sqrt(σ/(1−σ))``, with σ' standing in for σ in the denominator at σ = 1."""
    denom_sigma = torch.where(sigma >= 1.0, sigma_next, sigma)
    return noise_level * torch.sqrt(sigma / (1 - denom_sigma))


def _coefficients(sigma, sigma_next, kernel, noise_level):
    """Per-sample (std, a, b) with ``μ = a·x + b·v`` for the chosen kernel (all float32 ``[B]``)."""
    delta = sigma - sigma_next
    if kernel == "cps":
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        c = torch.sqrt(torch.clamp(sigma_next**2 - std**2, min=0.0))
        # μ = (1−σ')·(x − σ·v) + c·(x + (1−σ)·v)
        a = (1 - sigma_next) + c
        b = -(1 - sigma_next) * sigma + c * (1 - sigma)
        return std, a, b
    s = _flow_grpo_scale(sigma, sigma_next, noise_level) if kernel == "flow_grpo" else torch.full_like(sigma, noise_level)
    std = s * torch.sqrt(delta)
    # μ = x − Δ·[v + s²·(x + (1−σ)·v)/(2σ)]
    k = s**2 / (2 * sigma)
    a = 1 - delta * k
    b = -delta * (1 + k * (1 - sigma))
    return std, a, b


def _validate(sigma, sigma_next, kernel):
    if torch.any(sigma_next >= sigma):
        raise ValueError("an SDE step needs sigma > sigma_next (sampling runs from 1 to 0)")
    if torch.any(sigma <= 0) or torch.any(sigma > 1):
        raise ValueError("sigma must lie in (0, 1] for an SDE step")
    if kernel == "cps" and torch.any(sigma_next <= 0):
        raise ValueError(
            "the CPS kernel has std = σ'·sin(aπ/2) = 0 on the final step to σ' = 0, so its log-prob is undefined; "
            "make that step deterministic (False in sde_mask)"
        )


def kernel_std(sigma: SigmaLike, sigma_next: SigmaLike, *, kernel: str = "flow_grpo", noise_level: float = 0.7) -> torch.Tensor:
    """Transition standard deviation of ``kernel`` for ``σ → σ'`` (float32, shape of the broadcast sigmas)."""
    _check_kernel(kernel)
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float32)
    return _coefficients(sigma, sigma_next, kernel, noise_level)[0]


def kernel_lambda(sigma: SigmaLike, sigma_next: SigmaLike, *, kernel: str = "flow_grpo", noise_level: float = 0.7) -> torch.Tensor:
    """λ with ``∂ log π / ∂v = −λ·ξ`` (ξ the standardised noise of the transition), i.e. ``λ = −b/std``.

    For Flow-GRPO this is ``√Δ/s + s·√Δ·(1−σ)/(2σ)``; the module docstring gives the KL it enters.
    """
    _check_kernel(kernel)
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float32)
    std, _, b = _coefficients(sigma, sigma_next, kernel, noise_level)
    return -b / std


def sde_kl(
    velocity: torch.Tensor,
    ref_velocity: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    *,
    kernel: str = "flow_grpo",
    noise_level: float = 0.7,
) -> torch.Tensor:
    """Exact ``KL(π_θ ‖ π_ref)`` of two transitions from the same ``x`` with the same kernel, summed per sample:
    ``‖μ_θ − μ_ref‖²/(2·std²) = (λ²/2)·‖v_θ − v_ref‖²``. Shape ``[B]``, float32."""
    _check_kernel(kernel)
    batch = velocity.shape[0]
    sigma = _per_sample(sigma, batch, velocity.device)
    sigma_next = _per_sample(sigma_next, batch, velocity.device)
    lam = kernel_lambda(sigma, sigma_next, kernel=kernel, noise_level=noise_level)
    diff = (velocity.float() - ref_velocity.float()).flatten(1)
    return 0.5 * lam**2 * diff.pow(2).sum(1)


def sde_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    *,
    kernel: str = "flow_grpo",
    noise_level: float = 0.7,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    noise: torch.Tensor | None = None,
) -> StepOutput:
    """One stochastic step ``σ → σ'`` and the exact log-density of its result.

    Args:
        velocity: model output ``v`` at ``(sample, σ)``, any float dtype, any latent shape ``[B, ...]``.
        sample: current state ``x``.
        sigma, sigma_next: floats or per-sample tensors ``[B]``.
        kernel: ``"flow_grpo"``, ``"dance"`` or ``"cps"``.
        noise_level: ``a`` for flow_grpo / cps, ``η`` for dance.
        prev_sample: if given, score this stored transition (training) instead of sampling.
        generator: RNG for the noise when sampling; a list gives one generator per sample (as diffusers'
            ``randn_tensor``), so a sample's noise does not depend on how the batch is split across processes.
        noise: when sampling, the standard normal draw ``ε`` itself, ``[B, ...]`` (pre-drawn noise: branches given
            the same tensor share their random numbers); ``x' = μ + std·ε`` as with a generator's draw.

    Returns:
        :class:`StepOutput`; gradients flow from ``log_prob`` and ``mean`` into ``velocity``.
    """
    _check_kernel(kernel)
    x = sample.float()
    v = velocity.float()
    batch = x.shape[0]
    sigma = _per_sample(sigma, batch, x.device)
    sigma_next = _per_sample(sigma_next, batch, x.device)
    _validate(sigma, sigma_next, kernel)
    std, a, b = _coefficients(sigma, sigma_next, kernel, noise_level)
    mean = _bcast(a, x) * x + _bcast(b, x) * v

    if prev_sample is None:
        if noise is None:
            noise = randn(x.shape, generator, x.device)
        elif generator is not None:
            raise ValueError("pass the noise or a generator to draw it from, not both")
        elif noise.shape != x.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != sample shape {tuple(x.shape)}")
        else:
            noise = noise.to(device=x.device, dtype=torch.float32)
        prev_sample = mean.detach() + _bcast(std, x) * noise
    else:
        if prev_sample.shape != x.shape:
            raise ValueError(f"prev_sample shape {tuple(prev_sample.shape)} != sample shape {tuple(x.shape)}")
        prev_sample = prev_sample.float()

    dims = x[0].numel()
    sq = (prev_sample.detach() - mean).flatten(1).pow(2).sum(1)
    log_prob = -sq / (2 * std**2) - dims * torch.log(std) - dims * _LOG_SQRT_2PI
    return StepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)


def ode_step(velocity: torch.Tensor, sample: torch.Tensor, sigma: SigmaLike, sigma_next: SigmaLike) -> StepOutput:
    """One Euler step ``x' = x − Δ·v`` (float32). ``std`` is zero and ``log_prob`` is ``None``."""
    x = sample.float()
    batch = x.shape[0]
    sigma = _per_sample(sigma, batch, x.device)
    sigma_next = _per_sample(sigma_next, batch, x.device)
    prev = x - _bcast(sigma - sigma_next, x) * velocity.float()
    return StepOutput(prev_sample=prev, log_prob=None, mean=prev, std=torch.zeros_like(sigma))
