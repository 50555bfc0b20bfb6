"""Where a config's paths point: :data:`REPO_ROOT`, :func:`resolve_path` (an existing local path, relative ones
under the working directory, then the repository root) and :func:`looks_local` (a path clearly meant as local rather
than a hub id). The builders (:mod:`flowgrpo.builders`) and the model loaders (:mod:`flowgrpo.models`) share this rule;
this module imports nothing of the package.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["REPO_ROOT", "resolve_path", "looks_local"]

#: The repository (or source tree) root: relative paths in configs that do not exist under the working
#: directory are looked up here, so ``python train.py`` works from any directory of an editable install.
REPO_ROOT = Path(__file__).resolve().parents[1]


def resolve_path(path: str | os.PathLike) -> Path | None:
    """An existing local path: as given when absolute, else under the cwd, else under :data:`REPO_ROOT`.
    Returns None when none exists."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p if p.exists() else None
    for base in (Path.cwd(), REPO_ROOT):
        if (base / p).exists():
            return (base / p).resolve()
    return None


def looks_local(path: str) -> bool:
    """True when ``path`` is clearly meant as a local path (absolute, ./, ~, or its first directory exists
    here, like ``assets/...``) rather than a hub id ``org/name``."""
    if path.startswith((".", "/", "~")) or os.path.isabs(path):
        return True
    head = Path(path).parts[0] if Path(path).parts else ""
    return any((base / head).is_dir() for base in (Path.cwd(), REPO_ROOT)) and len(Path(path).parts) >= 2
