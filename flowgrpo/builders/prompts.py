"""Prompt sets: a ``data`` node's train and test files read (plain text or GenEval-style JSONL with metadata), and
the pools the trainer draws prompts from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from omegaconf import DictConfig, OmegaConf

from ..config import config_key, validate
from ..paths import REPO_ROOT, resolve_path

__all__ = ["PromptSet", "build_prompts", "prompt_pools", "tag_rows"]


@dataclass
class PromptSet:
    """Prompts and (JSONL) their metadata records, aligned; ``metadata`` is None for plain text lists."""

    prompts: list[str]
    metadata: list[dict] | None
    source: str
    lines: list[int] | None = None  # the file line of each prompt (error messages), when read from a file

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self) -> Iterator[str]:
        return iter(self.prompts)

    def subset(self, index) -> "PromptSet":
        """The prompts at ``index`` (a sequence of ints), metadata kept aligned."""
        index = [int(i) for i in index]
        meta = None if self.metadata is None else [self.metadata[i] for i in index]
        lines = None if self.lines is None else [self.lines[i] for i in index]
        return PromptSet([self.prompts[i] for i in index], meta, self.source, lines)


def _read_prompts(path: Path, fmt: str, prompt_key: str, key_name: str) -> PromptSet:
    prompts: list[str] = []
    lines: list[int] = []
    metadata: list[dict] | None = [] if fmt == "jsonl" else None
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if fmt == "text":
                if line and not line.startswith("#"):
                    prompts.append(line)
                    lines.append(lineno)
                continue
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not JSON ({err}); is {key_name} a .jsonl file? "
                                 "(plain prompt lists: data.format=text)") from err
            if not isinstance(record, dict) or prompt_key not in record:
                raise ValueError(f"{path}:{lineno}: no {prompt_key!r} field (data.prompt_key)")
            prompts.append(str(record[prompt_key]))
            lines.append(lineno)
            metadata.append(record)
    if not prompts:
        raise ValueError(f"{key_name}={str(path)!r} holds no prompts")
    return PromptSet(prompts, metadata, str(path), lines)


def prompt_pools(prompts: PromptSet, sampling: str) -> list[list[int]]:
    """Index pools the trainer draws prompts from: one pool of everything (``data.sampling=uniform``), or one
    pool per metadata ``tag`` in first-seen order (``tag_balanced``: each tag equally often, whatever its size;
    ``cgpo``: the curriculum's categories).

    Raises:
        ValueError: naming ``data.sampling`` when ``tag_balanced`` / ``cgpo`` meets prompts without a ``tag`` field.
    """
    if sampling == "uniform":
        return [list(range(len(prompts)))]
    _require_tags(prompts, f"data.sampling={sampling}", "; use data.sampling=uniform")
    pools: dict[str, list[int]] = {}
    for i, m in enumerate(prompts.metadata):
        pools.setdefault(str(m["tag"]), []).append(i)
    return list(pools.values())


def tag_rows(metadata: list[dict], tags: list[str], key: str, source: str) -> list[int]:
    """Indices, in file order, of the GenEval records whose ``tag`` is one of ``tags``.

    Raises:
        ValueError: naming ``key`` (the option that gave ``tags``) when it is empty or names a tag no record of
            ``source`` has; the message lists the tags present.
    """
    present = sorted({str(m["tag"]) for m in metadata})
    unknown = [t for t in tags if t not in present]
    if not tags or unknown:
        raise ValueError(f"{key}={tags}: {'no tags given' if not tags else f'no prompt has tag(s) {unknown}'}; "
                         f"the tags of {source} are {present}")
    return [i for i, m in enumerate(metadata) if str(m["tag"]) in tags]


def _require_tags(prompts: PromptSet, option: str, hint: str = "") -> None:
    """Raise naming ``option`` unless every record of ``prompts`` has a metadata ``tag``."""
    if prompts.metadata is None or any("tag" not in m for m in prompts.metadata):
        raise ValueError(f"{option} needs a 'tag' field in every record of {prompts.source} "
                         f"(GenEval-style JSONL){hint}")


def _with_tags(prompts: PromptSet, tags: list[str], key: str) -> PromptSet:
    """The records of ``prompts`` whose metadata ``tag`` is one of ``tags`` (``data.train_tags``), in file order."""
    _require_tags(prompts, f"{key}={tags}")
    return prompts.subset(tag_rows(prompts.metadata, tags, key, prompts.source))


def build_prompts(data: DictConfig, split: str = "train") -> PromptSet | None:
    """Read the ``train``, ``val`` (validation) or ``test`` prompt set of a ``data`` node; a held-out split whose
    file is null → None. The trainer reads ``train`` and ``val``; only ``scripts/paired_eval.py --split test`` reads
    ``test``.

    Raises:
        FileNotFoundError: naming ``data.<split>_file`` when the file does not exist.
    """
    validate(data)
    if split not in ("train", "val", "test"):
        raise ValueError(f"split must be 'train', 'val' or 'test', got {split!r}")
    name = f"{split}_file"
    if OmegaConf.is_missing(data, name):
        raise ValueError(f"{config_key(data, name)} is not set: pass {config_key(data, name)}=PATH")
    value = data[name]
    if value is None:
        return None
    path = resolve_path(value)
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"{config_key(data, name)}={value!r}: no such file (looked under {Path.cwd()} and {REPO_ROOT}); "
            f"set {config_key(data, name)}=PATH"
        )
    prompts = _read_prompts(path, data.format, data.prompt_key, config_key(data, name))
    if split == "train" and data.train_tags is not None:
        prompts = _with_tags(prompts, list(data.train_tags), config_key(data, "train_tags"))
    if split == "train" and data.max_prompts is not None:
        prompts = prompts.subset(range(min(data.max_prompts, len(prompts))))
    return prompts
