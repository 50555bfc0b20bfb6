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

__all__ = ["knob", "knob_of"]


def knob(default: Any = MISSING, *, choices: tuple | None = None, ge: float | None = None,
         gt: float | None = None, le: float | None = None):
    """A dataclass field carrying the constraints :func:`~flowgrpo.config.validate` checks."""
    meta = {k: v for k, v in dict(choices=choices, ge=ge, gt=gt, le=le).items() if v is not None}
    return field(default=default, metadata=meta)


def knob_of(schema: type, name: str):
    """Field ``name`` of the dataclass ``schema`` again, its default and constraints, for a schema with two parents
    that both declare it: a dataclass takes each field from the last of its bases (in reverse method resolution
    order) that has it, which may be one holding the common ancestor's default rather than the parent's override."""
    parent = schema.__dataclass_fields__[name]  # at most one of default / default_factory is set (a list's factory)
    return field(default=parent.default, default_factory=parent.default_factory, metadata=dict(parent.metadata))
