"""What ``python train.py`` runs: choose the run dir on rank 0, build the :class:`~flowgrpo.trainer.Trainer`,
train, and leave a summary (JSON + reward curves) in the run dir."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .config import validate

__all__ = ["main", "resolve_output_dir"]


def resolve_output_dir(cfg: DictConfig) -> Path:
    """``trainer.output_dir`` when set, else Hydra's run dir (``hydra.runtime.output_dir``). Hydra never
    changes the working directory here (``hydra.job.chdir=false``), so outputs are written to this path."""
    if cfg.trainer.output_dir is not None:
        out = Path(cfg.trainer.output_dir)
    else:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            raise RuntimeError("no Hydra run dir (not started through train.py): set trainer.output_dir=PATH")
        out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _shared_output_dir(cfg: DictConfig, accelerator) -> Path:
    """Every process composes its own config and would pick its own timestamped Hydra dir: rank 0 chooses, the
    others receive its choice."""
    from accelerate.utils import broadcast_object_list

    chosen = [str(resolve_output_dir(cfg)) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(chosen, from_process=0)
    out = Path(chosen[0])
    out.mkdir(parents=True, exist_ok=True)
    return out


def plot_curves(history: list[dict], evals: list[dict], path: Path) -> Path | None:
    """Training reward per iteration and held-out reward at each evaluation, one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is a convenience; the numbers are in summary.json
        return None
    keys = sorted({k for e in evals for k in e if k.startswith("eval/") and k.count("/") == 1})
    fig, axes = plt.subplots(1, 1 + len(keys), figsize=(4 * (1 + len(keys)), 3), squeeze=False)
    axes[0, 0].plot([h["iteration"] for h in history], [h["reward/mean"] for h in history])
    axes[0, 0].set(title="train reward", xlabel="iteration")
    for ax, key in zip(axes[0, 1:], keys):
        ax.plot([e["iteration"] for e in evals if key in e], [e[key] for e in evals if key in e], marker="o")
        ax.set(title=key, xlabel="iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(cfg: DictConfig) -> dict[str, Any]:
    """Train with ``cfg``; returns the summary (also written to ``summary.json`` in the run dir)."""
    validate(cfg)
    from accelerate import Accelerator

    from .trainer import Trainer

    accelerator = Accelerator(mixed_precision=cfg.trainer.mixed_precision, cpu=not torch.cuda.is_available())
    out = _shared_output_dir(cfg, accelerator)
    if accelerator.is_main_process:
        OmegaConf.save(cfg, out / "config.yaml", resolve=True)
    trainer = Trainer(cfg, out, accelerator=accelerator)
    summary = trainer.fit()
    if accelerator.is_main_process:
        summary["curves"] = str(plot_curves(trainer.history, trainer.evals, out / "curves.png"))
        summary["output_dir"] = str(out)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        print(f"summary: {out / 'summary.json'}", flush=True)
    return summary


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run `python train.py` (Hydra entry point)")
