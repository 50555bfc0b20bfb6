"""MixGRPO's sliding SDE window (arXiv 2507.21802) and MixGRPO-Flash's compressed ODE tail.

Over ``T`` sampling steps the window ``W(l) = {l, …, l+w−1}`` is stochastic and trained; every other step is
an ODE step. The window start ``l`` moves by a stride ``s`` every ``τ`` iterations and rolls back to 0 once it
would pass ``T − w``. Schedules:

* ``progressive`` — constant interval ``τ``;
* ``random`` — a fresh uniform start every ``τ`` iterations;
* ``linear_decay`` — ``τ(l) = max(τ_min, τ₀ − k·ReLU(l − l_thr))``;
* ``exp_decay`` — ``τ(l) = max(τ_min, τ₀·exp(−k·ReLU(l − l_thr)))``;
* ``frozen`` — ``l`` never moves (MixGRPO-Flash*, window at 0).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

__all__ = ["SDEWindow", "WINDOW_SCHEDULES", "compress_tail"]

WINDOW_SCHEDULES = ("progressive", "random", "linear_decay", "exp_decay", "frozen")


@dataclass
class SDEWindow:
    """Where MixGRPO's SDE window sits, and how it moves between iterations.

    Args:
        num_steps: sampling steps ``T``.
        size: window size ``w``.
        shift_interval: ``τ₀``, iterations between moves.
        stride: ``s``, steps moved each time.
        schedule: one of :data:`WINDOW_SCHEDULES`.
        start: initial window start ``l``.
        seed: RNG seed of the ``random`` schedule.
        decay_rate: ``k`` of the decay schedules.
        decay_threshold: ``l_thr``: the interval decays only once ``l`` passes it.
        min_interval: ``τ_min``, the smallest interval the decay schedules reach.

    Call :meth:`advance` once per finished iteration; :meth:`state_dict` / :meth:`load_state_dict` resume it.
    """

    num_steps: int
    size: int = 4
    shift_interval: int = 25
    stride: int = 1
    schedule: str = "progressive"
    start: int = 0
    seed: int = 0
    decay_rate: float = 0.1
    decay_threshold: int = 0
    min_interval: int = 1
    _since_move: int = field(default=0, init=False, repr=False)
    _rng: random.Random = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.schedule not in WINDOW_SCHEDULES:
            raise ValueError(f"unknown window schedule {self.schedule!r}; choose one of {WINDOW_SCHEDULES}")
        if not 1 <= self.size <= self.num_steps:
            raise ValueError(f"window size {self.size} must be in [1, num_steps={self.num_steps}]")
        if self.shift_interval < 1 or self.stride < 1 or self.min_interval < 1:
            raise ValueError("shift_interval, stride and min_interval must be >= 1")
        if not 0 <= self.start <= self.max_start:
            raise ValueError(f"window start {self.start} must be in [0, {self.max_start}] (num_steps − size)")
        self._rng = random.Random(self.seed)

    @property
    def max_start(self) -> int:
        return self.num_steps - self.size

    @property
    def positions(self) -> list[int]:
        """Step indices inside the window."""
        return list(range(self.start, self.start + self.size))

    def mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool ``[T]``, True inside the window."""
        m = torch.zeros(self.num_steps, dtype=torch.bool, device=device)
        m[self.start : self.start + self.size] = True
        return m

    def interval(self) -> int:
        """Iterations the window stays at its current start."""
        excess = max(self.start - self.decay_threshold, 0)
        if self.schedule == "linear_decay":
            return max(self.min_interval, int(round(self.shift_interval - self.decay_rate * excess)))
        if self.schedule == "exp_decay":
            return max(self.min_interval, int(round(self.shift_interval * math.exp(-self.decay_rate * excess))))
        return self.shift_interval

    def advance(self) -> bool:
        """Count one finished iteration; move the window when its interval is up. Returns whether it moved."""
        if self.schedule == "frozen":
            return False
        self._since_move += 1
        if self._since_move < self.interval():
            return False
        self._since_move = 0
        if self.schedule == "random":
            self.start = self._rng.randint(0, self.max_start)
        else:
            nxt = self.start + self.stride
            self.start = nxt if nxt <= self.max_start else 0
        return True

    def state_dict(self) -> dict:
        return {"start": self.start, "since_move": self._since_move, "rng": self._rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.start = int(state["start"])
        self._since_move = int(state["since_move"])
        rng = state["rng"]
        # getstate() is (version, tuple, gauss); JSON/torch round-trips may turn tuples into lists.
        self._rng.setstate((rng[0], tuple(rng[1]), rng[2]))


def compress_tail(sigmas: torch.Tensor, last_sde: int, ratio: float = 0.4) -> torch.Tensor:
    """MixGRPO-Flash: keep ``sigmas[: last_sde + 2]`` (everything up to the end of the window) and replace the
    ``n = T − 1 − last_sde`` steps after it by ``max(1, ⌊n·ratio⌋)`` steps, uniform in σ from the window's
    end to 0 [ours: the grid DPM-Solver++ gets on flow models in diffusers (``use_flow_sigmas``, shift 1);
    sub-sampling the shifted grid instead leaves one huge final jump where x̂₀ is under-dispersed].
    Steps before the window are never compressed.

    Returns the new ``[T' + 1]`` schedule; step indices up to ``last_sde`` are unchanged.
    """
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32)
    steps = sigmas.shape[0] - 1
    if not 0 <= last_sde < steps:
        raise ValueError(f"last_sde={last_sde} must index a step of the {steps}-step schedule")
    if not 0 < ratio <= 1:
        raise ValueError(f"compression ratio must be in (0, 1], got {ratio}")
    tail = steps - 1 - last_sde
    if tail <= 1:
        return sigmas.clone()
    keep = max(1, math.floor(tail * ratio))
    start = float(sigmas[last_sde + 1])
    return torch.cat([sigmas[: last_sde + 2], torch.linspace(start, 0.0, keep + 1)[1:]])
