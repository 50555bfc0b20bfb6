"""The run log: what the trainer and the CLI report goes to the console (as before) and to ``<run dir>/train.log``.

Messages go through the ``flowgrpo`` logger (:data:`log`). :func:`run_log` attaches ``train.log`` for the duration of
a run on the main process only (the others write no file), copies ``warnings.warn`` into it, and writes the
traceback of an exception that ends the run before the exception propagates. Console lines are written with
``tqdm.write`` so that they do not collide with a progress bar.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Iterator

from .errors import UserError

__all__ = ["log", "run_log", "bar_paused", "LOG_NAME", "RUN_ENTRIES", "RunDirInUse", "earlier_run", "clear_run"]

LOG_NAME = "train.log"
#: what a run writes into its run dir (flowgrpo.cli, the trainer, the galleries, the file-based loggers): a dir holding
#: any of them holds a run; trainer.overwrite=true removes them (and Hydra's record of the command, .hydra/) and
#: nothing else
RUN_ENTRIES = ("config.yaml", LOG_NAME, "metrics.jsonl", "summary.json", "curves.png", "checkpoints", "gallery",
               "wandb", "tensorboard", "mlruns", ".aim")
log = logging.getLogger("flowgrpo")
_warnings_log = logging.getLogger("py.warnings")  # the logger logging.captureWarnings writes to
_FILE_ONLY = "flowgrpo_file_only"


class _ConsoleHandler(logging.Handler):
    """The console, as ``print`` wrote it: the message alone; INFO to stdout, WARNING and above to stderr; through
    ``tqdm.write`` so that a progress bar on the terminal is cleared and redrawn around the line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, _FILE_ONLY, False) and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm.auto import tqdm

            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            tqdm.write(record.getMessage(), file=stream)
            stream.flush()
        except Exception:  # pragma: no cover - logging's own convention: never raise from a handler
            self.handleError(record)


def _console() -> None:
    """One console handler on the ``flowgrpo`` logger (idempotent); it does not propagate to the root logger, whose
    handlers (Hydra's) would print the line a second time in another format."""
    if not any(isinstance(h, _ConsoleHandler) for h in log.handlers):
        log.addHandler(_ConsoleHandler())
    log.setLevel(logging.INFO)
    log.propagate = False


_console()

_active: dict[Path, list] = {}  # train.log path -> [file handler, nesting depth]


def _file_handler(path: Path) -> logging.FileHandler:
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    return handler


@contextlib.contextmanager
def _capture_warnings(handler: logging.Handler) -> Iterator[None]:
    """Copy every shown warning into ``handler`` (as ``logging.captureWarnings`` would, under the ``py.warnings``
    logger), then show it as before: on the console, or to whatever recorder (``pytest.warns``,
    ``warnings.catch_warnings(record=True)``) was installed. ``logging.captureWarnings`` itself would replace that
    display, and a recorder would see nothing."""
    previous = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        record = _warnings_log.makeRecord(_warnings_log.name, logging.WARNING, filename, lineno,
                                          warnings.formatwarning(message, category, filename, lineno, line).rstrip(),
                                          None, None)
        if handler.filter(record):
            handler.handle(record)
        try:
            from tqdm.auto import tqdm

            mode = tqdm.external_write_mode(file=file or sys.stderr)
        except ImportError:  # pragma: no cover
            mode = contextlib.nullcontext()
        with mode:
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    try:
        yield
    finally:
        if warnings.showwarning is showwarning:
            warnings.showwarning = previous


def _log_crash(err: BaseException) -> None:
    """The traceback into the file only (Python prints it on the console when the exception ends the process)."""
    if getattr(err, "_flowgrpo_logged", False):
        return
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip()
    log.error("the run ended with an exception:\n%s", text, extra={_FILE_ONLY: True})
    try:
        err._flowgrpo_logged = True  # a run log nested in another writes it once
    except AttributeError:  # pragma: no cover
        pass


@contextlib.contextmanager
def run_log(run_dir: str | Path, main: bool = True) -> Iterator[Path | None]:
    """Attach ``<run_dir>/train.log`` (appended to, as a resumed run continues its log) for the duration; yields
    its path, ``None`` when not ``main``. Nested calls for the same dir share one file handler. An exception leaving
    the block has its traceback written to the file, then propagates unchanged."""
    if not main:
        yield None
        return
    path = (Path(run_dir) / LOG_NAME).resolve()
    entry = _active.get(path)
    if entry is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = _active[path] = [_file_handler(path), 0]
    handler = entry[0]
    entry[1] += 1
    outer = entry[1] == 1
    root = logging.getLogger()
    if outer:
        log.addHandler(handler)
        root.addHandler(handler)  # other libraries' records that reach the root logger (warnings of diffusers, ...)
    try:
        with _capture_warnings(handler) if outer else contextlib.nullcontext():
            try:
                yield path
            except BaseException as err:
                if not isinstance(err, (SystemExit, GeneratorExit)):
                    _log_crash(err)
                raise
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            log.removeHandler(handler)
            root.removeHandler(handler)
            handler.close()
            del _active[path]


@contextlib.contextmanager
def bar_paused(bar) -> Iterator[None]:
    """Leave the time spent in the block out of a tqdm bar's elapsed time and its s/it (the iteration bar counts
    iterations, not the held-out evaluations between them). ``bar``: a tqdm bar, or None."""
    start = time.time()  # tqdm's own clock
    try:
        yield
    finally:
        if bar is not None and not getattr(bar, "disable", True):
            spent = time.time() - start
            bar.start_t += spent
            bar.last_print_t += spent  # the next update's interval, from which the rate is smoothed


def code_version(where: str | Path | None = None) -> dict | None:
    """The git commit of the code at ``where`` (default: this package) and whether tracked files differ from it:
    ``{"commit": "abc1234", "changes": False}``; None outside a git work tree (an installed package) or without git.
    A run records it so that a published number names the code that produced it."""
    where = Path(where) if where is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=where, capture_output=True, text=True,
                              timeout=30)
        if head.returncode != 0:
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "changes": bool(status.stdout.strip())}


def code_label(version: dict | None) -> str | None:
    """:func:`code_version`'s result as one string: ``abc1234``, or ``abc1234+changes`` when tracked files differed
    from that commit; None for None."""
    return None if version is None else version["commit"] + ("+changes" if version["changes"] else "")


def close_file_logs(directory: Path) -> None:
    """Detach and close the root logger's file handlers writing into ``directory`` (Hydra's own ``train.log``)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).resolve().parent == directory:
            root.removeHandler(handler)
            handler.close()


def remove_empty_dirs(start: Path) -> None:
    """Remove ``start`` and its parents while they are empty, up to (not including) the working directory."""
    stop = Path.cwd().resolve()
    for d in [start, *start.parents]:
        if d == stop or stop not in d.parents or any(d.iterdir()):
            break
        d.rmdir()


def holds_nothing(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds nothing of a run: it is missing, empty, or holds only what Hydra makes before the
    run starts (``.hydra/`` and an empty log)."""
    if not run_dir.is_dir():
        return True
    log_file = run_dir / LOG_NAME
    return not any(p.name != ".hydra" and not (p == log_file and p.stat().st_size == 0) for p in run_dir.iterdir())


class RunDirInUse(UserError):
    """A fresh run (no ``trainer.resume``) was pointed at a run dir that holds another run; the message names the
    ways on (resume it, another dir, ``trainer.overwrite=true``)."""


def earlier_run(run_dir: Path) -> list[str]:
    """What of an earlier run ``run_dir`` holds (entries of :data:`RUN_ENTRIES`, dirs with a trailing ``/``); empty
    when it holds none. An empty ``train.log`` is not one: Hydra opens it before the run starts."""
    if not run_dir.is_dir():
        return []
    found = []
    for name in RUN_ENTRIES:
        path = run_dir / name
        if path.is_dir():
            found.append(f"{name}/")
        elif (path.exists() or path.is_symlink()) and not (name == LOG_NAME and path.is_file()
                                                           and path.stat().st_size == 0):
            found.append(name)
    return found


def clear_run(run_dir: Path) -> list[str]:
    """Remove what an earlier run left in ``run_dir`` (:data:`RUN_ENTRIES` and ``.hydra/``), leaving anything else
    there; returns what was removed. Hydra's handle on ``train.log`` is closed first."""
    close_file_logs(run_dir.resolve())
    removed = []
    for name in (*RUN_ENTRIES, ".hydra"):
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            removed.append(f"{name}/")
        elif path.exists() or path.is_symlink():
            path.unlink()
            removed.append(name)
    return removed


def discard_run_dir(run_dir: Path) -> None:
    """Remove a run dir this run made (with its empty parents, up to the working directory) when the run failed
    while it was being set up: an empty or half-made run dir would otherwise look like a run (``trainer.resume=auto``
    searches them) and a timestamped Hydra dir would stay under ``outputs/``."""
    close_file_logs(run_dir)
    try:
        shutil.rmtree(run_dir)
        remove_empty_dirs(run_dir.parent)
    except OSError as err:
        warnings.warn(f"could not remove the run dir {run_dir}: {err.strerror or err}", RuntimeWarning, stacklevel=2)


def discard_hydra_dir() -> None:
    """A run that fails before it has a run dir of its own (a bad config — schema, ranges, batch arithmetic, reward ↔
    model, image or clip size — or an output dir that cannot be made) leaves no trace of Hydra's: its timestamped dir
    goes when it holds nothing but ``.hydra/`` and an empty log."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hydra_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    close_file_logs(hydra_dir)
    if not hydra_dir.is_dir():
        return
    if not holds_nothing(hydra_dir):
        return  # something of the user's is there
    try:
        shutil.rmtree(hydra_dir)
        remove_empty_dirs(hydra_dir.parent)
    except OSError as err:
        warnings.warn(f"could not remove Hydra's run dir {hydra_dir}: {err.strerror or err}", RuntimeWarning,
                      stacklevel=2)
