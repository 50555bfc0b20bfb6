"""What ``python train.py`` runs: choose the run dir on rank 0, build the :class:`~flowgrpo.trainer.Trainer`,
train, and leave a summary (JSON + reward curves) in the run dir. What it reports, and the traceback of a crash,
also goes to ``train.log`` there (:mod:`flowgrpo.runlog`)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .jsonio import dumps
from .checkpoint import atomic_write_text
from .config import steps_line, validate
from .errors import mark_set_up
from .runlog import (LOG_NAME, close_file_logs, code_version, discard_hydra_dir, discard_run_dir, holds_nothing, log,
                     remove_empty_dirs, run_log)

__all__ = ["main", "resolve_output_dir"]


def resolve_output_dir(cfg: DictConfig) -> Path:
    """``trainer.output_dir`` when set, else Hydra's run dir (``hydra.runtime.output_dir``), created. Hydra never
    changes the working directory here (``hydra.job.chdir=false``), so outputs are written to this path."""
    out = _output_path(cfg)
    _make_dir(out)
    return out


def _output_path(cfg: DictConfig) -> Path:
    if cfg.trainer.output_dir is not None:
        return Path(cfg.trainer.output_dir)
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        raise RuntimeError("no Hydra run dir (not started through train.py): set trainer.output_dir=PATH")
    return Path(HydraConfig.get().runtime.output_dir)


def _make_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(err.errno, f"cannot create the output directory {out}: {err.strerror or err}; set "
                                 "trainer.output_dir to a directory that can be made") from err


def _adopt_hydra_dir(out: Path, main: bool) -> None:
    """Hydra made its own run dir before this code ran (``.hydra/`` and an empty ``train.log`` it keeps open). Its
    log file is closed: :func:`~flowgrpo.runlog.run_log` writes ``train.log``, once, on the main process. When that
    dir is not ``out`` (``trainer.output_dir`` was given, or another process chose), its ``.hydra/`` moves into
    ``out`` (main process) and the dir and its empty parents are removed, so that no stray ``outputs/...`` is left.
    A dir holding anything else is left as it is."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    close_file_logs(hydra_dir)  # run_log writes train.log (one writer, and only on the main process)
    if hydra_dir == out.resolve() or not hydra_dir.is_dir():
        return
    try:
        log_file, configs = hydra_dir / LOG_NAME, hydra_dir / ".hydra"
        if log_file.is_file() and log_file.stat().st_size == 0:
            log_file.unlink()
        if configs.is_dir():
            if main:
                shutil.rmtree(out / ".hydra", ignore_errors=True)
                shutil.move(str(configs), str(out / ".hydra"))
            elif not any(p.is_dir() for p in configs.iterdir()):
                shutil.rmtree(configs)
        remove_empty_dirs(hydra_dir)
    except OSError as err:  # tidying up: never worth the run
        warnings.warn(f"could not remove Hydra's run dir {hydra_dir}: {err.strerror or err}", RuntimeWarning,
                      stacklevel=2)


def _shared_output_dir(cfg: DictConfig, accelerator) -> tuple[Path, bool]:
    """Every process composes its own config and would pick its own timestamped Hydra dir: rank 0 chooses, the
    others receive its choice. Also whether the dir held nothing of a run before (:func:`~flowgrpo.runlog.holds_nothing`:
    then a failure while the run is set up removes it)."""
    from accelerate.utils import broadcast_object_list

    chosen = [None, None]
    if accelerator.is_main_process:
        path = _output_path(cfg)
        chosen = [str(path), holds_nothing(path)]
        _make_dir(path)
    if accelerator.num_processes > 1:
        broadcast_object_list(chosen, from_process=0)
    out = Path(chosen[0])
    _make_dir(out)
    return out, bool(chosen[1])


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
    accelerator = None
    try:
        validate(cfg)
        from accelerate import Accelerator

        from .build import check_config

        accelerator = Accelerator(mixed_precision=cfg.trainer.mixed_precision, cpu=not torch.cuda.is_available())
        check_config(cfg, accelerator.num_processes)  # batch arithmetic, reward ↔ model, sizes: before any run dir
        out, fresh = _shared_output_dir(cfg, accelerator)
    except BaseException as err:
        mark_set_up(err)
        discard_hydra_dir()
        if accelerator is not None:  # the process group too (see the end of this function)
            accelerator.end_training()
        raise
    from .trainer import Trainer

    main_process = accelerator.is_main_process
    _adopt_hydra_dir(out, main_process)
    code = code_version() if main_process else None  # the code as it is when the run starts
    set_up = finished = False
    try:
        with run_log(out, main=main_process):
            if main_process:
                OmegaConf.save(cfg, out / "config.yaml", resolve=True)
                if code:
                    log.info(f"code: commit {code['commit']}{' with uncommitted changes' if code['changes'] else ''}")
                log.info(steps_line(cfg))  # the steps sampled, and whether they are the model's grid or stated
            trainer = Trainer(cfg, out, accelerator=accelerator)
            set_up = True
            summary = trainer.fit()
            if main_process:
                curves = out / "curves.png"
                try:
                    summary["curves"] = str(plot_curves(trainer.history, trainer.evals, curves))
                except Exception as err:  # a convenience: the numbers are in summary.json and metrics.jsonl
                    summary["curves"] = None
                    cause = getattr(err, "strerror", None) or f"{type(err).__name__}: {err}"
                    warnings.warn(f"could not write {curves}: {cause}; the run goes on", RuntimeWarning, stacklevel=2)
                summary["output_dir"] = str(out)
                summary["code"] = code
                path = out / "summary.json"
                try:
                    atomic_write_text(path, dumps(summary, indent=2, default=str))  # NaN / inf: null
                except OSError as err:
                    raise OSError(err.errno, f"could not write {path}: {err.strerror or err}") from err
                log.info(f"summary: {path}")
        finished = True
    except BaseException as err:
        if not set_up:
            mark_set_up(err)
            if fresh and main_process:  # a set-up failure (a prompt file, the model, memory): no half run dir is
                discard_run_dir(out)    # left behind; the error itself is on the console
        raise
    finally:
        # a process that exits with its process group alive can abort in the backend's teardown (gloo: SIGABRT,
        # "terminate called without an active exception"), turning a finished run into a failed launch: after a
        # finished run the processes meet (the main one writes the summary last), then each destroys the group
        # (train.py then ends a launched process without the interpreter's teardown: launch.end_launched_process)
        if finished:
            accelerator.wait_for_everyone()
        accelerator.end_training()
    return summary


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run `python train.py` (Hydra entry point)")
