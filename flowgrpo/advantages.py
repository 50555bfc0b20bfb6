"""Group-relative advantages (phase 4 of ``flowgrpo.trainer``), shared by every GRPO-style algorithm.

``A_i = clip((r_i − mean_group)/(std + eps), −clip, clip)``, where the rows
``p·G … p·G+G−1`` of a batch form group ``p`` (the trainer lays rollouts out so) and ``std`` is the group's
or, with ``global_std``, the whole batch's (Flash-GRPO, arXiv 2605.15980; Flow-GRPO's ``global_std``).

Reference choices, read in the published trainers' code:

* **std is the population std (ddof 0).** Flow-GRPO (arXiv 2505.05470, ``flow_grpo/stat_tracking.py``,
  ``PerPromptStatTracker.update``) uses ``np.std`` — ddof 0 — plus ``1e-4``, per prompt or, with
  ``global_std``, ``np.std`` of every reward of the gathered batch; the mean stays per prompt either way. We do
  the same, in float64 as it does. (DanceGRPO / MixGRPO use ``torch.std`` — ddof 1 — plus ``1e-8``: their
  advantages are √((G−1)/G) times ours, 0.935× at G=8, which the PPO clip and the learning rate absorb.)
* Flow-GRPO groups by prompt *text* (two groups drawn for the same prompt merge); we group by rows, which is
  what "group" means in our plan (phase 1 may draw the same prompt twice; they stay separate groups).
* **Zero-spread groups give exactly 0** (not a rounding error of their mean divided by 1e-4), so ``A == 0``
  reliably marks samples that carry no signal (Flow-GRPO drops all-zero-advantage samples before training).
* Multi-reward (DanceGRPO / MixGRPO, arXiv 2507.21802, ``multi_reward_mix=advantage_aggr``): one group
  advantage per reward component, summed with weights, clipped once at the end (their code clips in the
  training step, after aggregation). MixGRPO uses raw weights (all 1.0); we normalise them to sum to 1
  so adding a reward does not scale the advantage and with it the effective learning rate.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["group_advantages", "slas_advantages", "weighted_advantages", "advantage_stats", "component_group_stats",
           "RewardAggregator"]


def _groups(values: torch.Tensor, group_size: int, name: str = "rewards") -> torch.Tensor:
    """``[N]`` → float64 ``[N/G, G]`` (the caller's rows p·G … p·G+G−1 form group p)."""
    values = torch.as_tensor(values)
    if values.ndim != 1:
        raise ValueError(f"{name} must be a 1-D tensor [N], got shape {tuple(values.shape)}")
    if group_size < 1 or values.shape[0] % group_size:
        raise ValueError(f"{values.shape[0]} {name} do not split into groups of trainer.group_size={group_size}")
    return values.detach().to(torch.float64).view(-1, group_size)


def _check_finite(r: torch.Tensor) -> None:
    if not torch.isfinite(r).all():
        bad = (~torch.isfinite(r)).flatten().nonzero().flatten().tolist()
        raise ValueError(f"non-finite rewards at rows {bad[:8]}{' ...' if len(bad) > 8 else ''}: a reward must "
                         "raise rather than return NaN/inf (it would poison every advantage of the batch)")


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    global_std: bool = False,
    clip: float | None = 5.0,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Group-normalised advantages ``clip((r − mean_group)/(std + eps), −clip, clip)``, float32 ``[N]``.

    Args:
        rewards: ``[N]`` scalar rewards of the whole (global) batch, groups consecutive.
        group_size: ``G``; ``N`` must be a multiple of it.
        global_std: divide by the std of all ``N`` rewards instead of each group's (mean stays per group).
        clip: clip to ``[−clip, clip]``; ``None`` = no clipping.
        eps: added to the std (Flow-GRPO: 1e-4).

    Both stds are population stds (ddof 0, ``np.std``) as in Flow-GRPO. Groups whose rewards are all equal get
    exactly 0. Non-finite rewards raise.

    >>> group_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), 2, eps=0.0)
    tensor([-1.,  1.,  0.,  0.])
    """
    r = _groups(rewards, group_size)
    _check_finite(r)
    from rewards.aggregate import per_reward_group_advantages  # the one group normaliser (usable standalone)

    return per_reward_group_advantages({"reward": r.flatten()}, {"reward": 1.0}, group_size, clip=clip, eps=eps,
                                       global_std=global_std)


def slas_advantages(rewards: torch.Tensor, group_size: int, *, gamma: float, clip: float | None = 5.0) -> torch.Tensor:
    """Super-linear advantage shaping (SLAS, arXiv 2605.10937), float32 ``[N]``.

    ``Δr_i = r_i − mean_group`` (no per-group std: dividing by it calls a 0.01 spread as large as a 0.5 one),
    ``u = Δr / std_batch(Δr)``, ``Ã = sign(u)·|u|^{1+γ}``, then ``Ã / rms_batch(Ã)`` and the clip.

    A deviation under one batch standard deviation is shrunk relative to a larger one — two samples keep
    ``|Ã₁/Ã₂| = |Δr₁/Δr₂|^{1+γ}`` — so near-ties stop pulling the update as hard as real wins. Shaping is odd and
    monotone: the order inside a group is unchanged. The paper's normalisation is "batch-level" without saying
    where it sits; we normalise before the power (so "small" means small against this batch, whatever the reward's
    scale) and rescale to unit RMS after it (so γ changes the direction of the update, not its size). ``γ = 0`` is
    plain mean-centring with the batch std. Groups with no spread get exactly 0.

    >>> slas_advantages(torch.tensor([0.0, 2.0, 1.0, 1.0]), 2, gamma=1.0)
    tensor([-1.4142,  1.4142,  0.0000,  0.0000])
    """
    if gamma < 0:
        raise ValueError(f"SLAS needs gamma >= 0 (algo.slas_gamma), got {gamma}")
    r = _groups(rewards, group_size)
    _check_finite(r)
    centred = r - r.mean(dim=1, keepdim=True)
    centred = torch.where((r.amax(dim=1) == r.amin(dim=1)).unsqueeze(1), torch.zeros_like(centred), centred)
    std = centred.flatten().std(correction=0)
    if std == 0:  # no group has any spread: no signal anywhere
        return torch.zeros(r.numel(), dtype=torch.float32)
    u = centred / std
    shaped = u.sign() * u.abs().pow(1.0 + gamma)
    adv = shaped / shaped.pow(2).mean().sqrt()
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.flatten().to(torch.float32)


def weighted_advantages(
    components: dict[str, torch.Tensor],
    weights: dict[str, float],
    group_size: int,
    *,
    clip: float | None = 5.0,
    **kw,
) -> torch.Tensor:
    """Multi-reward advantages: ``clip(Σ_k ŵ_k·A_k, ±clip)`` with ``A_k`` the unclipped group advantage of
    component ``k`` and ``ŵ_k = w_k / Σ_j w_j`` (DanceGRPO / MixGRPO ``advantage_aggr``, weights normalised).

    Args:
        components: ``{name: rewards [N]}``; every component named in ``weights`` must be present (extra
            components, e.g. logged-only ones, are ignored).
        weights: ``{name: w}``, non-negative with a positive sum; a zero weight drops the component.
        group_size, clip, **kw: as :func:`group_advantages` (``global_std``, ``eps``).
    """
    from rewards.aggregate import per_reward_group_advantages  # one implementation, usable without the trainer

    for name in weights:
        if name in components:
            group_advantages(components[name], group_size, clip=None, **kw)  # same input checks (finite, shape)
    return per_reward_group_advantages(components, weights, group_size, clip=clip, **kw)


def _group_spread(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For grouped values ``[P, G]``: the fraction of groups with no spread (constant: no learning signal) and the
    mean within-group population std."""
    return (r.amax(dim=1) == r.amin(dim=1)).double().mean(), r.std(dim=1, correction=0).mean()


def advantage_stats(advantages: torch.Tensor, rewards: torch.Tensor, group_size: int) -> dict[str, float]:
    """Scalars to log for phase 4 (python floats).

    ``zero_std_group_fraction`` (groups with no reward spread: no learning signal; Flow-GRPO's
    ``zero_std_ratio``), ``reward_group_std_mean`` (mean within-group population std; Flow-GRPO's
    ``reward_std_mean``), ``reward_mean`` / ``reward_std`` (batch), ``adv_mean`` / ``adv_std`` / ``adv_abs_max``,
    ``adv_abs_mean`` and ``adv_zero_fraction`` (samples with exactly zero advantage, i.e. not trained on).
    """
    r = _groups(rewards, group_size)
    a = _groups(advantages, group_size, "advantages").flatten()
    if a.numel() != r.numel():
        raise ValueError(f"{a.numel()} advantages for {r.numel()} rewards")
    zero_std, group_std = _group_spread(r)
    stats = {
        "zero_std_group_fraction": zero_std,
        "reward_group_std_mean": group_std,
        "reward_mean": r.mean(),
        "reward_std": r.flatten().std(correction=0),
        "adv_mean": a.mean(),
        "adv_std": a.std(correction=0),
        "adv_abs_mean": a.abs().mean(),
        "adv_abs_max": a.abs().max(),
        "adv_zero_fraction": (a == 0).double().mean(),
    }
    return {k: float(v) for k, v in stats.items()}


def component_group_stats(components: dict[str, torch.Tensor], names, group_size: int,
                          advantages: torch.Tensor | None = None) -> dict[str, float]:
    """Per-component spread within groups, whatever the aggregator (how saturated each reward term is):
    ``{name}/zero_std_group_fraction`` (groups where that component is constant: it ranks nobody there),
    ``{name}/group_std_mean`` (mean within-group population std) and ``{name}/hoyer`` (mean over groups of the Hoyer
    sparsity of its raw scores, TaRoS's saturation measure, arXiv 2511.19356: near 0 = compressed), for each of
    ``names``. With the final ``advantages`` ``[N]``: ``{name}/adv_corr``, the within-group Pearson correlation of
    the advantage with that component's own group advantage (equivalently its raw score), averaged over the groups
    where both vary (NaN when there is none) — how much of each term the update actually follows."""
    from rewards.aggregate import hoyer_sparsity

    out = {}
    adv = None if advantages is None else _groups(advantages, group_size, "advantages").cpu()
    for name in names:
        r = _groups(components[name], group_size, name).cpu()
        zero_std, group_std = _group_spread(r)
        out[f"{name}/zero_std_group_fraction"] = float(zero_std)
        out[f"{name}/group_std_mean"] = float(group_std)
        out[f"{name}/hoyer"] = float(hoyer_sparsity(r).mean())
        if adv is not None:
            out[f"{name}/adv_corr"] = _within_group_correlation(adv, r)
    return out


def _within_group_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over groups of the Pearson correlation of ``a`` and ``b`` (both ``[P, G]``), over the groups where
    both vary; NaN when none does."""
    if a.shape != b.shape:
        raise ValueError(f"{tuple(a.shape)} advantages for {tuple(b.shape)} rewards")
    live = (a.amax(dim=1) > a.amin(dim=1)) & (b.amax(dim=1) > b.amin(dim=1))
    a = a - a.mean(dim=1, keepdim=True)
    b = b - b.mean(dim=1, keepdim=True)
    na, nb = a.pow(2).sum(dim=1).sqrt(), b.pow(2).sum(dim=1).sqrt()
    if not live.any():
        return float("nan")
    corr = (a * b).sum(dim=1)[live] / (na[live] * nb[live])
    return float(corr.clamp(-1.0, 1.0).mean())


class RewardAggregator:
    """Phase 4 for a multi-component reward (``reward=multi``), chosen by ``reward.aggregate.name``:

    * ``per_reward`` — one group advantage per weighted component, combined with normalised weights
      (:func:`weighted_advantages`; DanceGRPO / MixGRPO ``advantage_aggr``);
    * ``taros`` — :class:`rewards.aggregate.TaRoS`, the paper's method (arXiv 2511.19356 v4): per-group softmax
      weights over the components in ``reward.aggregate.taros.order``; it **ignores the components' weights** (a
      weight of 0 still keeps a component out of training), and says so when they differ;
    * ``saturation_weighted`` — :class:`rewards.aggregate.SaturationWeighted`, this project's own aggregator
      (saturation-aware normalisation, intra-group sparsity), the one the earlier "TaRoS" results measured.

    The two stateful ones (TaRoS's threshold calibration, the running spread of ``saturation_weighted``) are part
    of the training state (:meth:`state_dict`); their diagnostics are logged. (``sum``, the default, needs no
    aggregator: the algorithm normalises the weighted sum like any reward.) Always called on the gathered global
    batch, so every process computes the same advantages.

    Args:
        aggregate: the ``reward.aggregate`` config node.
        weights: ``{component: weight}`` (``MultiReward.weights``).
        global_std, clip: the algorithm's (``algo.global_std``, ``algo.adv_clip``).
    """

    def __init__(self, aggregate, weights: dict[str, float], *, global_std: bool = False, clip: float | None = 5.0):
        from rewards.aggregate import SaturationWeighted, TaRoS

        self.name = str(aggregate.name)
        self.weights = dict(weights)
        self.global_std, self.clip = bool(global_std), clip
        self.method = None  # the stateful aggregator (taros, saturation_weighted); None for per_reward
        self.components = [k for k, w in self.weights.items() if w > 0]  # the trained ones, in the aggregator's order
        if self.name == "saturation_weighted":
            bounds = {k: tuple(v) for k, v in dict(aggregate.bounds or {}).items()}
            self.method = SaturationWeighted(self.weights, tau=aggregate.tau, kappa=aggregate.kappa,
                                             ema_decay=aggregate.ema_decay, bounds=bounds,
                                             headroom_min=aggregate.headroom_min, renorm=aggregate.renorm, clip=clip)
        elif self.name == "taros":
            t = aggregate.taros
            order = [str(k) for k in (t.order or [])]
            if order and sorted(order) != sorted(self.components):
                raise ValueError(f"reward.aggregate.taros.order={order} must list each trained component once (those "
                                 f"with a weight > 0): {self.components}")
            self.components = order or self.components
            tau = {str(k): float(v) for k, v in dict(t.tau or {}).items()}
            unknown = sorted(set(tau) - set(self.components))
            if unknown:
                raise KeyError(f"reward.aggregate.taros.tau names {unknown}, which are not trained components; "
                               f"trained: {self.components}")
            if t.thresholds == "stage_gates" and self.components[-1] in tau:
                raise KeyError(f"reward.aggregate.taros.tau names {self.components[-1]!r}, the last component of "
                               "reward.aggregate.taros.order: with thresholds=stage_gates it has no gate")
            if len({self.weights[k] for k in self.components}) > 1:
                warnings.warn(f"reward.aggregate.name=taros ignores the components' weights "
                              f"{ {k: self.weights[k] for k in self.components} }: the paper's TaRoS (arXiv 2511.19356) "
                              "weighs them by its own per-group softmax (logged as taros/<component>/weight)",
                              UserWarning, stacklevel=2)
            self.method = TaRoS(self.components, tau=tau, beta=t.beta, performance_sign=t.performance_sign,
                                thresholds=t.thresholds, calibration_iterations=t.calibration_iterations,
                                calibration_quantile=t.calibration_quantile, clip=clip, global_std=global_std)
        elif self.name != "per_reward":
            raise ValueError(f"reward.aggregate.name={self.name!r}: RewardAggregator handles per_reward, taros and "
                             "saturation_weighted")

    def __call__(self, components: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
        """Float32 advantages ``[N]`` from the gathered components ``{name: [N]}``."""
        missing = sorted(set(self.weights) - set(components))
        if missing:
            raise KeyError(f"reward components {missing} have a weight but were not scored; scored: {sorted(components)}")
        if self.name == "taros":
            return self.method({k: components[k] for k in self.components}, group_size)
        if self.method is not None:
            return self.method({k: components[k] for k in self.weights}, group_size)
        return weighted_advantages(components, self.weights, group_size, clip=self.clip, global_std=self.global_std)

    def diagnostics(self) -> dict[str, float]:
        """The aggregator's scalars of the last call (empty for ``per_reward``)."""
        return {} if self.method is None else self.method.diagnostics()

    def state_dict(self) -> dict:
        return {"name": self.name, "state": None if self.method is None else self.method.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        saved, inner = state.get("name"), state.get("state")
        if "state" not in state and "taros" in state:  # written before TaRoS followed the paper: that was
            inner = state["taros"]  # saturation_weighted (its state holds a running spread), or per_reward (None)
            if saved == "taros":
                if self.name != "saturation_weighted":
                    raise ValueError("the checkpoint aggregated rewards with the aggregator named 'taros' before "
                                     "TaRoS followed arXiv 2511.19356, now reward.aggregate.name=saturation_weighted: "
                                     f"resume with that, not {self.name!r}")
                saved = "saturation_weighted"
        if saved != self.name:
            raise ValueError(f"checkpoint aggregated rewards with {saved!r}, this run with {self.name!r} "
                             "(reward.aggregate.name)")
        if self.method is not None:
            self.method.load_state_dict(inner)
