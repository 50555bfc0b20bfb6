"""What ``python train.py`` runs: choose the run dir on rank 0, build the :class:`~flowgrpo.trainer.Trainer`,
train, and leave a summary (JSON + reward curves) in the run dir. What it reports, and the traceback of a crash,
also goes to ``train.log`` there (:mod:`flowgrpo.runlog`).

A run dir holds one run: a fresh run (no ``trainer.resume``), or ``trainer.resume=auto`` in a dir whose run left no
checkpoint, refuses a dir that already holds one before writing anything, unless ``trainer.overwrite=true``, which
removes that run's files first. The libraries' loading bars and
INFO lines are off during the run (``FLOWGRPO_DEBUG=1`` shows them)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from .jsonio import dumps
from .checkpoint import CheckpointManager, asks_resume, atomic_write_text
from .config import steps_line, validate
from .errors import DEBUG_ENV, mark_set_up
from .runlog import (LOG_NAME, RunDirInUse, clear_run, close_file_logs, code_version, discard_hydra_dir,
                     discard_run_dir, earlier_run, holds_nothing, log, remove_empty_dirs, run_log)

__all__ = ["main", "resolve_output_dir", "plot_curves", "steps_cost_line"]

_CONF = Path(__file__).resolve().parents[1] / "conf"


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


def _dir_key(cfg: DictConfig) -> str:
    """The key that chose the run dir, for messages."""
    return "trainer.output_dir" if cfg.trainer.output_dir is not None else "hydra.run.dir"


def _holds_checkpoint(path: Path) -> bool:
    """Whether the run dir ``path`` holds a checkpoint a resume would try (``checkpoints/checkpoint-N/``; one that
    turns out corrupt is the resume's to report)."""
    return bool(CheckpointManager(path / "checkpoints").checkpoints())


def _claim(path: Path, cfg: DictConfig) -> list[str]:
    """Whether this run may write into ``path``: a resume (``trainer.resume``) continues whatever is there; a fresh
    run needs a dir that holds no run (:func:`~flowgrpo.runlog.earlier_run`), or ``trainer.overwrite=true``, which
    removes the earlier run's files first, so that the dir never mixes two runs. ``trainer.resume=auto`` in a dir that
    holds a run but no checkpoint of it would be such a fresh start (or a resume of an earlier run of the experiment
    into this one's files), and is treated as one. Returns what was removed.

    Raises:
        RunDirInUse: naming the earlier run's files and the ways on.
    """
    earlier = earlier_run(path)
    if not earlier:
        return []
    resume = cfg.trainer.resume
    auto = asks_resume(resume) and str(resume).strip().lower() == "auto"
    if asks_resume(resume) and not (auto and not _holds_checkpoint(path)):
        return []
    if cfg.trainer.overwrite:
        return clear_run(path)
    key = _dir_key(cfg)
    new_dir = f"{key}=<a new directory> (or leave {key} out: a new outputs/DATE/TIME)"
    if auto:
        raise RunDirInUse(
            f"trainer.resume=auto: {key}={path} holds a run ({', '.join(earlier)}) but no checkpoint to continue "
            f"from (none in {path / 'checkpoints'}): starting there would mix this run with that run's files, so "
            f"nothing was written. Either\n"
            "  start over there: trainer.overwrite=true (deletes that run's files first)\n"
            f"  start a new run:  {new_dir}")
    continue_it = ("  continue it:     trainer.resume=auto\n" if _holds_checkpoint(path) else
                   "  (it has no checkpoint to continue from)\n")
    raise RunDirInUse(
        f"{key}={path} already holds a run ({', '.join(earlier)}): a fresh start (no trainer.resume) would "
        f"overwrite it, so nothing was written. Either\n{continue_it}"
        f"  start a new run: {new_dir}\n"
        "  replace it:      trainer.overwrite=true (deletes its files first)")


def _hydra_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir).resolve() if HydraConfig.initialized() else None


def _adopt_hydra_dir(out: Path) -> None:
    """Hydra made its own run dir before this code ran (with an empty ``train.log`` it kept open until the run
    started). When that dir is not ``out`` (``trainer.output_dir`` was given, or another process chose), it and its
    empty parents are removed, so that no stray ``outputs/...`` is left. A dir holding anything else is left as
    it is."""
    hydra_dir = _hydra_dir()
    if hydra_dir is None or hydra_dir == out.resolve() or not hydra_dir.is_dir():
        return
    try:
        log_file, configs = hydra_dir / LOG_NAME, hydra_dir / ".hydra"
        if log_file.is_file() and log_file.stat().st_size == 0:
            log_file.unlink()
        if configs.is_dir() and not any(p.is_dir() for p in configs.iterdir()):  # hydra.output_subdir set again
            shutil.rmtree(configs)  # the main process writes the record into out (_record_command)
        remove_empty_dirs(hydra_dir)
    except OSError as err:  # tidying up: never worth the run
        warnings.warn(f"could not remove Hydra's run dir {hydra_dir}: {err.strerror or err}", RuntimeWarning,
                      stacklevel=2)


def _record_command(cfg: DictConfig, out: Path) -> None:
    """Hydra's record of the command in ``out/.hydra/``: the config as composed (``config.yaml``), Hydra's settings
    (``hydra.yaml``) and the command line's overrides (``overrides.yaml``), as Hydra writes them. conf/train.yaml sets
    ``hydra.output_subdir: null`` so that Hydra writes nothing into a run dir before this run has claimed it
    (:func:`_claim`); this writes the same files once it has."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra = HydraConfig.instance().cfg  # {"hydra": ...}: what Hydra saves as hydra.yaml
    (out / ".hydra").mkdir(exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", hydra), ("overrides.yaml", hydra.hydra.overrides.task)):
        atomic_write_text(out / ".hydra" / name, OmegaConf.to_yaml(node))


def _shared_output_dir(cfg: DictConfig, accelerator) -> tuple[Path, bool, list[str]]:
    """Every process composes its own config and would pick its own timestamped Hydra dir: rank 0 chooses, the
    others receive its choice. Rank 0 also decides whether this run may use it (:func:`_claim`); a refusal is raised
    on every process, before anything is written. Returns the dir, whether it holds nothing of a run (then a failure
    while the run is set up removes it, :func:`~flowgrpo.runlog.holds_nothing`) and what ``trainer.overwrite=true``
    removed."""
    from accelerate.utils import broadcast_object_list

    chosen = [None, None, None, None]
    if accelerator.is_main_process:
        path = _output_path(cfg)
        try:
            removed, refused = _claim(path, cfg), None
        except RunDirInUse as err:
            removed, refused = [], str(err)
        chosen = [str(path), holds_nothing(path), removed, refused]
        if refused is None:
            _make_dir(path)
    if accelerator.num_processes > 1:
        broadcast_object_list(chosen, from_process=0)
    if chosen[3] is not None:
        raise RunDirInUse(chosen[3])
    out = Path(chosen[0])
    _make_dir(out)
    return out, bool(chosen[1]), list(chosen[2])


def plot_curves(history: list[dict], evals: list[dict], path: Path, per_row: int = 4) -> Path | None:
    """Training reward per iteration and each held-out value at each evaluation, one PNG: a grid of at most
    ``per_row`` panels a row, its rows as even as they can be (7 panels: 4 + 3)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is a convenience; the numbers are in summary.json
        return None
    keys = sorted({k for e in evals for k in e if k.startswith("eval/") and k.count("/") == 1},
                  key=lambda k: (k != "eval/reward", k))  # the held-out reward beside the training reward
    panels = 1 + len(keys)
    rows = math.ceil(panels / per_row)
    cols = math.ceil(panels / rows)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    axes = axes.flatten()
    axes[0].plot([h["iteration"] for h in history], [h["reward/mean"] for h in history])
    axes[0].set(title="train reward", xlabel="iteration")
    for ax, key in zip(axes[1:], keys):
        ax.plot([e["iteration"] for e in evals if key in e], [e[key] for e in evals if key in e], marker="o")
        ax.set(title=key, xlabel="iteration")
    for ax in axes[panels:]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def steps_cost_line(cfg: DictConfig) -> str | None:
    """A line for the start of a run whose sampler samples other step counts than the model's grid (``sampler=mix_sde``
    states 25 where the embedded models' grid is 10): a rollout, or a held-out sample, then costs that ratio of the
    model's velocity calls. None when both counts are the model's."""
    option = cfg.sampler.name
    with contextlib.suppress(Exception):
        from hydra.core.hydra_config import HydraConfig

        option = HydraConfig.get().runtime.choices.get("sampler") or option
    stated = {}
    with contextlib.suppress(OSError, TypeError, ValueError):
        stated = OmegaConf.to_container(OmegaConf.load(_CONF / "sampler" / f"{option}.yaml"))
    parts = []
    for key, what in (("num_steps", "per rollout"), ("eval_num_steps", "per held-out sample")):
        n, grid = int(cfg.sampler[key]), int(cfg.model[key])
        if n != grid:
            source = f"sampler={option}" if stated.get(key) == n else f"sampler.{key}={n}"
            parts.append(f"{source} samples {n} steps where the model's grid has {grid} (model.{key}): about "
                         f"{n / grid:.1f}x its velocity calls {what}")
    return "steps: " + "; ".join(parts) if parts else None


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """The run's console and ``train.log`` show what the run says: the libraries' INFO lines (matplotlib's, ...,
    which reach the root logger Hydra prints and ``train.log`` copies) and diffusers' and transformers' loading bars
    are off until the run ends, unless ``FLOWGRPO_DEBUG=1``. Warnings still show."""
    if os.environ.get(DEBUG_ENV, "").strip() == "1":
        yield
        return
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    root = logging.getLogger()
    level = root.level
    bars = [m for m in (diffusers_logging, transformers_logging) if m.is_progress_bar_enabled()]
    root.setLevel(max(level, logging.WARNING))
    for module in bars:
        module.disable_progress_bar()
    try:
        yield
    finally:
        root.setLevel(level)
        for module in bars:
            module.enable_progress_bar()


def main(cfg: DictConfig) -> dict[str, Any]:
    """Train with ``cfg``; returns the summary (also written to ``summary.json`` in the run dir)."""
    hydra_dir = _hydra_dir()
    if hydra_dir is not None:  # Hydra's train.log: run_log writes it (one writer, and only on the main process)
        close_file_logs(hydra_dir)
    with _quiet_libraries():
        return _train(cfg)


def _train(cfg: DictConfig) -> dict[str, Any]:
    accelerator = None
    try:
        validate(cfg)
        from accelerate import Accelerator

        from .builders import check_config

        accelerator = Accelerator(mixed_precision=cfg.trainer.mixed_precision, cpu=not torch.cuda.is_available())
        check_config(cfg, accelerator.num_processes)  # batch arithmetic, reward ↔ model, sizes: before any run dir
        out, fresh, removed = _shared_output_dir(cfg, accelerator)  # may refuse: nothing written yet
    except BaseException as err:
        mark_set_up(err)
        discard_hydra_dir()
        if accelerator is not None:  # the process group too (see the end of this function)
            accelerator.end_training()
        raise
    from .trainer import Trainer

    main_process = accelerator.is_main_process
    _adopt_hydra_dir(out)
    code = code_version() if main_process else None  # the code as it is when the run starts
    set_up = finished = False
    try:
        with run_log(out, main=main_process):
            if main_process:
                if removed:
                    log.info(f"trainer.overwrite=true: removed the earlier run's {', '.join(removed)} from {out}")
                _record_command(cfg, out)
                OmegaConf.save(cfg, out / "config.yaml", resolve=True)
                if code:
                    log.info(f"code: commit {code['commit']}{' with uncommitted changes' if code['changes'] else ''}")
                log.info(steps_line(cfg))  # the steps sampled, and whether they are the model's grid or stated
                cost = steps_cost_line(cfg)
                if cost:
                    log.info(cost)
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
                # what a seed's numbers depend on besides the code: one kind of CPU kernels computes the same
                # numbers whatever the thread count, another instruction set rounds differently
                summary["cpu_kernels"] = torch.backends.cpu.get_cpu_capability()
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
