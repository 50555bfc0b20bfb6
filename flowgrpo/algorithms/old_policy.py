"""The old policy some algorithms sample or score with: a copy of the trainable weights, moved on their schedule
(DiffusionNFT's moving average, KVPO's sync every few rollouts), swapped into the live parameters when used."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

__all__ = ["OldPolicy"]


class OldPolicy:
    """``θ_old``: a detached copy of the trainable parameters; it starts at ``θ`` on first use."""

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] | None = None

    def ensure(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Start at ``θ`` if unset; check a restored copy matches the parameters and move it onto their device."""
        params = list(params)
        if self.weights is None:
            self.weights = [p.detach().clone() for p in params]
        elif len(self.weights) != len(params) or any(o.shape != p.shape for o, p in zip(self.weights, params)):
            raise ValueError("the old policy's weights do not match the trainable parameters (a checkpoint of "
                             "another model.lora / model.finetune?)")
        else:
            self.weights = [o.to(device=p.device, dtype=p.dtype) for o, p in zip(self.weights, params)]

    @torch.no_grad()
    def move(self, params: Sequence[torch.nn.Parameter], keep: float = 0.0) -> None:
        """``θ_old ← keep·θ_old + (1 − keep)·θ`` (``keep = 0``: a copy of ``θ``)."""
        self.ensure(params)
        for old, p in zip(self.weights, params):
            old.copy_(old * keep + p.detach() * (1 - keep))

    @contextlib.contextmanager
    def swapped_in(self, params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
        """``θ_old`` in the trainable parameters for the duration; the live values come back after."""
        params = list(params)
        self.ensure(params)
        with torch.no_grad():
            live = [p.detach().clone() for p in params]
            for p, o in zip(params, self.weights):
                p.copy_(o)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(params, live):
                    p.copy_(v)

    def state_dict(self) -> list[torch.Tensor] | None:
        return None if self.weights is None else [t.detach().cpu().clone() for t in self.weights]

    def load_state_dict(self, state: list[torch.Tensor] | None) -> None:
        self.weights = None if state is None else [t.clone() for t in state]
