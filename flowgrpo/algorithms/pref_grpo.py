"""Pref-GRPO (arXiv 2508.20751): advantages from pairwise preferences inside each group instead of pointwise scores.

A pointwise reward often scores a group's samples almost alike; normalising by the group's std then blows tiny,
meaningless differences up to full-size advantages ("illusory advantage"), which invites reward hacking. Pref-GRPO
asks a pairwise judge about every unordered pair of a group and uses each sample's **win rate** as its reward:

    w_i = (wins_i + ½·ties_i) / (G − 1)          Σ_i w_i = G/2, so the mean win rate is always ½
    A_i = clip((w_i − mean_g w) / (std_g w + 1e-8), ±adv_clip)     (the unbiased std of the group, as the authors')

A group in which the judge sees no difference has ``A ≡ 0``: nothing is learned from it, however its pointwise scores
scatter. The update is DanceGRPO's PPO-clip (its kernel, 60 % of the steps, shared initial noise, no KL), with
GRPO-Guard's normalised ratio and ``1/|Δσ|`` step weight by default (``algo.ratio_norm``; the authors' ``--rationorm``):
:class:`~flowgrpo.algorithms.grpo_guard.GRPOGuard`.

The judge. The authors' is a 7B vision-language reward model asked "which image is better" per pair; the judge here runs
offline on any reward: it compares two samples' reward components (``algo.judge``, e.g. GenEval's ``strict`` verdict
then its ``partial`` credit) in order, the first that differs by more than ``algo.tie_margin`` decides, and a pair
that never differs is a tie. With ``algo.judge=[]`` it compares the training reward itself. Such a judge is
consistent (``P(a ≻ b) = 1 − P(b ≻ a)``), so each unordered pair is asked once; :func:`win_rates` takes any preference
matrix, so a judge that looks at images plugs in by building that matrix. The training reward curve still shows the
pointwise reward, which keeps its meaning (the mean win rate is ½ by construction and shows nothing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List

import torch

from ..knobs import knob
from .base import Batch, Needs, Scores
from .grpo import GRPO
from .grpo_guard import GRPOGuard, GRPOGuardConfig
from .policy_gradient import PolicyGradient

__all__ = ["PrefGRPOConfig", "PrefGRPO", "win_rates", "verdict_preferences", "preference_advantages"]


@dataclass
class PrefGRPOConfig(GRPOGuardConfig):
    """``algo=pref_grpo``: the authors' defaults (DanceGRPO's update with the normalised ratio)."""

    kl_beta: float = knob(0.0, ge=0)  # the authors train without a KL term
    timestep_fraction: float = knob(0.6, gt=0, le=1)  # a random 60% of the SDE steps per sample
    shared_noise: bool = True  # one initial noise per group (the authors' init_same_noise)
    ratio_norm: bool = True  # GRPO-Guard's normalised ratio and step weight; false: the plain PPO ratio
    # reward components the judge compares, in order (the first that differs decides); [] = the training reward
    judge: List[str] = field(default_factory=list)
    tie_margin: float = knob(0.0, ge=0)  # differences up to this count as a tie


def verdict_preferences(scores: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """``[G, G]`` ``P(i ≻ j)`` of a judge comparing per-sample verdicts ``scores`` (``[G]`` or ``[G, K]``, the ``K``
    criteria in order of importance): 1 / 0 by the first criterion on which ``|s_i − s_j| > margin``, ½ when none
    does (and on the diagonal)."""
    s = scores.double().reshape(scores.shape[0], -1)
    if not bool(torch.isfinite(s).all()):
        raise ValueError("the judge's scores hold NaN/inf: it cannot compare those samples")
    diff = s.unsqueeze(1) - s.unsqueeze(0)  # [G, G, K]
    decided = diff.abs() > margin
    first = decided.to(torch.uint8).argmax(dim=2, keepdim=True)  # the first deciding criterion (0 when none)
    sign = torch.gather(diff, 2, first).squeeze(2).sign()
    any_decided = decided.any(dim=2)
    return torch.where(any_decided, (sign + 1) / 2, torch.full_like(sign, 0.5))


def win_rates(preferences: torch.Tensor) -> torch.Tensor:
    """``[G]`` win rate of each sample from a ``[G, G]`` matrix of ``P(i ≻ j)``: ``Σ_{j≠i} P(i ≻ j) / (G − 1)``. Only
    the upper triangle is read (each unordered pair asked once, ``P(j ≻ i) = 1 − P(i ≻ j)``)."""
    G = preferences.shape[0]
    if preferences.shape != (G, G) or G < 2:
        raise ValueError(f"preferences must be a [G, G] matrix with G >= 2, got {tuple(preferences.shape)}")
    upper = torch.triu(preferences.double(), diagonal=1)
    full = upper + torch.triu(1 - preferences.double(), diagonal=1).T
    return full.sum(dim=1) / (G - 1)


def preference_advantages(win: torch.Tensor, group_size: int, clip: float) -> torch.Tensor:
    """Group-standardised win rates (unbiased group std + 1e-8), clipped to ``±clip``; float32 ``[n]``."""
    w = win.double().view(-1, group_size)
    adv = (w - w.mean(dim=1, keepdim=True)) / (w.std(dim=1, keepdim=True) + 1e-8)
    return adv.clamp(-clip, clip).flatten().float()


class PrefGRPO(GRPOGuard):
    """Pref-GRPO. See the module docstring.

    Args:
        base_sigmas: ``[T+1]`` schedule.
        **kwargs: the sampler's kernel / noise level / solver and fields of :class:`PrefGRPOConfig`.
    """

    name = "pref_grpo"
    config_class = PrefGRPOConfig

    @classmethod
    def declare_needs(cls, algo_cfg) -> Needs:  # the normalised ratio needs the rollout's means; the plain one does not
        return dataclasses.replace(super().declare_needs(algo_cfg), record_means=bool(algo_cfg.ratio_norm))

    def ratio_terms(self, batch, step, rows, steps):
        if self.cfg.ratio_norm:
            return super().ratio_terms(batch, step, rows, steps)
        return PolicyGradient.ratio_terms(self, batch, step, rows, steps)

    def judge_scores(self, batch: Batch) -> torch.Tensor:
        """``[n, K]`` what the judge compares per row: the ``algo.judge`` components, or the reward."""
        if not self.cfg.judge:
            return batch.rewards.detach().double().cpu().view(-1, 1)
        missing = [c for c in self.cfg.judge if c not in batch.components]
        if missing:
            raise KeyError(f"algo.judge names {missing}, which the reward does not return (it returns "
                           f"{sorted(batch.components)}); set algo.judge=[] to compare the training reward")
        return torch.stack([batch.components[c].detach().double().cpu() for c in self.cfg.judge], dim=1)

    def advantages(self, scores: Scores) -> torch.Tensor:
        """Per group of this process, the judge's preferences over its pairs → win rates → advantages; gathered."""
        batch = scores.batch
        G = batch.plan.group_size
        judged = self.judge_scores(batch)
        win = torch.cat([win_rates(verdict_preferences(judged[p:p + G], self.cfg.tie_margin))
                         for p in range(0, judged.shape[0], G)])
        return scores.gather(preference_advantages(win, G, self.cfg.adv_clip))

    def _adv_text(self) -> str:
        judged = "+".join(self.cfg.judge) if self.cfg.judge else "the reward"
        return f"advantage (win rates of a pairwise judge on {judged}, group std, clip ±{self.cfg.adv_clip:g})"

    def describe(self) -> str:
        tail = GRPO.describe(self).split(": ", 1)[1]  # the rollout and the trained steps, as GRPO says them
        ratio = ("normalised ratio, surrogate / |dsigma|" if self.cfg.ratio_norm else "plain PPO ratio")
        return f"pref_grpo (Pref-GRPO): {ratio}; {tail}"
