"""Plan a run's per-GPU memory and FLOPs before paying for it, on a CPU, with no weights.

Every module the run holds is built from its real architecture config (``assets/configs/<org>--<name>/``, the
checkpoints' own ``config.json`` files, or a local diffusers folder) under PyTorch's ``FakeTensorMode``: tensors carry
shape, dtype and device but no memory, so a 12B transformer costs nothing to build and a forward at real size takes
seconds. The run's own code then executes on them — ``prepare_trainable`` (LoRA or full fine-tuning, gradient
checkpointing), the algorithm's rollout engine (``Algorithm.make_rollout``), ``adapter.decode`` as the trainer's score
phase calls it, the algorithm's ``loss`` through the trainer's :class:`~flowgrpo.context.TrainerContext` and its
backward, AdamW's step, and :func:`flowgrpo.evaluation.generate` — while

* :class:`MemoryTracker` (a ``TorchDispatchMode``) counts every tensor storage alive, by category (weights,
  gradients, optimizer state, activations, other: the batch the iteration holds), and keeps the split at the peak;
* ``FlopCounterMode`` counts the FLOPs of matmuls, convolutions and attention.

How this models the GPU (what a plan is and is not):

* Attention: on CPU, ``scaled_dot_product_attention`` takes the fused flash kernel
  (``_scaled_dot_product_flash_attention_for_cpu``), which keeps only the output and the log-sum-exp for backward,
  as FlashAttention on the GPU does; the planner counts its FLOPs with PyTorch's own SDPA formulas. Under a mask (a
  streaming model's full-sequence forward, a segmented cross-attention) it keeps the same plus the mask converted to
  an additive bias of the mask's shape, what the GPU's memory-efficient kernel is given (no score matrix either);
  a streaming model's CPU-only shortcut for sparse frame masks (gathered key frames) is switched off
  (:func:`~flowgrpo.models.causal_wan.accelerator_attention`).
* Mixed precision: ``torch.autocast("cpu", bfloat16)`` stands for accelerate's CUDA autocast (the same op lists for
  matmuls, convolutions and attention).
* Counted: tensors. Not counted: the CUDA context and cuBLAS/NCCL workspaces (about 0.5–1 GiB) and the caching
  allocator's fragmentation; the headroom a plan leaves must cover them (the report asks for 10% of the card).
* Several GPUs: one process is planned (rank 0's share of the batch). DDP's gradient buckets (one copy of the
  trained gradients) are added arithmetically to "other"; FSDP2 is not run under fake tensors — its sharding of the
  transformer's weights, gradients and optimizer state is applied arithmetically (``launcher="fsdp"``).
* Reward models with a real architecture (CLIP ViT-L/14, DINO ViT-B/16) are built and run on one batch of frames;
  rule-based rewards (detectors without weights, optical flow on the CPU) cost no GPU memory.

The idea of planning a training step on fake tensors follows PyTorch's ``torch.distributed._tools.mem_tracker``
(torchtitan's memory estimation runs the same way); the tracker here is ours: it accounts storages by category
without registering hooks on frozen parameters (``MemTracker`` cannot, and every LoRA run has them).

>>> report = plan_run(cfg, num_processes=8)          # doctest: +SKIP
>>> print(report.table())                            # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from .config import STREAM_FAMILY
from .context import TrainerContext
from .memory import CATEGORIES, MemoryTracker, _real, module_scope

__all__ = ["GPU", "GPUS", "MemoryTracker", "fake_mode", "flop_counter", "arch_dir", "build_pipeline",
           "PhasePlan", "RunPlan", "plan_run", "CATEGORIES"]

GiB = 2**30
ARCH_ROOT = Path(__file__).resolve().parents[1] / "assets" / "configs"


@dataclass(frozen=True)
class GPU:
    """A card the plan is checked against: usable memory (what ``torch.cuda.mem_get_info`` reports as total) and
    the dense bf16 tensor-core peak from the vendor's data sheet."""

    name: str
    memory_bytes: int
    peak_flops: float


GPUS = {
    "h100": GPU("H100 SXM 80 GB", 81559 * 2**20, 989.4e12),
    "h200": GPU("H200 141 GB", 143771 * 2**20, 989.4e12),
    "a100": GPU("A100 SXM 80 GB", 81920 * 2**20, 312e12),
}


# ------------------------------------------------------------------------------------------ fake tensors


@contextlib.contextmanager
def fake_mode() -> Iterator[Any]:
    """``FakeTensorMode`` in which modules can be built and cast.

    ``Module._apply`` (``.to``, ``.float()``, peft moving an adapter to its base layer's dtype) swaps fake
    parameters in place with ``torch.utils.swap_tensors``, which fails on them ("Couldn't swap Linear.weight"). Inside
    this context it assigns a new ``Parameter`` instead, one per original parameter, so tied weights stay tied.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    original = torch.nn.Module._apply
    replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(old) -> (old, kept alive during one call; new)

    depth = [0]

    def _apply(self, fn, recurse=True):
        depth[0] += 1
        try:
            return _apply_one(self, fn, recurse)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                replaced.clear()  # the old parameters may go (kept only while one call may meet them twice)

    def _apply_one(self, fn, recurse):
        if recurse:
            for module in self.children():
                module._apply(fn)
        for key, param in list(self._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                with torch.no_grad():
                    new = fn(param)
                if new is not param:
                    new = torch.nn.Parameter(new, requires_grad=param.requires_grad)
                replaced[id(param)] = (param, new)
            self._parameters[key] = replaced[id(param)][1]
        for key, buf in list(self._buffers.items()):
            if buf is not None:
                self._buffers[key] = fn(buf)
        return self

    # schedulers read their schedule back with .item() at construction: they are built on real tensors (a few floats)
    import diffusers

    schedulers = [diffusers.FlowMatchEulerDiscreteScheduler, diffusers.UniPCMultistepScheduler]
    inits = [cls.__init__ for cls in schedulers]
    for cls, init in zip(schedulers, inits):
        cls.__init__ = functools.wraps(init)(lambda self, *a, _init=init, **k: _real_call(_init, self, *a, **k))
    torch.nn.Module._apply = _apply
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        torch.nn.Module._apply = original
        for cls, init in zip(schedulers, inits):
            cls.__init__ = init
        replaced.clear()


def _real_call(fn, *args, **kwargs):
    with _real():
        return fn(*args, **kwargs)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules directly in ``dtype`` (cheaper and exact: no cast afterwards)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


class FlopCounter(TorchDispatchMode):
    """FLOPs of matmuls, convolutions and attention, with PyTorch's formulas (``torch.utils.flop_counter``).

    ``FlopCounterMode`` itself also tracks modules through autograd hooks on their outputs, which keep the tensors a
    non-reentrant gradient checkpoint would free (a 30-block backward then holds every block's recomputation), so
    the planner counts with the formulas alone. The CPU flash-attention kernels get the CUDA kernels' formulas (the
    same shapes; PyTorch registers none for them).
    """

    def __init__(self):
        super().__init__()
        from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

        def forward(query, key, value, *args, out_val=None, **kwargs) -> int:
            return sdpa_flop_count(query.shape, key.shape, value.shape)

        def backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
            return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)

        aten = torch.ops.aten
        self.registry = dict(flop_registry)
        self.registry[aten._scaled_dot_product_flash_attention_for_cpu] = forward
        self.registry[aten._scaled_dot_product_flash_attention_for_cpu_backward] = backward
        self.total = 0

    def get_total_flops(self) -> int:
        return self.total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


def flop_counter() -> FlopCounter:
    """A :class:`FlopCounter` (a context manager; ``get_total_flops()`` after it)."""
    return FlopCounter()


# ---------------------------------------------------------------------------------------- architectures


def arch_dir(pretrained: str) -> Path:
    """Where the architecture of ``model.pretrained`` is described: a local diffusers folder as it is, a hub id
    ``org/name`` as ``assets/configs/org--name`` (config files only, no weights).

    Raises:
        FileNotFoundError: naming ``model.pretrained`` and the folder to add.
    """
    from .builders import resolve_path

    local = resolve_path(pretrained) if not pretrained.startswith(("tiny-random:", "random-init:")) else None
    if local is not None and (local / "model_index.json").is_file():
        return local
    folder = ARCH_ROOT / pretrained.replace("/", "--")
    if (folder / "model_index.json").is_file() or (folder / "config.json").is_file():
        return folder
    raise FileNotFoundError(
        f"model.pretrained={pretrained!r}: no architecture config to plan with; add its config files (model_index.json "
        f"and each component's config.json, no weights) under {folder}, or point model.pretrained to a local "
        f"diffusers folder")


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _keep_fp32(module: torch.nn.Module) -> None:
    """What diffusers' ``from_pretrained(torch_dtype=...)`` keeps in float32 (``_keep_in_fp32_modules``, any dtype;
    transformers keeps its list only for float16, so its models are left as built)."""
    names = getattr(module, "_keep_in_fp32_modules", None) or []
    for sub_name, sub in module.named_modules():
        if any(n in sub_name.split(".") for n in names):
            sub.float()


def _transformers_model(cls, config, dtype: torch.dtype):
    """A transformers model in ``dtype`` without its weight initialisation (values are irrelevant to a plan, and
    some initialisers read values back)."""
    from transformers.initialization import no_init_weights

    with default_dtype(dtype), no_init_weights():
        model = cls(config)
    model.tie_weights()  # skipped with the initialisation; from_pretrained ties (T5's shared embedding)
    return model.eval()


def _build_component(folder: Path, library: str, cls_name: str, dtype: torch.dtype):
    if library == "diffusers":
        import diffusers

        cls = getattr(diffusers, cls_name)
        if cls_name.endswith("Scheduler"):
            with _real():  # a schedule of a few floats, read back with .item() at construction
                return cls.from_config(_read(folder / "scheduler_config.json"))
        config = _read(folder / "config.json")
        if cls_name == "AutoencoderKLWan" and "latents_mean" not in config and "z_dim" in config:
            # the planner does not need the statistics (shapes only); Wan 2.2's are not shipped here
            config = dict(config, latents_mean=[0.0] * config["z_dim"], latents_std=[1.0] * config["z_dim"])
        with default_dtype(dtype):
            module = cls.from_config(config)
        _keep_fp32(module)
        return module.eval()
    if library == "transformers":
        import transformers

        if "Tokenizer" in cls_name:
            from .models.tiny import tiny_clip_tokenizer, tiny_t5_tokenizer

            # real vocabularies are not needed: prompts are padded to the configured lengths either way
            return tiny_clip_tokenizer() if "CLIP" in cls_name else tiny_t5_tokenizer()
        cls = getattr(transformers, cls_name)
        config = cls.config_class.from_dict(_read(folder / "config.json"))
        return _transformers_model(cls, config, dtype)
    raise ValueError(f"{folder}: component library {library!r} is not planned (diffusers or transformers)")


def build_pipeline(model: DictConfig):
    """The pipeline of ``model`` (a ``model`` config node) with every component built from its config, in
    ``model.torch_dtype`` (the VAE in ``model.vae_dtype``), as ``from_pretrained`` would load it. Call inside
    :func:`fake_mode` for a real-size model. A streaming model (``model.family=causal_wan``) is a
    :class:`~flowgrpo.models.StreamingWanPipeline` (:func:`build_stream_pipeline`)."""
    from .models.load import parse_dtype

    dtype = parse_dtype(model.torch_dtype)
    if str(model.pretrained).startswith("random-init:"):  # scripts/gpu_check.py's pipelines, built in code
        from .models.random_init import build_random_pipeline

        pipe = build_random_pipeline(str(model.pretrained).split(":", 1)[1], torch_dtype=dtype)
        if str(model.family) == STREAM_FAMILY:  # made causal as flowgrpo.models.load_stream_pipeline makes it
            from .models.stream_load import stream_pipeline_of

            return stream_pipeline_of(pipe, model)
        if model.vae_dtype:
            pipe.vae.to(parse_dtype(model.vae_dtype))
        return pipe
    if str(model.pretrained).startswith("tiny-random:"):  # the tiny twins are built in code, not from files
        from .models.tiny import build_tiny_pipeline

        with _real():  # a few MB; its scheduler reads values at construction
            pipe = build_tiny_pipeline(str(model.family), torch_dtype=dtype)
            if model.vae_dtype:
                pipe.vae.to(parse_dtype(model.vae_dtype))
        return pipe
    if str(model.family) == STREAM_FAMILY:
        return build_stream_pipeline(model)
    pipe = _assemble(arch_dir(str(model.pretrained)), model, dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _assemble(root: Path, model: DictConfig, dtype: torch.dtype, **given):
    """The pipeline ``root/model_index.json`` describes, every component built from its config but those ``given``."""
    import inspect

    import diffusers

    from .models.load import parse_dtype

    index = _read(root / "model_index.json")
    components, extras = dict(given), {}
    for name, value in index.items():
        if name.startswith("_") or name in given:
            continue
        if isinstance(value, list) and len(value) == 2:
            if value[0] is None:
                components[name] = None
                continue
            part_dtype = parse_dtype(model.vae_dtype) if name == "vae" and model.vae_dtype else dtype
            components[name] = _build_component(root / name, value[0], value[1], part_dtype)
        else:
            extras[name] = value
    pipeline_cls = getattr(diffusers, index["_class_name"])
    accepted = inspect.signature(pipeline_cls.__init__).parameters
    components = {k: v for k, v in components.items() if k in accepted}
    extras = {k: v for k, v in extras.items() if k in accepted}
    return pipeline_cls(**components, **extras)


def build_stream_pipeline(model: DictConfig):
    """A streaming model's pipeline (``model.family=causal_wan``) without its weights: the text encoder and VAE of
    ``model.pretrained``'s architecture, the transformer built as the streaming loader builds it
    (:func:`~flowgrpo.models.build_streaming_wan_transformer`: the loader's module, every tensor in the dtype a
    checkpoint would be loaded in), made causal with ``model.stream`` as :func:`~flowgrpo.models.load_stream_pipeline`
    does (:func:`~flowgrpo.models.stream_load.stream_pipeline_of`). Call inside :func:`fake_mode` for a real-size
    model: the streaming checkpoints (``model.stream.checkpoint``) are never read."""
    from .models.load import parse_dtype
    from .models.stream_load import stream_pipeline_of
    from .models.wan_checkpoints import build_streaming_wan_transformer

    root = arch_dir(str(model.pretrained))
    dtype = parse_dtype(model.torch_dtype)
    transformer = build_streaming_wan_transformer(_read(root / "transformer" / "config.json"), torch_dtype=dtype)
    pipe = _assemble(root, model, dtype, transformer=transformer)
    return stream_pipeline_of(pipe, model)


# ----------------------------------------------------------------------------------------------- reports


@dataclass
class PhasePlan:
    """One phase's peak per GPU: bytes by category at the peak, where it happened, its FLOPs and wall time here."""

    name: str
    peak_bytes: int
    split: dict[str, int]
    where: str
    flops: float
    note: str = ""
    host_bytes: int = 0  # the most held in host memory during the phase (trainer.offload_kept_context)

    def row(self) -> str:
        parts = " ".join(f"{k} {self.split.get(k, 0) / GiB:6.2f}" for k in CATEGORIES)
        host = f" | host {self.host_bytes / GiB:.2f} GiB" if self.host_bytes else ""
        return (f"{self.name:<8} peak {self.peak_bytes / GiB:7.2f} GiB | {parts} | {self.flops / 1e12:9.1f} TFLOP | "
                f"at {self.where}{host}")


@dataclass
class RunPlan:
    """A run's plan: per-phase peaks on one GPU, the largest modules, FLOPs per iteration and a projected time."""

    config: str
    gpu: str
    gpu_bytes: int
    num_processes: int
    launcher: str
    phases: list[PhasePlan]
    modules: list[dict]
    params: dict[str, int]
    batch: dict[str, int]
    flops_per_iteration: float
    eval_flops: float
    mfu: float
    peak_flops: float
    notes: list[str] = field(default_factory=list)
    plan_seconds: float = 0.0

    @property
    def peak_bytes(self) -> int:
        return max(p.peak_bytes for p in self.phases)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: p.peak_bytes).name

    @property
    def headroom_bytes(self) -> int:
        return self.gpu_bytes - self.peak_bytes

    @property
    def fits(self) -> bool:
        """The peak leaves at least 10% of the card for the CUDA context, workspaces and fragmentation."""
        return self.headroom_bytes >= 0.1 * self.gpu_bytes

    @property
    def projected_seconds(self) -> float:
        """Projection, not a measurement: FLOPs of one iteration on one GPU at ``mfu`` of the card's peak."""
        return self.flops_per_iteration / (self.peak_flops * self.mfu)

    def to_dict(self) -> dict:
        d = asdict(self)
        for phase in d["phases"]:  # as the table reads them
            phase.update(peak_gib=round(phase["peak_bytes"] / GiB, 2), host_gib=round(phase["host_bytes"] / GiB, 2))
        d.update(peak_bytes=self.peak_bytes, peak_gib=round(self.peak_bytes / GiB, 2), peak_phase=self.peak_phase,
                 headroom_gib=round(self.headroom_bytes / GiB, 2), fits=self.fits,
                 projected_seconds_per_iteration=round(self.projected_seconds, 1))
        return d

    def table(self) -> str:
        lines = [f"plan: {self.config} on {self.num_processes} x {self.gpu} ({self.launcher}), per GPU, GiB "
                 f"(categories: {', '.join(CATEGORIES)})"]
        lines += ["  " + p.row() for p in self.phases]
        lines.append(f"  peak {self.peak_bytes / GiB:.2f} GiB in {self.peak_phase} of {self.gpu_bytes / GiB:.1f}: "
                     f"headroom {self.headroom_bytes / GiB:.2f} GiB ({'fits' if self.fits else 'DOES NOT FIT'}: "
                     "10% of the card kept for context, workspaces, fragmentation)")
        lines.append("  largest modules: " + "; ".join(f"{m['name']} {m['bytes'] / GiB:.2f} GiB ({m['params'] / 1e9:.2f}B)"
                                                       for m in self.modules[:6]))
        lines.append(f"  FLOPs per iteration per GPU {self.flops_per_iteration / 1e15:.2f} PFLOP (+ evaluation "
                     f"{self.eval_flops / 1e15:.2f} PFLOP per held-out batch); projected {self.projected_seconds:.0f} s "
                     f"per iteration at {self.mfu:.0%} of {self.peak_flops / 1e12:.0f} TFLOP/s (a projection, not a "
                     "measurement)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# -------------------------------------------------------------------------------------------- the phases


def _plan_context(adapter, unwrapped, ref_copy, guidance, autocast, algorithm, params, seed) -> TrainerContext:
    """The trainer's own :class:`~flowgrpo.context.TrainerContext` (the trained transformer's velocity with the
    training guidance under autocast, the reference policy, keyed generators) over a stand-in holding what it reads
    of a trainer: the planned update reaches the model through the code a run's update does."""
    trainer = SimpleNamespace(adapter=adapter, unwrapped=unwrapped, ref_copy=ref_copy, model_kw={"guidance": guidance},
                              acc=SimpleNamespace(autocast=autocast), algorithm=algorithm, params=params, updates=0,
                              cfg=SimpleNamespace(trainer=SimpleNamespace(seed=seed)))
    return TrainerContext(trainer)


def _reward_models(cfg: DictConfig) -> list[tuple[str, str, int]]:
    """``(component name, architecture folder, frames per forward)`` of the reward models with weights the run loads
    onto the GPU (float32, as ``rewards`` loads them)."""
    names: list[tuple[str, dict]] = []
    reward = OmegaConf.to_container(cfg.reward, resolve=True)
    kwargs = reward.get("kwargs") or {}
    if reward["name"] == "multi":
        for comp in kwargs.get("components") or []:
            names.append((comp["name"], comp.get("kwargs") or {}))
    elif reward["name"] == "segments":
        names.append((kwargs.get("reward", ""), kwargs.get("kwargs") or {}))
    else:
        names.append((reward["name"], kwargs))
    out = []
    for name, kw in names:
        batch = int(kw.get("batch_size", 64))
        if name in ("video_clip", "clipscore", "pickscore") or (name == "geneval" and kw.get("detector") == "real"):
            out.append((name, str(kw.get("clip_path", "openai/clip-vit-large-patch14")), batch))
        if name == "video_consistency" and kw.get("backbone", "dino") == "dino":
            out.append((name, str(kw.get("model_path", "facebook/dino-vitb16")), batch))
    return out


def _build_reward_model(path: str):
    import transformers

    folder = ARCH_ROOT / path.replace("/", "--")
    if not (folder / "config.json").is_file():
        return None
    config = _read(folder / "config.json")
    cls = getattr(transformers, config["architectures"][0])
    return _transformers_model(cls, cls.config_class.from_dict(config), torch.float32)


def _reward_forward(model, frames: int) -> torch.Tensor:
    """One no-grad forward of a reward model's image tower on ``frames`` 224x224 images (what scoring a chunk of
    decoded frames costs it)."""
    size = model.config.vision_config.image_size if hasattr(model.config, "vision_config") else model.config.image_size
    pixels = torch.empty(frames, 3, size, size)
    with torch.no_grad():
        if hasattr(model, "get_image_features"):
            return model.get_image_features(pixel_values=pixels)
        return model(pixel_values=pixels).last_hidden_state[:, 0]


def _module_table(components: dict[str, torch.nn.Module]) -> list[dict]:
    """The largest modules by held bytes (parameters, buffers): each component and its largest direct children."""
    rows = []
    for name, module in components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        seen = set()

        def size(m):
            n = b = 0
            for t in list(m.parameters()) + list(m.buffers()):
                if id(t) not in seen:
                    seen.add(id(t))
                    n += t.numel()
                    b += t.numel() * t.element_size()
            return n, b

        n, b = size(module)
        rows.append({"name": name, "params": n, "bytes": b})
    return sorted(rows, key=lambda r: -r["bytes"])


def plan_run(cfg: DictConfig, *, num_processes: int = 1, gpu: str = "h100", launcher: str | None = None,
             mfu: float = 0.4, fake: bool = True, build=None, phases: tuple[str, ...] = ("rollout", "update", "eval"),
             label: str = "", switch_frames: tuple[int, ...] | None = None) -> RunPlan:
    """Plan one iteration of the run ``cfg`` on one of ``num_processes`` GPUs.

    Args:
        cfg: the composed config (as ``train.py`` composes it).
        num_processes: processes (GPUs) the batch is split over, as ``accelerate launch`` would run it.
        gpu: a key of :data:`GPUS`.
        launcher: ``"ddp"`` (the default with several processes), ``"fsdp"`` (sharding applied arithmetically), or
            ``"single"``.
        mfu: the share of the card's peak FLOP/s the projected time assumes.
        fake: build and run under fake tensors (False: real tensors, for checking a plan against a real run at tiny
            size).
        build: ``build(model_cfg) -> pipeline``; default :func:`build_pipeline`.
        phases: which phases to run, in order (``rollout`` includes encoding and scoring).
        switch_frames: a streaming model's prompt switches (pixel frames) in the streams it plans when the run's
            prompt file (``data.train_file``) is not at hand; ``None``: the file's first streams, else one segment.
    """
    from .builders import batch_plan, build_sampler, model_kwargs
    from .algorithms import Batch, build_algorithm
    from .finetune import EMA, frozen_reference, prepare_trainable
    from .models import FlowAdapter, StreamAdapter
    from .models.causal_wan import accelerator_attention
    from .offload import observe_host_copies
    from .rollout import SamplingModel

    t0 = time.time()
    if gpu not in GPUS:
        raise ValueError(f"gpu={gpu!r}: one of {', '.join(GPUS)}")
    launcher = launcher or ("ddp" if num_processes > 1 else "single")
    if launcher not in ("ddp", "fsdp", "single"):
        raise ValueError(f"launcher={launcher!r}: ddp, fsdp or single")
    streaming = cfg.model.family == STREAM_FAMILY
    t = cfg.trainer
    bp = batch_plan(cfg, num_processes)
    bf16 = t.mixed_precision == "bf16"
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    tracker = MemoryTracker()
    tracker.small_real = 65536 if fake else None
    stack = contextlib.ExitStack()
    if fake:
        stack.enter_context(fake_mode())
    stack.enter_context(accelerator_attention())  # a streaming model's masked attention as on the GPU
    # what trainer.offload_kept_context keeps in host memory, made there
    stack.enter_context(observe_host_copies(tracker.to_host, scope=lambda: tracker.labelled("host")))
    notes: list[str] = []
    try:
        built = (build or build_pipeline)(cfg.model)
        with _real():  # the adapter may swap in an Euler scheduler (a schedule read back at construction)
            adapter = StreamAdapter(built) if streaming else FlowAdapter.from_pipeline(built)
        pipe = adapter.pipe
        components = {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}
        for module in components.values():
            module.requires_grad_(False)
        unwrapped = pipe.transformer
        params = prepare_trainable(unwrapped, cfg.model)
        ref_copy = frozen_reference(unwrapped) if cfg.model.finetune == "full" and cfg.algo.kl_beta > 0 else None
        if ref_copy is not None:
            components["reference"] = ref_copy
        rewards = []
        for name, path, batch in _reward_models(cfg):
            model = _build_reward_model(path) if fake else None
            if model is not None:
                components[f"reward:{name}"] = model
                rewards.append((name, model, batch))
        for module in components.values():
            tracker.track_module(module, "weights")
        names = {id(m): f"{k}.{n}" if n else k for k, c in components.items() for n, m in c.named_modules()}
        with _real():
            sampler = build_sampler(cfg.sampler, adapter=adapter, model=cfg.model)
            # the chunks a sample is made in, as the trainer asks: one, or a streaming model's blocks
            algorithm = build_algorithm(cfg.algo, cfg.sampler, sampler.sigmas,
                                        chunks=adapter.num_chunks(cfg.model.num_frames))
            bp = batch_plan(cfg, num_processes, trained_steps=algorithm.trained_steps())
        kw = model_kwargs(cfg.model)
        g = kw["guidance"]
        seed = int(t.seed)

        stack.enter_context(tracker)
        stack.enter_context(module_scope(tracker, names))
        tracker.watch_gradients(params)
        # steady state: AdamW's moments exist (created by the first step; written out because the step counter's
        # .item() cannot run on fake tensors), the EMA of the trained weights too
        optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.adam_betas), eps=t.adam_eps,
                                      weight_decay=t.weight_decay)
        with tracker.labelled("optimizer"):
            for p in params:
                optimizer.state[p] = {"step": torch.tensor(0.0, device="cpu") if not fake else _real_scalar(),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            ema = EMA(params, t.ema.decay) if t.ema.enabled else None
        ddp_bytes = sum(p.numel() * p.element_size() for p in params) if launcher == "ddp" else 0
        if ddp_bytes:
            notes.append(f"DDP gradient buckets: {ddp_bytes / GiB:.2f} GiB added to 'other' in every phase")
        ctx = _plan_context(adapter, unwrapped, ref_copy, g, autocast, algorithm, params, seed)
        with tracker.labelled("weights"), torch.no_grad(), algorithm.sampling_policy(ctx):
            pass  # steady state: an algorithm's own copy of the trained weights (an old policy) exists

        results: list[PhasePlan] = []

        def phase(name: str, note: str = ""):
            return _Phase(tracker, results, name, note, ddp_bytes)

        flops = {}
        n_local = bp.rollouts_per_process
        mine = list(range(0, t.prompts_per_iteration, num_processes))
        prompts = [f"a prompt {p}" for p in mine]
        metadata = None
        if streaming:
            metadata = _stream_records(cfg, len(mine), switch_frames)
            notes.append("streams planned with prompt switches at pixel frames "
                         f"{[s['start'] for s in metadata[0]['segments'][1:]]} of {cfg.model.num_frames}")
        with _real():
            plan = algorithm.plan(t.prompts_per_iteration, t.group_size, generator=torch.Generator().manual_seed(seed))
            rows = torch.tensor([p * t.group_size + j for p in mine for j in range(t.group_size)], dtype=torch.long)
            local_plan = plan.subset(rows)
        batch = None
        if "rollout" in phases:
            with phase("rollout", f"{n_local} samples in chunks of {bp.rollout_batch_per_process}, "
                                  f"{algorithm.num_steps} steps; decode and score them") as ph:
                with torch.no_grad():
                    # as Trainer._encode: a stream's conditioning is its segment prompts and where they switch
                    cond = adapter.encode_prompts(prompts, kw["negative_prompt"], guidance_scale=g["guidance_scale"],
                                                  max_sequence_length=kw["max_sequence_length"], metadata=metadata,
                                                  num_frames=cfg.model.num_frames,
                                                  **{k: v for k, v in g.items() if k != "guidance_scale"})
                    cond = cond.repeat_interleave(t.group_size)
                batch = Batch(prompts=[p for p in prompts for _ in range(t.group_size)],
                              metadata=None if metadata is None else [m for m in metadata for _ in range(t.group_size)],
                              global_rows=rows, cond=cond, plan=local_plan)
                sampling = SamplingModel(adapter, guidance=g, size=kw["size"], autocast=autocast)
                engine = algorithm.make_rollout(sampling, seed=seed, batch_size=bp.rollout_batch_per_process,
                                                offload_context=t.offload_kept_context)
                with algorithm.sampling_policy(ctx):  # as Trainer.rollout: the weights the algorithm samples with
                    batch = engine(batch, 0)
                with torch.no_grad():  # the trainer's score phase: decode every rollout, keep the pixels
                    batch.images = adapter.decode(adapter.join_chunks(batch.final)).float().clamp_(0, 1)
                    frames = batch.images.shape[0] * (batch.images.shape[1] if batch.images.ndim == 5 else 1)
                    for name, model, per_call in rewards:
                        calls = math.ceil(min(frames, n_local * 8 if batch.images.ndim == 5 else frames) / per_call)
                        with flop_counter() as fc:
                            _reward_forward(model, min(per_call, frames))
                        ph.extra_flops += fc.get_total_flops() * max(0, calls - 1)
                    batch.images = None  # scored: Trainer.score moves the pixels to the host for the gallery
                _advantage_stand_in(algorithm, batch)
            flops["rollout"] = results[-1].flops
        if "update" in phases:
            if batch is None:
                raise ValueError("the update phase needs the rollout phase first")
            micro = bp.train_micro_batch
            steps_mask = batch.plan.train_mask.flatten(1)  # a chunk axis: steps are flat indices c·T' + i
            steps = torch.stack([r.nonzero().squeeze(1) for r in steps_mask])
            rows_mb = torch.arange(0, min(micro, n_local))
            with phase("update", f"one micro-batch of {micro} x one trained step, backward, AdamW step") as ph:
                unwrapped.train()
                loss, _ = algorithm.loss(ctx, batch, rows_mb, steps[rows_mb, 0])
                with tracker.labelled("activations"):
                    loss.backward()
                    del loss
                    torch.nn.utils.clip_grad_norm_(params, float(t.max_grad_norm), foreach=True) \
                        if t.max_grad_norm else None
                if not fake:
                    with tracker.labelled("optimizer"):
                        optimizer.step()
                else:
                    _fake_adamw_step(optimizer, tracker)
                if ema is not None:
                    ema.update()
                optimizer.zero_grad(set_to_none=True)
                unwrapped.eval()
            per_iteration = (n_local // micro) * bp.trained_steps * t.inner_epochs
            flops["update"] = results[-1].flops
            if per_iteration > 1:
                # the next micro-batch step: its FLOPs stand for the rest of the iteration's (work an algorithm
                # does once per group or per iteration, KVPO's no-grad replays of a group under the old, initial and
                # current weights, is in the first only)
                nxt = torch.arange(micro, min(2 * micro, n_local)) if n_local > micro else rows_mb
                step = steps[nxt, 0] if n_local > micro else steps[rows_mb, min(1, steps.shape[1] - 1)]
                unwrapped.train()
                with flop_counter() as fc:
                    loss, _ = algorithm.loss(ctx, batch, nxt, step)
                    loss.backward()
                    del loss
                optimizer.zero_grad(set_to_none=True)
                unwrapped.eval()
                flops["update"] += fc.get_total_flops() * (per_iteration - 1)
            results[-1].note += f"; {per_iteration} such micro-batch steps per iteration"
        if "eval" in phases:
            from .evaluation import generate

            if batch is not None:
                del batch  # the held-out evaluation runs between iterations: the training batch is gone
            bsz = bp.rollout_batch_per_process
            with phase("eval", f"a held-out batch of {bsz}: {len(sampler.eval_sigmas) - 1}-step ODE with guidance, "
                               "decode, score") as ph:
                with torch.no_grad():
                    images = generate(adapter, [f"held-out {i}" for i in range(bsz)],
                                      [torch.Generator().manual_seed(i) for i in range(bsz)],
                                      sigmas=sampler.eval_sigmas, model_kw=kw, autocast=autocast,
                                      metadata=None if metadata is None else
                                      [metadata[i % len(metadata)] for i in range(bsz)])
                    frames = images.shape[0] * (images.shape[1] if images.ndim == 5 else 1)
                    for name, model, per_call in rewards:
                        _reward_forward(model, min(per_call, frames))
                    del images
            flops["eval"] = results[-1].flops
        split_params = {"transformer": sum(p.numel() for p in unwrapped.parameters()),
                        "trainable": sum(p.numel() for p in params)}
        block_bytes = max((sum(p.numel() * p.element_size() for p in block.parameters())
                           for blocks in unwrapped.children() if isinstance(blocks, torch.nn.ModuleList)
                           for block in blocks), default=0)
        modules = _module_table(components)
    finally:
        stack.close()
    if launcher == "fsdp":
        _fsdp_arithmetic(results, modules, block_bytes, num_processes, notes)
    g_ = GPUS[gpu]
    return RunPlan(
        config=label, gpu=g_.name, gpu_bytes=g_.memory_bytes, num_processes=num_processes, launcher=launcher,
        phases=results, modules=modules, params=split_params,
        batch={"rollouts_per_process": bp.rollouts_per_process, "rollout_batch": bp.rollout_batch_per_process,
               "micro_batch": bp.train_micro_batch, "trained_steps": bp.trained_steps,
               "accumulation": bp.accumulation},
        flops_per_iteration=flops.get("rollout", 0.0) + flops.get("update", 0.0), eval_flops=flops.get("eval", 0.0),
        mfu=mfu, peak_flops=g_.peak_flops, notes=notes, plan_seconds=round(time.time() - t0, 1))


def _stream_records(cfg: DictConfig, n: int, switch_frames: tuple[int, ...] | None) -> list[dict]:
    """``n`` streams of ``model.num_frames`` frames for a streaming plan (what a stream's layout decides: its
    segments' prompts, and where it switches, which sets KVPO's fork and LongLive's re-cache): the first ``n`` of the
    run's prompt file when it is at hand and ``switch_frames`` is not given, else streams switching at
    ``switch_frames`` (none: one segment)."""
    from .paths import resolve_path

    frames = int(cfg.model.num_frames)
    if switch_frames is None and not OmegaConf.is_missing(cfg.data, "train_file") and cfg.data.get("train_file"):
        found = resolve_path(str(cfg.data.train_file))
        if found is not None and found.is_file() and found.suffix == ".jsonl":
            records = [json.loads(line) for line in found.read_text().splitlines() if line.strip()]
            records = [r for r in records if r.get("segments") and int(r.get("num_frames", frames)) == frames]
            if records:
                return [records[i % len(records)] for i in range(n)]
    starts = [0, *sorted(int(f) for f in (switch_frames or ()))]
    return [{"prompt": f"a stream {i}", "num_frames": frames,
             "segments": [{"start": s, "prompt": f"a stream {i}, segment {j}"} for j, s in enumerate(starts)]}
            for i in range(n)]


def _advantage_stand_in(algorithm, batch) -> None:
    """What the score and advantage phases leave for the update, as zeros (values change no shape or cost): the
    advantages, and an algorithm's per-group extras (KVPO: whether any branch beat the reference run; streaming AWM:
    its per-segment advantages)."""
    n, G = len(batch.prompts), batch.plan.group_size
    batch.advantages = torch.zeros(n)
    batch.rewards = torch.zeros(n)
    if batch.extras is None:
        batch.extras = {}
    if algorithm.name == "kvpo":
        batch.extras["beats_reference"] = torch.ones(n // G, dtype=torch.bool)
    if algorithm.name == "stream_awm" and algorithm.cfg.advantage != "stream":
        batch.extras["segment_advantages"] = torch.zeros(n, int(batch.cond.segments.max()) + 1)


def _real_scalar() -> torch.Tensor:
    """AdamW's step counter as a real CPU scalar (its ``.item()`` must work); a few bytes, not tracked."""
    with _real():
        return torch.tensor(0.0)


def _fake_adamw_step(optimizer: torch.optim.Optimizer, tracker: MemoryTracker) -> None:
    """What ``torch.optim.AdamW``'s foreach step allocates beyond its state, per dtype group: the bias-corrected
    denominators (``sqrt(exp_avg_sq)``), one temporary the size of the trained weights; the moments are updated in
    place. (Its step counter's ``.item()`` cannot run on fake tensors, so the step is written out.)"""
    with torch.no_grad(), tracker.labelled("optimizer"):
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            state = [optimizer.state[p] for p in params]
            torch._foreach_mul_([s["exp_avg"] for s in state], group["betas"][0])
            torch._foreach_add_([s["exp_avg"] for s in state], [p.grad for p in params], alpha=1 - group["betas"][0])
            torch._foreach_mul_([s["exp_avg_sq"] for s in state], group["betas"][1])
            denom = torch._foreach_sqrt([s["exp_avg_sq"] for s in state])
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_addcdiv_(params, [s["exp_avg"] for s in state], denom, value=-group["lr"])
            del denom


class _Phase:
    """Resets the tracker's peak and counts FLOPs for one phase; records a :class:`PhasePlan` on exit."""

    def __init__(self, tracker, results, name, note, ddp_bytes):
        self.tracker, self.results, self.name, self.note, self.ddp_bytes = tracker, results, name, note, ddp_bytes
        self.extra_flops = 0.0

    def __enter__(self):
        self.tracker.reset_peak()
        self.counter = flop_counter()
        self.counter.__enter__()
        self.start = time.time()
        return self

    def __exit__(self, *exc):
        self.counter.__exit__(*exc)
        if exc[0] is not None:
            return False
        split = dict(self.tracker.peak_split)
        split["other"] = split.get("other", 0) + self.ddp_bytes
        self.results.append(PhasePlan(self.name, self.tracker.peak + self.ddp_bytes, split, self.tracker.peak_where,
                                      float(self.counter.get_total_flops()) + self.extra_flops, self.note,
                                      host_bytes=self.tracker.host_peak))
        return False


def _fsdp_arithmetic(results: list[PhasePlan], modules: list[dict], block_bytes: int, P: int, notes: list[str]) -> None:
    """FSDP2 over ``P`` processes, arithmetically: the transformer's weights, and the gradients and optimizer state
    (all of them the transformer's), divided by ``P``, plus two of its largest blocks gathered in full (the one
    running and the prefetched one)."""
    transformer = next((m for m in modules if m["name"] == "transformer"), None)
    if transformer is None or P <= 1:
        return
    saved = transformer["bytes"] * (1 - 1 / P) - 2 * block_bytes
    for p in results:
        p.split["weights"] -= int(saved)
        for k in ("gradients", "optimizer"):
            p.split[k] = int(p.split.get(k, 0) / P)
        p.peak_bytes = sum(p.split.values())
    notes.append(f"FSDP2 applied arithmetically over {P} processes: transformer weights, gradients and optimizer "
                 f"state sharded, two blocks of {block_bytes / GiB:.2f} GiB gathered")
