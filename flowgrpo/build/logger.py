"""Scalar logging behind one call: :class:`RunLogger` from a ``logger`` node (``none`` or ``wandb``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ..config import validate

__all__ = ["RunLogger", "build_logger"]


@dataclass
class RunLogger:
    """Scalar logging behind one call. ``logger=none`` logs nothing here (the run dir still gets galleries);
    ``logger=wandb`` imports wandb lazily and starts a run (the ``WANDB_MODE`` environment variable wins over
    ``logger.mode``, so tests run it disabled)."""

    name: str
    run: Any = None
    history: list[tuple[int, dict]] = field(default_factory=list)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.history.append((step, dict(scalars)))
        if self.run is not None:
            self.run.log(scalars, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def build_logger(logger: DictConfig, *, output_dir: str | os.PathLike | None = None,
                 config: dict | None = None) -> RunLogger:
    """A :class:`RunLogger` from a ``logger`` node (call on rank 0 only)."""
    validate(logger)
    if logger.name == "none":
        return RunLogger("none")
    import wandb  # optional and lazy

    run = wandb.init(
        project=logger.project,
        entity=logger.entity,
        name=logger.run_name or (Path(output_dir).name if output_dir else None),
        tags=list(logger.tags),
        mode=os.environ.get("WANDB_MODE", logger.mode),
        dir=str(output_dir) if output_dir else None,
        config=config,
    )
    return RunLogger("wandb", run=run)
