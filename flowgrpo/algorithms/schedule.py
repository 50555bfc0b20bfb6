"""Helpers the algorithms build their :class:`~flowgrpo.algorithms.base.RolloutPlan` from.

* :func:`rollout_schedule` — MixGRPO-Flash (arXiv 2507.21802): after the last SDE step, the remaining steps on a
  grid compressed by ``algo.compress_ratio`` (``samplers.compress_tail``).
* :func:`trained_step_count` — ``algo.timestep_fraction``: ``max(1, ⌊n·f⌋)`` of a rollout's ``n`` SDE steps, as
  the published trainers' ``int(num_steps · timestep_fraction)``.
* :func:`select_trained` — which steps those are (random per sample, or the first ones).
"""

from __future__ import annotations

import torch

from samplers import compress_tail

__all__ = ["SELECTIONS", "rollout_schedule", "trained_step_count", "select_trained"]

SELECTIONS = ("random", "first")


def rollout_schedule(
    sigmas: torch.Tensor, mask: torch.Tensor, *, compress_ratio: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigmas', mask')`` actually integrated: with ``compress_ratio < 1`` (MixGRPO-Flash) the steps after the
    last SDE step are replaced by ``max(1, ⌊n·ratio⌋)`` steps (``samplers.compress_tail``); steps up to the last
    SDE step, and their indices, are unchanged. ``mask`` is a bool ``[T]`` shared by the batch."""
    if compress_ratio >= 1 or not bool(mask.any()):
        return sigmas, mask
    last = int(mask.nonzero().max())
    compressed = compress_tail(sigmas, last, compress_ratio)
    return compressed, mask[: compressed.shape[0] - 1].clone()


def trained_step_count(num_sde: int, fraction: float = 1.0) -> int:
    """Trained steps of a rollout with ``num_sde`` SDE steps: ``max(1, int(num_sde·fraction))``, 0 when none.

    ``int`` (floor) as the published trainers' ``int(num_steps * timestep_fraction)`` (Flow-GRPO, DanceGRPO,
    MixGRPO)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"algo.timestep_fraction={fraction} must be in (0, 1]")
    return 0 if num_sde == 0 else max(1, int(num_sde * fraction))


def select_trained(
    sde_mask: torch.Tensor,
    fraction: float = 1.0,
    *,
    selection: str = "random",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The trained subset ``⊆ sde_mask`` (bool ``[N, T]``): per row ``trained_step_count(n_row, fraction)`` of its
    SDE steps — all of them when ``fraction = 1`` (no random draw).

    ``selection="random"``: a uniform subset per row, independently (DanceGRPO: a fresh ``randperm`` of the
    timesteps per sample, first ``⌊T·f⌋`` trained). ``"first"``: the earliest (noisiest) ones (Flow-GRPO: its
    per-sample permutation is commented out to ``arange``, so it trains steps ``0 … ⌊T·f⌋−1``; its 0.99 default
    just drops the final step).
    """
    if selection not in SELECTIONS:
        raise ValueError(f"timestep selection {selection!r} is not one of {', '.join(SELECTIONS)}")
    sde_mask = torch.as_tensor(sde_mask, dtype=torch.bool)
    counts = sde_mask.sum(dim=1)
    keep = torch.tensor([trained_step_count(int(n), fraction) for n in counts.tolist()], dtype=torch.long)
    if bool((keep == counts).all()):
        return sde_mask.clone()
    rows, steps = sde_mask.shape
    if selection == "random":
        score = torch.rand(rows, steps, generator=generator)
    else:  # earlier steps first
        score = -torch.arange(steps, dtype=torch.float32).expand(rows, steps)
    score = score.masked_fill(~sde_mask, float("-inf"))
    order = score.argsort(dim=1, descending=True)  # SDE steps first, in selection order
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(steps).expand(rows, steps))
    return sde_mask & (rank < keep.unsqueeze(1))
