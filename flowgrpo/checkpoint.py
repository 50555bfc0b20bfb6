"""Checkpoints that survive a crash, a LoRA that diffusers can load, RNG states, and a clean stop on SIGTERM.

Phase 6 of ``flowgrpo.trainer`` (log / checkpoint). What a resume needs is the trainer's business
(:mod:`flowgrpo.run_state`: weights/LoRA, optimizer, LR schedule, EMA, RNG, window/plan state, step); this module
only makes writing it safe:

>>> manager = CheckpointManager(run_dir / "checkpoints", keep=2)                          # doctest: +SKIP
>>> manager.save(step, {"step": step, "optimizer": opt.state_dict(), "rng": capture_rng_state()},
...              writers={"lora": lambda d: save_lora_weights(pipe, d)})                   # doctest: +SKIP
>>> path, state = manager.load_intact(manager.resume_candidates(PATH))  # newest intact one  # doctest: +SKIP

Layout of ``root``::

    checkpoint-000100/state.pt       torch.save of the state dict
    checkpoint-000100/lora/          one directory or file per writer (here the diffusers-format LoRA)
    checkpoint-000100/manifest.json  every other file with its size and sha256, written last
    latest                           "checkpoint-000100\\n", the last checkpoint written

A checkpoint directory only ever appears under its final name complete: everything is built in a hidden
temporary directory in ``root``, flushed to disk, then renamed. A crash (or a writer that raises) while
saving leaves the previous checkpoint as it was and still ``latest``. A filesystem error (disk full, I/O error)
raises :class:`CheckpointWriteError` naming the checkpoint, the file and the cause.

What is on disk can still go bad later (a copy cut short, a file deleted, a flipped byte): :meth:`verify` checks a
checkpoint against its manifest, and :meth:`CheckpointManager.load_intact` takes the newest candidate that passes,
warning about (and naming) each one it skips; :class:`CheckpointError` when none does. Checkpoints written before
manifests existed (no ``manifest.json``) are only checked by loading their ``state.pt``.

:func:`find_runs` lists earlier runs of the same experiment (the ``meta`` a manifest records) for
``trainer.resume=auto`` in a fresh run directory.

Call ``save`` on the main process only; under FSDP gather the full state dicts first (collectives run on every
rank: ``flowgrpo.finetune.trainable_state(..., gather=True)`` and friends), then let rank 0 write.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from .errors import UserError
from .jsonio import dumps

__all__ = [
    "asks_resume",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointWriteError",
    "GracefulStop",
    "atomic_write_text",
    "capture_rng_state",
    "find_runs",
    "restore_rng_state",
    "save_lora_weights",
    "save_transformer_weights",
]

#: File of the torch-saved state inside a checkpoint directory.
STATE_FILE = "state.pt"
#: Text file in the checkpoint root naming the last checkpoint written.
LATEST_FILE = "latest"
#: JSON file in a checkpoint directory: every other file's size and sha256 (and the saver's ``meta``), written last.
MANIFEST_FILE = "manifest.json"
#: a checkpoint whose weights were found to produce non-finite samples: kept, never resumed from
DIVERGED_FILE = "DIVERGED"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_TMP_PREFIX = ".tmp-checkpoint-"
_TRASH_PREFIX = ".trash-checkpoint-"


# ------------------------------------------------------------------------------------------------ RNG


def capture_rng_state() -> dict:
    """The global RNG states of Python ``random``, NumPy, torch (CPU) and every CUDA device (if available).

    Everything is a tensor or a plain Python value, so the dict saves with ``torch.save`` and loads with
    ``torch.load(weights_only=True)``. States are per process: under multi-process training each rank has its own
    (gather them, e.g. ``accelerate.utils.gather_object``, and restore each rank's own).
    """
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    return state


def restore_rng_state(state: dict) -> None:
    """Restore what :func:`capture_rng_state` captured, so the next draws of every generator repeat.

    CUDA states are restored on as many devices as both the saved state and this process have (a warning when
    the counts differ); saved CUDA states on a machine without CUDA are ignored with a warning.
    """
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "numpy" in state:
        s = state["numpy"]
        key = s["key"].numpy() if isinstance(s["key"], torch.Tensor) else np.asarray(s["key"])
        np.random.set_state({
            "bit_generator": s["bit_generator"],
            "state": {"key": key.astype(np.uint32), "pos": int(s["pos"])},
            "has_gauss": int(s["has_gauss"]),
            "gauss": float(s["gauss"]),
        })
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            warnings.warn("restore_rng_state: the state holds CUDA RNG states but CUDA is not available; ignored",
                          stacklevel=2)
            return
        n = torch.cuda.device_count()
        if n != len(cuda):
            warnings.warn(f"restore_rng_state: {len(cuda)} saved CUDA RNG states for {n} visible devices; "
                          f"restoring the first {min(n, len(cuda))}", stacklevel=2)
        for device, dev_state in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(dev_state.cpu(), device)


# ------------------------------------------------------------------------------------- files on disk


def _fsync_path(path: Path) -> None:
    """fsync one file or directory (directories: best effort; not possible on every OS)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:  # EINVAL/EBADF: directories on some filesystems
        if err.errno not in (errno.EINVAL, errno.EBADF, errno.EISDIR):
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old content or the new, never a part (a temporary file
    beside it, flushed, then renamed over it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # (a full disk) no half-written temporary left beside the file
        raise
    _fsync_path(path.parent)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_table(root: Path) -> dict[str, dict]:
    """``{relative posix path: {"size", "sha256"}}`` of every file under ``root`` but the manifest itself."""
    table = {}
    for dirpath, _, filenames in os.walk(root):
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel != MANIFEST_FILE:
                table[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    return dict(sorted(table.items()))


def _read_manifest(checkpoint: Path) -> dict | None:
    """A checkpoint's parsed manifest, or None when it has none or it cannot be read."""
    try:
        manifest = json.loads((checkpoint / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def _free_space(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:,.0f} MiB free there"
    except OSError:
        return "free space unknown"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used (unreadable, incomplete, corrupt), or no intact one to resume from; the
    message names the checkpoints and what is wrong with each."""


def asks_resume(resume: str | None) -> bool:
    """Whether ``trainer.resume`` asks for a resume (``auto`` or a path); null, empty, ``none`` and ``null`` start
    fresh."""
    return resume is not None and str(resume).strip().lower() not in ("", "none", "null")


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed on the filesystem (disk full, I/O error, permissions). ``errno`` is the cause's;
    the message names the checkpoint, the file and the cause, and says the previous checkpoint is intact."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_SAFE_SCALARS = (int, float, bool, str, bytes, complex, type(None))
_SAFE_TORCH = (torch.dtype, torch.device, torch.Size)


def _check_weights_only(obj, where: str) -> None:
    """Raise TypeError naming the first value ``torch.load(weights_only=True)`` would refuse.

    Checked at save time, so a state that could not be resumed fails at the first checkpoint, not on resume.
    Types are compared exactly: numpy scalars subclass ``float`` but do not load, neither do namedtuples.
    """
    t = type(obj)
    if isinstance(obj, torch.Tensor) or t in _SAFE_SCALARS or isinstance(obj, _SAFE_TORCH):
        return
    if t in (dict, OrderedDict):
        for key, value in obj.items():
            _check_weights_only(key, f"{where} (a key)")
            _check_weights_only(value, f"{where}[{key!r}]")
        return
    if t in (list, tuple, set):
        for i, value in enumerate(obj):
            _check_weights_only(value, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} is a {t.__module__}.{t.__qualname__}, which torch.load(weights_only=True) refuses: store tensors, "
        f"Python numbers/strings and dict/list/tuple of them (e.g. .item(), .tolist(), torch.as_tensor(...), "
        f"a state_dict()), or make the manager with CheckpointManager(..., weights_only=False) for trusted files"
    )


# -------------------------------------------------------------------------------------------- manager


class CheckpointManager:
    """Atomic, pruned checkpoints under one root directory.

    Args:
        root: directory holding ``checkpoint-NNNNNN/`` and ``latest`` (created on the first save).
        keep: checkpoints kept after each save, the one just written included (``None``: keep all).
        weights_only: load with ``torch.load(weights_only=True)`` (no arbitrary code from a checkpoint file)
            and check at save time that the state only holds what that loader accepts.
    """

    def __init__(self, root: str | os.PathLike, *, keep: int | None = 2, weights_only: bool = True):
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 (or None to keep every checkpoint), got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.weights_only = weights_only

    # -- names

    def path(self, step: int) -> Path:
        """The final directory of the checkpoint of ``step``."""
        return self.root / f"checkpoint-{int(step):06d}"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Checkpoint directories as ``(step, dir)``, by increasing step. Temporary directories of saves in progress
        (here or in other processes) are never listed; a listed one can still have gone bad since it was written
        (see :meth:`verify`)."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            m = _NAME.match(child.name)
            if m and child.is_dir():
                found.append((int(m.group(1)), child))
        return sorted(found)

    @staticmethod
    def _looks_complete(path: Path) -> bool:
        return ((path / MANIFEST_FILE).is_file() or (path / STATE_FILE).is_file()) and not (path / DIVERGED_FILE).exists()

    @staticmethod
    def mark_diverged(path: str | os.PathLike, why: str) -> None:
        """Keep checkpoint ``path`` but never resume from it (:meth:`verify` names it, :meth:`latest` passes it
        over): its weights were found to produce non-finite samples."""
        atomic_write_text(Path(path) / DIVERGED_FILE, why.rstrip("\n") + "\n")

    # -- save

    def save(self, step: int, state: dict, *, writers: dict[str, Callable[[Path], None]] | None = None,
             meta: dict | None = None) -> Path:
        """Write ``root/checkpoint-{step:06d}/`` atomically, point ``latest`` at it, prune old checkpoints.

        Args:
            step: the training step (iteration) the state belongs to.
            state: saved with ``torch.save`` as ``state.pt``.
            writers: ``{name: fn}``; each ``fn(dir / name)`` writes one more file or directory (it gets a path
                that does not exist yet), e.g. ``{"lora": lambda p: save_lora_weights(pipe, p)}``.
            meta: JSON-able facts recorded in the manifest (``manifest["meta"]``), e.g. which experiment wrote it
                (:func:`find_runs` matches on them).

        Returns:
            The checkpoint directory.

        An exception from ``torch.save`` or a writer removes the temporary directory and propagates (with a note
        naming the checkpoint); the previous checkpoints and ``latest`` are untouched. A filesystem error (disk full,
        I/O error) is raised as :class:`CheckpointWriteError` naming the checkpoint, the file and the cause. A
        checkpoint of the same step is replaced.
        """
        writers = dict(writers or {})
        if STATE_FILE in writers:
            raise ValueError(f"writer name {STATE_FILE!r} is reserved for the state")
        for name in writers:
            if not name or Path(name).name != name or name.startswith("."):
                raise ValueError(f"writer name {name!r} must be a plain file or directory name")
        if self.weights_only:
            _check_weights_only(state, "state")

        final = self.path(step)
        doing = "creating the checkpoint directory"
        tmp = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temporaries()
            tmp = self.root / f"{_TMP_PREFIX}{int(step):06d}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            doing = f"writing {STATE_FILE}"
            # through a Python file object: a full disk then raises OSError(ENOSPC), not torch's bare zip error
            with open(tmp / STATE_FILE, "wb") as fh:
                torch.save(state, fh)
            for name, write in writers.items():
                doing = f"writing {name!r}"
                write(tmp / name)
            doing = f"writing {MANIFEST_FILE}"
            manifest = {"format": 1, "step": int(step), "written": time.time(), "meta": dict(meta or {}),
                        "files": _file_table(tmp)}
            atomic_write_text(tmp / MANIFEST_FILE, dumps(manifest, indent=1) + "\n")  # last: the seal (NaN: null)
            doing = "flushing and renaming it into place"
            _fsync_tree(tmp)
            if final.exists():
                # POSIX cannot rename a directory onto a non-empty one: move the old one aside first. A crash between
                # the two renames loses this step's old copy only (other checkpoints and their `latest` survive).
                trash = self.root / f"{_TRASH_PREFIX}{final.name}.{uuid.uuid4().hex[:8]}"
                os.replace(final, trash)
                os.replace(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_path(self.root)
        except BaseException as err:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = self.latest()
            kept = (f"the previous checkpoint {previous} is intact and still latest" if previous is not None
                    else "there is no previous checkpoint")
            if isinstance(err, OSError) and not isinstance(err, CheckpointWriteError):
                cause = err.strerror or str(err) or type(err).__name__
                where = f" ({err.filename})" if err.filename else ""
                raise CheckpointWriteError(
                    err.errno, f"could not write checkpoint {final}: {cause}{where} while {doing} "
                    f"({_free_space(self.root)}); nothing was replaced: {kept}") from err
            if isinstance(err, Exception):
                err.add_note(f"(while {doing} for checkpoint {final}; nothing was replaced: {kept})")
            raise
        try:
            atomic_write_text(self.root / LATEST_FILE, final.name + "\n")
        except OSError as err:
            raise CheckpointWriteError(
                err.errno, f"checkpoint {final} was written, but {self.root / LATEST_FILE} could not be updated: "
                f"{err.strerror or err} ({_free_space(self.root)}); a resume may pick an older checkpoint") from err
        self._prune(newest=final)
        return final

    def _prune(self, newest: Path) -> None:
        if self.keep is None:
            return
        others = [(step, path) for step, path in self.checkpoints() if path != newest]
        # The checkpoint just written always stays (even when a resume rolled back to an earlier step), then the
        # highest steps among the others.
        for _, path in others[: max(0, len(others) - (self.keep - 1))]:
            shutil.rmtree(path, ignore_errors=True)

    def _remove_stale_temporaries(self) -> None:
        """Remove temporary directories left by crashed saves of *this host* (their process is gone); those of
        live processes, or of other hosts on a shared filesystem, are left alone."""
        host = socket.gethostname()
        for child in self.root.iterdir():
            # (.trash-checkpoint-* dirs, left only by a crash mid-replace, are kept for manual recovery.)
            if not child.name.startswith(_TMP_PREFIX) or not child.is_dir():
                continue
            parts = child.name[len(_TMP_PREFIX):].split(".")
            # step.host.pid.rand — the host may itself contain dots
            if len(parts) < 4 or not parts[-2].isdigit():
                continue
            if ".".join(parts[1:-2]) == host and not _pid_alive(int(parts[-2])):
                shutil.rmtree(child, ignore_errors=True)

    # -- find and load

    def latest(self) -> Path | None:
        """The checkpoint named by ``root/latest`` if it looks complete (a manifest, or a ``state.pt``), else such
        a checkpoint of highest step, else None. Cheap: nothing is hashed (:meth:`verify` does that)."""
        pointed = self._pointed()
        if pointed is not None and self._looks_complete(pointed):
            return pointed
        found = [path for _, path in self.checkpoints() if self._looks_complete(path)]
        return found[-1] if found else None

    def _pointed(self) -> Path | None:
        try:
            name = (self.root / LATEST_FILE).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
        return self.root / name if _NAME.match(name) and (self.root / name).is_dir() else None

    def candidates(self, start: str | os.PathLike | None = None) -> list[Path]:
        """Checkpoints to try on resume, in order: ``start`` (default: the one ``latest`` names, else the highest
        step), then every other checkpoint of a lower step, highest first. Nothing is checked here."""
        found = self.checkpoints()
        if start is None:
            pointed = self._pointed()
            if pointed is None:
                return [path for _, path in reversed(found)]
            first, rest = pointed, [path for _, path in reversed(found) if path != pointed]
            return [first, *rest]
        start = Path(start)
        m = _NAME.match(start.name)
        if m is None:  # a checkpoint directory renamed or copied elsewhere: only itself
            return [start]
        step = int(m.group(1))
        return [start, *[path for s, path in reversed(found) if s < step]]

    @staticmethod
    def verify(path: str | os.PathLike) -> str | None:
        """None when the checkpoint directory ``path`` is intact, else what is wrong with it (naming the file).

        Intact: ``manifest.json`` reads and lists ``state.pt``, and every file it lists is there with its size and
        sha256. A checkpoint without a manifest passes when it has a ``state.pt`` (written before manifests existed;
        :meth:`load` still fails on one that does not load).
        """
        path = Path(path)
        if not path.is_dir():
            return f"{path} is not a directory"
        if (path / DIVERGED_FILE).exists():
            return f"marked diverged ({path / DIVERGED_FILE}): its weights produced non-finite samples"
        if not (path / MANIFEST_FILE).is_file():
            if (path / STATE_FILE).is_file():
                return None
            return f"incomplete: it has neither {MANIFEST_FILE} nor {STATE_FILE}"
        manifest = _read_manifest(path)
        if manifest is None:
            return f"{path / MANIFEST_FILE} cannot be read (not a manifest)"
        files = manifest["files"]
        if STATE_FILE not in files:
            return f"{path / MANIFEST_FILE} lists no {STATE_FILE}"
        for rel, info in files.items():
            file = path / rel
            try:
                size = file.stat().st_size
            except OSError:
                return f"{file} is missing"
            info = info if isinstance(info, dict) else {}
            if size != info.get("size"):
                return f"{file} is truncated or overwritten ({size} bytes, the manifest says {info.get('size')})"
            try:
                digest = _sha256(file)
            except OSError as err:
                return f"{file} cannot be read ({err.strerror or err})"
            if digest != info.get("sha256"):
                return f"{file} is corrupt (its sha256 differs from the manifest's)"
        return None

    def resolve(self, resume: str | os.PathLike | None) -> Path | None:
        """The checkpoint ``trainer.resume`` asks for.

        Args:
            resume: ``None`` (or ``""``, ``"none"``, ``"null"``): start fresh → None. ``"auto"``: the latest
                checkpoint under this manager's root, or None when there is none (first run of a job that
                resubmits itself). A path: a checkpoint directory, its ``state.pt``, a checkpoint root (its
                latest is used) or a run directory (its ``checkpoints/``); it must exist.

        Raises:
            FileNotFoundError: a path that is not (or holds no) checkpoint; the message names ``trainer.resume``.
        """
        if resume is None or (isinstance(resume, str) and resume.strip().lower() in ("", "none", "null")):
            return None
        if isinstance(resume, str) and resume.strip().lower() == "auto":
            return self.latest()
        return self.resume_candidates(resume)[0]

    def resume_candidates(self, resume: str | os.PathLike) -> list[Path]:
        """The checkpoints to try for ``trainer.resume=PATH``, newest first (see :meth:`candidates`): a checkpoint
        directory (or its ``state.pt``) then the older ones beside it; a checkpoint root or a run directory (its
        ``checkpoints/``): its latest, then the older ones.

        Raises:
            FileNotFoundError: a path that is not (or holds no) checkpoint; the message names ``trainer.resume``.
        """
        path = Path(resume).expanduser()
        if path.is_file() and path.name == STATE_FILE:
            path = path.parent
        if path.is_dir() and (_NAME.match(path.name) or self._looks_complete(path)):
            return CheckpointManager(path.parent).candidates(start=path)
        for root in (path, path / "checkpoints"):
            found = CheckpointManager(root).candidates() if root.is_dir() else []
            if found:
                return found
        raise FileNotFoundError(
            f"trainer.resume={str(resume)!r}: {'no such file or directory' if not path.exists() else 'holds no checkpoint'} "
            f"({path.resolve()}). Set trainer.resume to a checkpoint directory (with {STATE_FILE}), a checkpoint "
            f"root or a run directory (its latest is used), trainer.resume=auto (latest under {self.root} if any) or "
            f"trainer.resume=null"
        )

    def load(self, path: str | os.PathLike) -> dict:
        """``torch.load`` of a checkpoint's state (a checkpoint directory or its ``state.pt``) onto the CPU.

        Raises:
            FileNotFoundError: no ``state.pt`` there.
            CheckpointError: the file does not load (truncated, corrupt, ...); the message names it.
        """
        path = Path(path)
        file = path if path.is_file() else path / STATE_FILE
        if not file.is_file():
            raise FileNotFoundError(f"no checkpoint state at {file} (trainer.resume)")
        try:
            return torch.load(file, map_location="cpu", weights_only=self.weights_only)
        except Exception as err:  # torch's zip reader, the unpickler, EOF, I/O: all name no file
            first_line = (str(err).splitlines() or [""])[0]
            raise CheckpointError(f"{file} cannot be loaded ({type(err).__name__}: {first_line})") from err

    def load_intact(self, candidates: Iterable[str | os.PathLike]) -> tuple[Path, dict]:
        """The first of ``candidates`` (newest first) that :meth:`verify` passes and that loads, with its state.

        Each one skipped is named in a warning (what is wrong with it), then the next older one is tried.

        Raises:
            CheckpointError: none is intact; the message lists every candidate and its fault.
        """
        skipped = []
        for path in map(Path, candidates):
            problem = self.verify(path)
            if problem is None:
                try:
                    return path, self.load(path)
                except (CheckpointError, OSError) as err:
                    problem = str(err)
            skipped.append(f"{path}: {problem}")
            warnings.warn(f"checkpoint {path} is not usable: {problem}; skipped, trying the next older one",
                          RuntimeWarning, stacklevel=2)
        if not skipped:
            raise CheckpointError("no checkpoint to resume from")
        raise CheckpointError("no intact checkpoint to resume from:\n  " + "\n  ".join(skipped) +
                              "\nRestore one, point trainer.resume at another checkpoint, or set trainer.resume=null to "
                              "start fresh")


def find_runs(search_dir: str | os.PathLike, meta: dict, *, exclude: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """Run directories under ``search_dir`` (its children and grandchildren, e.g. Hydra's ``outputs/DATE/TIME``)
    holding a ``checkpoints/`` whose manifests recorded ``meta`` (:meth:`CheckpointManager.save`'s ``meta``), newest
    first: by when their newest such checkpoint was written. ``exclude``: run directories to leave out (this run's).
    Only manifests are read; a run whose every manifest is unreadable is not found."""
    search_dir = Path(search_dir)
    if not search_dir.is_dir():
        return []
    meta = json.loads(dumps(meta))  # as a manifest holds it (tuples are lists, NaN null)
    excluded = {Path(p).resolve() for p in exclude}
    found = []
    for root in {*search_dir.glob("*/checkpoints"), *search_dir.glob("*/*/checkpoints")}:
        run = root.parent
        if run.resolve() in excluded or not root.is_dir():
            continue
        written = [m.get("written", 0.0) for _, path in CheckpointManager(root).checkpoints()
                   if (m := _read_manifest(path)) is not None and m.get("meta") == meta]
        if written:
            found.append((max(written), str(run), run))
    return [run for *_, run in sorted(found, reverse=True)]


# ----------------------------------------------------------------------------------------------- LoRA


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / FSDP-style ``.module`` and ``torch.compile``'s ``_orig_mod`` (what accelerate's unwrap does)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel) or (
            type(model).__name__ in ("FullyShardedDataParallel", "DeepSpeedEngine") and hasattr(model, "module")
        ):
            model = model.module
        else:
            return model


def save_lora_weights(pipe, out_dir: str | os.PathLike, *, transformer: torch.nn.Module | None = None,
                      state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Save the trainable LoRA of the transformer in diffusers format: ``pipe.load_lora_weights(out_dir)`` (or
    ``PipelineClass.load_lora_weights``) loads it into a fresh pipeline.

    Args:
        pipe: the pipeline (or its class) — its ``save_lora_weights`` sets the format (``transformer.`` key prefix).
        out_dir: directory to write ``pytorch_lora_weights.safetensors`` into (created).
        transformer: the LoRA'd transformer, default ``pipe.transformer``; may be the accelerate-wrapped or the
            unwrapped peft-injected model.
        state_dict: the full weights to save, by the transformer's parameter names (at least its LoRA ones), e.g.
            ``flowgrpo.finetune.trainable_state(transformer, gather=True)`` on rank 0 under FSDP, where the module's
            own state dict holds only this rank's shards. Default: the transformer's state dict.

    The adapter's ``LoraConfig`` (rank, alpha, target modules) is saved as metadata, so ``lora_alpha != r``
    survives the round trip. Keys stay in PEFT naming (``...to_q.lora_A.weight``), which is diffusers' format for
    transformer LoRAs (what diffusers' own SD3 / FLUX / Wan LoRA scripts save);
    ``convert_state_dict_to_diffusers`` is for the old UNet / text-encoder format and would rename attention keys
    only, so it is not applied.
    """
    from peft import get_peft_model_state_dict

    cls = pipe if isinstance(pipe, type) else type(pipe)
    if transformer is None:
        if isinstance(pipe, type):
            raise ValueError("save_lora_weights: pass transformer= when pipe is a pipeline class")
        transformer = pipe.transformer
    transformer = _unwrap(transformer)
    peft_config = getattr(transformer, "peft_config", None)
    if not peft_config:
        raise ValueError(
            f"save_lora_weights: {type(transformer).__name__} has no LoRA adapter (full fine-tuning? then save "
            f"transformer.save_pretrained(...) instead)"
        )
    active = transformer.active_adapters() if hasattr(transformer, "active_adapters") else list(peft_config)
    active = [active] if isinstance(active, str) else list(active)
    if len(active) != 1:
        raise ValueError(f"save_lora_weights: expected one active adapter, found {active}")
    name = active[0]
    layers = get_peft_model_state_dict(transformer, state_dict=state_dict, adapter_name=name)
    layers = {k: v.detach().cpu().contiguous() for k, v in layers.items()}
    metadata = peft_config[name].to_dict()
    cls.save_lora_weights(Path(out_dir), transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata)


def save_transformer_weights(transformer: torch.nn.Module, out_dir: str | os.PathLike,
                             params: dict[str, torch.Tensor]) -> None:
    """Write a diffusers model directory (``config.json`` + ``diffusion_pytorch_model.safetensors``, what
    ``save_pretrained`` writes, loadable with ``from_pretrained``) from full parameter tensors ``params`` (every
    parameter by name, e.g. gathered from FSDP shards) and the module's persistent buffers (FSDP does not shard
    buffers)."""
    from safetensors.torch import save_file

    transformer = _unwrap(transformer)
    state = {n: v.detach().cpu().contiguous() for n, v in params.items()}
    for prefix, module in transformer.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                state[f"{prefix}.{name}" if prefix else name] = buf.detach().cpu().contiguous()
    missing = {n for n, _ in transformer.named_parameters()} - state.keys()
    if missing:
        raise ValueError(f"save_transformer_weights: no tensor for {sorted(missing)[:3]} ({len(missing)} parameters)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    transformer.save_config(out_dir)
    save_file(state, out_dir / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------- stop


class GracefulStop:
    """Turn SIGTERM / SIGINT into a request the training loop polls, so it can checkpoint and exit cleanly.

    >>> with GracefulStop() as stop:                                                   # doctest: +SKIP
    ...     for step in range(start, total):
    ...         plan(); rollout(); score()
    ...         if stop.requested: break          # abandon the iteration: checkpoint the last finished one
    ...         advantage(); update(); log()
    ...         if stop.requested: checkpoint(step); break

    The handlers only set ``requested`` (and ``signal``); the loop decides where to stop. A second SIGINT
    (Ctrl-C twice) raises ``KeyboardInterrupt`` for a hard stop. The previous handlers are restored on exit.

    Python only lets the main thread install signal handlers: entered from another thread this is a no-op
    (``active`` is False and ``requested`` only changes through :meth:`request`).

    Under multi-process training every rank gets the signal at its own moment: agree before acting, e.g.
    ``accelerator.reduce(torch.tensor(float(stop.requested), device=accelerator.device), "max") > 0``.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.requested = False
        self.signal: signal.Signals | None = None
        self.active = False
        self._previous: dict[int, object] = {}

    def request(self, signum: int | None = None) -> None:
        """Ask for a stop programmatically (time limit, tests); ``signum`` is remembered when given."""
        if not self.requested and signum is not None:
            self.signal = signal.Signals(signum)
        self.requested = True

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        first = not self.requested
        self.request(signum)
        if first:
            msg = (f"\n{signal.Signals(signum).name} received: stopping after the current phase and writing a "
                   f"checkpoint" + (" (Ctrl-C again to abort now)" if signal.SIGINT in self._previous else "") + "\n")
            try:
                os.write(2, msg.encode())  # unbuffered: print() can fail re-entrantly inside a signal handler
            except OSError:
                pass

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        self.active = True
        return self

    def __exit__(self, *exc) -> bool:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        self.active = False
        return False


#: config keys a resume may change without changing what the run computes: its length, what is logged, evaluated
#: and kept, where it writes, and how rollouts are batched (speed only). A key is matched exactly or, ending in a dot
#: or an underscore, as a prefix.
RESUME_HARMLESS = ("trainer.iterations", "trainer.eval_", "trainer.gallery_", "trainer.log_every",
                   "trainer.checkpoint_every", "trainer.keep_checkpoints", "trainer.resume", "trainer.resume_",
                   "trainer.output_dir", "trainer.overwrite", "trainer.rollout_batch_size",
                   "trainer.max_skipped_updates", "trainer.max_update_ratio", "logger.", "sampler.eval_num_steps",
                   "data.val_file", "data.test_file")


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def resume_config_changes(saved: dict | None, now: dict) -> tuple[list[str], list[str]]:
    """``(meaningful, harmless)``: the config keys whose values differ between a checkpoint's run (``saved``, its
    recorded config) and the resuming one, as ``key: old -> new`` lines. Harmless keys are :data:`RESUME_HARMLESS`;
    every other difference (the algorithm, model, sampler, reward, data, batch plan, optimizer, schedule, seed)
    changes what the resumed run means. A key that only one side has (a checkpoint from before a knob was added) is
    reported as harmless, unless its group's ``name`` changed too (``algo.window.size`` of ``algo=mix_grpo`` against
    ``algo=grpo``): then it is part of that change. A checkpoint without a recorded config gives no differences."""
    if not saved:
        return [], []
    old, new = _flat(saved), _flat(now)
    meaningful, harmless = [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if a == b:
            continue
        line = f"{key}: {a!r} -> {b!r}"
        # a key only one side has comes from another version of the schema (a knob added since, at its default),
        # or from another option of its group (another algorithm's knobs), which the group's name tells apart
        group_name = key.split(".", 1)[0] + ".name"
        absent = (key not in old or key not in new) and old.get(group_name) == new.get(group_name)
        if absent or any(key == h or (h.endswith((".", "_")) and key.startswith(h)) for h in RESUME_HARMLESS):
            harmless.append(line)
        else:
            meaningful.append(line)
    return meaningful, harmless
