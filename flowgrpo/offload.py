"""Tensors that wait in host memory between the rollout and the update (``trainer.offload_kept_context``).

A streaming model's update rescores each trained transition under the KV cache it was sampled with, so the rollout
keeps the caches of the blocks that train a step. On a GPU they are the largest thing a streaming iteration holds
besides the live caches (tens of GiB at 480 × 832); :func:`to_host` moves them to page-locked host memory after the
block is sampled and :func:`to_device` brings one micro-batch's share back when the update reads it. Both are copies
on the GPU's stream, so the order of the work is kept without a synchronisation.

On a machine without a GPU the tensors are already in host memory and nothing is copied, unless an observer is
registered (:func:`observe_host_copies`): then both directions copy, so that a memory plan
(:mod:`flowgrpo.planner`) sees the host copy apart from the device one and the device copy made again for the update.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch

__all__ = ["HostCopy", "to_host", "to_device", "observe_host_copies"]

_observers: list[tuple[Callable[[torch.Tensor], None], Callable[[], ContextManager]]] = []


@contextlib.contextmanager
def observe_host_copies(fn: Callable[[torch.Tensor], None],
                        scope: Callable[[], ContextManager] = contextlib.nullcontext) -> Iterator[None]:
    """Call ``fn(t)`` on every tensor put in host memory inside the block (:func:`to_host`'s copies and the rows
    :class:`HostCopy` selects and joins there), and make the copies even where the tensors are in host memory
    already; the host-side work runs inside ``scope()``. A plan on fake tensors counts them so, apart from the
    device's memory."""
    entry = (fn, scope)
    _observers.append(entry)
    try:
        yield
    finally:
        _observers.remove(entry)


@contextlib.contextmanager
def _host_work() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for _, scope in _observers:
            stack.enter_context(scope())
        yield


def _report(t: torch.Tensor) -> torch.Tensor:
    for fn, _ in _observers:
        fn(t)
    return t


def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` in host memory: a page-locked copy of a GPU tensor (the copy back then overlaps the work), ``t`` itself
    where it is in host memory already (a copy when an observer is registered); ``None`` stays ``None``."""
    if t is None:
        return None
    if t.device.type == "cpu":
        if not _observers:
            return t
        with _host_work():
            return _report(t.clone())
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    out.copy_(t, non_blocking=True)
    return _report(out)


def to_device(t: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    """``t`` on ``device`` for the work that reads it (a copy when an observer is registered, as :func:`to_host`)."""
    if t is None:
        return None
    if _observers and torch.device(device) == t.device:
        return t.clone()
    return t.to(device, non_blocking=True)


@dataclass
class HostCopy:
    """A conditioning (anything with ``map_tensors``, ``__len__``, ``__getitem__`` and ``cat``: a streaming model's
    ``StreamCond``) whose tensors wait in host memory, as the parts it was offloaded in. Rows are selected there and
    :meth:`to` brings the selection back; joining copies keeps the parts apart (no second host copy of the whole).

    >>> kept = HostCopy.of(cond)                 # after the block is sampled            # doctest: +SKIP
    >>> velocity(x, sigma, kept[rows].to(x.device))                                      # doctest: +SKIP
    """

    parts: list

    @classmethod
    def of(cls, cond: Any) -> "HostCopy":
        return cls([cond.map_tensors(to_host)])

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def __getitem__(self, index) -> "HostCopy":
        """The rows ``index`` (an int, a slice or row indices, in their order) as one part."""
        rows = torch.arange(len(self))[index].reshape(-1)
        ends = torch.tensor([len(p) for p in self.parts]).cumsum(0)
        part = torch.searchsorted(ends, rows, right=True)  # the part each row is in ...
        local = rows - torch.cat([ends.new_zeros(1), ends])[part]  # ... and its row there
        pieces, start = [], 0
        with _host_work():  # selected in host memory
            for stop in [*((part[1:] != part[:-1]).nonzero().squeeze(1) + 1).tolist(), len(rows)]:  # runs of a part
                pieces.append(self.parts[int(part[start])][local[start:stop]])
                start = stop
        return HostCopy([self._join(pieces)])

    @classmethod
    def cat(cls, items: Sequence["HostCopy"]) -> "HostCopy":
        """The rows of ``items`` in order (their parts side by side: nothing is copied)."""
        return cls([part for item in items for part in item.parts])

    def to(self, device: torch.device | str) -> Any:
        """The conditioning on ``device`` (:func:`to_device` on each tensor of the joined parts)."""
        return self._join(self.parts).map_tensors(functools.partial(to_device, device=device))

    @staticmethod
    def _join(parts: list) -> Any:
        if len(parts) == 1:
            return parts[0]
        with _host_work():  # made in host memory
            joined = type(parts[0]).cat(parts)
        return joined.map_tensors(_report)
