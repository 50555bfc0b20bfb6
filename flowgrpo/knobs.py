"""The field every config schema is built from: a default with the constraints :func:`flowgrpo.config.validate`
checks (choices, bounds), stored in the dataclass field's metadata.

>>> from dataclasses import dataclass
>>> @dataclass
... class LoraConfig:
...     rank: int = knob(32, ge=1)  # LoRA rank r
>>> LoraConfig.__dataclass_fields__["rank"].metadata["ge"]
1

An algorithm's schema (``flowgrpo/algorithms/<name>.py``) uses it as the schemas of ``flowgrpo.config`` do; this
module imports nothing of the package, so either can.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from omegaconf import MISSING

__all__ = ["knob"]


def knob(default: Any = MISSING, *, choices: tuple | None = None, ge: float | None = None,
         gt: float | None = None, le: float | None = None):
    """A dataclass field carrying the constraints :func:`~flowgrpo.config.validate` checks."""
    meta = {k: v for k, v in dict(choices=choices, ge=ge, gt=gt, le=le).items() if v is not None}
    return field(default=default, metadata=meta)
