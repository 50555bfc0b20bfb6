"""Higher-order flow ODE solvers.

DPM-Solver++(2M) in the data (x₀) parametrisation, as MixGRPO-Flash (arXiv 2507.21802) uses after the SDE
window. For rectified flow ``α = 1−σ`` and ``λ = log(α/σ)``; the first-order update equals Euler exactly.
"""

from __future__ import annotations

import math

import torch

__all__ = ["dpm_solver_2m_step", "MIN_STEP_RATIO"]

# Second order only when the step does not grow more than 1/MIN_STEP_RATIO times in λ over the previous
# one. FlowMatch grids end with a jump to σ_min = shift(1/1000) whose h dwarfs h_prev (r ≪ 1), where the D1
# extrapolation blows up whatever the number of steps; this generalises diffusers' lower_order_final.
MIN_STEP_RATIO = 0.5


def _lambda(sigma: float) -> float:
    """Half log-SNR ``log((1−σ)/σ)``; −inf at σ = 1, +inf at σ = 0."""
    if sigma >= 1.0:
        return -math.inf
    if sigma <= 0.0:
        return math.inf
    return math.log((1 - sigma) / sigma)


def dpm_solver_2m_step(
    sample: torch.Tensor,
    x0_pred: torch.Tensor,
    sigma: float,
    sigma_next: float,
    *,
    prev_x0_pred: torch.Tensor | None = None,
    prev_sigma: float | None = None,
) -> torch.Tensor:
    """One DPM-Solver++(2M) step ``σ → σ'`` from the current data prediction ``x̂₀`` (float32 math).

    ``x' = (σ'/σ)·x − α'·(e^{−h} − 1)·(D0 + ½·D1)``, ``h = λ' − λ``, ``D1 = (D0 − x̂₀_prev)/r``,
    ``r = h_prev/h``. Falls back to first order (``D1 = 0``) without a usable history — no previous
    prediction, a previous step from σ = 1 (λ = −∞), a step much longer than the last one in λ
    (``r < MIN_STEP_RATIO``, e.g. the jump to the scheduler's σ_min) — and on the final step to σ' = 0,
    where the update is ``x' = x̂₀`` (diffusers' ``lower_order_final``).
    """
    x = sample.float()
    d0 = x0_pred.float()
    if sigma_next <= 0.0:
        return d0.clone()
    lam, lam_next = _lambda(sigma), _lambda(sigma_next)
    alpha_next = 1.0 - sigma_next
    # e^{-h} = exp(λ − λ'); at σ = 1 (λ = −∞) it is 0 and the step is x' = σ'·x + α'·x̂₀.
    exp_neg_h = 0.0 if math.isinf(lam) else math.exp(lam - lam_next)
    d = d0
    if prev_x0_pred is not None and prev_sigma is not None and not math.isinf(lam):
        lam_prev = _lambda(prev_sigma)
        if not math.isinf(lam_prev):
            r = (lam - lam_prev) / (lam_next - lam)
            if r >= MIN_STEP_RATIO:
                d = d0 + 0.5 * (d0 - prev_x0_pred.float()) / r
    return (sigma_next / sigma) * x - alpha_next * (exp_neg_h - 1.0) * d
