"""Seeded generators: every random draw of a run comes from a generator keyed by a tuple of integers.

A key is ``(seed, stream, ...)``: the run's seed (``trainer.seed``, or ``trainer.eval_seed`` for held-out noise),
which kind of draw it serves (the stream ids below), then what the draw is for (the iteration, the global row, the
inner epoch, ...). Never a process-local stream: a sample's prompt, initial noise, SDE noise and the order its
trained steps are visited in are the same on any number of processes and after a resume.

>>> g = seeded_generator(seed, NOISE_STREAM, iteration, row)                      # doctest: +SKIP
>>> torch.randn(4, generator=g)                                                  # doctest: +SKIP
"""

from __future__ import annotations

import torch

__all__ = [
    "ALGO_STREAM",
    "EVAL_STREAM",
    "NOISE_STREAM",
    "ORDER_STREAM",
    "PROMPTS_STREAM",
    "SDE_STREAM",
    "TEST_STREAM",
    "seeded_generator",
]

_MIX = 1_000_003  # odd multiplier mixing (seed, iteration, index) into one generator seed


def seeded_generator(*keys: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded by a tuple of integers (deterministic, independent streams for distinct tuples)."""
    seed = 0
    for k in keys:
        seed = (seed * _MIX + int(k) + 1) % (2**63 - 1)
    return torch.Generator(device=device).manual_seed(seed)


# Stream ids: which kind of draw a generator serves.
PROMPTS_STREAM = 1  # the iteration's prompts, and the algorithm's plan
NOISE_STREAM = 2  # a rollout's initial noise
SDE_STREAM = 3  # a rollout's SDE noise
ORDER_STREAM = 4  # the order the update visits a row's trained steps in
EVAL_STREAM = 5  # held-out noise (flowgrpo.evaluation)
ALGO_STREAM = 6  # an algorithm's own draws in its update (UpdateContext.generator)
TEST_STREAM = 7  # test-set noise: drawn only by scripts/paired_eval.py --split test, for reported claims
