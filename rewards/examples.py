"""A reward written the way you write your own (``docs/your-own.md``): a plain function of a batch, in a module of
its own, that the package imports by its path: ``reward=custom reward.target=rewards.examples:redness``.

>>> import torch
>>> red, grey = torch.zeros(1, 3, 8, 8), torch.full((1, 3, 8, 8), 0.5)
>>> red[:, 0] = 1.0
>>> redness(torch.cat([red, grey]), ["a red square", "a grey square"], None)
tensor([1., 0.])
"""

from __future__ import annotations

import torch

__all__ = ["redness"]


def redness(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> torch.Tensor:
    """How red each sample is: the mean over its pixels of ``max(R − (G + B) / 2, 0)``, in [0, 1].

    ``images``: float ``[B, 3, H, W]`` in [0, 1] (videos ``[B, T, 3, H, W]``: the mean over every frame). Returns a
    float tensor ``[B]``. It reads neither the prompts nor the metadata: a reward may, or may not.
    """
    r, g, b = images.float().unbind(-3)
    return (r - (g + b) / 2).clamp(min=0).flatten(1).mean(1)
