"""Errors for people: what ``python train.py`` prints when a run cannot start for a reason its user can fix.

A user error is printed as one message, without a traceback, and ``train.py`` exits with status 1:

- a config key or value: Hydra's own errors (an unknown key or option, a value of the wrong type) and
  :class:`~flowgrpo.config.ConfigError`; an unknown key, option or choice gets the closest known one
  (``trainer.iteration=5`` → did you mean ``trainer.iterations=5``?);
- a missing path (``FileNotFoundError``, ``NotADirectoryError``, ``IsADirectoryError``, ``PermissionError``) or a
  missing package (an ``ImportError`` that says what to install, or of a module outside this repository);
- a refusal that names the fix (:class:`UserError`: a run dir that holds another run, a resume that would change its
  run, no checkpoint to resume from);
- a value or file the run's set-up refused (a ``ValueError`` or ``OSError`` raised before the first iteration, marked
  by :func:`mark_set_up`: prompt files, the model, the reward's weights).

Anything else (a bug, an error inside the loop) keeps its traceback. ``FLOWGRPO_DEBUG=1``, or Hydra's own
``HYDRA_FULL_ERROR=1``, shows the traceback of every error; ``FLOWGRPO_DEBUG=1`` also brings back the libraries' INFO
lines and loading bars (:mod:`flowgrpo.cli`).

This module imports nothing heavy: ``train.py`` uses it before torch is imported.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import re
import sys
from typing import Iterable, Iterator

__all__ = ["UserError", "DEBUG_ENV", "debugging", "did_you_mean", "mark_set_up", "reported", "user_message"]

#: set to 1 for tracebacks (and the libraries' INFO lines and loading bars) instead of one message per error
DEBUG_ENV = "FLOWGRPO_DEBUG"
_HYDRA_ENV = "HYDRA_FULL_ERROR"
_OWN_PACKAGES = ("flowgrpo", "rewards", "samplers")
_SET_UP = "_flowgrpo_set_up"
_lent = False  # HYDRA_FULL_ERROR=1 was set by reported(), not by the person running


class UserError(Exception):
    """An error the person running fixes by changing the command (its message says how): ``train.py`` prints the
    message alone."""


def _env_is_one(name: str) -> bool:
    return os.environ.get(name, "").strip() == "1"


def debugging() -> bool:
    """Whether the person running asked for tracebacks: ``FLOWGRPO_DEBUG=1`` or ``HYDRA_FULL_ERROR=1``."""
    return _env_is_one(DEBUG_ENV) or (_env_is_one(_HYDRA_ENV) and not _lent)


def did_you_mean(word: str, known: Iterable[str]) -> str | None:
    """The entry of ``known`` closest to ``word`` (``difflib``), or None when none is close.

    >>> did_you_mean("mixsde", ["cps", "dance", "mix_sde", "mix_sde_flash", "sde"])
    'mix_sde'
    """
    found = difflib.get_close_matches(word, [str(k) for k in known], n=1, cutoff=0.6)
    return found[0] if found else None


def mark_set_up(err: BaseException) -> None:
    """Mark ``err`` as raised while the run was set up (before its first iteration): a ``ValueError`` or ``OSError``
    there is a value or file the set-up refused, and its message is what the person needs."""
    with contextlib.suppress(AttributeError):
        setattr(err, _SET_UP, True)


def user_message(err: BaseException, composing: bool = False) -> str | None:
    """The message ``train.py`` prints for ``err`` when it is a user error (see the module's docstring), with the
    notes added to it; None for any other exception. ``composing``: ``err`` left Hydra while it composed the config
    (then Hydra's and OmegaConf's errors are the command line's; inside a run, only a mandatory value left unset is)."""
    for describe in ((_hydra_message,) if composing else ()) + (_unset_value, _config_message, _plain_message):
        text = describe(err)
        if text is not None:
            return "\n".join([text, *getattr(err, "__notes__", ())])
    return None


@contextlib.contextmanager
def reported() -> Iterator[None]:
    """``python train.py``'s user errors as one message each (exit status 1); any other error propagates.

    Used twice: around the whole command (``train.py``'s ``__main__``) and around the run (its Hydra task). The outer
    one sets ``HYDRA_FULL_ERROR=1`` so that Hydra raises what it finds while composing the config (an unknown key or
    option) instead of printing its own report, and the inner one takes it back, so that an error inside the run that
    is not the user's is reported by Hydra as before. Nothing changes when the person asked for tracebacks
    (:func:`debugging`)."""
    global _lent
    if debugging():
        yield
        return
    outer = not _lent
    if outer:
        os.environ[_HYDRA_ENV], _lent = "1", True
    else:
        os.environ.pop(_HYDRA_ENV, None)
        _lent = False
    try:
        yield
    except Exception as err:
        message = user_message(err, composing=outer)
        if message is None:
            raise
        rank = os.environ.get("RANK", "0")
        sys.stdout.flush()
        sys.stderr.write(("" if rank in ("", "0") else f"[rank {rank}] ") + f"error: {message}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None
    finally:
        if outer and _lent:
            os.environ.pop(_HYDRA_ENV, None)
            _lent = False


# ------------------------------------------------------------------------------------------- Hydra's errors


def _unset_value(err: BaseException) -> str | None:
    """A mandatory value (``???``) read while it is unset: which key to set."""
    from omegaconf.errors import MissingMandatoryValue

    if not isinstance(err, MissingMandatoryValue):
        return None
    key = getattr(err, "full_key", None)
    return f"{key} must be set ({key}=...): {_first_line(err)}" if key else _first_line(err)


def _first_line(err: BaseException | None) -> str:
    return str(err).strip().splitlines()[0] if err is not None and str(err).strip() else ""


def _hydra_message(err: BaseException) -> str | None:
    """Hydra's errors while it composes the config, without OmegaConf's type lines, with a suggestion."""
    try:
        from hydra.errors import HydraException, MissingConfigException
        from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
    except ImportError:  # pragma: no cover - Hydra is a dependency
        return None
    if isinstance(err, MissingConfigException):
        return _missing_option(err)
    if not isinstance(err, (HydraException, OmegaConfBaseException)):
        return None
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else None
    text = str(err)
    override = re.search(r"use \+(\S+)", text) or re.search(r"Error merging override (\S+)", text)
    override = override.group(1) if override else getattr(err, "override", None)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and getattr(cause, "full_key", None):
        return _unknown_key(override or cause.full_key, cause)
    if cause is not None:
        return f"{override or cause.full_key}: {_first_line(cause)}"
    lines = [line for line in text.splitlines() if not re.match(r"\s*(full_key:|reference_type=|object_type=)", line)]
    text = "\n".join(lines).strip()
    return f"{override}: {text}" if override and override not in text else text


def _unknown_key(override: str, cause) -> str:
    """``trainer.iteration=5: no key 'iteration' in trainer; did you mean trainer.iterations=5?``"""
    from omegaconf import DictConfig

    full_key, key = str(cause.full_key), str(cause.key)
    where = full_key[: -len(key)].rstrip(".")
    parent = cause.parent_node
    known = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
    if not where:  # the top level: a group (sampler=...) or a group's node (sampler.num_steps=...)
        from .config import CHOOSABLE_GROUPS

        known = [*dict.fromkeys([*CHOOSABLE_GROUPS, *(k for k in known if k != "hydra")])]
    match = did_you_mean(key, known)
    text = f"{override}: no key {key!r} in {where or 'the config'}"
    if match is not None:
        prefix = f"{where}.{match}" if where else match
        text += f"; did you mean {override.replace(full_key, prefix, 1) if full_key in override else prefix}?"
    return text + " (every key: docs/config.md)"


def _missing_option(err) -> str:
    """``sampler=mixsde: no such option; did you mean sampler=mix_sde? (options: cps, dance, ...)``; the typed
    ``base_*`` schemas are not options a person chooses."""
    group, _, name = str(err.missing_cfg_file or "").rpartition("/")
    options = [o for o in (err.options or []) if not o.startswith("base_")]
    if not group or not options:
        return _first_line(err)
    origin = re.match(r"In '([^']+)'", str(err))
    match = did_you_mean(name, options)
    return (f"{group}={name}: no such option" + (f" (asked by {origin.group(1)})" if origin and origin.group(1) !=
                                                 "train" else "")
            + (f"; did you mean {group}={match}?" if match else "") + f" (options: {', '.join(options)})")


# ------------------------------------------------------------------------------------------- the config's checks


def _config_message(err: BaseException) -> str | None:
    """:class:`~flowgrpo.config.ConfigError`'s lines, an unknown key or a value outside its choices with the closest
    known one."""
    config = sys.modules.get("flowgrpo.config")
    if config is None or not isinstance(err, config.ConfigError):
        return None
    return "\n".join(_suggest_in_line(line) for line in str(err).splitlines())


def _suggest_in_line(line: str) -> str:
    unknown = re.match(r"\s*(\S+): unknown key \(not in (\w+), ([\w.]+)\)$", line)
    if unknown:
        key = unknown.group(1)
        try:
            import dataclasses

            schema = getattr(importlib.import_module(unknown.group(3)), unknown.group(2))
            match = did_you_mean(key.rpartition(".")[2], [f.name for f in dataclasses.fields(schema)])
        except (ImportError, AttributeError, TypeError):
            match = None
        return line + (f"; did you mean {key.rpartition('.')[0]}.{match}?" if match else "")
    choice = re.match(r"\s*(\S+)=(['\"]?)(.*?)\2 is not one of (.+)$", line)
    if choice:
        match = did_you_mean(choice.group(3), choice.group(4).split(", "))
        return line + (f"; did you mean {choice.group(1)}={match}?" if match else "")
    return line


# ------------------------------------------------------------------------------------------- paths, packages, refusals


def _plain_message(err: BaseException) -> str | None:
    if isinstance(err, UserError):
        return str(err)
    if isinstance(err, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)):
        return _os_text(err)
    if isinstance(err, ImportError):
        text = str(err)
        if "pip install" in text:
            return text
        name = getattr(err, "name", None)
        if isinstance(err, ModuleNotFoundError) and name and name.split(".")[0] not in _OWN_PACKAGES:
            return f"{text}: install the package that provides it ({DEBUG_ENV}=1 shows where it was imported)"
        return None
    if getattr(err, _SET_UP, False) and isinstance(err, (ValueError, OSError)):
        return f"{_os_text(err)}\n({DEBUG_ENV}=1 shows the traceback)"
    return None


def _os_text(err: BaseException) -> str:
    """An ``OSError``'s message without its ``[Errno N]`` prefix; any other exception's ``str``."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror + (f": {err.filename}" if err.filename else "")
    return str(err)
