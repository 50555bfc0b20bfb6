"""Typed schemas of the Hydra config tree (``conf/``), registered in Hydra's ConfigStore.

Every config group (``conf/<group>/``) has one dataclass schema here, stored as ``<group>/base_<group>``; each
group file extends it through its own defaults list (``defaults: [base_model, _self_]``), and
``conf/train.yaml`` extends the top-level :class:`TrainConfig` (``base_train``). Hydra then rejects

* an unknown key — ``python train.py model.foo=1`` → ``Key 'foo' is not in struct ... full_key: model.foo``;
* a wrong type — ``trainer.group_size=abc`` → ``Value 'abc' ... could not be converted to Integer ...
  full_key: trainer.group_size``.

Choices and ranges that OmegaConf cannot express (it has no ``Literal``; its Enums would turn ``"dpm++2m"``
into an invalid identifier and hand Enum objects to the trainer) are declared on the field itself —
``field(metadata={"choices": (...)})``, ``{"ge": 1}`` — and checked by :func:`validate`, whose errors name
the full key too (``sampler.kernel='foo' is not one of ...``). ``flowgrpo.builders`` and ``flowgrpo.cli`` call it
before anything is built, so a typo fails in a second, not after the model has loaded.

Importing this module registers the schemas (idempotent).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from samplers import KERNELS, SOLVERS

from .knobs import knob as _knob  # the schemas' field (public: flowgrpo.knobs.knob)
from .registry import ALGORITHMS, TEMPORAL_FACTORS, load_algorithms

__all__ = [
    "ModelConfig",
    "LoraConfig",
    "StreamModelConfig",
    "STREAM_FAMILY",
    "SamplerConfig",
    "AlgoConfig",
    "RewardConfig",
    "DataConfig",
    "LoggerConfig",
    "TrainerConfig",
    "EMAConfig",
    "TrainConfig",
    "GROUP_SCHEMAS",
    "register_configs",
    "algo_schema",
    "validate",
    "streaming_model_message",
    "steps_line",
    "config_key",
    "ConfigError",
]


class ConfigError(ValueError):
    """A config value is outside its allowed set or range; the message names the full key."""


DTYPES = ("float32", "bfloat16", "float16")
#: ``model.family`` of streaming models (a causal Wan, block by block: ``flowgrpo.models.StreamingWanPipeline``).
STREAM_FAMILY = "causal_wan"
#: families that generate videos (``model.num_frames`` set).
VIDEO_FAMILIES = ("wan", STREAM_FAMILY)

# --------------------------------------------------------------------------------------------- model


@dataclass
class LoraConfig:
    """peft LoRA on the denoiser (the transformer); used when ``model.finetune=lora``."""

    rank: int = _knob(32, ge=1)  # LoRA rank r
    alpha: float = _knob(64.0, gt=0)  # scale alpha/r on the LoRA branch
    dropout: float = _knob(0.0, ge=0, le=1)  # LoRA dropout (0 keeps rollout and training forwards identical)
    init_weights: str = _knob("gaussian", choices=("gaussian", "default", "pissa", "olora"))  # peft init_lora_weights
    # module-name suffixes to wrap, per model family; all-linear: every linear layer of the transformer blocks
    target_modules: List[str] = field(default_factory=list)


@dataclass
class StreamModelConfig:
    """A streaming model (``model.family=causal_wan``): its checkpoint and how it streams. The settings are those of
    ``flowgrpo.models.StreamConfig``; frame size, guidance, negative prompt and text length are the model's own keys
    (``model.height``, ``model.guidance_scale``, ...)."""

    # the streaming checkpoint loaded into the transformer of model.pretrained (Self-Forcing's self_forcing_dmd.pt,
    # LongLive's longlive_base.pt); null: model.pretrained is a streaming model directory (with stream_config.json)
    # or random-init:<arch>
    checkpoint: Optional[str] = MISSING
    checkpoint_key: Optional[str] = None  # its entry; null = generator with a LoRA, else generator_ema if present
    lora_checkpoint: Optional[str] = MISSING  # a LoRA merged into its weights (LongLive's lora.pt); null = none
    lora_alpha: Optional[float] = _knob(None, gt=0)  # that LoRA's alpha (merged as alpha/rank · B·A); null = its rank
    block_frames: int = _knob(1, ge=1)  # latent frames per block
    num_steps: int = _knob(4, ge=1)  # denoising steps per block: 1000·(1 − j/S), warped by shift
    shift: float = _knob(5.0, gt=0)  # static shift of those steps (Self-Forcing: 4 steps, shift 5)
    sink_frames: int = _knob(1, ge=0)  # first latent frames every block attends to (whole blocks)
    window_frames: Optional[int] = _knob(None, ge=1)  # newest latent frames a block sees, itself included; null = all
    cache_frames: Optional[int] = _knob(None, ge=1)  # most latent frames kept in the KV cache; null = all written ones
    context_sigma: float = _knob(0.0, ge=0, le=1)  # noise level of the context written to the cache (0: clean)
    recache: bool = True  # at a prompt switch, re-write the cached window under the new prompt (LongLive)


@dataclass
class ModelConfig:
    """Which pipeline to load and how to run it (``conf/model/*.yaml``)."""

    family: str = MISSING  # adapter family (flowgrpo.models.ADAPTERS): sd3, flux, wan; causal_wan: a streaming Wan
    # local dir, hub id, "tiny-random:<family>" for the in-memory test twin, or "random-init:<arch>" for a published
    # architecture at random initialisation (cost measurements: scripts/gpu_check.py)
    pretrained: str = MISSING
    torch_dtype: str = _knob("float32", choices=DTYPES)  # dtype the frozen weights load in
    vae_dtype: Optional[str] = _knob(None, choices=(None, *DTYPES))  # the decoder's dtype; null = torch_dtype
    attention: str = _knob("sdpa", choices=("sdpa", "xformers"))  # attention kernel; xformers needs flowgrpo[xformers]
    height: int = _knob(MISSING, ge=8)  # image height in pixels
    width: int = _knob(MISSING, ge=8)  # image width in pixels
    num_frames: Optional[int] = _knob(None, ge=1)  # video frames (Wan); null for image models
    num_steps: int = _knob(10, ge=1)  # the model's rollout step grid: sampler.num_steps unless the sampler option sets its own
    eval_num_steps: int = _knob(40, ge=1)  # the model's held-out ODE steps: sampler.eval_num_steps unless the sampler option sets its own
    guidance_scale: float = _knob(1.0, ge=0)  # CFG scale at rollout (FLUX-dev: distilled guidance embedding)
    guidance_kwargs: Dict[str, Any] = field(default_factory=dict)  # family-specific guidance (FLUX: true_cfg_scale)
    negative_prompt: str = ""  # negative prompt for CFG
    max_sequence_length: Optional[int] = _knob(None, ge=1)  # text tokens for T5/UMT5; null = pipeline default
    finetune: str = _knob("lora", choices=("lora", "full"))  # train LoRA adapters, or every transformer weight
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA shape and where it goes
    gradient_checkpointing: bool = False  # trade compute for memory in the transformer's backward
    pipeline_kwargs: Dict[str, Any] = field(default_factory=dict)  # extra from_pretrained kwargs (text_encoder_3: null)
    stream: Optional[StreamModelConfig] = None  # causal_wan: the streaming checkpoint and settings; null otherwise


# ------------------------------------------------------------------------------------------- sampler


@dataclass
class SamplerConfig:
    """How rollouts integrate noise → data: steps, schedule, the SDE kernel and the ODE solver (``conf/sampler/``).

    Which steps are stochastic is the algorithm's decision (``algo``): every step (Flow-GRPO, DanceGRPO), a
    sliding window (MixGRPO), one step per prompt (Flash-GRPO) or none (DiffusionNFT). The sampler says how a
    stochastic step is drawn (``kernel``, ``noise_level``) and how deterministic steps are solved (``solver``).

    Steps: an option that states ``num_steps`` (``sampler=dance``: 16, ``sampler=mix_sde``: 25) runs them on every
    model; one that does not (``sampler=sde``, ``sampler=cps``) runs the model's grid, ``model.num_steps`` and
    ``model.eval_num_steps`` (the embedded models: 10 and 10; the others: 10 and 40). Nothing rewrites a stated
    value: the command line (``sampler.num_steps=N``) and presets set it like any other key.
    """

    name: str = MISSING  # the option's name, for logs (stream: a streaming model's own sampler)
    num_steps: int = _knob(II("model.num_steps"), ge=1)  # T: sampling steps of a training rollout
    eval_num_steps: int = _knob(II("model.eval_num_steps"), ge=1)  # ODE steps of held-out evaluation / galleries
    shift: Optional[float] = _knob(None, gt=0)  # override the model's schedule shift; null = the scheduler's own
    kernel: str = _knob("flow_grpo", choices=tuple(KERNELS))  # SDE transition of the stochastic steps (samplers.steps)
    noise_level: float = _knob(0.7, ge=0)  # a (flow_grpo, cps) or eta (dance)
    solver: str = _knob("euler", choices=tuple(SOLVERS))  # ODE solver of the deterministic steps after the last SDE step


# ---------------------------------------------------------------------------------------------- algo


@dataclass
class AlgoConfig:
    """What every algorithm's config has (``conf/algo/``). Each algorithm extends it with its own schema
    (``Algorithm.config_class`` in ``flowgrpo/algorithms/<name>.py``), stored as ``algo/base_<name>``; an option
    file starts from that schema and states only what differs from its defaults."""

    name: str = MISSING  # a registered algorithm (flowgrpo.algorithms.ALGORITHMS)
    adv_clip: float = _knob(5.0, gt=0)  # clip advantages to [-adv_clip, adv_clip]
    global_std: bool = False  # normalise advantages by the batch std instead of the group's
    kl_beta: float = _knob(0.0, ge=0)  # weight of the KL / regression term to the reference (LoRA disabled)
    shared_noise: bool = False  # one initial noise per group
    cfg_in_training: bool = True  # the trained velocity uses CFG, as the rollout sampled with it


# -------------------------------------------------------------------------------------------- reward


@dataclass
class TaRoSConfig:
    """The paper's TaRoS (arXiv 2511.19356 v4, Sec. 4; ``reward.aggregate.name=taros``, ``rewards.aggregate.TaRoS``):
    per group, softmax weights from each component's mean against its threshold and its Hoyer sparsity. It ignores
    the components' weights (a weight of 0 still keeps a component out)."""

    # the trained components from first to last priority (the paper: visual quality, motion, text alignment);
    # [] = the reward's component order
    order: List[str] = field(default_factory=list)
    # fixed thresholds tau_j, {component: value} (the paper: 0.68-0.75 on [0, 1] scores); unnamed ones are calibrated
    tau: Dict[str, float] = field(default_factory=dict)
    calibration_iterations: int = _knob(5, ge=1)  # iterations whose group means calibrate an unnamed tau_j
    calibration_quantile: float = _knob(0.5, ge=0, le=1)  # the quantile of those group means taken as tau_j
    beta: float = _knob(0.3, ge=0)  # weight of the Hoyer-sparsity term (the paper: 0.1, 0.3 or 0.5)
    # 1: h(mean - tau) as printed (a component above its threshold gains weight); -1: h(tau - mean), the stated
    # intent of down-weighting a saturated component
    performance_sign: int = _knob(1, choices=(1, -1))
    # per_component: a tau_j for each component, as printed; stage_gates: K-1 gates, component j's term is
    # h(mean_{j-1} - tau_{j-1}), the first's h(0)
    thresholds: str = _knob("per_component", choices=("per_component", "stage_gates"))


@dataclass
class AggregateConfig:
    """How phase 4 turns a reward's weighted components (``reward=multi``'s sub-rewards, ``reward=long_video``'s
    aspects) into advantages (``rewards.aggregate``)."""

    # sum: group-normalise the weighted sum; per_reward: weighted per-component group advantages; taros: the paper's
    # TaRoS (reward.aggregate.taros.*); saturation_weighted: this project's own saturation-aware aggregator
    name: str = _knob("sum", choices=("sum", "per_reward", "taros", "saturation_weighted"))
    tau: float = _knob(0.5, ge=0)  # saturation_weighted: spread floor as a fraction of its running mean
    kappa: float = _knob(0.1, ge=0)  # saturation_weighted: soft threshold on the normalised advantage
    ema_decay: float = _knob(0.9, ge=0, le=0.999)  # saturation_weighted: running-mean decay of the group spread
    # saturation_weighted: gate a bounded component with less headroom than this
    headroom_min: float = _knob(0.05, ge=0, le=1)
    # saturation_weighted: re-normalise the weights or the group's std
    renorm: str = _knob("weights", choices=("weights", "std"))
    bounds: Dict[str, List[float]] = field(default_factory=dict)  # saturation_weighted: {component: [min, max]}
    taros: TaRoSConfig = field(default_factory=TaRoSConfig)  # the paper's TaRoS (name=taros)


@dataclass
class RewardConfig:
    """``rewards.load(name, **kwargs)`` (``conf/reward/``); kwargs are the reward's own constructor arguments. Your own
    reward: ``reward=custom reward.target=package.module:name`` (``rewards.custom``)."""

    name: str = MISSING  # registry name, see rewards.available(); custom: the reward reward.target names
    # reward=custom: your reward's import path, package.module:name (a function fn(images, prompts, metadata), or a
    # class built with reward.kwargs); null for the registered rewards
    target: Optional[str] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to the reward constructor (custom: yours)
    aggregate: AggregateConfig = field(default_factory=AggregateConfig)  # multi-component advantages


# ---------------------------------------------------------------------------------------------- data


@dataclass
class CurriculumConfig:
    """CGPO's prompt curriculum (``data.sampling=cgpo``; ``flowgrpo.curriculum``); defaults are the authors' constants."""

    lam: float = _knob(10.0, ge=0)  # category weight 1 + lam * v_c (v_c: the category's share of 1/mean reward)
    variance_cap: float = _knob(0.6, gt=0)  # cap on a prompt's group reward variance before the min-max map
    floor: float = _knob(0.1, gt=0, le=1)  # least probability of a prompt
    history: int = _knob(2, ge=0)  # earlier raw probabilities a prompt's is averaged with
    ema: float = _knob(0.5, gt=0, le=1)  # weight of a new category weight against the old one


@dataclass
class DataConfig:
    """Prompt sets (``conf/data/``): GenEval-style JSONL (prompt + metadata) or a plain text list."""

    name: str = MISSING  # the option's name, for logs
    format: str = _knob("jsonl", choices=("jsonl", "text"))  # jsonl: a record per line; text: a prompt per line
    train_file: str = MISSING  # training prompts (relative paths: cwd, then the repository root)
    val_file: Optional[str] = MISSING  # validation prompts: what training evaluates on (and probes, sweeps); null = none
    test_file: Optional[str] = None  # test prompts, scored only by scripts/paired_eval.py --split test; null = none
    prompt_key: str = "prompt"  # JSONL field holding the prompt text
    max_prompts: Optional[int] = _knob(None, ge=1)  # keep only the first N training prompts (debugging)
    train_tags: Optional[List[str]] = None  # keep only training prompts with these metadata tags; held-out untouched
    # tag_balanced: a tag first, then a prompt of it; cgpo: CGPO's curriculum from earlier rewards (data.curriculum.*)
    sampling: str = _knob("uniform", choices=("uniform", "tag_balanced", "cgpo"))
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)  # data.sampling=cgpo's constants


# -------------------------------------------------------------------------------------------- logger


@dataclass
class LoggerConfig:
    """Where scalars and galleries go besides the run dir (``conf/logger/``), through accelerate's trackers; the run
    dir always gets ``metrics.jsonl``, the galleries and their HTML index."""

    name: str = _knob(MISSING, choices=("none", "wandb", "tensorboard", "mlflow", "aim"))  # backend
    project: str = "flowgrpo"  # W&B project; MLflow and Aim experiment
    entity: Optional[str] = None  # W&B team; null = your default
    run_name: Optional[str] = None  # null = the run dir's name
    tags: List[str] = field(default_factory=list)  # run tags (W&B, MLflow, Aim)
    mode: str = _knob("online", choices=("online", "offline", "disabled"))  # W&B mode (env WANDB_MODE wins)
    fps: int = _knob(8, ge=1)  # frame rate of gallery videos (files and trackers)


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
    and asserted by ``flowgrpo.builders.batch_plan``.
    """

    iterations: int = _knob(100, ge=1)  # GRPO iterations (rollout + update rounds)
    prompts_per_iteration: int = _knob(8, ge=1)  # N, global: distinct prompts per iteration
    group_size: int = _knob(8, ge=2)  # G: samples per prompt (advantages are relative within a group)
    rollout_batch_size: Optional[int] = _knob(None, ge=1)  # global samples per rollout forward; null = all N*G at once
    offload_kept_context: bool = False  # streaming models: the KV caches an update rescores under wait in host memory
    train_batch_size: int = _knob(16, ge=1)  # global samples per training forward (split over processes)
    gradient_accumulation_steps: int = _knob(2, ge=1)  # micro-batches per optimizer update (each spans its K steps)
    inner_epochs: int = _knob(1, ge=1)  # passes over one iteration's rollouts
    lr: float = _knob(3e-4, gt=0)  # AdamW learning rate
    weight_decay: float = _knob(1e-4, ge=0)  # AdamW weight decay
    adam_betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    adam_eps: float = _knob(1e-8, gt=0)  # AdamW epsilon
    lr_scheduler: str = _knob("constant", choices=("constant", "cosine", "linear"))  # over optimizer updates
    warmup_updates: int = _knob(0, ge=0)  # linear warm-up of the learning rate
    max_grad_norm: Optional[float] = _knob(1.0, gt=0)  # clip the gradient norm; null = no clipping
    max_skipped_updates: int = _knob(3, ge=1)  # stop after this many updates in a row skipped (non-finite, or diverged)
    max_update_ratio: Optional[float] = _knob(1.0, gt=0)  # an update of more than this x the trained weights' norm: rolled back, skipped
    ema: EMAConfig = field(default_factory=EMAConfig)  # EMA of trainable weights
    mixed_precision: str = _knob("no", choices=("no", "fp16", "bf16"))  # accelerate autocast for the trained forward
    allow_tf32: bool = True  # TF32 matmuls on Ampere+ GPUs
    seed: int = 0  # seeds prompts, noise and SDE draws, each keyed by (seed, iteration, global row): the same on any number of processes
    eval_every: int = _knob(25, ge=0)  # iterations between held-out evaluations; 0 = only eval_before / eval_at_end
    eval_before: bool = True  # evaluate the pretrained model first (the baseline)
    eval_at_end: bool = True  # evaluate the final weights when the run completes (false: only what eval_every asks)
    eval_num_prompts: Optional[int] = _knob(None, ge=1)  # held-out prompts per evaluation; null = all
    eval_seed: int = 0  # seeds the held-out images: one fixed benchmark whatever trainer.seed (runs stay comparable)
    eval_samples_per_prompt: int = _knob(1, ge=1)  # fixed-seed images per held-out prompt (GenEval: 4)
    eval_samples_per_tag: Optional[int] = _knob(48, ge=1)  # at least this many images per metadata tag (small tags get more seeds; null = none)
    gallery_every: int = _knob(10, ge=0)  # iterations between galleries (PNG grid + parquet + W&B table); 0 = off
    gallery_size: int = _knob(16, ge=1)  # samples per gallery; the training gallery shows at least one per prompt
    log_every: int = _knob(1, ge=1)  # iterations between scalar logs
    checkpoint_every: int = _knob(50, ge=0)  # iterations between checkpoints; 0 = only at the end
    keep_checkpoints: Optional[int] = _knob(2, ge=1)  # newest checkpoints kept; null = all
    resume: Optional[str] = None  # null = fresh; "auto" = newest intact checkpoint of this or an earlier same-experiment run; or a path
    resume_search_dir: Optional[str] = None  # where resume=auto finds earlier runs; null = <root> of a timestamped <root>/DATE/TIME run dir
    resume_force: bool = False  # resume although the config changes what the checkpoint's run meant (algorithm, batch plan, ...)
    output_dir: Optional[str] = None  # null = Hydra's run dir (chosen on rank 0)
    # a fresh run (no resume, or resume=auto in a dir whose run left no checkpoint) may replace the run a run dir
    # holds: its files are deleted first
    overwrite: bool = False


# --------------------------------------------------------------------------------------------- top


@dataclass
class TrainConfig:
    """The whole run: one node per config group."""

    model: ModelConfig = MISSING
    sampler: SamplerConfig = MISSING
    algo: Any = MISSING  # the schema of the chosen algorithm (AlgoConfig subclass)
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
    """Store ``base_train``, ``<group>/base_<group>`` and every registered algorithm's schema as
    ``algo/base_<name>`` in Hydra's ConfigStore (safe to call again)."""
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    for group, schema in GROUP_SCHEMAS.items():
        if group != "algo":  # an algorithm option extends its own schema, algo/base_<name>
            cs.store(group=group, name=f"base_{group}", node=schema)
    for name, cls in ALGORITHMS.items():
        cs.store(group="algo", name=f"base_{name}", node=cls.config_class)
    return cs


def algo_schema(name: str) -> type:
    """The schema of the algorithm registered as ``name``.

    Raises:
        ConfigError: naming ``algo.name`` and the registered algorithms.
    """
    if name not in ALGORITHMS:
        raise ConfigError(f"algo.name={name!r} is not one of {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name].config_class


# ----------------------------------------------------------------------------------------- validate


def config_key(node: DictConfig, key: str) -> str:
    """Full dotted key of ``node.key`` (``data.train_file``) for messages that name what to change, or ``key`` for
    a detached node."""
    try:
        prefix = node._get_full_key(None) if isinstance(node, DictConfig) else ""
    except Exception:  # pragma: no cover - defensive: detached nodes
        prefix = ""
    return f"{prefix}.{key}" if prefix else key


def _nested_schema(tp: Any) -> type | None:
    """The dataclass of a nested group field (``LoraConfig``, or ``Optional[StreamModelConfig]``), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 and dataclasses.is_dataclass(
        args[0]) else None


def _check_fields(node: Any, schema: type, errors: list[str]) -> None:
    hints = typing.get_type_hints(schema)
    names = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys():  # Hydra's "+key=value" appends past the schema's struct flag
        if key not in names:
            errors.append(f"{config_key(node, key)}: unknown key (not in {schema.__name__}, {schema.__module__})")
    for f in dataclasses.fields(schema):
        if f.name not in node or OmegaConf.is_missing(node, f.name):
            continue  # a MISSING value is reported by OmegaConf itself when it is read
        value = node[f.name]
        nested = _nested_schema(hints.get(f.name))
        if nested is not None and isinstance(value, DictConfig):
            _check_fields(value, nested, errors)
            continue
        meta, key = f.metadata, config_key(node, f.name)
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


def _model_checks(m: DictConfig, errors: list[str]) -> None:
    """Constraints between the keys of a ``model`` node."""
    if OmegaConf.is_missing(m, "family"):
        return
    if not OmegaConf.is_missing(m, "pretrained"):
        if m.pretrained.startswith("tiny-random:") and m.pretrained != f"tiny-random:{m.family}":
            errors.append(f"model.pretrained={m.pretrained!r} does not match model.family={m.family!r}")
    if m.family in VIDEO_FAMILIES and m.num_frames is None:
        errors.append(f"model.num_frames must be set for model.family={m.family!r} (a video model)")
    if m.family not in VIDEO_FAMILIES and m.num_frames is not None:
        errors.append(f"model.num_frames={m.num_frames} is only for video models (model.family='wan' or "
                      f"{STREAM_FAMILY!r}): set it to null")
    if m.family != STREAM_FAMILY:
        if m.get("stream") is not None:
            errors.append(f"model.stream is only for streaming models (model.family={STREAM_FAMILY!r}): set it to "
                          "null")
        return
    st = m.get("stream")
    if st is None:
        errors.append(f"model.stream must be set for model.family={STREAM_FAMILY!r} (the streaming checkpoint and "
                      "its settings)")
        return
    if m.attention != "sdpa":
        errors.append(f"model.attention={m.attention!r}: a streaming model runs its own causal attention over "
                      "PyTorch's fused kernel; use model.attention=sdpa")
    if not OmegaConf.is_missing(st, "checkpoint") and not OmegaConf.is_missing(st, "lora_checkpoint") \
            and st.checkpoint is None and st.lora_checkpoint is not None:
        errors.append("model.stream.lora_checkpoint is merged into the weights of model.stream.checkpoint, which is "
                      "null: set both, or neither for a streaming model directory")
    if not OmegaConf.is_missing(m, "pretrained") and str(m.pretrained).startswith("random-init:"):
        for key in ("checkpoint", "lora_checkpoint"):  # as flowgrpo.models.load_stream_pipeline refuses them
            if not OmegaConf.is_missing(st, key) and st[key] is not None:
                errors.append(f"model.stream.{key}={st[key]!r} with model.pretrained={m.pretrained!r}: a random-init "
                              f"model has random weights and loads no checkpoint; set model.stream.{key}=null, or "
                              f"set model.pretrained to the diffusers Wan2.1-T2V-1.3B pipeline to load the "
                              f"checkpoint into")
    b = st.block_frames
    if b < 1:
        return  # reported by _check_fields
    if st.sink_frames % b:
        errors.append(f"model.stream.sink_frames={st.sink_frames} must be whole blocks of "
                      f"model.stream.block_frames={b}")
    if st.window_frames is not None and st.window_frames % b:
        errors.append(f"model.stream.window_frames={st.window_frames} must be whole blocks of "
                      f"model.stream.block_frames={b}")
    if st.cache_frames is not None and st.window_frames is not None \
            and st.cache_frames < st.sink_frames + st.window_frames:
        errors.append(f"model.stream.cache_frames={st.cache_frames} must hold the sink and the window "
                      f"(model.stream.sink_frames + window_frames = {st.sink_frames + st.window_frames})")
    if m.num_frames is not None:
        t = TEMPORAL_FACTORS[STREAM_FAMILY]  # pixel frames per latent frame, before a pipeline loads
        latent = (m.num_frames - 1) // t + 1
        if (m.num_frames - 1) % t or latent % b:
            errors.append(f"model.num_frames={m.num_frames} must be {t}·k + 1 frames whose k + 1 latent "
                          f"frames are whole blocks of model.stream.block_frames={b} (e.g. "
                          f"{t * (max(1, round(latent / b)) * b - 1) + 1})")


def _model_option() -> str | None:
    """The ``model=`` option of the running Hydra app (``python train.py model=NAME``), if any."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get("model")


def streaming_model_message(model: DictConfig, algo: str, option: str | None = None) -> str:
    """Why ``algo`` cannot train a streaming model, and what can (``option``: its ``model=`` name; default: the
    running Hydra app's choice)."""
    option = option or _model_option()
    streaming = sorted(n for n, a in ALGORITHMS.items() if a.streaming)
    return (f"{'model=' + option if option else 'this model'} is a streaming model (model.family={model.family!r}): "
            f"it generates a video block by block, and algo={algo} trains a model that denoises whole clips. Train it "
            f"with a streaming algorithm ({', '.join('algo=' + n for n in streaming)}; sampler=stream), or sample it "
            f"with `python -m flowgrpo.stream --preset {option or 'NAME'} ...`")


def _model_and_algo(cfg: DictConfig) -> tuple[Any, Any] | None:
    """``(cfg.model, cfg.algo)`` when both are there with a model family and a registered algorithm name (what the
    streaming checks compare), else None."""
    m, a = cfg.get("model"), cfg.get("algo")
    if m is None or a is None or OmegaConf.is_missing(m, "family") or OmegaConf.is_missing(a, "name") \
            or a.name not in ALGORITHMS:
        return None
    return m, a


def _pairing_errors(cfg: DictConfig) -> list[str]:
    """A streaming model trains with a streaming algorithm, and a streaming algorithm trains a streaming model."""
    pair = _model_and_algo(cfg)
    if pair is None:
        return []
    m, a = pair
    streaming_model, streaming_algo = m.family == STREAM_FAMILY, ALGORITHMS[a.name].streaming
    if streaming_model and not streaming_algo:
        return [streaming_model_message(m, a.name)]
    if streaming_algo and not streaming_model:
        return [f"algo={a.name} trains a streaming model (model.family={STREAM_FAMILY!r}, e.g. "
                f"model=causal_wan_shapes), but model.family={m.family!r} denoises whole clips or images: choose "
                "a streaming model (model=...), or another algorithm (algo=...)"]
    return []


def _stream_checks(cfg: DictConfig, errors: list[str]) -> None:
    """A streaming model trains with a streaming algorithm over its own few-step schedule; and the other way round."""
    pair = _model_and_algo(cfg)
    if pair is None:
        return
    (m, a), s = pair, cfg.get("sampler")
    errors.extend(_pairing_errors(cfg))
    t = cfg.get("trainer")
    if t is not None and t.get("offload_kept_context") and m.family != STREAM_FAMILY:
        errors.append(f"trainer.offload_kept_context=true: only a streaming model (model.family={STREAM_FAMILY!r}) "
                      f"keeps context for its update (the KV caches of the trained blocks), and "
                      f"model.family={m.family!r} keeps none; set trainer.offload_kept_context=false")
    if not (m.family == STREAM_FAMILY and ALGORITHMS[a.name].streaming) or s is None or m.get("stream") is None:
        return
    steps = m.stream.num_steps
    for key in ("num_steps", "eval_num_steps"):
        if s[key] != steps:
            errors.append(f"sampler.{key}={s[key]}: a streaming model denoises each block in its own "
                          f"model.stream.num_steps={steps} steps; set sampler.{key}={steps} (sampler=stream does)")
    if s.noise_level != 1.0:  # held-out streams are sampled at level 1 (StreamAdapter.generate): train as evaluated
        errors.append(f"sampler.noise_level={s.noise_level}: a streaming model re-noises with fresh noise at level 1 "
                      "between steps, in rollouts as in its held-out evaluation; set sampler.noise_level=1.0 "
                      "(sampler=stream does)")
    if s.shift is not None:
        errors.append(f"sampler.shift={s.shift}: a streaming model's noise levels are its own (model.stream.shift); "
                      "set sampler.shift=null")
    if s.kernel != "cps":
        errors.append(f"sampler.kernel={s.kernel!r}: a streaming model re-noises its clean prediction between steps, "
                      "the cps kernel (at noise level 1, its own sampler); use sampler=stream")


def _stream_sampler_message(cfg: DictConfig) -> str | None:
    """Why ``sampler=stream`` cannot sample a model that is not a streaming one, or None."""
    m, s = cfg.get("model"), cfg.get("sampler")
    if m is None or s is None or OmegaConf.is_missing(m, "family") or m.family == STREAM_FAMILY:
        return None
    raw = OmegaConf.to_container(s, resolve=False)
    if raw.get("name") != "stream" and "model.stream" not in f"{raw.get('num_steps')}{raw.get('eval_num_steps')}":
        return None
    return (f"sampler=stream is a streaming model's own sampler (each block in model.stream.num_steps steps), but "
            f"model.family={m.family!r} denoises whole {'clips' if m.family in VIDEO_FAMILIES else 'images'}: choose "
            f"another sampler (sampler=..., e.g. the default sde), or a streaming model (model=causal_wan_shapes) "
            f"with a streaming algorithm")


def _unresolved(node: Any, errors: list[str]) -> None:
    """Report every key of ``node`` whose interpolation cannot be resolved, naming the key and what it points at."""
    if not isinstance(node, DictConfig):
        return
    for key in node.keys():
        if OmegaConf.is_missing(node, key):
            continue  # a ``???`` left for the user: reported by OmegaConf when it is read
        try:
            value = node[key]
        except InterpolationResolutionError as err:
            raw = OmegaConf.to_container(node, resolve=False)[key]
            errors.append(f"{config_key(node, key)}={raw} cannot be resolved: {str(err).splitlines()[0]}")
            continue
        _unresolved(value, errors)


def _weighs_components(reward: DictConfig) -> bool:
    """Whether a reward's scalar is a weighted sum of components that an aggregator can take apart
    (``reward.weights``): a multi-reward's sub-rewards, or the long-video reward's aspects when its score is their
    weighted mean."""
    if reward.name in ("multi", "custom"):  # custom: the built reward says (its weights), checked when it is built
        return True
    return reward.name == "long_video" and reward.kwargs.get("score", "mean") == "mean"


#: the knobs of reward.aggregate that only reward.aggregate.name=saturation_weighted reads
_SATURATION_WEIGHTED_KNOBS = ("tau", "kappa", "ema_decay", "headroom_min", "renorm", "bounds")


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def _aggregate_checks(agg: DictConfig, errors: list[str]) -> None:
    """A knob of one aggregator set while another runs would be silently ignored: refuse it, naming the key."""
    if OmegaConf.is_missing(agg, "name"):
        return
    default = AggregateConfig()
    if agg.name == "taros":
        for key in _SATURATION_WEIGHTED_KNOBS:
            if key not in agg:
                continue
            value = _plain(agg[key])
            if value != getattr(default, key):
                errors.append(f"reward.aggregate.{key}={value!r} is a knob of reward.aggregate.name=saturation_weighted "
                              "(this project's own aggregator), which the paper's TaRoS does not read: remove it, or "
                              "set reward.aggregate.name=saturation_weighted; TaRoS's knobs are reward.aggregate.taros.*")
    elif "taros" in agg and isinstance(agg.taros, DictConfig):
        theirs = TaRoSConfig()
        for key in agg.taros.keys():
            value = _plain(agg.taros[key])
            if hasattr(theirs, key) and value != getattr(theirs, key):
                errors.append(f"reward.aggregate.taros.{key}={value!r} is read only by reward.aggregate.name=taros, "
                              f"but reward.aggregate.name={agg.name!r}: remove it, or set reward.aggregate.name=taros")


def _cross_checks(cfg: DictConfig, errors: list[str]) -> None:
    """Constraints between keys (each message names the keys to change)."""
    m, s, a = cfg.get("model"), cfg.get("sampler"), cfg.get("algo")
    if m is not None and not OmegaConf.is_missing(cfg, "model"):
        _model_checks(m, errors)
        _stream_checks(cfg, errors)
        message = None if s is None or OmegaConf.is_missing(cfg, "sampler") else _stream_sampler_message(cfg)
        if message:
            errors.append(message)
    r = cfg.get("reward")
    if r is not None and not OmegaConf.is_missing(r, "name") and r.name == "custom" and not r.get("target"):
        errors.append("reward=custom trains your own reward and reward.target is not set: set "
                      "reward.target=package.module:function, the import path of your function fn(images, prompts, "
                      "metadata) (or of a reward class of your module), e.g. reward.target=my_rewards:redness "
                      "(docs/your-own.md)")
    elif r is not None and not OmegaConf.is_missing(r, "name") and r.name != "custom" and r.get("target") is not None:
        errors.append(f"reward.target={r.target!r} names your own reward, but reward={r.name!r} is a registered one: "
                      "use reward=custom with it, or set reward.target=null")
    if r is not None and not OmegaConf.is_missing(r, "name") and r.aggregate.name != "sum" \
            and not _weighs_components(r):
        errors.append(f"reward.aggregate.name={r.aggregate.name!r} combines the weighted components of a reward, but "
                      f"reward={r.name!r} (kwargs {dict(r.kwargs)}) has one score: use reward=multi, or "
                      "reward=long_video with reward.kwargs.score=mean, or reward.aggregate.name=sum")
    if r is not None and not OmegaConf.is_missing(r, "name"):
        _aggregate_checks(r.aggregate, errors)
    if a is not None and r is not None and a.get("slas_gamma") is not None and not OmegaConf.is_missing(r, "name") \
            and r.aggregate.name != "sum":
        errors.append(f"algo.slas_gamma={a.slas_gamma} shapes the advantage of one reward, but "
                      f"reward.aggregate.name={r.aggregate.name!r} computes the advantages per component: set "
                      "algo.slas_gamma=null, or reward.aggregate.name=sum")
    t = cfg.get("trainer")
    if t is not None and len(t.adam_betas) != 2:
        errors.append(f"trainer.adam_betas={list(t.adam_betas)} must hold two values [beta1, beta2]")
    if a is not None and s is not None and not OmegaConf.is_missing(a, "name"):
        if a.name in ALGORITHMS:  # an unknown name is reported by _check_fields
            errors.extend(ALGORITHMS[a.name].check_config(a, s))


def validate(cfg: DictConfig) -> DictConfig:
    """Check choices, ranges and cross-key constraints of a composed config (whole tree or one group node).

    Raises:
        ConfigError: listing every violation, each naming its full key (e.g. ``sampler.kernel``).
    """
    errors: list[str] = []
    groups = [g for g in GROUP_SCHEMAS if g in cfg]
    if groups:  # the whole tree; a key that cannot be resolved fails first, with why
        unresolved: list[str] = []
        for group in groups:
            if not OmegaConf.is_missing(cfg, group):
                _unresolved(cfg[group], unresolved)
        if unresolved:  # say why first: a streaming model's keys asked of a model that has none
            message = _stream_sampler_message(cfg)
            if message:
                unresolved = _pairing_errors(cfg) + [message] + [u for u in unresolved if "model.stream" not in u]
            raise ConfigError("invalid config:\n  " + "\n  ".join(unresolved))
        for key in cfg.keys():
            if key not in GROUP_SCHEMAS and key != "hydra":
                errors.append(f"{key}: unknown top-level key (groups: {', '.join(GROUP_SCHEMAS)})")
        for group in groups:
            if not OmegaConf.is_missing(cfg, group):
                schema = _algo_schema(cfg[group], errors) if group == "algo" else GROUP_SCHEMAS[group]
                if schema is not None:
                    _check_fields(cfg[group], schema, errors)
        _cross_checks(cfg, errors)
    else:  # one group node, e.g. cfg.sampler
        schema = _schema_of(cfg, errors)
        if schema is None and not errors:
            raise TypeError("validate() takes the composed config or one of its group nodes")
        if schema is not None:
            _check_fields(cfg, schema, errors)
        if schema is ModelConfig and not errors:
            _model_checks(cfg, errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return cfg


def steps_line(cfg: DictConfig) -> str:
    """The steps a run samples and where each count comes from, for its log: the model's grid (the sampler option
    states none) or a stated value (the sampler option, a preset or the command line)."""
    raw = OmegaConf.to_container(cfg.sampler, resolve=False)

    def one(key: str) -> str:
        grid = isinstance(raw.get(key), str) and raw[key].strip() == f"${{model.{key}}}"
        origin = f"model.{key}: the model's grid" if grid else "stated by the sampler option, a preset or an override"
        return f"sampler.{key}={cfg.sampler[key]} ({origin})"

    return f"steps: {one('num_steps')}, {one('eval_num_steps')}"


def _algo_schema(node: DictConfig, errors: list[str]) -> type | None:
    """The schema of an ``algo`` node, from the algorithm registry by ``algo.name``."""
    if OmegaConf.is_missing(node, "name"):
        return None
    try:
        return algo_schema(node.name)
    except ConfigError as err:
        errors.append(str(err))
        return None


def _schema_of(node: DictConfig, errors: list[str]) -> type | None:
    """The schema of a group node: an algorithm's by its name, else its structured type, else the schema of the
    group it sits under."""
    if node._key() == "algo" or isinstance(OmegaConf.get_type(node), type) and issubclass(
            OmegaConf.get_type(node), AlgoConfig):
        return _algo_schema(node, errors)
    obj_type = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(obj_type):
        return obj_type
    key = node._key()
    return GROUP_SCHEMAS.get(key) if isinstance(key, str) else None


# ------------------------------------------------------------------------------------------------ --help

#: the groups a user chooses from on the command line, in --help's order (the others under conf/ are applied for
#: them: model_defaults/<model>.yaml with its model, experiment_algo/<experiment>/<algo>.yaml with its pair)
CHOOSABLE_GROUPS = (*GROUP_SCHEMAS, "experiment", "debug")
_CONF = Path(__file__).resolve().parents[1] / "conf"


def help_groups(conf: str | Path | None = None, width: int = 116) -> str:
    """``python train.py --help``'s list of groups: each group's options (its ``conf/<group>/*.yaml``, the typed
    ``base_*`` schemas left out) and, in brackets, the option the command composes (the default, or what the command
    line chose)."""
    import textwrap

    from hydra.core.hydra_config import HydraConfig

    chosen = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    lines = []
    for group in CHOOSABLE_GROUPS:
        names = sorted(p.stem for p in (Path(conf or _CONF) / group).glob("*.yaml") if not p.stem.startswith("base_"))
        head = f"  {group} [{chosen.get(group) or 'none'}]: "
        lines.append(textwrap.fill(", ".join(names), width, initial_indent=head,
                                   subsequent_indent=" " * len(head), break_on_hyphens=False))
    return "\n".join(lines)


OmegaConf.register_new_resolver("flowgrpo.help_groups", lambda: help_groups(), replace=True)
register_configs()
# Every algorithm module stores its own schema when its class is defined (Algorithm.__init_subclass__); importing
# the package here makes `import flowgrpo.config` enough for Hydra to compose any algo option.
load_algorithms()
