"""Turn composed config nodes (``conf/``, schemas in :mod:`flowgrpo.config`) into the objects a run uses.

>>> from flowgrpo.build import build_adapter, build_sampler, build_reward, build_prompts, batch_plan
>>> adapter = build_adapter(cfg.model)                       # doctest: +SKIP
>>> sampler = build_sampler(cfg.sampler, adapter=adapter, model=cfg.model)  # doctest: +SKIP
>>> print(batch_plan(cfg, num_processes=2).banner())        # doctest: +SKIP

Every builder validates its node first (:func:`flowgrpo.config.validate`), and every error names the config
key to change (``data.train_file``, ``model.pretrained``, ``trainer.train_batch_size``, ...).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from .config import STREAM_FAMILY, validate

__all__ = [
    "REPO_ROOT",
    "resolve_path",
    "build_adapter",
    "Sampler",
    "build_sampler",
    "build_reward",
    "PromptSet",
    "prompt_pools",
    "build_prompts",
    "RunLogger",
    "build_logger",
    "BatchPlan",
    "batch_plan",
    "model_kwargs",
    "reward_modality",
    "check_reward_model",
    "check_prompt_metadata",
    "checkpoint_bytes",
    "check_output_dir",
    "Preflight",
    "preflight",
]

#: The repository (or source tree) root: relative paths in configs that do not exist under the working
#: directory are looked up here, so ``python train.py`` works from any directory of an editable install.
REPO_ROOT = Path(__file__).resolve().parents[1]


def _key(node: DictConfig, name: str) -> str:
    """Full dotted key of ``node.name`` (``data.train_file``), or ``name`` for a detached node."""
    prefix = node._get_full_key(None) if isinstance(node, DictConfig) else ""
    return f"{prefix}.{name}" if prefix else name


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


def _looks_local(path: str) -> bool:
    """True when ``path`` is clearly meant as a local path (absolute, ./, ~, or its first directory exists
    here, like ``assets/...``) rather than a hub id ``org/name``."""
    if path.startswith((".", "/", "~")) or os.path.isabs(path):
        return True
    head = Path(path).parts[0] if Path(path).parts else ""
    return any((base / head).is_dir() for base in (Path.cwd(), REPO_ROOT)) and len(Path(path).parts) >= 2


# --------------------------------------------------------------------------------------------- model


def build_adapter(model: DictConfig, *, device: str | torch.device = "cpu"):
    """``flowgrpo.models.load_adapter`` from a ``model`` node.

    ``model.pretrained`` is a local pipeline directory (relative: cwd, then the repo root), a hub id, or
    ``tiny-random:<family>``. A path that is clearly local but missing fails at once (no hub round-trip),
    naming ``model.pretrained``. A streaming model (``model.family=causal_wan``) is loaded by
    ``flowgrpo.models.load_stream_pipeline`` and seen through a ``flowgrpo.models.StreamAdapter``.
    """
    validate(model)
    if model.family == STREAM_FAMILY:
        from .models import StreamAdapter, load_stream_pipeline

        return StreamAdapter(load_stream_pipeline(model, device=device))
    from .models import load_adapter  # heavy (diffusers): import on use

    pretrained = model.pretrained
    if not pretrained.startswith(("tiny-random:", "random-init:")):
        local = resolve_path(pretrained)
        if local is not None:
            pretrained = str(local)
        elif _looks_local(pretrained):
            raise FileNotFoundError(
                f"{_key(model, 'pretrained')}={model.pretrained!r}: no such directory (looked under {Path.cwd()} "
                f"and {REPO_ROOT}). Set {_key(model, 'pretrained')} to a diffusers pipeline directory (with "
                f"model_index.json), a hub id available offline, or tiny-random:{model.family}."
            )
    kwargs = OmegaConf.to_container(model.pipeline_kwargs, resolve=True)
    return load_adapter(
        model.family,
        pretrained,
        torch_dtype=model.torch_dtype,
        device=device,
        attention=model.attention,
        vae_dtype=model.vae_dtype,
        **kwargs,
    )


def model_kwargs(model: DictConfig) -> dict[str, Any]:
    """What ``encode_prompts`` / ``prepare_noise`` / ``velocity`` need from the model node, as plain values:
    ``size`` (height, width, num_frames), ``guidance`` (guidance_scale + family-specific guidance kwargs),
    ``negative_prompt`` and ``max_sequence_length``."""
    return {
        "size": {"height": model.height, "width": model.width, "num_frames": model.num_frames},
        "guidance": {"guidance_scale": model.guidance_scale,
                     **OmegaConf.to_container(model.guidance_kwargs, resolve=True)},
        "negative_prompt": model.negative_prompt,
        "max_sequence_length": model.max_sequence_length,
    }


# ------------------------------------------------------------------------------------------- sampler


@dataclass
class Sampler:
    """A ``sampler`` node made concrete: the schedules, the SDE kernel and the ODE solver.

    Attributes:
        sigmas: ``[T+1]`` schedule of training rollouts (the model scheduler's, unless ``sampler.shift`` is set).
        eval_sigmas: ``[T_eval+1]`` schedule of held-out ODE evaluation.
        kernel, noise_level, solver: as in the config.

    Which steps of a rollout are stochastic and trained is the algorithm's plan
    (``flowgrpo.algorithms.build_algorithm(cfg.algo, cfg.sampler, sampler.sigmas)``).
    """

    sigmas: torch.Tensor
    eval_sigmas: torch.Tensor
    kernel: str
    noise_level: float
    solver: str

    @property
    def num_steps(self) -> int:
        return self.sigmas.shape[0] - 1


def build_sampler(sampler: DictConfig, *, adapter=None, model: DictConfig | None = None) -> Sampler:
    """A :class:`Sampler` from a ``sampler`` node.

    The schedule is the model scheduler's own (``adapter.sigmas`` at ``model``'s size: SD3/Wan static shift,
    FLUX's resolution-dependent μ); without an adapter, or with ``sampler.shift`` set, it is
    ``samplers.flow_sigmas(num_steps, shift)`` (shift 3.0 when unset, SD3's).
    """
    validate(sampler)
    from samplers import flow_sigmas

    def sigmas(steps: int) -> torch.Tensor:
        if sampler.shift is None and adapter is not None:
            size = {} if model is None else {"height": model.height, "width": model.width,
                                             "num_frames": model.num_frames}
            return adapter.sigmas(steps, **size).float().cpu()
        return flow_sigmas(steps, 3.0 if sampler.shift is None else sampler.shift)

    return Sampler(
        sigmas=sigmas(sampler.num_steps),
        eval_sigmas=sigmas(sampler.eval_num_steps),
        kernel=sampler.kernel,
        noise_level=float(sampler.noise_level),
        solver=sampler.solver,
    )


# -------------------------------------------------------------------------------------------- reward


def build_reward(reward: DictConfig):
    """``rewards.load(reward.name, **reward.kwargs)``; errors name ``reward.name`` / ``reward.kwargs``."""
    validate(reward)
    import rewards

    if reward.name not in rewards.available():
        raise KeyError(
            f"{_key(reward, 'name')}={reward.name!r} is not a registered reward; available: "
            f"{', '.join(rewards.available()) or '(none)'}"
        )
    kwargs = OmegaConf.to_container(reward.kwargs, resolve=True)
    try:
        return rewards.load(reward.name, **kwargs)
    except TypeError as err:
        raise TypeError(f"{_key(reward, 'kwargs')}={kwargs!r} rejected by reward {reward.name!r}: {err}") from err


# ---------------------------------------------------------------------------------------------- data


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
    """Read the ``train`` or ``test`` prompt set of a ``data`` node. ``test`` without ``data.test_file`` → None.

    Raises:
        FileNotFoundError: naming ``data.train_file`` / ``data.test_file`` when the file does not exist.
    """
    validate(data)
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    name = f"{split}_file"
    if OmegaConf.is_missing(data, name):
        raise ValueError(f"{_key(data, name)} is not set: pass {_key(data, name)}=PATH")
    value = data[name]
    if value is None:
        return None
    path = resolve_path(value)
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"{_key(data, name)}={value!r}: no such file (looked under {Path.cwd()} and {REPO_ROOT}); "
            f"set {_key(data, name)}=PATH"
        )
    prompts = _read_prompts(path, data.format, data.prompt_key, _key(data, name))
    if split == "train" and data.train_tags is not None:
        prompts = _with_tags(prompts, list(data.train_tags), _key(data, "train_tags"))
    if split == "train" and data.max_prompts is not None:
        prompts = prompts.subset(range(min(data.max_prompts, len(prompts))))
    return prompts


# ----------------------------------------------------------------------------------------- preflight
# Checks that need no model weights and no rollout: a wrong config, data file or output directory fails here,
# at set-up, instead of at the iteration that first meets it.


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
    """What :func:`preflight` built on the way: the reward and the prompt sets, checked against each other."""

    reward: Any
    train_set: PromptSet
    test_set: PromptSet | None


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
    train_set = build_prompts(cfg.data, "train")
    test_set = build_prompts(cfg.data, "test")
    for prompts, key in ((train_set, "data.train_file"), (test_set, "data.test_file")):
        if prompts is not None:
            check_prompt_metadata(prompts, reward, str(cfg.reward.name), key)
            if cfg.model.family == STREAM_FAMILY:
                check_stream_prompts(prompts, cfg.model, key)
    return Preflight(reward, train_set, test_set)


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


# -------------------------------------------------------------------------------------------- logger


@dataclass
class RunLogger:
    """Scalar logging behind one call. ``logger=none`` logs nothing here (the run dir still gets galleries);
    ``logger=wandb`` imports wandb lazily and starts a run (the ``WANDB_MODE`` environment variable wins over
    ``logger.mode``, so tests run it disabled)."""

    name: str
    run: Any = None
    history: list[tuple[int, dict]] = field(default_factory=list)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.history.append((step, dict(scalars)))
        if self.run is not None:
            self.run.log(scalars, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def build_logger(logger: DictConfig, *, output_dir: str | os.PathLike | None = None,
                 config: dict | None = None) -> RunLogger:
    """A :class:`RunLogger` from a ``logger`` node (call on rank 0 only)."""
    validate(logger)
    if logger.name == "none":
        return RunLogger("none")
    import wandb  # optional and lazy

    run = wandb.init(
        project=logger.project,
        entity=logger.entity,
        name=logger.run_name or (Path(output_dir).name if output_dir else None),
        tags=list(logger.tags),
        mode=os.environ.get("WANDB_MODE", logger.mode),
        dir=str(output_dir) if output_dir else None,
        config=config,
    )
    return RunLogger("wandb", run=run)


# ----------------------------------------------------------------------------------------- batch plan


@dataclass
class BatchPlan:
    """The batch arithmetic of one iteration; all counts are per iteration."""

    num_processes: int
    prompts: int  # N, global
    group_size: int  # G
    rollouts: int  # M = N·G, global
    rollouts_per_process: int  # m = M / P
    rollout_batch_per_process: int  # samples per rollout forward on one process
    rollout_chunks: int  # rollout forwards-per-step batches on one process
    trained_steps: int  # K per rollout
    trained_steps_note: str
    train_micro_batch: int  # samples per training forward on one process
    accumulation: int  # A micro-batches per optimizer update
    updates_per_iteration: int  # U (over all inner epochs)
    inner_epochs: int

    @property
    def backward_per_update(self) -> int:
        """Backward passes accumulated into one optimizer update (micro-batches × trained steps)."""
        return self.accumulation * self.trained_steps

    def banner(self) -> str:
        P = self.num_processes
        lines = [
            f"batch plan: {self.prompts} prompts × {self.group_size} samples = {self.rollouts} rollouts/iteration "
            f"over {P} process{'es' if P > 1 else ''} → {self.rollouts_per_process} per process "
            f"(rollout forward: {self.rollout_batch_per_process} samples × {self.rollout_chunks} chunk"
            f"{'s' if self.rollout_chunks > 1 else ''})",
            f"            {self.trained_steps} trained steps each ({self.trained_steps_note}); "
            f"training micro-batch {self.train_micro_batch} per process",
            f"            {self.accumulation} accumulation step{'s' if self.accumulation != 1 else ''} × "
            f"{self.trained_steps} trained steps = "
            f"{self.backward_per_update} backward passes per update → {self.updates_per_iteration} optimizer "
            f"update{'s' if self.updates_per_iteration != 1 else ''} per iteration "
            f"({self.inner_epochs} inner epoch{'s' if self.inner_epochs != 1 else ''})",
        ]
        return "\n".join(lines)


def batch_plan(cfg: DictConfig, num_processes: int = 1, trained_steps: tuple[int, str] | None = None) -> BatchPlan:
    """Derive per-process batch sizes from the global ones in ``cfg.trainer`` and assert they divide evenly.

    ``trained_steps`` is the algorithm's ``(K, note)`` (``Algorithm.trained_steps()``): steps each sample trains;
    omitted, the divisibility is checked alone (before the model and the algorithm are built) and K is 0.

    Raises:
        ValueError: a size that does not divide, naming the knob(s) to change.
    """
    validate(cfg)
    t = cfg.trainer
    P = int(num_processes)
    if P < 1:
        raise ValueError(f"num_processes must be >= 1, got {P}")
    N, G = t.prompts_per_iteration, t.group_size
    M = N * G
    if M % P:
        raise ValueError(
            f"trainer.prompts_per_iteration × trainer.group_size = {N} × {G} = {M} rollouts do not split over "
            f"{P} processes: make {M} a multiple of {P} (change trainer.prompts_per_iteration or trainer.group_size)"
        )
    m = M // P
    R = M if t.rollout_batch_size is None else t.rollout_batch_size
    if R % P or M % R:
        raise ValueError(
            f"trainer.rollout_batch_size={R} must be a multiple of the {P} processes and divide the {M} rollouts "
            f"of an iteration (trainer.prompts_per_iteration × trainer.group_size); or set it to null (all at once)"
        )
    B, A = t.train_batch_size, t.gradient_accumulation_steps
    if B % P:
        raise ValueError(f"trainer.train_batch_size={B} (global) must be a multiple of the {P} processes")
    from .algorithms import ALGORITHMS  # the registry's classes say whether an update keeps groups whole

    algorithm = ALGORITHMS.get(cfg.algo.name)  # an unknown name is reported by build_algorithm, naming algo.name
    if algorithm is not None and algorithm.group_steps and (B // P) % G:
        raise ValueError(f"algo={cfg.algo.name} trains whole groups per micro-batch: the per-process micro-batch "
                         f"(trainer.train_batch_size={B} / {P} processes = {B // P}) must be a multiple of "
                         f"trainer.group_size={G}")
    if M % (B * A):
        raise ValueError(
            f"trainer.train_batch_size × trainer.gradient_accumulation_steps = {B} × {A} = {B * A} samples per "
            f"optimizer update must divide the {M} rollouts of an iteration: change trainer.train_batch_size or "
            f"trainer.gradient_accumulation_steps (or trainer.prompts_per_iteration / trainer.group_size)"
        )
    K, note = trained_steps if trained_steps is not None else (0, "decided by the algorithm")
    updates = t.inner_epochs * M // (B * A)
    return BatchPlan(
        num_processes=P, prompts=N, group_size=G, rollouts=M, rollouts_per_process=m,
        rollout_batch_per_process=R // P, rollout_chunks=M // R, trained_steps=K, trained_steps_note=note,
        train_micro_batch=B // P, accumulation=A, updates_per_iteration=updates, inner_epochs=t.inner_epochs,
    )
