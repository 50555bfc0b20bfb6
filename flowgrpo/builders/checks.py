"""Checks that need no model weights and no rollout: a wrong config, data file or output directory fails here, at
set-up, instead of at the iteration that first meets it (:func:`preflight`, :func:`check_config`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..config import STREAM_FAMILY
from ..paths import resolve_path
from .batch import batch_plan
from .prompts import PromptSet, build_prompts
from .reward import build_reward

__all__ = ["reward_modality", "check_reward_model", "check_prompt_metadata", "MIN_FREE_BYTES", "checkpoint_bytes",
           "check_output_dir", "Preflight", "check_config", "preflight", "size_multiples", "check_sizes",
           "check_stream_prompts", "checked_prompts"]


def _model_modality(model: DictConfig) -> str:
    return "video" if model.family == "wan" or model.num_frames is not None else "image"


def reward_modality(reward: DictConfig) -> str:
    """What a ``reward`` node scores, from the config alone (nothing is built): ``"video"``, ``"image"`` or
    ``"any"``.

    The registered class's ``modality`` attribute when it has one; else ``video`` for ``video_*`` names, ``any``
    for ``remote`` (its server decides) and ``image`` for the rest. ``multi`` has the modality its components
    share (``"mixed"`` when some score clips and others images).
    """
    import rewards
    from rewards.base import _REGISTRY

    name = str(reward.name)
    if name == "multi":
        parts = {reward_modality(OmegaConf.create({"name": str(spec["name"])}))
                 for spec in ((reward.get("kwargs") or {}).get("components") or []) if "name" in spec} - {"any"}
        return "mixed" if len(parts) > 1 else (parts.pop() if parts else "any")
    rewards.available()  # registers the built-in rewards
    declared = getattr(_REGISTRY.get(name), "modality", None)
    if declared in ("video", "image", "any"):
        return declared
    if name.startswith("video_"):
        return "video"
    return "any" if name == "remote" else "image"


def check_reward_model(reward: DictConfig, model: DictConfig) -> None:
    """Raise ``ValueError`` naming ``reward=`` and ``model=`` when the reward cannot score what the model makes
    (a video reward on an image model, an image reward on a video model). Config only: call before loading."""
    want, have = reward_modality(reward), _model_modality(model)
    if want in ("any", have):
        return
    import rewards

    fits = [n for n in rewards.available()
            if n != "multi" and reward_modality(OmegaConf.create({"name": n})) in (have, "any")]
    what = ("mixes video and image rewards in reward.kwargs.components" if want == "mixed"
            else f"scores {want}s")
    raise ValueError(
        f"reward={reward.name} {what}, but model={model.family} ({model.pretrained}) generates {have}s; "
        f"choose a reward that scores {have}s ({', '.join(fits)}) or "
        f"{'an image' if want == 'image' else 'a video' if want == 'video' else 'a matching'} model"
    )


def _metadata_checks(reward) -> list[tuple[str, Any]]:
    """``(name, check_metadata)`` of a built reward and, for ``multi``, of each of its components."""
    checks = []
    if callable(getattr(reward, "check_metadata", None)):
        checks.append((type(reward).__name__, reward.check_metadata))
    for prefix, part in (getattr(reward, "rewards", None) or {}).items():
        if callable(getattr(part, "check_metadata", None)):
            checks.append((prefix, part.check_metadata))
    return checks


def check_prompt_metadata(prompts: PromptSet, reward, reward_name: str, key: str = "data.train_file") -> None:
    """Check every metadata record of ``prompts`` against the reward's schema (its ``check_metadata``).

    Raises:
        ValueError: ``FILE:LINE: <what is wrong>`` for the first bad record, or naming ``reward=`` and ``key``
            when the reward needs metadata and ``prompts`` is a plain text list.
    """
    checks = _metadata_checks(reward)
    if not checks:
        return
    if prompts.metadata is None:
        raise ValueError(
            f"reward={reward_name} needs a metadata record per prompt, but {key}={prompts.source} is a plain prompt "
            f"list (data.format=text); use a GenEval-style JSONL file with data.format=jsonl"
        )
    for i, record in enumerate(prompts.metadata):
        for _, check in checks:
            try:
                check(record)
            except ValueError as err:
                line = prompts.lines[i] if prompts.lines is not None else None
                where = f"{prompts.source}:{line}" if line is not None else f"{prompts.source} (record {i})"
                raise ValueError(f"{where}: {err} ({key}, reward={reward_name})") from None


#: Free space required in the output directory before the trainable parameter count is known.
MIN_FREE_BYTES = 256 * 2**20


def checkpoint_bytes(num_trainable: int, ema: bool = False) -> int:
    """A generous estimate of one checkpoint's size: fp32 trainable weights, AdamW's two moments, the EMA copy
    when enabled, plus 25% and 16 MiB for the rest of the state."""
    per_param = 4 * (3 + int(bool(ema)))
    return int(num_trainable * per_param * 1.25) + 16 * 2**20


def check_output_dir(path: str | os.PathLike, need_bytes: int = MIN_FREE_BYTES) -> Path:
    """Create ``path`` if needed, prove it writable with a probe file, and check it has ``need_bytes`` free.

    Raises:
        OSError: naming the directory, when it cannot be created or written, or has too little free space.
    """
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-probe-"):
            pass
    except OSError as err:
        raise OSError(f"output directory {str(out)!r} is not writable ({type(err).__name__}: {err}); set "
                      f"trainer.output_dir to a writable directory") from err
    free = shutil.disk_usage(out).free
    if free < need_bytes:
        raise OSError(f"output directory {str(out)!r} has {free / 2**20:.0f} MiB free, but one checkpoint needs "
                      f"about {need_bytes / 2**20:.0f} MiB; free some space or set trainer.output_dir elsewhere")
    return out


@dataclass
class Preflight:
    """What :func:`preflight` built on the way: the reward and the prompt sets, checked against each other (the test
    set is not among them: only the reporting command reads it, through :func:`checked_prompts`)."""

    reward: Any
    train_set: PromptSet
    val_set: PromptSet | None


def check_config(cfg: DictConfig, num_processes: int = 1) -> None:
    """The checks that read nothing but the config (and a local pipeline's ``vae/`` and ``transformer/``
    ``config.json``): the batch arithmetic, reward ↔ model modality, the image or clip size. ``train.py`` runs them
    before it makes a run dir, so a config that cannot run leaves no ``outputs/DATE/TIME`` behind."""
    batch_plan(cfg, num_processes)
    check_reward_model(cfg.reward, cfg.model)
    check_sizes(cfg.model)


def preflight(cfg: DictConfig, output_dir: str | os.PathLike) -> Preflight:
    """Every check that needs no model: reward ↔ model modality, the sizes, the output directory (writable, free
    space), prompt files (present, non-empty, parseable) and their metadata against the reward's schema (file:line).
    Builds the reward and the prompt sets, which the caller keeps."""
    check_reward_model(cfg.reward, cfg.model)
    check_sizes(cfg.model)
    check_output_dir(output_dir)
    reward = build_reward(cfg.reward)
    train_set = checked_prompts(cfg, reward, "train")
    return Preflight(reward, train_set, checked_prompts(cfg, reward, "val"))


def checked_prompts(cfg: DictConfig, reward, split: str) -> PromptSet | None:
    """The ``split`` prompt set of ``cfg.data`` (``train``, ``val`` or ``test``), its metadata checked against
    ``reward``'s schema and, for a streaming model, its streams against the model; None for a null held-out file."""
    prompts = build_prompts(cfg.data, split)
    if prompts is not None:
        key = f"data.{split}_file"
        check_prompt_metadata(prompts, reward, str(cfg.reward.name), key)
        if cfg.model.family == STREAM_FAMILY:
            check_stream_prompts(prompts, cfg.model, key)
    return prompts


def size_multiples(model: DictConfig) -> dict | None:
    """What ``model.height`` / ``width`` (and ``num_frames``) must be multiples of, read from the pipeline's
    ``vae/config.json`` and ``transformer/config.json`` without loading it: ``{"spatial": n}`` and, for Wan,
    ``{"temporal": n}`` (frames = n·k + 1). None when the checkpoint is not a local diffusers folder (a hub id, the
    in-memory twins): the adapter checks the sizes when it first needs a latent."""
    root = resolve_path(str(model.pretrained)) if not str(model.pretrained).startswith("tiny-random:") else None
    family = str(model.family)
    if root is None or family not in ("sd3", "flux", "wan", STREAM_FAMILY):
        return None
    try:
        vae = json.loads((root / "vae" / "config.json").read_text())
        transformer = json.loads((root / "transformer" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if family in ("wan", STREAM_FAMILY):  # AutoencoderKLWan: 2x per downsampling stage in space, listed ones in time
        stages = vae.get("temperal_downsample") or []
        patch = transformer.get("patch_size") or [1, 1, 1]
        return {"spatial": 2 ** len(stages) * int(patch[1]), "temporal": 2 ** sum(bool(x) for x in stages)}
    scale = 2 ** (len(vae.get("block_out_channels") or [0]) - 1)
    return {"spatial": scale * (2 if family == "flux" else int(transformer.get("patch_size", 1)))}


def check_sizes(model: DictConfig) -> None:
    """``model.height`` / ``width`` / ``num_frames`` against what the pipeline can generate, before it loads:
    ``ValueError`` naming the keys, the multiple and the nearest sizes that work."""
    multiples = size_multiples(model)
    if multiples is None:
        return
    m = multiples["spatial"]
    for key in ("height", "width"):
        value = int(model[key])
        if value % m or value <= 0:
            near = sorted({max(m, value // m * m), value // m * m + m})
            raise ValueError(f"model.{key}={value}: {model.family} at {model.pretrained} generates sizes divisible by "
                             f"{m} (VAE downsampling x patch size); try model.{key}=" + " or ".join(map(str, near)))
    temporal = multiples.get("temporal")
    frames = model.get("num_frames")
    if temporal and frames is not None and (int(frames) - 1) % temporal:
        k = (int(frames) - 1) // temporal
        near = sorted({temporal * max(k, 0) + 1, temporal * (k + 1) + 1})
        raise ValueError(f"model.num_frames={frames}: {model.family} at {model.pretrained} generates {temporal}·k + 1 "
                         "frames; try model.num_frames=" + " or ".join(map(str, near)))


def check_stream_prompts(prompts: PromptSet, model: DictConfig, key: str) -> None:
    """A streaming model's prompts are streams: every record lists its segments (prompt, start frame) and is as long
    as ``model.num_frames``. Raises ``ValueError`` naming ``FILE:LINE`` and the key."""
    for i, record in enumerate(prompts.metadata or [None]):
        line = prompts.lines[i] if prompts.lines is not None and record is not None else None
        where = f"{prompts.source}:{line}" if line is not None else prompts.source
        segments = record.get("segments") if isinstance(record, dict) else None
        if not segments or not all(isinstance(s, dict) and "prompt" in s and "start" in s for s in segments):
            raise ValueError(f"{where}: a streaming model (model.family={STREAM_FAMILY}) trains on streams: each "
                             f"record needs 'segments', a list of {{'prompt', 'start'}} ({key}; e.g. "
                             f"assets/prompts/streams_train.jsonl)")
        frames = record.get("num_frames")
        if frames is not None and int(frames) != model.num_frames:
            raise ValueError(f"{where}: a stream of {frames} frames, but model.num_frames={model.num_frames} ({key})")
