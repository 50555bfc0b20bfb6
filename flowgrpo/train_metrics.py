"""The ``train/*`` scalars of an iteration over the whole global batch, whatever the number of processes: the loss
infos of every micro-batch of every process combined as one process holding the whole batch would log them."""

from __future__ import annotations

import math
import zlib

import torch

__all__ = ["train_scalars"]


def train_scalars(infos: list[dict[str, float]], gather=None) -> dict[str, float]:
    """An iteration's ``train/*`` scalars (without the prefix) from the loss infos of its micro-batches, over the
    global batch: ``infos[i]`` is what this process logged at the ``i``-th micro-batch × trained step it ran.

    One process logs, per key, the mean over the positions that have it (``grad_norm`` only where the optimizer
    stepped). Processes run the same positions in lockstep, and the ``i``-th micro-batches of all processes hold the
    samples of one process's ``i``-th micro-batch with the same global batch (B/P samples each, prompts dealt
    round-robin; exactly so when a micro-batch holds whole groups). So on P processes a key's value at a position is
    the mean over the processes that have it there — or, for a key named ``*_max`` / ``*_min`` (a micro-batch's
    extreme, e.g. ``ratio_max``), their max / min — and the iteration's value is again the mean over positions: what
    one process with the whole batch logs, not P times fewer micro-batches' worth. A NaN or inf value propagates.

    Args:
        infos: this process's loss infos, in the order run; every process runs as many and logs the same keys
            (which ones may depend on the position, not on the process's samples).
        gather: on P > 1 processes, ``[L] -> [P, L]``: every process's copy of a float64 tensor, in rank order, on
            the host (a collective; called twice: the key set and count of positions first, then the values);
            ``None`` on one process.

    Returns:
        ``{key: value}`` in the order the keys first appear in ``infos``.
    """
    keys = list(dict.fromkeys(k for info in infos for k in info))
    layout = sorted(keys)  # the tensor's rows: the same on every process whatever order the keys came in
    values = torch.zeros(len(layout), len(infos), dtype=torch.float64)
    present = torch.zeros_like(values)
    for i, info in enumerate(infos):
        for r, k in enumerate(layout):
            if k in info:
                values[r, i], present[r, i] = float(info[k]), 1.0
    packed = torch.cat([values.flatten(), present.flatten()])
    if gather is None:
        stacked = packed[None]
    else:
        # what the processes must agree on before their values are gathered (a gather of tensors of unequal lengths
        # fails, or hangs a GPU backend): the key set and the number of positions
        shape = torch.tensor([len(layout), len(infos), zlib.crc32("\n".join(layout).encode())], dtype=torch.float64)
        shapes = gather(shape)
        if not torch.equal(shapes, shape.expand_as(shapes)):
            raise RuntimeError(f"the processes logged different loss-info keys or numbers of micro-batches this "
                               f"iteration (this one: {len(infos)} micro-batches, keys {layout}); Algorithm.loss must "
                               "return the same keys on every process, whatever its samples")
        stacked = gather(packed)
    n = values.numel()
    values, present = stacked[:, :n].view(-1, *values.shape), stacked[:, n:].view(-1, *values.shape).bool()
    count = present.sum(0)
    mean = torch.where(present, values, 0.0).sum(0) / count  # NaN where no process has the key: skipped below
    peak = {"max": torch.where(present, values, -math.inf).amax(0), "min": torch.where(present, values, math.inf).amin(0)}
    out = {}
    for k in keys:
        r = layout.index(k)
        kind = k.rsplit("_", 1)[-1]
        per_position = (peak[kind] if kind in peak else mean)[r].tolist()
        # a Python sum in the order run: one process's value is the plain mean of its infos, to the last bit
        kept = [v for v, c in zip(per_position, count[r].tolist()) if c > 0]
        out[k] = sum(kept) / len(kept)
    return out
