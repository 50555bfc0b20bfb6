"""MixGRPO and MixGRPO-Flash (arXiv 2507.21802): SDE and training on a sliding window, ODE elsewhere.

The window ``W(l) = {l, …, l+w−1}`` (``algo.window``, a ``samplers.SDEWindow``) is stochastic and trained; every
other step is deterministic. :meth:`MixGRPO.end_iteration` counts an iteration and moves the window on its
schedule; its position and RNG travel in :meth:`MixGRPO.state_dict`.

MixGRPO-Flash (``algo.compress_ratio < 1``, usually with ``sampler.solver=dpm++2m``; ``experiment=mix_grpo_flash_*``):
the steps after the window are integrated on ``max(1, ⌊(T−1−l_last)·ratio⌋)`` steps (``samplers.compress_tail``);
steps up to the window's end are never compressed, so trained step indices are those of the full grid.

Every member of a group sees ODE steps only before the window, so with shared initial noise
(``algo.shared_noise``, on by default as in MixGRPO) the prefix ``0 … l−1`` is the same for the whole group
(:meth:`~flowgrpo.algorithms.base.RolloutPlan.shared_prefix`): the rollout integrates it once per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from samplers import WINDOW_SCHEDULES, SDEWindow

from ..knobs import knob
from .grpo import GRPOConfig, trained_fraction
from .policy_gradient import PolicyGradient
from .schedule import rollout_schedule, select_trained

__all__ = ["WindowConfig", "MixGRPOConfig", "MixGRPO", "default_window_size"]


@dataclass
class WindowConfig:
    """MixGRPO's sliding SDE window; mirrors ``samplers.SDEWindow``'s arguments."""

    size: Optional[int] = knob(None, ge=1)  # w: SDE (and trained) steps per rollout; null = 4 of 25 scaled to T
    shift_interval: int = knob(25, ge=1)  # tau: iterations between window moves
    stride: int = knob(1, ge=1)  # s: steps the window moves each time
    schedule: str = knob("progressive", choices=WINDOW_SCHEDULES)  # how the window moves
    start: int = knob(0, ge=0)  # first window position l
    seed: int = 0  # RNG of the "random" schedule (saved with the window state)
    decay_rate: float = knob(0.1, ge=0)  # k of exp_decay / slope of linear_decay on tau
    decay_threshold: int = knob(0, ge=0)  # l_thr: window position where the interval starts decaying
    min_interval: int = knob(1, ge=1)  # floor of the decayed interval


@dataclass
class MixGRPOConfig(GRPOConfig):
    """``algo=mix_grpo``: MixGRPO's defaults (no KL, shared noise, window of 4 in 25 steps)."""

    kl_beta: float = knob(0.0, ge=0)  # MixGRPO (after DanceGRPO) trains without a KL term
    shared_noise: bool = True  # one initial noise per group: the ODE prefix before the window is computed once
    window: WindowConfig = field(default_factory=WindowConfig)  # the sliding SDE window
    compress_ratio: float = knob(1.0, gt=0, le=1)  # MixGRPO-Flash: keep this fraction of the steps after the window


def default_window_size(num_steps: int) -> int:
    """MixGRPO's window of 4 in 25 steps, scaled to ``num_steps``: ``max(1, round(4·T/25))`` (2 of 10)."""
    return max(1, round(4 * num_steps / 25))


class MixGRPO(PolicyGradient):
    """GRPO on MixGRPO's sliding SDE window. See the module docstring.

    Args:
        base_sigmas: ``[T+1]`` schedule.
        window: an ``SDEWindow`` to use instead of one built from ``algo.window``.
        **kwargs: the sampler's kernel / noise level / solver, and fields of :class:`MixGRPOConfig`.
    """

    name = "mix_grpo"
    config_class = MixGRPOConfig

    def __init__(self, base_sigmas: torch.Tensor, *, window: SDEWindow | None = None, **kwargs) -> None:
        super().__init__(base_sigmas, **kwargs)
        if window is None:
            w = self.cfg.window
            if isinstance(w, dict):
                w = WindowConfig(**w)
                self.cfg.window = w
            size = w.size if w.size is not None else default_window_size(self.num_steps)
            try:
                window = SDEWindow(self.num_steps, size=size, shift_interval=w.shift_interval, stride=w.stride,
                                   schedule=w.schedule, start=w.start, seed=w.seed, decay_rate=w.decay_rate,
                                   decay_threshold=w.decay_threshold, min_interval=w.min_interval)
            except ValueError as err:
                raise ValueError(f"algo.window: {err}") from err
        if window.num_steps != self.num_steps:
            raise ValueError(f"the window spans {window.num_steps} steps but sampler.num_steps={self.num_steps}")
        self.window = window

    @classmethod
    def check_config(cls, algo_cfg, sampler_cfg) -> list[str]:
        size = algo_cfg.window.size
        if size is not None and size > sampler_cfg.num_steps:
            return [f"algo.window.size={size} exceeds sampler.num_steps={sampler_cfg.num_steps}"]
        return []

    def schedule(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas [T'+1], sde_mask [T'])`` at the window's current position."""
        mask = self.window.mask().clone()
        if self.kernel == "cps":  # a CPS step into sigma' = 0 has no density
            mask &= self.base_sigmas[1:] > 0
        if not bool(mask.any()):
            raise ValueError(f"the window {self.window.positions} holds no stochastic step for the {self.kernel} "
                             "kernel (its step into sigma'=0 is ODE): widen algo.window.size")
        return rollout_schedule(self.base_sigmas, mask, compress_ratio=self.cfg.compress_ratio)

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None):
        rows = self._check_batch(num_prompts, group_size)
        sigmas, mask = self.schedule()
        sde = mask.expand(rows, -1).clone()
        train = select_trained(sde, self.cfg.timestep_fraction, selection=self.cfg.timestep_selection,
                               generator=generator)
        return self._make_plan(sigmas, sde, train, group_size, window_start=self.window.start,
                               rollout_steps=sigmas.shape[0] - 1)

    def trained_steps(self) -> tuple[int, str]:
        n = int(self.schedule()[1].sum())
        return trained_fraction(self.cfg, n, f"a window of {n} SDE steps")

    def end_iteration(self, ctx=None) -> None:
        self.window.advance()

    def state_dict(self) -> dict:
        return {"window": self.window.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.window.load_state_dict(state["window"])

    def describe(self) -> str:
        w = self.window
        n = w.size
        k = self.trained_steps()[0]
        moves = ("frozen" if w.schedule == "frozen"
                 else f"{w.schedule}, every {w.shift_interval} it, stride {w.stride}")
        text = (f"mix_grpo (MixGRPO): SDE window of {n} of {self.num_steps} steps at l={w.start} ({moves}), "
                f"{self._kernel_text()}, trains {'all' if k == n else f'{k} ({self.cfg.timestep_selection}) of the'} "
                f"window steps; ODE elsewhere ({self.solver})")
        if self.cfg.compress_ratio < 1:
            steps = self.schedule()[0].shape[0] - 1
            text += (f", post-window tail compressed ×{self.cfg.compress_ratio:g} "
                     f"(MixGRPO-Flash; the rollout has {steps} steps now)")
        return f"{text}; {self._adv_text()}"
