"""The GRPO policy loss on per-step log-probabilities (phase 5 of ``flowgrpo.trainer``).

``ρ = exp(log π_θ − log π_old)`` per trained transition; ``L = mean(w · max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε)))``.
This is the PPO-clip surrogate of Flow-GRPO (arXiv 2505.05470) / DanceGRPO (arXiv 2505.07818) / MixGRPO
(arXiv 2507.21802), with per-transition weights ``w`` for Flash-GRPO's temporal gradient rectification
(arXiv 2605.15980). The KL term (``samplers.sde_kl``) is added as ``β·KL`` by ``policy_gradient.PolicyGradient``.

Log-prob reduction — why the published clip ranges are 1e-4…1e-5
-----------------------------------------------------------------
``samplers.sde_step`` returns the exact log-density **summed** over the ``D`` latent elements of a sample.
The published trainers instead take the **mean** over elements (Flow-GRPO's ``sd3_sde_with_logprob.py``:
``log_prob.mean(dim=tuple(range(1, ndim)))``), i.e. ``sum / D`` (constants included; they cancel in the
ratio). Then

* ``log ρ_mean = log ρ_sum / D``: the same policy change moves the mean-ratio ``D`` times less
  (``D = 16·64·64 = 65 536`` for SD3 at 512 px). A clip range ``ε`` on the mean ratio is a window of about
  ``±ε·D`` on the log of the exact ratio: Flow-GRPO's ``1e-4`` at 512 px ≈ ±6.5 — which is why their
  ``ε`` is 1e-4…1e-5 and not PPO's usual 0.2, and why it must be re-tuned when ``algo.logprob_reduction`` or
  the latent size changes (with "sum", an ``ε`` near PPO's 0.1–0.2 is the comparable choice).
* The policy gradient shrinks by the same ``1/D`` (near ρ = 1, ``∇ρ_mean = ∇log π_sum / D``). Adam mostly
  absorbs a global scale, but not relative ones: gradient clipping (``trainer.max_grad_norm``) and the balance
  with ``β·KL`` — Flow-GRPO's KL is a per-element mean too, so a summed KL (``samplers.sde_kl``) next to a
  "mean" policy loss needs ``β`` divided by ``D`` to match them.
* ``approx_kl`` and ``clip_fraction`` are reported on whichever scale is chosen.

"sum" is the exact likelihood ratio (PPO as written); "mean" reproduces the published hyper-parameters.
"""

from __future__ import annotations

import torch

__all__ = ["ppo_clip_loss", "reduce_log_prob", "sq_mean", "keyed_noise", "renoise", "REDUCTIONS"]

REDUCTIONS = ("sum", "mean")


def reduce_log_prob(log_prob_sum: torch.Tensor, numel: int, reduction: str) -> torch.Tensor:
    """Turn ``sde_step``'s summed log-density into the scale the PPO ratio uses (``algo.logprob_reduction``).

    Args:
        log_prob_sum: ``[B]`` log π summed over each sample's ``numel`` latent elements.
        numel: ``D``, latent elements per sample (``latents[0].numel()``).
        reduction: ``"sum"`` — unchanged, the exact density; ``"mean"`` — ``log_prob_sum / D``, the published
            trainers' per-element mean. See the module docstring for what this does to ``algo.clip_range``.

    Apply the same reduction to the rollout's ``log π_old`` and to the training-time ``log π_θ``.
    """
    if reduction == "sum":
        return log_prob_sum
    if reduction == "mean":
        if numel < 1:
            raise ValueError(f"numel must be >= 1, got {numel}")
        return log_prob_sum / numel
    raise ValueError(f"algo.logprob_reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")


def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    weights: torch.Tensor | None = None,
    detach_advantages: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip surrogate over a batch of trained transitions.

    Args:
        log_prob: ``[B]`` log π_θ of the stored transitions under the current model (carries the gradient).
        old_log_prob: ``[B]`` log π_old recorded at rollout (same reduction; no gradient).
        advantages: ``[B]`` each transition's trajectory advantage (already clipped by phase 4).
        clip_range: ``ε`` (``algo.clip_range``).
        weights: optional ``[B]`` per-transition loss weights (Flash-GRPO's rectification); ``None`` = 1.
        detach_advantages: ``False`` lets the gradient flow through ``advantages`` too (an advantage computed from
            the policy itself, e.g. Flow-OPD's KL reward with ``algo.detach_kl=false``).

    Returns:
        ``(loss, stats)``: ``loss = mean(w · max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε)))`` (0-d, float32) and detached 0-d
        tensors (no host sync; ``.item()`` them when logging): ``policy_loss`` (= loss), ``clip_fraction``
        (``|ρ−1| > ε``, Flow-GRPO's ``clipfrac``), ``clip_fraction_high`` / ``clip_fraction_low``
        (``ρ−1 > ε`` / ``1−ρ > ε``), ``approx_kl`` (``0.5·mean((log π_θ − log π_old)²)``, Flow-GRPO's),
        ``ratio_mean``, ``ratio_min``, ``ratio_max``.

    With ``log_prob == old_log_prob`` (unchanged weights, first inner epoch) ``ρ = 1`` and the loss is
    ``−mean(w·A)``; its gradient is ``−mean(w·A·∇log π_θ)``, the policy gradient.
    """
    if clip_range <= 0:
        raise ValueError(f"algo.clip_range must be > 0, got {clip_range}")
    shape = log_prob.shape
    if old_log_prob.shape != shape or advantages.shape != shape:
        raise ValueError(f"log_prob {tuple(shape)}, old_log_prob {tuple(old_log_prob.shape)} and advantages "
                         f"{tuple(advantages.shape)} must have the same shape")
    log_ratio = log_prob.float() - old_log_prob.detach().float()
    ratio = torch.exp(log_ratio)
    adv = (advantages.detach() if detach_advantages else advantages).float()
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_item = torch.maximum(unclipped, clipped)
    if weights is not None:
        if weights.shape != shape:
            raise ValueError(f"weights {tuple(weights.shape)} must have the shape of log_prob {tuple(shape)}")
        per_item = weights.detach().float() * per_item
    loss = per_item.mean()
    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "policy_loss": loss.detach(),
            "clip_fraction": ((r - 1.0).abs() > clip_range).float().mean(),
            "clip_fraction_high": (r - 1.0 > clip_range).float().mean(),
            "clip_fraction_low": (1.0 - r > clip_range).float().mean(),
            "approx_kl": 0.5 * log_ratio.detach().pow(2).mean(),
            "ratio_mean": r.mean(),
            "ratio_min": r.min(),
            "ratio_max": r.max(),
        }
    return loss, stats


def sq_mean(x: torch.Tensor) -> torch.Tensor:
    """Per-sample mean of ``x²`` over the non-batch dims, in float32 (the flow-matching and velocity-regression terms
    of the likelihood-free algorithms)."""
    return x.float().pow(2).mean(dim=tuple(range(1, x.ndim)))


def add_velocity_kl(loss: torch.Tensor, info: dict, v: torch.Tensor, v_ref: torch.Tensor, beta: float,
                    key: str = "kl") -> torch.Tensor:
    """``loss + β·mean‖v − v_ref‖²``, the mean over samples of :func:`sq_mean`, with that mean logged (detached) as
    ``info[key]``: the likelihood-free algorithms' regression of the trained velocity ``v`` to another policy's
    ``v_ref`` at the same noisy input (the reference policy, ``algo.kl_beta``; AWM's slow EMA copy, ``ema_kl``).
    For two Gaussian transitions whose means differ by ``Δt·(v − v_ref)`` the KL is this up to a σ-dependent
    factor, hence the name the papers give it."""
    kl = sq_mean(v - v_ref).mean()
    info[key] = kl.detach()
    return loss + beta * kl


def keyed_noise(like: torch.Tensor, generators) -> torch.Tensor:
    """One standard normal draw of ``like``'s per-sample shape from each generator, stacked on ``like``'s device.
    With generators keyed by global rows or groups (``UpdateContext.generator``) the draws are the same on any
    number of processes and after a resume."""
    return torch.stack([torch.randn(like.shape[1:], generator=g) for g in generators]).to(like.device)


def renoise(x0: torch.Tensor, sigma: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flow-matching interpolant ``x_σ = (1 − σ) x₀ + σ ε`` per row (``sigma``: ``[B]``), and ``σ`` shaped to
    broadcast over ``x₀``: how the likelihood-free algorithms (DiffusionNFT, AWM, DGPO) noise clean samples again."""
    s = sigma.view(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * eps, s
