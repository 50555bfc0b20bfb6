"""Multi-reward aggregation over the per-component rewards of GRPO groups.

Three ways to turn the components ``{name: [N]}`` of a batch (rows ``p·G … p·G+G−1`` form group ``p``) into one
training signal, usable without a trainer:

* :func:`weighted_sum` — one scalar reward ``Σ_k w_k·r_k`` (Flow-GRPO's ``multi_score``); normalise it afterwards
  like any reward.
* :func:`per_reward_group_advantages` — one group advantage per component, combined with normalised weights
  ``ŵ_k = w_k/Σ_j w_j`` and clipped once (DanceGRPO, arXiv 2505.07818; MixGRPO, arXiv 2507.21802,
  ``multi_reward_mix=advantage_aggr``). Same numbers as ``flowgrpo.advantages.weighted_advantages`` (population
  std, ``+1e-4``, zero-spread groups exactly 0), which may delegate here; this module never imports ``flowgrpo``.
* :class:`TaRoS` — saturation-aware per-component normalisation, intra-group sparsity and ranking-preserving
  aggregation, after arXiv 2511.19356v2. **[ours]**: the paper was not reachable; this is our own formulation
  of it, with the choices below marked as ours.

>>> import torch
>>> R = {"a": torch.tensor([0.0, 1.0, 2.0, 2.0]), "b": torch.tensor([1.0, 0.0, 5.0, 5.0])}
>>> weighted_sum(R, {"a": 1.0, "b": 0.5})
tensor([0.5000, 1.0000, 4.5000, 4.5000])
>>> per_reward_group_advantages(R, {"a": 1.0, "b": 1.0}, group_size=2, eps=0.0)
tensor([0., 0., 0., 0.])
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

__all__ = ["weighted_sum", "per_reward_group_advantages", "TaRoS"]


def _check_weights(weights: Mapping[str, float], components: Mapping[str, torch.Tensor] | None = None) -> dict[str, float]:
    if not weights:
        raise ValueError("multi-reward aggregation needs at least one weight")
    weights = {str(k): float(v) for k, v in weights.items()}
    if any(w < 0 for w in weights.values()) or not sum(weights.values()) > 0:
        raise ValueError(f"reward weights must be >= 0 with a positive sum, got {weights}")
    if components is not None:
        missing = sorted(set(weights) - set(components))
        if missing:
            raise KeyError(f"reward components {missing} have a weight but no scores; scored: {sorted(components)}")
    return weights


def _column(values, name: str) -> torch.Tensor:
    t = torch.as_tensor(values).detach()
    if t.ndim != 1:
        raise ValueError(f"reward component {name!r} must be 1-D [N], got shape {tuple(t.shape)}")
    t = t.to("cpu", torch.float64)
    if not torch.isfinite(t).all():
        bad = (~torch.isfinite(t)).nonzero().flatten().tolist()
        raise ValueError(f"reward component {name!r} is not finite at rows {bad[:8]}: a reward must raise rather "
                         "than return NaN/inf (only logged-only components, weight 0 or absent, may hold NaN)")
    return t


def _grouped(t: torch.Tensor, group_size: int | None, what: str) -> torch.Tensor:
    """``[N, ...]`` → ``[N/G, G, ...]``; ``group_size=None`` = one group."""
    n = t.shape[0]
    g = n if group_size is None else int(group_size)
    if g < 1 or n % g:
        raise ValueError(f"{n} {what} do not split into groups of group_size={group_size}")
    return t.reshape(n // g, g, *t.shape[1:])


def weighted_sum(components: Mapping[str, torch.Tensor], weights: Mapping[str, float]) -> torch.Tensor:
    """``Σ_k w_k·r_k`` over the weighted components (raw weights, as Flow-GRPO's multi-score), float32 ``[N]``.

    Components without a weight (logged-only ones) are ignored; a zero weight drops a component.
    """
    weights = _check_weights(weights, components)
    total = None
    for name, w in weights.items():
        if w == 0:
            continue
        term = _column(components[name], name) * w
        total = term if total is None else total + term
    return total.to(torch.float32)


def per_reward_group_advantages(
    components: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_size: int,
    *,
    clip: float | None = 5.0,
    eps: float = 1e-4,
    global_std: bool = False,
) -> torch.Tensor:
    """``clip(Σ_k ŵ_k·A_k, ±clip)``, ``A_k = (r_k − mean_group)/(std + eps)`` per component, ``ŵ_k = w_k/Σ_j w_j``.

    DanceGRPO / MixGRPO's ``advantage_aggr`` with the weights normalised, so adding a reward does not
    rescale the advantage. Stds are population stds (ddof 0), per group or, with ``global_std``, over all ``N``
    rewards of the component; a component whose group has no spread contributes exactly 0 there. Float32 ``[N]``.
    """
    weights = _check_weights(weights, components)
    total_w = sum(weights.values())
    adv = None
    for name, w in weights.items():
        if w == 0:
            continue
        r = _grouped(_column(components[name], name), group_size, f"rewards of {name!r}")
        centred = r - r.mean(dim=1, keepdim=True)
        std = r.flatten().std(correction=0) if global_std else r.std(dim=1, correction=0, keepdim=True)
        a = centred / (std + eps)
        flat = (r.amax(dim=1) == r.amin(dim=1)).unsqueeze(1)
        a = torch.where(flat, torch.zeros_like(a), a) * (w / total_w)
        adv = a if adv is None else adv + a
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.flatten().to(torch.float32)


class TaRoS:
    """TaRoS multi-reward advantages (after arXiv 2511.19356v2; **[ours]**, the paper was not reachable).

    For each group's rewards ``R ∈ ℝ^{G×K}``:

    1. per component ``μ_k``, ``σ_k`` over the group (population std); ``σ̄_k`` a running EMA over training of
       the batch-mean of ``σ_k``;
    2. saturation-aware normalisation ``ã_ik = (R_ik − μ_k)/(max(σ_k, τ·σ̄_k) + eps)`` — a component whose spread
       has collapsed relative to its history is *not* blown up to unit variance; optional headroom gate for
       bounded rewards: the component gets weight 0 in a group where ``(R_max − μ_k)/(R_max − R_min) < h_min``;
    3. intra-group sparsity ``ŝ_ik = sign(ã_ik)·max(|ã_ik| − κ, 0)``;
    4. ``A_i = Σ_k ω̂_k ŝ_ik``, clipped to ±``clip``.

    Our choices ([ours], kept when the paper is reachable only if it agrees):

    * **EMA order**: ``σ̄`` is updated with the current batch *before* it is used (so the first batch has a
      defined ``σ̄`` = its own mean spread), ``σ̄ ← β·σ̄ + (1−β)·mean_groups(σ_k)``; ``update=False`` scores
      without touching the state (evaluation).
    * **"Re-normalised within the group"** (``renorm``): ``"weights"`` (default) re-normalises the weights over the
      components that are live in that group, ``ω̂_k = ω_k·g_k/Σ_j ω_j·g_j`` (``g`` the headroom gate), so a gated
      component's weight mass moves to the others and the advantage keeps the unit-variance scale of GRPO for
      healthy components; it never rescales by the group's spread, which would undo step 2 for a group whose only
      spread is a saturated component. ``"std"`` is the literal alternative: ``A`` standardised within the group
      (population std) — it re-amplifies a lone saturated component up to unit variance; kept for comparison.
    * **Collapse**: a group where every ``ŝ`` is 0 (no spread beyond ``κ``, or every component gated) contributes
      exactly 0, as does a component with ``σ_k = 0`` in a group.
    * With ``κ = 0``, ``τ·σ̄ ≤ σ`` and one component, ``A`` equals the plain group advantage (``eps`` = 1e-4 as
      Flow-GRPO); ranking inside a group is preserved for any single component (every step is monotone).

    Args:
        weights: ``{component: ω_k}`` (≥ 0, positive sum; normalised internally). Its order is the column order
            of a tensor input.
        tau: ``τ``, floor of the spread as a fraction of its running mean (0 disables the saturation floor).
        kappa: ``κ``, soft threshold on ``|ã|`` (0 disables sparsity).
        ema_decay: ``β`` of the running mean ``σ̄``.
        bounds: ``{component: (R_min, R_max)}`` for the headroom gate (components not named are never gated).
        headroom_min: ``h_min`` of the gate.
        renorm: ``"weights"`` or ``"std"`` (see above).
        clip: clip ``A`` to ±clip (``None``: no clip). eps: added to every spread.

    >>> taros = TaRoS({"geneval": 1.0, "jpeg": 0.1}, tau=0.5, kappa=0.0)
    >>> R = torch.tensor([[0.0, -20.0], [1.0, -20.1], [0.0, -19.9], [1.0, -20.0]])
    >>> taros(R, group_size=4).shape
    torch.Size([4])
    """

    def __init__(
        self,
        weights: Mapping[str, float],
        *,
        tau: float = 0.5,
        kappa: float = 0.1,
        ema_decay: float = 0.9,
        bounds: Mapping[str, Sequence[float]] | None = None,
        headroom_min: float = 0.05,
        renorm: str = "weights",
        clip: float | None = 5.0,
        eps: float = 1e-4,
    ):
        self.weights = _check_weights(weights)
        self.names = list(self.weights)
        if tau < 0 or kappa < 0 or eps < 0:
            raise ValueError(f"TaRoS: tau, kappa and eps must be >= 0, got tau={tau}, kappa={kappa}, eps={eps}")
        if not 0 <= ema_decay < 1:
            raise ValueError(f"TaRoS: ema_decay must be in [0, 1), got {ema_decay}")
        if renorm not in ("weights", "std"):
            raise ValueError(f"TaRoS: renorm must be 'weights' or 'std', got {renorm!r}")
        self.tau, self.kappa, self.ema_decay, self.eps = float(tau), float(kappa), float(ema_decay), float(eps)
        self.headroom_min, self.renorm, self.clip = float(headroom_min), renorm, clip
        self.bounds: dict[str, tuple[float, float]] = {}
        for name, b in (bounds or {}).items():
            if name not in self.weights:
                raise KeyError(f"TaRoS: bounds given for {name!r}, which has no weight; weighted: {self.names}")
            lo, hi = (float(v) for v in b)
            if not hi > lo:
                raise ValueError(f"TaRoS: bounds of {name!r} must be (R_min, R_max) with R_max > R_min, got {tuple(b)}")
            self.bounds[name] = (lo, hi)
        self.sigma_ema: torch.Tensor | None = None  # [K] float64, None before the first update
        self.num_updates = 0
        self._diagnostics: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ math

    def _matrix(self, rewards) -> torch.Tensor:
        if isinstance(rewards, Mapping):
            missing = sorted(set(self.names) - set(rewards))
            if missing:
                raise KeyError(f"TaRoS: components {missing} have a weight but no scores; scored: {sorted(rewards)}")
            return torch.stack([_column(rewards[n], n) for n in self.names], dim=1)
        r = torch.as_tensor(rewards).detach().to("cpu", torch.float64)
        if r.ndim != 2 or r.shape[1] != len(self.names):
            raise ValueError(f"TaRoS: rewards must be [N, K={len(self.names)}] (columns {self.names}), got {tuple(r.shape)}")
        for k, n in enumerate(self.names):
            _column(r[:, k], n)
        return r

    def __call__(self, rewards, group_size: int | None = None, *, update: bool = True) -> torch.Tensor:
        """Advantages float32 ``[N]`` of ``rewards`` (``[N, K]`` tensor in ``weights`` order, or ``{name: [N]}``).

        ``group_size=None`` treats all rows as one group (``[G, K]``). ``update=False`` leaves ``σ̄`` unchanged
        (it must have been set by an earlier update then).
        """
        R = _grouped(self._matrix(rewards), group_size, "reward rows")  # [P, G, K]
        mu = R.mean(dim=1, keepdim=True)
        sigma = R.std(dim=1, correction=0, keepdim=True)  # [P, 1, K]
        batch_sigma = sigma.mean(dim=(0, 1))  # [K]
        if update:
            if self.sigma_ema is None:
                self.sigma_ema = batch_sigma.clone()
            else:
                self.sigma_ema = self.ema_decay * self.sigma_ema + (1 - self.ema_decay) * batch_sigma
            self.num_updates += 1
        elif self.sigma_ema is None:
            raise RuntimeError("TaRoS: update=False before any update: the running spread σ̄ is not set yet")
        sigma_bar = self.sigma_ema.view(1, 1, -1)

        a = (R - mu) / (torch.maximum(sigma, self.tau * sigma_bar) + self.eps)
        a = torch.where(sigma == 0, torch.zeros_like(a), a)
        s = a.sign() * (a.abs() - self.kappa).clamp_min(0)

        w = torch.tensor([self.weights[n] for n in self.names], dtype=torch.float64).view(1, 1, -1)
        gate = torch.ones_like(mu)  # [P, 1, K]
        for k, n in enumerate(self.names):
            if n in self.bounds:
                lo, hi = self.bounds[n]
                gate[:, :, k] = ((hi - mu[:, :, k]) / (hi - lo) >= self.headroom_min).double()
        live = w * gate
        mass = live.sum(dim=2, keepdim=True)
        w_hat = torch.where(mass > 0, live / mass.clamp_min(1e-300), torch.zeros_like(live))
        contrib = w_hat * s  # [P, G, K]
        A = contrib.sum(dim=2)  # [P, G]
        if self.renorm == "std":
            std = A.std(dim=1, correction=0, keepdim=True)
            A = torch.where(std > 0, (A - A.mean(dim=1, keepdim=True)) / (std + self.eps), torch.zeros_like(A))
        if self.clip is not None:
            A = A.clamp(-self.clip, self.clip)
        self._record(R, sigma, s, gate, A)
        return A.flatten().to(torch.float32)

    # -------------------------------------------------------------------------------------------- logging

    def _record(self, R, sigma, s, gate, A) -> None:
        P, G, K = R.shape
        half = G // 2
        order = A.argsort(dim=1, descending=True, stable=True)  # members by aggregated advantage
        ranked_groups = (A != 0).any(dim=1)  # the gap is measured where the aggregate ranks anything
        diag = {}
        for k, n in enumerate(self.names):
            ratio = sigma[:, 0, k] / self.sigma_ema[k] if self.sigma_ema[k] > 0 else torch.zeros(P, dtype=torch.float64)
            zeroed = ((s[:, :, k] == 0) | (gate[:, :, k] == 0)).double().mean()
            gap = torch.tensor(0.0)
            if half and ranked_groups.any():
                ranked = R[:, :, k].gather(1, order)[ranked_groups]
                gap = (ranked[:, :half].mean(1) - ranked[:, G - half:].mean(1)).mean()
            diag[f"{n}/saturation"] = float(ratio.mean())  # σ_k / σ̄_k, mean over groups (≪ 1: saturating)
            diag[f"{n}/zeroed"] = float(zeroed)  # fraction of (member, group) entries with ŝ = 0 or gated
            diag[f"{n}/gap"] = float(gap)  # mean R_k of the top half minus the bottom half by A, groups with A ≠ 0
            diag[f"{n}/gated"] = float((gate[:, 0, k] == 0).double().mean())  # fraction of groups gated off
            diag[f"{n}/sigma_ema"] = float(self.sigma_ema[k])
        diag["zero_group_fraction"] = float((A == 0).all(dim=1).double().mean())  # groups contributing nothing
        self._diagnostics = diag

    def diagnostics(self) -> dict[str, float]:
        """Scalars of the last call, ``"{component}/{stat}"`` → float: ``saturation`` (σ_k/σ̄_k, mean over groups),
        ``zeroed`` (fraction of entries with ŝ = 0 or gated), ``gap`` (top-vs-bottom half separation of the
        component under the aggregated ranking, in reward units, over the groups where ``A`` is not all 0),
        ``gated`` (fraction of groups gated off), ``sigma_ema`` (σ̄_k); and
        ``zero_group_fraction``. Empty before the first call."""
        return dict(self._diagnostics)

    # ---------------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """The running state (resume with :meth:`load_state_dict`); the knobs come from the config."""
        return {
            "names": list(self.names),
            "sigma_ema": None if self.sigma_ema is None else self.sigma_ema.clone(),
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: Mapping) -> None:
        if list(state["names"]) != self.names:
            raise ValueError(f"TaRoS state is for components {list(state['names'])}, this instance weights {self.names}")
        ema = state["sigma_ema"]
        self.sigma_ema = None if ema is None else torch.as_tensor(ema, dtype=torch.float64).clone()
        self.num_updates = int(state["num_updates"])

    def __repr__(self) -> str:
        return (f"TaRoS(weights={self.weights}, tau={self.tau}, kappa={self.kappa}, ema_decay={self.ema_decay}, "
                f"bounds={self.bounds}, headroom_min={self.headroom_min}, renorm={self.renorm!r}, clip={self.clip})")
