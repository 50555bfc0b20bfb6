"""Typed schemas of the Hydra config tree (``conf/``), registered in Hydra's ConfigStore.

Every config group of DESIGN.md has one dataclass schema here, stored as ``<group>/base_<group>``; each
group file extends it through its own defaults list (``defaults: [base_model, _self_]``), and
``conf/train.yaml`` extends the top-level :class:`TrainConfig` (``base_train``). Hydra then rejects

* an unknown key — ``python train.py model.foo=1`` → ``Key 'foo' is not in struct ... full_key: model.foo``;
* a wrong type — ``trainer.group_size=abc`` → ``Value 'abc' ... could not be converted to Integer ...
  full_key: trainer.group_size``.

Choices and ranges that OmegaConf cannot express (it has no ``Literal``; its Enums would turn ``"dpm++2m"``
into an invalid identifier and hand Enum objects to the trainer) are declared on the field itself —
``field(metadata={"choices": (...)})``, ``{"ge": 1}`` — and checked by :func:`validate`, whose errors name
the full key too (``sampler.kernel='foo' is not one of ...``). ``flowgrpo.build`` and ``flowgrpo.cli`` call it
before anything is built, so a typo fails in a second, not after the model has loaded.

Importing this module registers the schemas (idempotent).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

__all__ = [
    "ModelConfig",
    "LoraConfig",
    "SamplerConfig",
    "WindowConfig",
    "AlgoConfig",
    "FlashConfig",
    "RewardConfig",
    "DataConfig",
    "LoggerConfig",
    "TrainerConfig",
    "EMAConfig",
    "TrainConfig",
    "GROUP_SCHEMAS",
    "register_configs",
    "validate",
    "ConfigError",
]


class ConfigError(ValueError):
    """A config value is outside its allowed set or range; the message names the full key."""


def _knob(default: Any = MISSING, *, choices: tuple | None = None, ge: float | None = None,
          gt: float | None = None, le: float | None = None):
    """A dataclass field carrying the constraints :func:`validate` checks."""
    meta = {k: v for k, v in dict(choices=choices, ge=ge, gt=gt, le=le).items() if v is not None}
    return field(default=default, metadata=meta)


DTYPES = ("float32", "bfloat16", "float16")

# --------------------------------------------------------------------------------------------- model


@dataclass
class LoraConfig:
    """peft LoRA on the denoiser (the transformer); used when ``model.finetune=lora``."""

    rank: int = _knob(32, ge=1)  # LoRA rank r
    alpha: float = _knob(64.0, gt=0)  # scale alpha/r on the LoRA branch
    dropout: float = _knob(0.0, ge=0, le=1)  # LoRA dropout (0 keeps rollout and training forwards identical)
    init_weights: str = _knob("gaussian", choices=("gaussian", "default", "pissa", "olora"))  # peft init_lora_weights
    target_modules: List[str] = field(default_factory=list)  # module-name suffixes to wrap, per model family


@dataclass
class ModelConfig:
    """Which pipeline to load and how to run it (``conf/model/*.yaml``)."""

    family: str = _knob(MISSING, choices=("sd3", "flux", "wan"))  # adapter: StableDiffusion3 / Flux / Wan pipeline
    pretrained: str = MISSING  # local dir, hub id, or "tiny-random:<family>" for the in-memory test twin
    torch_dtype: str = _knob("float32", choices=DTYPES)  # dtype the frozen weights load in
    vae_dtype: Optional[str] = _knob(None, choices=(None, *DTYPES))  # the decoder's dtype; null = torch_dtype
    attention: str = _knob("sdpa", choices=("sdpa", "xformers"))  # attention kernel; xformers needs flowgrpo[xformers]
    height: int = _knob(MISSING, ge=8)  # image height in pixels
    width: int = _knob(MISSING, ge=8)  # image width in pixels
    num_frames: Optional[int] = _knob(None, ge=1)  # video frames (Wan); null for image models
    guidance_scale: float = _knob(1.0, ge=0)  # CFG scale at rollout (FLUX-dev: distilled guidance embedding)
    guidance_kwargs: Dict[str, Any] = field(default_factory=dict)  # family-specific guidance (FLUX: true_cfg_scale)
    negative_prompt: str = ""  # negative prompt for CFG
    max_sequence_length: Optional[int] = _knob(None, ge=1)  # text tokens for T5/UMT5; null = pipeline default
    finetune: str = _knob("lora", choices=("lora", "full"))  # train LoRA adapters, or every transformer weight
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA shape and where it goes
    gradient_checkpointing: bool = False  # trade compute for memory in the transformer's backward
    pipeline_kwargs: Dict[str, Any] = field(default_factory=dict)  # extra from_pretrained kwargs (text_encoder_3: null)


# ------------------------------------------------------------------------------------------- sampler


@dataclass
class WindowConfig:
    """MixGRPO's sliding SDE window (arXiv 2507.21802); mirrors ``samplers.SDEWindow``'s arguments."""

    size: int = _knob(4, ge=1)  # w: SDE (and trained) steps per rollout
    shift_interval: int = _knob(25, ge=1)  # tau: iterations between window moves
    stride: int = _knob(1, ge=1)  # s: steps the window moves each time
    schedule: str = _knob("progressive", choices=("progressive", "random", "linear_decay", "exp_decay", "frozen"))
    start: int = _knob(0, ge=0)  # first window position l
    seed: int = 0  # RNG of the "random" schedule (saved with the window state)
    decay_rate: float = _knob(0.1, ge=0)  # k of exp_decay / slope of linear_decay on tau
    decay_threshold: int = _knob(0, ge=0)  # l_thr: window position where the interval starts decaying
    min_interval: int = _knob(1, ge=1)  # floor of the decayed interval


@dataclass
class SamplerConfig:
    """How rollouts integrate noise → data: steps, schedule, which steps are stochastic (``conf/sampler/``)."""

    name: str = MISSING  # the option's name, for logs
    num_steps: int = _knob(10, ge=1)  # T: sampling steps of a training rollout
    eval_num_steps: int = _knob(40, ge=1)  # ODE steps of held-out evaluation / galleries
    shift: Optional[float] = _knob(None, gt=0)  # override the model's schedule shift; null = the scheduler's own
    sde: str = _knob("all", choices=("all", "window", "none"))  # stochastic steps: every one, MixGRPO window, none
    kernel: str = _knob("flow_grpo", choices=("flow_grpo", "dance", "cps"))  # SDE transition (MATH.md)
    noise_level: float = _knob(0.7, ge=0)  # a (flow_grpo, cps) or eta (dance)
    solver: str = _knob("euler", choices=("euler", "dpm++2m"))  # ODE solver after the last SDE step
    compress_ratio: float = _knob(1.0, gt=0, le=1)  # MixGRPO-Flash: keep this fraction of the steps after the window
    window: WindowConfig = field(default_factory=WindowConfig)  # used when sde=window


# ---------------------------------------------------------------------------------------------- algo


@dataclass
class FlashConfig:
    """Flash-GRPO's iso-temporal single SDE step (arXiv 2605.15980); used by ``algo=flash_grpo``."""

    max_step: Optional[int] = _knob(None, ge=1)  # K: k_p ~ U{0..K-1}; null = first half of the steps
    rectify: bool = True  # temporal gradient rectification: weight (1/lambda_k)/mean(1/lambda)


@dataclass
class AlgoConfig:
    """The update rule (``conf/algo/``); the sampler decides which steps are stochastic."""

    name: str = _knob(MISSING, choices=("grpo", "mix_grpo", "flash_grpo"))  # algorithm module
    clip_range: float = _knob(1e-4, gt=0)  # PPO epsilon on the per-step ratio (scale depends on logprob_reduction)
    logprob_reduction: str = _knob("mean", choices=("sum", "mean"))  # sum: exact density; mean: anchors' per-element
    adv_clip: float = _knob(5.0, gt=0)  # clip advantages to [-adv_clip, adv_clip]
    global_std: bool = False  # normalise advantages by the batch std instead of the group's
    kl_beta: float = _knob(0.0, ge=0)  # weight of KL to the reference (LoRA disabled)
    timestep_fraction: float = _knob(1.0, gt=0, le=1)  # fraction of the SDE steps trained (DanceGRPO 0.6)
    timestep_selection: str = _knob("random", choices=("random", "first"))  # which: random per sample, or the noisiest
    shared_noise: bool = False  # one initial noise per group (DanceGRPO / MixGRPO)
    cfg_in_training: bool = True  # recompute log-probs with CFG, as the rollout sampled them
    flash: FlashConfig = field(default_factory=FlashConfig)  # Flash-GRPO only


# -------------------------------------------------------------------------------------------- reward


@dataclass
class AggregateConfig:
    """How phase 4 turns a multi-component reward (``reward=multi``) into advantages (``rewards.aggregate``)."""

    name: str = _knob("sum", choices=("sum", "per_reward", "taros"))  # sum: group-normalise the weighted sum
    tau: float = _knob(0.5, ge=0)  # taros: spread floor as a fraction of its running mean
    kappa: float = _knob(0.1, ge=0)  # taros: soft threshold on the normalised advantage
    ema_decay: float = _knob(0.9, ge=0, le=0.999)  # taros: running-mean decay of the group spread
    headroom_min: float = _knob(0.05, ge=0, le=1)  # taros: gate a bounded component with less headroom than this
    renorm: str = _knob("weights", choices=("weights", "std"))  # taros: re-normalise weights or the group's std
    bounds: Dict[str, List[float]] = field(default_factory=dict)  # taros: {component: [min, max]} for the gate


@dataclass
class RewardConfig:
    """``rewards.load(name, **kwargs)`` (``conf/reward/``); kwargs are the reward's own constructor arguments."""

    name: str = MISSING  # registry name, see rewards.available()
    kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to the reward constructor
    aggregate: AggregateConfig = field(default_factory=AggregateConfig)  # multi-component advantages


# ---------------------------------------------------------------------------------------------- data


@dataclass
class DataConfig:
    """Prompt sets (``conf/data/``): GenEval-style JSONL (prompt + metadata) or a plain text list."""

    name: str = MISSING  # the option's name, for logs
    format: str = _knob("jsonl", choices=("jsonl", "text"))  # jsonl: a record per line; text: a prompt per line
    train_file: str = MISSING  # training prompts (relative paths: cwd, then the repository root)
    test_file: Optional[str] = MISSING  # held-out prompts; null = none (each option says)
    prompt_key: str = "prompt"  # JSONL field holding the prompt text
    max_prompts: Optional[int] = _knob(None, ge=1)  # keep only the first N training prompts (debugging)
    train_tags: Optional[List[str]] = None  # keep only training prompts with these metadata tags; held-out untouched
    sampling: str = _knob("uniform", choices=("uniform", "tag_balanced"))  # tag_balanced: tag first, then a prompt of it


# -------------------------------------------------------------------------------------------- logger


@dataclass
class LoggerConfig:
    """Scalar logging backend (``conf/logger/``); galleries are also written to the run dir regardless."""

    name: str = _knob(MISSING, choices=("wandb", "none"))  # backend
    project: str = "flowgrpo"  # W&B project
    entity: Optional[str] = None  # W&B team; null = your default
    run_name: Optional[str] = None  # null = the run dir's name
    tags: List[str] = field(default_factory=list)  # W&B tags
    mode: str = _knob("online", choices=("online", "offline", "disabled"))  # W&B mode (env WANDB_MODE wins)


# ------------------------------------------------------------------------------------------- trainer


@dataclass
class EMAConfig:
    """EMA of the trainable weights, used for evaluation and saved in checkpoints."""

    enabled: bool = False  # keep an EMA copy
    decay: float = _knob(0.9, ge=0, le=1)  # per update
    update_every: int = _knob(1, ge=1)  # optimizer updates between EMA updates


@dataclass
class TrainerConfig:
    """The loop's budget, batch arithmetic, optimisation and bookkeeping (``conf/trainer/``).

    Batch sizes are **global** (all processes together); per-process values are derived, printed at start
    and asserted by ``flowgrpo.build.batch_plan``.
    """

    iterations: int = _knob(100, ge=1)  # GRPO iterations (rollout + update rounds)
    prompts_per_iteration: int = _knob(16, ge=1)  # N, global: distinct prompts per iteration
    group_size: int = _knob(8, ge=2)  # G: samples per prompt (advantages are relative within a group)
    rollout_batch_size: Optional[int] = _knob(None, ge=1)  # global samples per rollout forward; null = all N*G at once
    train_batch_size: int = _knob(8, ge=1)  # global samples per training forward (split over processes)
    gradient_accumulation_steps: int = _knob(1, ge=1)  # micro-batches per optimizer update (x K steps)
    inner_epochs: int = _knob(1, ge=1)  # passes over one iteration's rollouts
    lr: float = _knob(3e-4, gt=0)  # AdamW learning rate
    weight_decay: float = _knob(1e-4, ge=0)  # AdamW weight decay
    adam_betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    adam_eps: float = _knob(1e-8, gt=0)  # AdamW epsilon
    lr_scheduler: str = _knob("constant", choices=("constant", "cosine", "linear"))  # over optimizer updates
    warmup_updates: int = _knob(0, ge=0)  # linear warm-up of the learning rate
    max_grad_norm: Optional[float] = _knob(1.0, gt=0)  # clip the gradient norm; null = no clipping
    ema: EMAConfig = field(default_factory=EMAConfig)  # EMA of trainable weights
    mixed_precision: str = _knob("no", choices=("no", "fp16", "bf16"))  # accelerate autocast for the trained forward
    allow_tf32: bool = True  # TF32 matmuls on Ampere+ GPUs
    seed: int = 0  # seeds prompts, noise and SDE draws (per process offset by rank)
    eval_every: int = _knob(10, ge=0)  # iterations between held-out evaluations; 0 = only before/after
    eval_before: bool = True  # evaluate the pretrained model first (the baseline)
    eval_num_prompts: Optional[int] = _knob(None, ge=1)  # held-out prompts per evaluation; null = all
    eval_seed: int = 0  # seeds the held-out images: one fixed benchmark whatever trainer.seed (runs stay comparable)
    eval_samples_per_prompt: int = _knob(1, ge=1)  # fixed-seed images per held-out prompt (GenEval: 4)
    eval_samples_per_tag: Optional[int] = _knob(None, ge=1)  # at least this many images per metadata tag (small tags get more seeds)
    gallery_every: int = _knob(10, ge=0)  # iterations between galleries (PNG grid + parquet + W&B table); 0 = off
    gallery_size: int = _knob(16, ge=1)  # samples per gallery
    log_every: int = _knob(1, ge=1)  # iterations between scalar logs
    checkpoint_every: int = _knob(50, ge=0)  # iterations between checkpoints; 0 = only at the end
    keep_checkpoints: Optional[int] = _knob(2, ge=1)  # newest checkpoints kept; null = all
    resume: Optional[str] = None  # null = fresh run; "auto" = newest checkpoint in output_dir; or a checkpoint path
    output_dir: Optional[str] = None  # null = Hydra's run dir (chosen on rank 0)


# --------------------------------------------------------------------------------------------- top


@dataclass
class TrainConfig:
    """The whole run: one node per config group."""

    model: ModelConfig = MISSING
    sampler: SamplerConfig = MISSING
    algo: AlgoConfig = MISSING
    reward: RewardConfig = MISSING
    data: DataConfig = MISSING
    logger: LoggerConfig = MISSING
    trainer: TrainerConfig = MISSING


GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "sampler": SamplerConfig,
    "algo": AlgoConfig,
    "reward": RewardConfig,
    "data": DataConfig,
    "logger": LoggerConfig,
    "trainer": TrainerConfig,
}


def register_configs() -> ConfigStore:
    """Store ``base_train`` and ``<group>/base_<group>`` in Hydra's ConfigStore (safe to call again)."""
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
    return cs


register_configs()


# ----------------------------------------------------------------------------------------- validate


def _full_key(node: DictConfig, key: str) -> str:
    try:
        prefix = node._get_full_key(None)
    except Exception:  # pragma: no cover - defensive: detached nodes
        prefix = ""
    return f"{prefix}.{key}" if prefix else key


def _check_fields(node: Any, schema: type, errors: list[str]) -> None:
    hints = typing.get_type_hints(schema)
    names = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys():  # Hydra's "+key=value" appends past the schema's struct flag
        if key not in names:
            errors.append(f"{_full_key(node, key)}: unknown key (not in {schema.__name__}; see flowgrpo/config.py)")
    for f in dataclasses.fields(schema):
        if f.name not in node or OmegaConf.is_missing(node, f.name):
            continue  # a MISSING value is reported by OmegaConf itself when it is read
        value = node[f.name]
        if dataclasses.is_dataclass(hints.get(f.name)) and isinstance(value, DictConfig):
            _check_fields(value, hints[f.name], errors)
            continue
        meta, key = f.metadata, _full_key(node, f.name)
        if value is None or not meta:
            continue
        if "choices" in meta and value not in meta["choices"]:
            errors.append(f"{key}={value!r} is not one of {', '.join(map(str, meta['choices']))}")
        if "ge" in meta and value < meta["ge"]:
            errors.append(f"{key}={value!r} must be >= {meta['ge']}")
        if "gt" in meta and value <= meta["gt"]:
            errors.append(f"{key}={value!r} must be > {meta['gt']}")
        if "le" in meta and value > meta["le"]:
            errors.append(f"{key}={value!r} must be <= {meta['le']}")


def _cross_checks(cfg: DictConfig, errors: list[str]) -> None:
    """Constraints between keys (each message names the keys to change)."""
    m, s, a = cfg.get("model"), cfg.get("sampler"), cfg.get("algo")
    if m is not None and not OmegaConf.is_missing(m, "pretrained") and not OmegaConf.is_missing(m, "family"):
        if m.pretrained.startswith("tiny-random:") and m.pretrained != f"tiny-random:{m.family}":
            errors.append(f"model.pretrained={m.pretrained!r} does not match model.family={m.family!r}")
        if m.family == "wan" and m.num_frames is None:
            errors.append("model.num_frames must be set for model.family='wan' (a video model)")
        if m.family != "wan" and m.num_frames is not None:
            errors.append(f"model.num_frames={m.num_frames} is only for video models (model.family='wan'): "
                          "set it to null")
    r = cfg.get("reward")
    if r is not None and not OmegaConf.is_missing(r, "name") and r.aggregate.name != "sum" and r.name != "multi":
        errors.append(f"reward.aggregate.name={r.aggregate.name!r} combines the components of a multi-reward, but "
                      f"reward={r.name!r} has one score: use reward=multi, or reward.aggregate.name=sum")
    t = cfg.get("trainer")
    if t is not None and len(t.adam_betas) != 2:
        errors.append(f"trainer.adam_betas={list(t.adam_betas)} must hold two values [beta1, beta2]")
    if s is not None:
        if s.sde == "window" and s.window.size > s.num_steps:
            errors.append(f"sampler.window.size={s.window.size} exceeds sampler.num_steps={s.num_steps}")
        if s.compress_ratio < 1 and s.solver != "dpm++2m":
            errors.append("sampler.compress_ratio < 1 compresses the post-window steps for DPM-Solver++: "
                          "set sampler.solver=dpm++2m (or compress_ratio=1.0)")
        if s.compress_ratio < 1 and s.sde != "window":
            errors.append("sampler.compress_ratio < 1 applies after the MixGRPO window: needs sampler.sde=window")
    if a is not None and s is not None and not OmegaConf.is_missing(a, "name"):
        if a.name == "mix_grpo" and s.sde != "window":
            errors.append(f"algo=mix_grpo trains the MixGRPO window but sampler.sde={s.sde!r}: "
                          "add algo=grpo (Flow-GRPO / DanceGRPO), or use sampler=mix_sde / mix_sde_flash")
        if a.name == "grpo" and s.sde != "all":
            errors.append(f"algo=grpo (Flow-GRPO / DanceGRPO) trains every SDE step of a full-trajectory SDE but "
                          f"sampler.sde={s.sde!r}: use sampler=sde / dance / cps, or algo=mix_grpo for a window")
        if a.name in ("grpo", "mix_grpo") and s.sde == "none":
            errors.append(f"algo={a.name} has nothing to train with sampler.sde='none' (no stochastic step): "
                          "use sampler=sde / dance / cps / mix_sde, or algo=flash_grpo (it adds its own SDE step)")
        if a.name == "flash_grpo" and a.flash.max_step is not None and a.flash.max_step > s.num_steps:
            errors.append(f"algo.flash.max_step={a.flash.max_step} exceeds sampler.num_steps={s.num_steps}")


def validate(cfg: DictConfig) -> DictConfig:
    """Check choices, ranges and cross-key constraints of a composed config (whole tree or one group node).

    Raises:
        ConfigError: listing every violation, each naming its full key (e.g. ``sampler.kernel``).
    """
    errors: list[str] = []
    groups = [g for g in GROUP_SCHEMAS if g in cfg]
    if groups:  # the whole tree
        for key in cfg.keys():
            if key not in GROUP_SCHEMAS and key != "hydra":
                errors.append(f"{key}: unknown top-level key (groups: {', '.join(GROUP_SCHEMAS)})")
        for group in groups:
            if not OmegaConf.is_missing(cfg, group):
                _check_fields(cfg[group], GROUP_SCHEMAS[group], errors)
        _cross_checks(cfg, errors)
    else:  # one group node, e.g. cfg.sampler
        schema = _schema_of(cfg)
        if schema is None:
            raise TypeError("validate() takes the composed config or one of its group nodes")
        _check_fields(cfg, schema, errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return cfg


def _schema_of(node: DictConfig) -> type | None:
    """The schema of a group node: its structured type, else the schema of the group it sits under."""
    obj_type = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(obj_type):
        return obj_type
    key = node._key()
    return GROUP_SCHEMAS.get(key) if isinstance(key, str) else None
