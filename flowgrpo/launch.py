"""Launch checks: a multi-process launch that would quietly run as one process is refused with the fix.

``accelerate launch --cpu --num_processes N`` (or a config file with ``use_cpu: true`` and ``num_processes: N``)
starts **one** process whatever N is — accelerate's ``--cpu`` path is its single-process launcher — and sets
``OMP_NUM_THREADS=1`` in it, so the run is one single-threaded process where N were asked for. Nothing in the
launched process's environment says N; the launcher's own command line does, so :func:`check_launch` reads the
parent process's arguments (Linux ``/proc``; elsewhere the check is skipped).

Multi-process CPU runs work with ``torchrun --nproc_per_node N train.py ...`` or ``accelerate launch --multi_gpu
--num_processes N train.py ...`` on a machine without GPUs: both start N processes on the gloo backend.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["requested_processes", "parent_argv", "check_launch", "end_launched_process"]


def _launcher_args(argv: Sequence[str]) -> list[str]:
    """The ``accelerate launch`` options of a launcher command line (those before the training script)."""
    argv = list(argv)
    # `accelerate launch ...` or `python -m accelerate.commands.launch ...`
    marks = [i for i, a in enumerate(argv) if a == "launch" or a.endswith("accelerate.commands.launch")]
    if not marks:
        return []
    start = marks[0] + 1
    out = []
    for arg in argv[start:]:
        if arg.endswith(".py") and not arg.startswith("-"):
            break  # the training script: what follows is its own arguments
        out.append(arg)
    return out


def _option(args: Sequence[str], name: str) -> str | None:
    """Value of ``--name V`` / ``--name=V`` (accelerate also accepts dashes for underscores)."""
    names = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in names:
            if eq:
                return value
            return args[i + 1] if i + 1 < len(args) else None
    return None


def requested_processes(argv: Sequence[str]) -> tuple[int | None, bool]:
    """``(num_processes, cpu)`` asked of ``accelerate launch`` by its command line ``argv`` (``--num_processes``
    and ``--cpu``, else the ``--config_file``'s ``num_processes`` / ``use_cpu``); ``(None, False)`` when ``argv``
    is not an ``accelerate launch`` command line."""
    args = _launcher_args(argv)
    if not args:
        return None, False
    num, cpu = _option(args, "num_processes"), "--cpu" in args
    config = _option(args, "config_file")
    if config and Path(config).is_file():
        from omegaconf import OmegaConf

        try:
            node = OmegaConf.load(config)
        except Exception:  # an unreadable config is accelerate's to report
            node = {}
        if num is None and node.get("num_processes") is not None:
            num = node.get("num_processes")
        cpu = cpu or bool(node.get("use_cpu", False))
    try:
        return (int(num) if num is not None else None), cpu
    except ValueError:
        return None, cpu


def parent_argv(pid: int | None = None) -> list[str]:
    """Command line of the parent process (of ``pid``, default this one) from ``/proc``; ``[]`` if unreadable."""
    try:
        ppid = os.getppid() if pid is None else int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        raw = Path(f"/proc/{ppid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def check_launch(environ: Mapping[str, str] | None = None, launcher_argv: Sequence[str] | None = None) -> None:
    """Raise ``SystemExit`` with the fix when an ``accelerate launch --cpu`` asked for more than one process but
    this is the only one (``WORLD_SIZE`` unset or 1). ``environ`` / ``launcher_argv`` default to this process's
    environment and its parent's command line."""
    environ = os.environ if environ is None else environ
    if str(environ.get("ACCELERATE_USE_CPU", "")).lower() not in ("true", "1"):
        return  # not launched by accelerate with --cpu
    if int(environ.get("WORLD_SIZE", "1") or 1) > 1:
        return  # a real multi-process launch
    argv = parent_argv() if launcher_argv is None else list(launcher_argv)
    num, cpu = requested_processes(argv)
    if not cpu or num is None or num <= 1:
        return
    threads = environ.get("OMP_NUM_THREADS")
    raise SystemExit(
        f"accelerate launch --cpu was asked for {num} processes but started one: its --cpu path is a single-process "
        f"launcher{f', and it set OMP_NUM_THREADS={threads} in it' if threads else ''}, so this run would train as "
        f"one {'single-threaded ' if threads == '1' else ''}process without saying so. For {num} CPU processes "
        f"launch with `torchrun --nproc_per_node {num} train.py ...` or `accelerate launch --multi_gpu "
        f"--num_processes {num} train.py ...` (without --cpu / use_cpu: on a machine without GPUs both start "
        f"{num} gloo processes). For one process, drop --num_processes (or set it to 1).")


def end_launched_process(environ: Mapping[str, str] | None = None) -> None:
    """End a process of a multi-process launch whose run finished: the exit handlers (``atexit``) and the log handlers
    run, the output is flushed, and the process exits 0 at once. A no-op in a single process (no ``WORLD_SIZE`` > 1).

    Without it the interpreter's own teardown would free the training objects that still hold the process group (the
    DDP-wrapped model keeps it after ``destroy_process_group``); a gloo worker thread that wants the GIL while the
    interpreter is being finalised is unwound by Python, which aborts the process (SIGABRT, "terminate called
    without an active exception") after everything was saved, now and then, and turns a finished run into a failed
    launch. The processes have met before this point (:func:`flowgrpo.cli.main` waits for all of them before it
    destroys the group), so none leaves while a peer is still inside a collective."""
    environ = os.environ if environ is None else environ
    if int(environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return
    atexit._run_exitfuncs()  # what a normal exit runs first: trackers, multiprocessing's children, temp dirs
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
