"""Loading helpers shared by rewards with learned weights: device / dtype resolution, and loaders whose errors
say what to fetch and which keyword to set (the rule: a reward that cannot load its weights raises an error
saying which path / hub id / package it needs).

Nothing here imports transformers or open_clip at module import: ``import rewards`` stays light.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Callable

import torch

__all__ = ["MissingWeightsError", "check_tokenizer", "from_pretrained", "load_state_dict_file", "resolve_device",
           "resolve_dtype"]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class MissingWeightsError(OSError):
    """A reward's weights (or tokenizer) are not where it was told to look.

    The message names the reward, the hub id / path it tried, where to get the file, and the keyword to set.
    ``reward``, ``source`` and ``kwarg`` are kept as attributes so callers (config tests, the trainer's startup)
    can tell "weights not on this machine" from a real bug. Subclass of ``OSError``: offline
    ``from_pretrained`` raises ``OSError`` too, and code catching that keeps working.
    """

    def __init__(self, reward: str, what: str, source: Any, kwarg: str, *, reason: str = "", fetch: str = "",
                 example: str | None = None):
        self.reward, self.what, self.source, self.kwarg = reward, what, source, kwarg
        example = example or f"rewards.load({reward!r}, {kwarg}='/path/to/it')"
        where = f"from {source!r}" if source is not None else f"(no {kwarg}= given)"
        if not fetch and isinstance(source, str) and source and not os.path.isabs(source) and source.count("/") == 1:
            fetch = f"Download it where a hub is reachable (`huggingface-cli download {source}`)"
        text = f"{reward}: cannot load the {what} {where}"
        text += f" ({reason.rstrip('.')})." if reason else "."
        text += f" {fetch}." if fetch else ""
        text += f" Then set {kwarg}= to it: {example} (in training: reward.kwargs.{kwarg}=...)."
        super().__init__(text)


def _reason(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> this process's current CUDA device if there is one (accelerate sets it per rank), else CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``None`` -> float32 (the references score in full precision); names as in configs ("bf16", "float16", ...)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(sorted(_DTYPES))} or a torch.dtype")
    return _DTYPES[key]


def from_pretrained(loader: Callable[..., Any], source: str, *, reward: str, what: str, kwarg: str,
                    example: str | None = None, **kwargs) -> Any:
    """``loader(source, **kwargs)`` (a transformers ``from_pretrained``), its failure turned into a
    :class:`MissingWeightsError` naming ``source`` and ``kwarg``: offline, a missing hub id raises ``OSError``; a
    checkpoint of another architecture or size raises ``RuntimeError`` / ``ValueError``."""
    try:
        return loader(source, **kwargs)
    except (OSError, RuntimeError, ValueError) as err:
        raise MissingWeightsError(reward, what, source, kwarg, reason=_reason(err), example=example) from err


def check_tokenizer(tokenizer, source: str, *, reward: str, kwarg: str, minimum: int = 256,
                    example: str | None = None) -> None:
    """Fail loudly on a near-empty tokenizer (some tokenizer classes load one for a missing hub id)."""
    if len(tokenizer) < minimum:
        raise MissingWeightsError(reward, "tokenizer", source, kwarg, example=example,
                                  reason=f"it loaded with only {len(tokenizer)} tokens, so its files are missing")


def load_state_dict_file(path: str | os.PathLike | None, *, reward: str, what: str, kwarg: str, fetch: str,
                         example: str | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a ``.pt`` / ``.pth`` / ``.bin`` (``torch.load(weights_only=True)``) or ``.safetensors`` file on CPU.

    ``fetch`` says where the file comes from (it is not on a hub we download from): it goes into the error raised
    when ``path`` is ``None``, missing, or unreadable.
    """
    if path is None or not os.path.isfile(path):
        reason = "" if path is None else "no such file"
        raise MissingWeightsError(reward, what, None if path is None else str(path), kwarg, reason=reason, fetch=fetch,
                                  example=example)
    path = str(path)
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path, device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError) as err:
        raise MissingWeightsError(reward, what, path, kwarg, fetch=fetch, example=example,
                                  reason=f"not a readable tensors-only checkpoint, {_reason(err)}") from err
