r"""KVPO's objective on the branch simplex: TVE scores, the branch policy, reference-relative advantages and the
clipped loss.

**TVE scores** (:func:`tve_scores`, "trajectory velocity energy"). Each branch's recorded inputs ``x_{k,j}`` and
clean predictions ``x̂₀_{k,j}`` (block ``k``, step ``j``) are replayed by the model being trained under the
unrouted context, giving ``x̂₀'_{k,j}``; the branch's score is

    ``s_g = Σ_k Σ_j −mean((x̂₀'_{k,j} − x̂₀_{k,j})²) / (2·max(σ_j, σ_floor)²)``

(mean over the elements of a block). Both predictions start from the same input (``x̂₀ = x − σ·v``), so the
squared error is ``σ²·‖Δv‖²``: an energy of the velocity change. ``σ_floor = 1`` (the official default) weights
every step ``1/2``, as Self-Forcing's noise levels are all ≤ 1. The replay itself is the caller's: the official
one covers every block of the fork chunk from the fork, keeps the gradient of the first 2 steps of each block
only, and between blocks writes its own last prediction (not the recorded block) into the cache.

**Branch policy** (:func:`branch_log_policy`): ``log π(g) = log_softmax_g(s_g)``; adding a constant to every score
changes nothing.

**Advantages** (:func:`reference_relative_advantages`, :func:`fuse_advantages`). Per reward component ``c``,
``A_c(g) = (r_c(g) − r_c(ref)) / (std([r_c(1), …, r_c(G), r_c(ref)]) + 1e-8)`` (unbiased std over ``G + 1``
values), then ``A = Σ_c w_c·A_c``. Such an advantage is computed for the *local* signal (rewards of the fork
segment, or of the fork's routed frames) and the *global* one (the whole stream); each is divided by its own std
over the branches (biased; left unchanged when that std is ≤ 1e-8), they are summed with weights 1.0 and 0.5 and
clamped to ±2.5. The sign stays relative to the reference branch: no mean is subtracted.

A floor on the std (``std_floor``, reward units; not in the official code) divides each component by
``max(std, floor)``; the signal is then divided by the std it has *without* the floor, so a group whose rewards
nearly tie (std below the floor) gets advantages ``std/floor`` times the official ones instead of unit-size ones,
and a group spread wider than the floor gets exactly the official ones.

**Loss** (:func:`kvpo_loss`). On the simplex, ``ρ_g = exp(clamp(log π_θ(g) − log π_old(g), −20, 20))`` (each
normalised by its logsumexp, so raw scores or log-policies may be passed);

    ``L = −mean_g min(ρ_g·A_g, clip(ρ_g, 1 − 0.1, 1 + 0.2)·A_g) + β·Σ_g π_θ(g)·(log π_θ(g) − log π_init(g))``

with ``β = 10`` and ``π_init`` the policy of the initial weights. When no branch beats the reference branch on
any signal, the loss is halved ("beats": a higher raw aggregate reward, local or global, as the official code
compares; the caller decides, :meth:`~flowgrpo.algorithms.kvpo.KVPO.advantages`). The official code ("mechanism_2") writes this as a softmax over the ``G``
log-policies plus one extra zero logit, scaling the loss by ``1 − π_extra``; since the ``G`` probabilities sum to
one, ``π_extra = 1/(1 + 1) = 1/2`` exactly, and the scale is 1 when some branch wins (the extra logit is −∞).
It is implemented as what it computes: a factor 1/2.
"""

from __future__ import annotations

from typing import Mapping

import torch

__all__ = ["tve_scores", "branch_log_policy", "reference_relative_advantage", "reference_relative_advantages",
           "fuse_advantages", "kvpo_loss"]


# ------------------------------------------------------------------------------------------- TVE and the policy


def tve_scores(x0_replay: torch.Tensor, x0_recorded: torch.Tensor, sigmas, sigma_floor: float = 1.0) -> torch.Tensor:
    """Each branch's TVE score, ``[G]``: ``Σ_k Σ_j −mean((x̂₀'_{g,k,j} − x̂₀_{g,k,j})²) / (2·max(σ_j, floor)²)``.

    Args:
        x0_replay: ``[G, K, S, ...]`` the clean predictions of the replay (block ``k``, step ``j``; the layout of
            ``ChunkedTrajectory.x0``); carries the gradient.
        x0_recorded: the same shape, what the branch recorded (no gradient).
        sigmas: ``[S]`` the noise level of each step (every block the same), or ``[K, S]``.
        sigma_floor: ``σ`` below it counts as ``sigma_floor`` (official default 1.0: every step weighs ``1/2``);
            0 gives the plain ``1/(2σ²)``.

    The mean runs over each block's elements (``...``). In the dtype of ``x0_replay`` (at least float32).
    """
    if x0_replay.shape != x0_recorded.shape or x0_replay.ndim < 3:
        raise ValueError(f"x0_replay {tuple(x0_replay.shape)} and x0_recorded {tuple(x0_recorded.shape)} must both "
                         "be [G, K, S, ...]")
    if sigma_floor < 0:
        raise ValueError(f"sigma_floor must be >= 0, got {sigma_floor}")
    dtype = torch.promote_types(x0_replay.dtype, torch.float32)
    g, k, s = x0_replay.shape[:3]
    sig = torch.as_tensor(sigmas, dtype=dtype, device=x0_replay.device)
    if sig.shape not in ((s,), (k, s)):
        raise ValueError(f"sigmas must be [S] = [{s}] or [K, S] = [{k}, {s}], got {tuple(sig.shape)}")
    eff = sig.clamp_min(sigma_floor) if sigma_floor > 0 else sig
    if torch.any(eff <= 0):
        raise ValueError("every step needs sigma > 0 when sigma_floor is 0")
    err = (x0_replay.to(dtype) - x0_recorded.detach().to(dtype)).square()
    mse = err.flatten(3).mean(-1) if err.ndim > 3 else err                       # [G, K, S]
    return -(mse / (2 * eff.square())).sum((1, 2))


def branch_log_policy(scores: torch.Tensor) -> torch.Tensor:
    """``log π(g) = log_softmax`` of the scores over the branches (the last dimension)."""
    return torch.log_softmax(scores, dim=-1)


# ------------------------------------------------------------------------------------------------- advantages


def reference_relative_advantage(rewards: torch.Tensor, reference: torch.Tensor | float, eps: float = 1e-8,
                                 std_floor: float = 0.0) -> torch.Tensor:
    """One component: ``(r_g − r_ref) / (max(std([r_1, …, r_G, r_ref]), std_floor) + eps)``, unbiased std, float64
    ``[G]``. A branch that scores exactly as the reference branch gets exactly 0. ``std_floor`` (reward units; 0: the
    official plain std) keeps a group whose rewards nearly tie from getting unit-size advantages."""
    r = torch.as_tensor(rewards).detach().to(torch.float64).cpu()
    if r.ndim != 1 or r.numel() < 1:
        raise ValueError(f"branch rewards must be a 1-D tensor [G], got shape {tuple(r.shape)}")
    ref = torch.as_tensor(reference).detach().to(torch.float64).cpu()
    if ref.numel() != 1:
        raise ValueError(f"the reference reward must be a scalar, got shape {tuple(ref.shape)}")
    ref = ref.reshape(())
    if not (torch.isfinite(r).all() and torch.isfinite(ref)):
        raise ValueError("rewards must be finite")
    if std_floor < 0:
        raise ValueError(f"std_floor must be >= 0, got {std_floor}")
    spread = torch.cat([r, ref[None]]).std()
    if std_floor > 0:
        spread = spread.clamp_min(std_floor)
    return (r - ref) / (spread + eps)


def reference_relative_advantages(branch_rewards: Mapping[str, torch.Tensor],
                                  reference_rewards: Mapping[str, torch.Tensor | float],
                                  weights: Mapping[str, float] | None = None, *, eps: float = 1e-8,
                                  std_floor: float = 0.0) -> torch.Tensor:
    """``Σ_c w_c·(r_c(g) − r_c(ref)) / (max(std([r_c(1..G), r_c(ref)]), std_floor) + eps)``, float32 ``[G]``.

    Args:
        branch_rewards: ``{component: [G]}`` each branch's reward per component.
        reference_rewards: ``{component: scalar}`` the reference branch's.
        weights: ``{component: w_c}`` (default 1 each; the official code uses the raw weights, not normalised).
        std_floor: the least std a component divides by (:func:`reference_relative_advantage`; 0: official).
    """
    if not branch_rewards:
        raise ValueError("branch_rewards must hold at least one component")
    if set(reference_rewards) != set(branch_rewards):
        raise ValueError(f"reference_rewards has components {sorted(reference_rewards)}, branch_rewards "
                         f"{sorted(branch_rewards)}: they must match")
    weights = {c: 1.0 for c in branch_rewards} if weights is None else dict(weights)
    if set(weights) != set(branch_rewards):
        raise ValueError(f"weights has components {sorted(weights)}, branch_rewards {sorted(branch_rewards)}: "
                         "they must match")
    total = None
    for name, rewards in branch_rewards.items():
        adv = float(weights[name]) * reference_relative_advantage(rewards, reference_rewards[name], eps, std_floor)
        if total is not None and adv.shape != total.shape:
            raise ValueError(f"component {name!r} has {adv.numel()} branch rewards, another {total.numel()}")
        total = adv if total is None else total + adv
    return total.float()


def _std_normalised(adv: torch.Tensor) -> torch.Tensor:
    std = adv.std(unbiased=False)
    return adv if std <= 1e-8 else adv / (std + 1e-8)


def fuse_advantages(local: torch.Tensor | None, global_: torch.Tensor | None, *, w_local: float = 1.0,
                    w_global: float = 0.5, clip: float | None = 2.5, local_norm: torch.Tensor | None = None,
                    global_norm: torch.Tensor | None = None) -> torch.Tensor:
    """``clamp(w_local·A_local/std(A_local) + w_global·A_global/std(A_global), −clip, clip)``, float32 ``[G]``.

    Each signal is divided by its biased std over the branches (unchanged when that std is ≤ 1e-8), no mean is
    subtracted (the sign stays relative to the reference branch). Either signal may be ``None`` (not trained);
    ``clip=None`` does not clamp. ``local_norm`` / ``global_norm``: divide by the std of that signal instead (the
    same signal computed without a std floor, so a floored, nearly tied signal stays small: the official
    normalisation would scale it back to unit size).
    """
    if local is None and global_ is None:
        raise ValueError("fuse_advantages needs at least one of local and global_")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")
    parts = []
    for name, adv, weight, norm in (("local", local, w_local, local_norm), ("global_", global_, w_global, global_norm)):
        if adv is None:
            continue
        adv = torch.as_tensor(adv).detach().to(torch.float64)
        if adv.ndim != 1:
            raise ValueError(f"{name} must be a 1-D tensor [G], got shape {tuple(adv.shape)}")
        if norm is None:
            parts.append(float(weight) * _std_normalised(adv))
            continue
        norm = torch.as_tensor(norm).detach().to(torch.float64)
        if norm.shape != adv.shape:
            raise ValueError(f"{name}'s norm {tuple(norm.shape)} must have its shape {tuple(adv.shape)}")
        std = norm.std(unbiased=False)
        parts.append(float(weight) * (adv if std <= 1e-8 else adv / (std + 1e-8)))
    if len(parts) == 2 and parts[0].shape != parts[1].shape:
        raise ValueError(f"local {tuple(parts[0].shape)} and global_ {tuple(parts[1].shape)} must have one value per "
                         "branch each")
    fused = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    if clip is not None:
        fused = fused.clamp(-clip, clip)
    return fused.float()


# ------------------------------------------------------------------------------------------------------- loss


def kvpo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    logp_init: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.1,
    clip_high: float = 0.2,
    kl_coef: float = 10.0,
    any_branch_beats_reference: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KVPO's loss on the branch simplex (module docstring, "Loss").

    Args:
        logp_new: ``[G]`` the current model's scores or log-policy (carries the gradient).
        logp_old: ``[G]`` the rollout (old) policy's; logp_init: ``[G]`` the initial weights' (no gradient), or
            ``None`` with ``kl_coef = 0`` (no KL term: nothing to measure it against).
            All three are normalised on the simplex (``x − logsumexp(x)``), so raw TVE scores do.
        advantages: ``[G]`` (:func:`fuse_advantages`).
        clip_low, clip_high: the ratio is clipped to ``[1 − clip_low, 1 + clip_high]``.
        kl_coef: ``β`` of ``KL(π_θ‖π_init)``.
        any_branch_beats_reference: False halves the loss (the official protection).

    Returns:
        ``(loss, stats)``: ``loss = scale·(−mean min(ρA, clip(ρ)A) + β·KL)`` with ``scale`` 1 or 1/2, and detached
        0-d tensors: ``policy_loss`` and ``kl`` (unscaled; no ``kl`` without ``logp_init``), ``loss_scale``, ``protected`` (1.0 when halved),
        ``clip_fraction`` (share of branches whose ρ the clip moves by more than 1e-6, the official measure), ``ratio_mean`` / ``ratio_min`` /
        ``ratio_max``, ``entropy`` (of π_θ), ``pi_max``.
    """
    shape = logp_new.shape
    if logp_init is None and kl_coef > 0:
        raise ValueError(f"kl_coef={kl_coef} weighs the KL to the initial policy: pass logp_init")
    if logp_new.ndim != 1 or logp_new.numel() < 1 or any(
            t.shape != shape for t in (logp_old, advantages) + (() if logp_init is None else (logp_init,))):
        raise ValueError(f"logp_new {tuple(shape)}, logp_old {tuple(logp_old.shape)}, logp_init "
                         f"{None if logp_init is None else tuple(logp_init.shape)} and advantages "
                         f"{tuple(advantages.shape)} must all be [G]")
    if not 0 < clip_low < 1 or clip_high <= 0:
        raise ValueError(f"clip_low must be in (0, 1) and clip_high > 0, got {clip_low}, {clip_high}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    dtype = torch.promote_types(logp_new.dtype, torch.float32)
    log_pi = branch_log_policy(logp_new.to(dtype))
    log_pi_old = branch_log_policy(logp_old.detach().to(dtype))
    log_ratio = (log_pi - log_pi_old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(dtype)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    policy_loss = -torch.minimum(ratio * adv, clipped * adv).mean()
    pi = log_pi.exp()
    kl = None
    if logp_init is not None:
        kl = (pi * (log_pi - branch_log_policy(logp_init.detach().to(dtype)))).sum()
    scale = 1.0 if any_branch_beats_reference else 0.5
    loss = scale * (policy_loss + kl_coef * kl if kl is not None else policy_loss)
    with torch.no_grad():
        r = ratio.detach()
        stats = {"policy_loss": policy_loss.detach()}
        if kl is not None:  # measured against the initial policy, when there is one
            stats["kl"] = kl.detach()
        stats.update({
            "loss_scale": torch.tensor(scale),
            "protected": torch.tensor(0.0 if any_branch_beats_reference else 1.0),
            "clip_fraction": ((r - r.clamp(1.0 - clip_low, 1.0 + clip_high)).abs() > 1e-6).float().mean(),
            "ratio_mean": r.mean(),
            "ratio_min": r.min(),
            "ratio_max": r.max(),
            "entropy": -(pi * log_pi).sum().detach(),
            "pi_max": pi.max().detach(),
        })
    return loss, stats


