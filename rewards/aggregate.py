"""Multi-reward aggregation over the per-component rewards of GRPO groups.

Four ways to turn the components ``{name: [N]}`` of a batch (rows ``p·G … p·G+G−1`` form group ``p``) into one
training signal, usable without a trainer:

* :func:`weighted_sum` — one scalar reward ``Σ_k w_k·r_k`` (Flow-GRPO's ``multi_score``); normalise it afterwards
  like any reward.
* :func:`per_reward_group_advantages` — one group advantage per component, combined with normalised weights
  ``ŵ_k = w_k/Σ_j w_j`` and clipped once (DanceGRPO, arXiv 2505.07818; MixGRPO, arXiv 2507.21802,
  ``multi_reward_mix=advantage_aggr``). Same numbers as ``flowgrpo.advantages.weighted_advantages`` (population
  std, ``+1e-4``, zero-spread groups exactly 0), which may delegate here; this module never imports ``flowgrpo``.
* :class:`TaRoS` — the paper's Target-Robust Reward Signaling (arXiv 2511.19356 v4, Sec. 4, eqs. 3–9): per group,
  softmax weights over the ordered components from their mean against a threshold and their Hoyer sparsity, the
  weighted raw scores then standardised within the group. It ignores the user's weights (see the class).
* :class:`SaturationWeighted` — **this project's own** aggregator, not the paper's: saturation-aware per-component
  normalisation against a running spread, intra-group soft-thresholding and a headroom gate. It was written before
  the TaRoS paper could be read, and the published comparisons labelled "TaRoS" up to now measured it.
* :func:`hoyer_sparsity` — the Hoyer sparsity index of each group's raw scores (TaRoS's saturation measure; also
  logged for every multi-reward run).

>>> import torch
>>> R = {"a": torch.tensor([0.0, 1.0, 2.0, 2.0]), "b": torch.tensor([1.0, 0.0, 5.0, 5.0])}
>>> weighted_sum(R, {"a": 1.0, "b": 0.5})
tensor([0.5000, 1.0000, 4.5000, 4.5000])
>>> per_reward_group_advantages(R, {"a": 1.0, "b": 1.0}, group_size=2, eps=0.0)
tensor([0., 0., 0., 0.])
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

__all__ = ["weighted_sum", "per_reward_group_advantages", "hoyer_sparsity", "TaRoS", "SaturationWeighted"]


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


def hoyer_sparsity(scores: torch.Tensor) -> torch.Tensor:
    """Hoyer sparsity ``S_H(r) = (√G − ‖r‖₁/‖r‖₂)/(√G − 1) ∈ [0, 1]`` over the last dimension (TaRoS's saturation
    measure, arXiv 2511.19356 v4, Sec. 4), float64 ``[...]`` for raw scores ``[..., G]``.

    Computed on the **raw** scores (not centred): a group whose scores are all equal — or all close, "compressed" —
    reads ≈ 0, one whose mass sits on few members reads towards 1. Defined as 0 for an all-zero vector and for
    ``G = 1`` (where ``√G − 1 = 0``): no spread to measure. The index depends on the scores' offset (scores far
    from 0 read as compressed), as the paper defines it.

    >>> hoyer_sparsity(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))
    tensor([1., 0., 0.], dtype=torch.float64)
    """
    r = torch.as_tensor(scores).detach().to("cpu", torch.float64)
    g = r.shape[-1]
    if g < 2:
        return torch.zeros(r.shape[:-1], dtype=torch.float64)
    a = r.abs()
    l1, l2 = a.sum(dim=-1), a.pow(2).sum(dim=-1).sqrt()
    root = math.sqrt(g)
    s = (root - l1 / l2.clamp_min(1e-300)) / (root - 1)
    # exactly 0 where every |r_i| is the same (a constant group, the all-zero vector), not a rounding error of it
    flat = a.amax(dim=-1) == a.amin(dim=-1)
    return torch.where(flat, torch.zeros_like(s), s.clamp(0.0, 1.0))


def _matrix(rewards, names: list[str], who: str, missing_means: str) -> torch.Tensor:
    """``rewards`` (``{name: [N]}`` or an ``[N, K]`` tensor in ``names`` order) as a float64 ``[N, K]`` matrix, each
    column checked (:func:`_column`); an error names the aggregator ``who`` and what is missing."""
    if isinstance(rewards, Mapping):
        missing = sorted(set(names) - set(rewards))
        if missing:
            raise KeyError(f"{who}: components {missing} {missing_means}; scored: {sorted(rewards)}")
        return torch.stack([_column(rewards[n], n) for n in names], dim=1)
    r = torch.as_tensor(rewards).detach().to("cpu", torch.float64)
    if r.ndim != 2 or r.shape[1] != len(names):
        raise ValueError(f"{who}: rewards must be [N, K={len(names)}] (columns {names}), got {tuple(r.shape)}")
    for k, n in enumerate(names):
        _column(r[:, k], n)
    return r


class TaRoS:
    """TaRoS, Target-Robust Reward Signaling (arXiv 2511.19356 v4, Sec. 4, eqs. 3–9), as the paper defines it
    (``reward.aggregate.name=taros``).

    For each prompt group of ``G`` samples and the ``K`` components in their priority order ``j = 1 … K`` (the paper:
    visual quality → motion quality → text alignment; here the ``components`` order), with raw scores
    ``r_j = (r_j^1 … r_j^G)``:

    1. the Hoyer sparsity of the raw scores, ``S_H(r_j)`` (:func:`hoyer_sparsity`; low: the group's scores are
       compressed, "saturated"), per group and without history;
    2. the utility ``g_j = h(r̄_j − τ_j) + β·[S_H(r_j) − S_H(r_{j+1})]``, ``h`` the logistic sigmoid, ``r̄_j`` the
       group's mean score, ``S_H(r_{K+1}) = 0``;
    3. the weights ``w = softmax_j(g_j)``, per group; the aggregate ``r̃^i = Σ_j w_j r_j^i`` per sample;
    4. the advantage: ``r̃`` standardised within its group, the usual GRPO group advantage (population std, ``eps``
       added, a group with no spread exactly 0, clipped to ±``clip``; ``global_std`` as the trainer's).

    **The user's weights are ignored**: the paper's weights are the softmax ones, recomputed per group, so the fixed
    weights of a composite reward (``reward.kwargs.components[*].weight``) do not enter the advantage — a run with
    TaRoS is its own uniform-weights control. (In the trainer a weight of 0 still means "logged, not trained on":
    such a component is not among ``components``.) Everything is computed on the raw scores, so their scale matters:
    the paper's scores lie in [0, 1], where ``h`` is nearly linear around ``τ`` and, with ``β ≤ 0.5``, the weights
    stay within roughly ±25% of uniform.

    ``τ_j``: a fixed value per component (``tau``; the paper: 0.75/0.75 on Wan-1.3B, 0.75/0.73 on 14B, 0.70/0.68 on
    HunyuanVideo), or "calibrated from the historical distribution of group-wise rewards" — here (our reading) the
    ``calibration_quantile`` quantile of the group means of the first ``calibration_iterations`` calls with
    ``update=True``, pooled; during those calls ``τ`` is that quantile over the calls so far (the current one
    included, so the first call has one), after them it is frozen. ``β`` (``beta``): the paper uses 0.1, 0.3, 0.5.

    Two places where the paper can be read two ways; the printed form is the default, the other an option:

    * **The sign of the performance term** (``performance_sign``). As printed (``+1``), ``h(r̄_j − τ_j)``: a
      component whose group mean is *above* its threshold gets *more* weight. The paper's text says the intent is to
      down-weight components that have saturated and move the emphasis on as quality rises; ``-1`` reads it so,
      ``h(τ_j − r̄_j)``: a component past its threshold gets less weight.
    * **How many thresholds** (``thresholds``). The equation prints ``τ_j`` for every component
      (``"per_component"``, the default: ``K`` thresholds). The experiments list ``K − 1`` values for ``K``
      components; ``"stage_gates"`` reads them as gates between consecutive stages (our formalisation): ``τ_j``,
      ``j < K``, is the gate that component ``j`` passes to open component ``j + 1``, so the performance term of
      component ``j ≥ 2`` is ``h(±(r̄_{j−1} − τ_{j−1}))`` and that of the first component the neutral ``h(0) = 1/2``;
      the last component has no threshold. With ``performance_sign=+1`` emphasis moves to the next component as the
      previous one passes its gate.

    Properties: one component gives exactly the plain group advantage (``w = 1``); a component constant within a
    group has ``S_H = 0`` and only shifts ``r̃`` there (no effect on the ranking; as the last component it changes
    nothing at all); the same scores under every component give the same advantage as one of them.

    Args:
        components: the component names in priority order (a mapping's keys are used, its values ignored). Also the
            column order of a tensor input.
        tau: ``{component: τ_j}`` fixed thresholds; components not named are calibrated. With ``"stage_gates"``
            the last component has none.
        beta: ``β`` (≥ 0) of the sparsity term.
        performance_sign: ``+1`` (printed) or ``-1`` (the stated intent), see above.
        thresholds: ``"per_component"`` (printed) or ``"stage_gates"``, see above.
        calibration_iterations: calls whose group means calibrate the unnamed ``τ_j`` (≥ 1).
        calibration_quantile: the quantile of those group means taken as ``τ_j`` (0 … 1; 0.5 the median).
        clip: clip the advantage to ±clip (``None``: no clip). eps: added to the group std.
        global_std: standardise by the batch's std of ``r̃`` instead of each group's (the mean stays per group).

    >>> t = TaRoS(["quality", "text"], tau={"quality": 0.7, "text": 0.7}, beta=0.3)
    >>> R = torch.tensor([[0.8, 0.2], [0.6, 0.9], [0.7, 0.5], [0.9, 0.4]])
    >>> t(R, group_size=4).shape
    torch.Size([4])
    """

    def __init__(
        self,
        components: Sequence[str] | Mapping[str, float],
        *,
        tau: Mapping[str, float] | None = None,
        beta: float = 0.3,
        performance_sign: int = 1,
        thresholds: str = "per_component",
        calibration_iterations: int = 5,
        calibration_quantile: float = 0.5,
        clip: float | None = 5.0,
        eps: float = 1e-4,
        global_std: bool = False,
    ):
        self.names = [str(n) for n in components]
        if not self.names or len(set(self.names)) != len(self.names):
            raise ValueError(f"TaRoS needs at least one component, each once; got {self.names}")
        if performance_sign not in (1, -1):
            raise ValueError(f"TaRoS: performance_sign must be 1 (as printed) or -1, got {performance_sign!r}")
        if thresholds not in ("per_component", "stage_gates"):
            raise ValueError(f"TaRoS: thresholds must be 'per_component' or 'stage_gates', got {thresholds!r}")
        if beta < 0 or eps < 0:
            raise ValueError(f"TaRoS: beta and eps must be >= 0, got beta={beta}, eps={eps}")
        if int(calibration_iterations) < 1 or not 0 <= calibration_quantile <= 1:
            raise ValueError(f"TaRoS: calibration_iterations must be >= 1 and calibration_quantile in [0, 1], got "
                             f"{calibration_iterations} and {calibration_quantile}")
        self.beta, self.performance_sign, self.thresholds = float(beta), int(performance_sign), thresholds
        self.calibration_iterations, self.calibration_quantile = int(calibration_iterations), float(calibration_quantile)
        self.clip, self.eps, self.global_std = clip, float(eps), bool(global_std)
        # the components that carry a threshold: all of them, or all but the last with stage gates
        self.gated = self.names if thresholds == "per_component" else self.names[:-1]
        self.tau_fixed: dict[str, float] = {}
        for name, value in (tau or {}).items():
            if name not in self.gated:
                why = ("the last component has no gate with thresholds='stage_gates'" if name in self.names
                       else f"it is not a component; components: {self.names}")
                raise KeyError(f"TaRoS: tau given for {name!r}, but {why}")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"TaRoS: tau of {name!r} must be finite, got {value}")
            self.tau_fixed[name] = value
        self.calibrated = [n for n in self.gated if n not in self.tau_fixed]
        self.history: torch.Tensor | None = None  # [calls·P, len(calibrated)] group means seen while calibrating
        self.tau_calibrated: torch.Tensor | None = None  # [len(calibrated)] float64, None before the first update
        self.num_updates = 0
        self._diagnostics: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ math

    def _matrix(self, rewards) -> torch.Tensor:
        return _matrix(rewards, self.names, "TaRoS", "were not scored")

    def _calibrate(self, means: torch.Tensor, update: bool) -> None:
        """Update the calibrated ``τ`` from this call's group means ``[P, K]`` while calibration lasts."""
        if not self.calibrated:
            return
        if update:
            if self.num_updates < self.calibration_iterations:
                cols = [self.names.index(n) for n in self.calibrated]
                seen = means[:, cols]
                self.history = seen.clone() if self.history is None else torch.cat([self.history, seen])
                self.tau_calibrated = torch.quantile(self.history, self.calibration_quantile, dim=0)
                if self.num_updates + 1 == self.calibration_iterations:
                    self.history = None  # frozen from here on: the means are no longer needed
        elif self.tau_calibrated is None:
            raise RuntimeError("TaRoS: update=False before any update: the calibrated thresholds τ are not set yet "
                               "(give every component a fixed tau, or call with update=True first)")

    def tau(self) -> dict[str, float]:
        """The thresholds in use, ``{component: τ_j}`` (fixed or calibrated; calibrated ones once set)."""
        out = dict(self.tau_fixed)
        if self.tau_calibrated is not None:
            out.update({n: float(v) for n, v in zip(self.calibrated, self.tau_calibrated)})
        return {n: out[n] for n in self.gated if n in out}

    def weights(self, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For grouped raw scores ``R [P, G, K]``: the weights ``w [P, K]``, utilities ``g [P, K]`` and Hoyer
        sparsities ``S_H [P, K]`` (eqs. 3–8), with the thresholds in use."""
        P, G, K = R.shape
        means = R.mean(dim=1)  # r̄_j per group, [P, K]
        hoyer = hoyer_sparsity(R.transpose(1, 2))  # [P, K]
        taus = self.tau()
        tau = torch.tensor([taus[n] for n in self.gated], dtype=torch.float64)
        s = self.performance_sign
        if self.thresholds == "per_component":
            perf = torch.sigmoid(s * (means - tau))
        else:  # stage gates: component j's term is the gate of component j − 1 (the first: h(0) = 1/2)
            perf = torch.cat([torch.full((P, 1), 0.5, dtype=torch.float64),
                              torch.sigmoid(s * (means[:, :-1] - tau))], dim=1)
        nxt = torch.cat([hoyer[:, 1:], torch.zeros(P, 1, dtype=torch.float64)], dim=1)  # S_H(r_{j+1}), S_H(r_{K+1}) = 0
        g = perf + self.beta * (hoyer - nxt)
        return torch.softmax(g, dim=1), g, hoyer

    def __call__(self, rewards, group_size: int | None = None, *, update: bool = True) -> torch.Tensor:
        """Advantages float32 ``[N]`` of ``rewards`` (``[N, K]`` tensor in ``components`` order, or
        ``{name: [N]}``). ``group_size=None`` treats all rows as one group. ``update=False`` leaves the threshold
        calibration unchanged (evaluation)."""
        R = _grouped(self._matrix(rewards), group_size, "reward rows")  # [P, G, K]
        self._calibrate(R.mean(dim=1), update)
        w, g, hoyer = self.weights(R)
        aggregate = (R * w.unsqueeze(1)).sum(dim=2)  # r̃^i = Σ_j w_j r_j^i, [P, G]
        if update:
            self.num_updates += 1
        adv = per_reward_group_advantages({"taros": aggregate.flatten()}, {"taros": 1.0}, R.shape[1], clip=self.clip,
                                          eps=self.eps, global_std=self.global_std)
        taus = self.tau()
        diag = {}
        for k, n in enumerate(self.names):
            diag[f"{n}/weight"] = float(w[:, k].mean())  # the softmax weight, mean over groups
            diag[f"{n}/utility"] = float(g[:, k].mean())  # g_j, mean over groups
            diag[f"{n}/hoyer"] = float(hoyer[:, k].mean())  # S_H of the raw scores, mean over groups
            if n in taus:
                diag[f"{n}/tau"] = taus[n]
        diag["calibrating"] = float(bool(self.calibrated) and self.num_updates < self.calibration_iterations)
        self._diagnostics = diag
        return adv

    # -------------------------------------------------------------------------------------------- logging

    def diagnostics(self) -> dict[str, float]:
        """Scalars of the last call: per component ``{name}/weight`` (softmax weight), ``{name}/utility`` (``g``) and
        ``{name}/hoyer`` (``S_H``), each the mean over groups, ``{name}/tau`` (its threshold; none for the last
        component with stage gates); ``calibrating`` (1 while calibrated thresholds still move). Empty before the
        first call."""
        return dict(self._diagnostics)

    # ---------------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """The calibration state (resume with :meth:`load_state_dict`); the knobs come from the config."""
        return {
            "method": "taros",
            "names": list(self.names),
            "calibrated": list(self.calibrated),
            "tau_calibrated": None if self.tau_calibrated is None else self.tau_calibrated.clone(),
            "history": None if self.history is None else self.history.clone(),
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("method") != "taros":
            raise ValueError("this TaRoS state was written by another aggregator (a state with a running spread "
                             "'sigma_ema' is saturation_weighted's, the aggregator named 'taros' before TaRoS followed "
                             "arXiv 2511.19356): resume it with reward.aggregate.name=saturation_weighted")
        if list(state["names"]) != self.names or list(state["calibrated"]) != self.calibrated:
            raise ValueError(f"TaRoS state is for components {list(state['names'])} (calibrating "
                             f"{list(state['calibrated'])}), this instance has {self.names} (calibrating {self.calibrated})")
        tau, hist = state["tau_calibrated"], state["history"]
        self.tau_calibrated = None if tau is None else torch.as_tensor(tau, dtype=torch.float64).clone()
        self.history = None if hist is None else torch.as_tensor(hist, dtype=torch.float64).clone()
        self.num_updates = int(state["num_updates"])

    def __repr__(self) -> str:
        return (f"TaRoS(components={self.names}, tau={self.tau_fixed}, beta={self.beta}, "
                f"performance_sign={self.performance_sign}, thresholds={self.thresholds!r}, "
                f"calibration_iterations={self.calibration_iterations}, "
                f"calibration_quantile={self.calibration_quantile}, clip={self.clip}, global_std={self.global_std})")


class SaturationWeighted:
    """Saturation-weighted multi-reward advantages — **this project's own formulation, not the TaRoS paper's**
    (``reward.aggregate.name=saturation_weighted``; the paper's method is :class:`TaRoS`). Written as a guess at
    arXiv 2511.19356v2 before the paper could be read; it shares the paper's aims (do not let a saturated component
    dominate, keep the ranking inside a group) but none of its equations. Kept under its own name because the
    published multi-reward comparisons labelled "TaRoS" were measured with it.

    For each group's rewards ``R ∈ ℝ^{G×K}``:

    1. per component ``μ_k``, ``σ_k`` over the group (population std); ``σ̄_k`` a running EMA over training of
       the batch-mean of ``σ_k``;
    2. saturation-aware normalisation ``ã_ik = (R_ik − μ_k)/(max(σ_k, τ·σ̄_k) + eps)`` — a component whose spread
       has collapsed relative to its history is *not* blown up to unit variance; optional headroom gate for
       bounded rewards: the component gets weight 0 in a group where ``(R_max − μ_k)/(R_max − R_min) < h_min``;
    3. intra-group sparsity ``ŝ_ik = sign(ã_ik)·max(|ã_ik| − κ, 0)``;
    4. ``A_i = Σ_k ω̂_k ŝ_ik``, clipped to ±``clip``.

    Our choices (all of it is ours):

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

    >>> sw = SaturationWeighted({"geneval": 1.0, "jpeg": 0.1}, tau=0.5, kappa=0.0)
    >>> R = torch.tensor([[0.0, -20.0], [1.0, -20.1], [0.0, -19.9], [1.0, -20.0]])
    >>> sw(R, group_size=4).shape
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
            raise ValueError(f"SaturationWeighted: tau, kappa and eps must be >= 0, got tau={tau}, kappa={kappa}, eps={eps}")
        if not 0 <= ema_decay < 1:
            raise ValueError(f"SaturationWeighted: ema_decay must be in [0, 1), got {ema_decay}")
        if renorm not in ("weights", "std"):
            raise ValueError(f"SaturationWeighted: renorm must be 'weights' or 'std', got {renorm!r}")
        self.tau, self.kappa, self.ema_decay, self.eps = float(tau), float(kappa), float(ema_decay), float(eps)
        self.headroom_min, self.renorm, self.clip = float(headroom_min), renorm, clip
        self.bounds: dict[str, tuple[float, float]] = {}
        for name, b in (bounds or {}).items():
            if name not in self.weights:
                raise KeyError(f"SaturationWeighted: bounds given for {name!r}, which has no weight; weighted: {self.names}")
            lo, hi = (float(v) for v in b)
            if not hi > lo:
                raise ValueError(f"SaturationWeighted: bounds of {name!r} must be (R_min, R_max) with R_max > R_min, got {tuple(b)}")
            self.bounds[name] = (lo, hi)
        self.sigma_ema: torch.Tensor | None = None  # [K] float64, None before the first update
        self.num_updates = 0
        self._diagnostics: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ math

    def _matrix(self, rewards) -> torch.Tensor:
        return _matrix(rewards, self.names, "SaturationWeighted", "have a weight but no scores")

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
            raise RuntimeError("SaturationWeighted: update=False before any update: the running spread σ̄ is not set yet")
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
            raise ValueError(f"SaturationWeighted state is for components {list(state['names'])}, this instance weights {self.names}")
        ema = state["sigma_ema"]
        self.sigma_ema = None if ema is None else torch.as_tensor(ema, dtype=torch.float64).clone()
        self.num_updates = int(state["num_updates"])

    def __repr__(self) -> str:
        return (f"SaturationWeighted(weights={self.weights}, tau={self.tau}, kappa={self.kappa}, ema_decay={self.ema_decay}, "
                f"bounds={self.bounds}, headroom_min={self.headroom_min}, renorm={self.renorm!r}, clip={self.clip})")
