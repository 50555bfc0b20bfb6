"""Test doubles of the trainer's interfaces, shared by the algorithm tests: a linear toy policy behind the
:class:`~flowgrpo.algorithms.UpdateContext` an algorithm's update reaches the model through, and the conditioning
it ignores.

``test_contracts`` holds :data:`CONTRACT` against the real ``UpdateContext``: a member added to (or dropped from)
the interface fails there until this double states whether it offers it."""

from __future__ import annotations

import contextlib

import torch

from flowgrpo.algorithms import UpdateContext

#: every member of ``UpdateContext`` and whether :class:`ToyContext` implements it (the streaming members are the
#: streaming tests' own doubles')
CONTRACT = {
    "params": True,
    "updates": True,
    "iteration": True,
    "epoch": True,
    "velocity": True,
    "reference": True,
    "generator": True,
    "stored_weights": True,
    "commit": False,
    "routed": False,
    "teacher_forced_velocity": False,
}


def keyed_generator(salt: int, *keys: int) -> torch.Generator:
    """A CPU generator seeded from ``salt`` and ``keys`` the way the trainer keys its draws (a different seed for
    every key tuple, the same one on every call)."""
    seed = salt
    for k in keys:
        seed = seed * 1_000_003 + int(k) + 1
    return torch.Generator().manual_seed(seed % (2**63 - 1))


class ToyContext(UpdateContext):
    """``v_θ(x, σ) = θ + a·x`` with one trainable per-channel ``θ`` (drawn from ``seed``), ``a`` fixed; the reference
    ``ref + a·x`` (``ref`` zero unless set); generators keyed by ``(salt, keys)``; ``stored`` maps a path to the
    weights :meth:`stored_weights` returns for it.

    Examples:
        >>> ctx = ToyContext(dim=2, a=0.5)
        >>> x = torch.ones(1, 2, 1, 1)
        >>> with ctx.reference():
        ...     ctx.velocity(x, 0.5, None).flatten().tolist()
        [0.5, 0.5]
    """

    def __init__(self, dim: int = 3, a: float = 0.5, seed: int = 0, salt: int = 23,
                 stored: dict[str, torch.Tensor] | None = None):
        self.theta = torch.nn.Parameter(torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
        self.params = [self.theta]
        self.updates = 0
        self.iteration, self.epoch = 0, 0
        self.ref = torch.zeros(dim)
        self.a = a
        self.salt = salt
        self.stored = {} if stored is None else stored
        self._in_ref = False

    def velocity(self, x, sigma, cond):
        base = self.ref if self._in_ref else self.theta
        return base.view(1, -1, 1, 1) + self.a * x

    @contextlib.contextmanager
    def reference(self):
        self._in_ref = True
        try:
            yield
        finally:
            self._in_ref = False

    def generator(self, *keys):
        return keyed_generator(self.salt, *keys)

    def stored_weights(self, path):
        return [self.stored[path].clone()]


class Cond:
    """Conditioning the toy velocity ignores; indexable by rows as an adapter's (``n`` rows, when known)."""

    def __init__(self, n: int | None = None):
        self.n = n

    def __getitem__(self, rows):
        return Cond(len(rows) if hasattr(rows, "__len__") else None)
