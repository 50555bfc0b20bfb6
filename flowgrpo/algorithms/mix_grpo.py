"""MixGRPO and MixGRPO-Flash (arXiv 2507.21802): SDE and training on a sliding window, ODE elsewhere.

The window ``W(l) = {l, …, l+w−1}`` of ``sampler.window`` (a ``samplers.SDEWindow``) is stochastic and trained;
every other step is deterministic. :meth:`MixGRPO.end_iteration` counts an iteration and moves the window on
its schedule; its position and RNG travel in :meth:`MixGRPO.state_dict`.

MixGRPO-Flash (``sampler=mix_sde_flash``: ``sampler.solver=dpm++2m``, ``sampler.compress_ratio < 1``): the steps
after the window are integrated by DPM-Solver++(2M) on ``max(1, ⌊(T−1−l_last)·ratio⌋)`` steps
(``samplers.compress_tail``); steps up to the window's end are never compressed, so trained step indices are
those of the full grid.

Every member of a group sees ODE steps only before the window, so with shared initial noise
(``algo.shared_noise``) the prefix ``0 … l−1`` is the same for the whole group
(:meth:`~flowgrpo.algorithms.base.RolloutPlan.shared_prefix`): the trainer integrates it once per prompt
(the anchor recomputes it G times).
"""

from __future__ import annotations

import torch

from samplers import SDEWindow

from .base import Algorithm, RolloutPlan
from .schedule import SELECTIONS, build_window, rollout_schedule, sde_steps, select_trained, trained_step_count

__all__ = ["MixGRPO"]


class MixGRPO(Algorithm):
    """GRPO on MixGRPO's sliding SDE window. See the module docstring.

    Args:
        base_sigmas: ``[T+1]`` schedule.
        window: the ``samplers.SDEWindow`` (stateful; moved by :meth:`end_iteration`).
        compress_ratio: MixGRPO-Flash's post-window compression (1 = none); needs ``solver="dpm++2m"``.
        selection: which window steps ``timestep_fraction < 1`` trains (see :mod:`.grpo`).
        **kwargs: :class:`~flowgrpo.algorithms.base.Algorithm`'s.
    """

    name = "mix_grpo"

    def __init__(self, base_sigmas: torch.Tensor, *, window: SDEWindow, compress_ratio: float = 1.0,
                 selection: str = "random", **kwargs) -> None:
        super().__init__(base_sigmas, **kwargs)
        if window.num_steps != self.num_steps:
            raise ValueError(f"the window spans {window.num_steps} steps but sampler.num_steps={self.num_steps}")
        if not 0 < compress_ratio <= 1:
            raise ValueError(f"sampler.compress_ratio={compress_ratio} must be in (0, 1]")
        if compress_ratio < 1 and self.solver != "dpm++2m":
            raise ValueError("sampler.compress_ratio < 1 compresses the post-window steps for DPM-Solver++: "
                             "set sampler.solver=dpm++2m (or sampler.compress_ratio=1.0)")
        if selection not in SELECTIONS:
            raise ValueError(f"timestep selection {selection!r} is not one of {', '.join(SELECTIONS)}")
        self.window = window
        self.compress_ratio = float(compress_ratio)
        self.selection = selection

    @classmethod
    def from_config(cls, algo_cfg, sampler_cfg, base_sigmas, *, window=None) -> "MixGRPO":
        if sampler_cfg.sde != "window":
            raise ValueError(
                f"algo=mix_grpo trains the MixGRPO window but sampler.sde={sampler_cfg.sde!r}: use "
                "sampler=mix_sde or sampler=mix_sde_flash (sampler.sde=window); for every step use algo=grpo"
            )
        window = window if window is not None else build_window(sampler_cfg)
        return cls(base_sigmas, window=window, compress_ratio=float(sampler_cfg.compress_ratio),
                   selection=algo_cfg.timestep_selection, **cls._common_kwargs(algo_cfg, sampler_cfg))

    def schedule(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas [T'+1], sde_mask [T'])`` at the window's current position."""
        mask = sde_steps("window", self.base_sigmas, self.kernel, self.window)
        if not bool(mask.any()):
            raise ValueError(f"the window {self.window.positions} holds no stochastic step for the {self.kernel} "
                             "kernel (its step into sigma'=0 is ODE): widen sampler.window.size")
        return rollout_schedule(self.base_sigmas, mask, compress_ratio=self.compress_ratio)

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None) -> RolloutPlan:
        rows = self._check_batch(num_prompts, group_size)
        sigmas, mask = self.schedule()
        sde = mask.expand(rows, -1).clone()
        train = select_trained(sde, self.timestep_fraction, selection=self.selection, generator=generator)
        return self._make_plan(sigmas, sde, train, group_size, window_start=self.window.start,
                               rollout_steps=sigmas.shape[0] - 1)

    def end_iteration(self) -> None:
        self.window.advance()

    def state_dict(self) -> dict:
        return {"window": self.window.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.window.load_state_dict(state["window"])

    def describe(self) -> str:
        w = self.window
        n = w.size
        k = trained_step_count(n, self.timestep_fraction)
        moves = ("frozen" if w.schedule == "frozen"
                 else f"{w.schedule}, every {w.shift_interval} it, stride {w.stride}")
        text = (f"mix_grpo (MixGRPO): SDE window of {n} of {self.num_steps} steps at l={w.start} ({moves}), "
                f"{self._kernel_text()}, trains {'all' if k == n else f'{k} ({self.selection}) of the'} window "
                f"steps; ODE elsewhere ({self.solver})")
        if self.compress_ratio < 1:
            steps = self.schedule()[0].shape[0] - 1
            text += (f", post-window tail compressed ×{self.compress_ratio:g} "
                     f"(MixGRPO-Flash; the rollout has {steps} steps now)")
        return f"{text}; {self._adv_text()}"
