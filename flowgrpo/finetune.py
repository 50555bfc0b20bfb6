"""What the update trains: LoRA adapters (peft) or every transformer weight; the frozen reference policy for
the KL term; an EMA of the trainable weights; their checkpoint state, gathered in full when FSDP shards them."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch

__all__ = ["prepare_trainable", "lora_targets", "reference_policy", "EMA", "gathers_state", "trainable_names", "trainable_state",
           "load_trainable_state", "optimizer_state", "load_optimizer_state", "ALL_LINEAR"]

#: ``model.lora.target_modules`` entry meaning every linear layer of the transformer's blocks (:func:`lora_targets`)
ALL_LINEAR = "all-linear"


def lora_targets(transformer: torch.nn.Module, target_modules) -> list[str]:
    """``model.lora.target_modules`` as peft's ``target_modules``: module-name suffixes as given, and
    :data:`ALL_LINEAR` (``all-linear``) expanded to the full name of every ``nn.Linear`` inside the transformer's
    blocks, the ``nn.ModuleList`` children of the transformer (Wan's ``blocks``, SD3's ``transformer_blocks``, FLUX's
    two lists): every attention projection and feed-forward layer, and nothing of the embedders, the output norm or
    the output projection. That is the LoRA of LongLive and KVPO (arXiv 2605.14278; github.com/Richard-Zhang-AI/KVPO
    wraps every linear of each ``CausalWanAttentionBlock``, rank and alpha 256); peft's own ``all-linear`` would also
    take the time and text embedders."""
    targets = list(target_modules)
    if ALL_LINEAR not in targets:
        return targets
    blocks = [(name, child) for name, child in transformer.named_children() if isinstance(child, torch.nn.ModuleList)]
    linear = [f"{name}.{sub}" for name, child in blocks for sub, m in child.named_modules()
              if isinstance(m, torch.nn.Linear)]
    if not linear:
        raise ValueError(f"model.lora.target_modules names {ALL_LINEAR!r}, but {type(transformer).__name__} has no "
                         "linear layer inside a list of blocks (an nn.ModuleList child): list the module names instead")
    return [t for t in targets if t != ALL_LINEAR] + linear


def prepare_trainable(transformer: torch.nn.Module, model_cfg) -> list[torch.nn.Parameter]:
    """Freeze the transformer, then add LoRA (``model.finetune=lora``) or unfreeze it (``full``).

    Returns the trainable parameters (in ``named_parameters`` order, which checkpoints rely on).
    """
    transformer.requires_grad_(False)
    if model_cfg.finetune == "lora":
        from peft import LoraConfig

        lora = model_cfg.lora
        if not lora.target_modules:
            raise ValueError("model.lora.target_modules is empty: list the transformer modules LoRA should wrap")
        transformer.add_adapter(
            LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                init_lora_weights=True if lora.init_weights == "default" else lora.init_weights,
                target_modules=lora_targets(transformer, lora.target_modules),
            )
        )
    else:
        transformer.requires_grad_(True)
    if model_cfg.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    params = [p for p in transformer.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"model.lora.target_modules={list(model_cfg.lora.target_modules)} matched no module")
    return params


def gathers_state(accelerator) -> bool:
    """Whether ``accelerator`` shards the trainable state across processes, so that a checkpoint must gather it in
    full (collectives: every rank calls the state functions below with ``gather=True``; rank 0 gets the tensors).

    FSDP2 (``conf/accelerate/fsdp.yaml``): True. Plain / DDP: False. DeepSpeed (``conf/accelerate/
    deepspeed_zero2.yaml``) and FSDP1: ``NotImplementedError`` — ZeRO partitions the optimizer state per rank and
    nothing here gathers it, FSDP1 is not verified; a checkpoint of rank 0's shard would resume wrongly.
    """
    from accelerate.utils import DistributedType

    kind = getattr(accelerator, "distributed_type", None)
    if kind == DistributedType.DEEPSPEED:
        raise NotImplementedError(
            "DeepSpeed (conf/accelerate/deepspeed_zero2.yaml) is not supported by the trainer's checkpoints: ZeRO "
            "partitions the optimizer state across ranks and the trainer does not gather it, so a checkpoint would "
            "hold rank 0's partition only. Use conf/accelerate/fsdp.yaml (FSDP2) or multi_gpu.yaml (DDP)")
    if kind == DistributedType.FSDP:
        if not getattr(accelerator, "is_fsdp2", False):
            raise NotImplementedError(
                "FSDP1 is not supported by the trainer's checkpoints (not verified); set fsdp_version: 2 as "
                "conf/accelerate/fsdp.yaml does")
        return True
    return False


def trainable_names(transformer: torch.nn.Module) -> list[str]:
    """The names of the parameters training updates, in ``named_parameters`` order (the order of checkpoints and of
    the update guard's copies)."""
    return [n for n, p in transformer.named_parameters() if p.requires_grad]


def trainable_state(transformer: torch.nn.Module, *, gather: bool = False) -> dict[str, torch.Tensor]:
    """Name → tensor of the trainable parameters (CPU copies), for checkpoints.

    ``gather=True`` (FSDP, see :func:`gathers_state`): a collective — call it on every rank; rank 0 gets the full
    tensors, the other ranks an empty dict.
    """
    if not gather:
        return {n: p.detach().cpu().clone() for n, p in transformer.named_parameters() if p.requires_grad}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(transformer, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                      ignore_frozen_params=True))
    # (clones: on CPU the gathered tensors can share storage that FSDP frees afterwards)
    return {n: full[n].clone() for n in trainable_names(transformer)} if full else {}


def load_trainable_state(transformer: torch.nn.Module, state: dict[str, torch.Tensor], *, gather: bool = False) -> None:
    """Copy ``state`` (full tensors, as :func:`trainable_state` returns) into the trainable parameters; with
    ``gather=True`` each rank keeps its shard of them (a collective: every rank passes the full state)."""
    names = trainable_names(transformer)
    if set(names) != state.keys():
        missing, extra = set(names) - state.keys(), state.keys() - set(names)
        raise ValueError(f"checkpoint does not match the trainable parameters (missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(extra)[:3]}): was it written with another model.lora / model.finetune?")
    if gather:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(transformer, dict(state), options=StateDictOptions(full_state_dict=True, strict=False))
        return
    params = dict(transformer.named_parameters())
    with torch.no_grad():
        for n in names:
            params[n].copy_(state[n])


def optimizer_state(transformer: torch.nn.Module, optimizer: torch.optim.Optimizer, *, gather: bool = False) -> dict:
    """The optimizer's state dict. ``gather=True`` (FSDP): a collective; rank 0 gets the full states, keyed by
    parameter name (``torch.distributed.checkpoint``'s format), the other ranks an empty dict."""
    if not gather:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    inner = torch_optimizer(optimizer)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(transformer, inner, options=options)


def _rekey_optimizer_state(state: dict, key) -> dict:
    return {"state": {key[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [key[k] for k in g["params"]]} for g in state["param_groups"]]}


def load_optimizer_state(transformer: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict, *,
                         gather: bool = False) -> None:
    """Load what :func:`optimizer_state` returned, with or without ``gather``, into this run's optimizer (sharded
    under FSDP with ``gather=True``: a collective). The optimizer must hold the trainable parameters in
    ``named_parameters`` order (:func:`prepare_trainable`'s), which maps torch's integer keys to names."""
    names = trainable_names(transformer)
    by_name = any(isinstance(k, str) for g in state["param_groups"] for k in g["params"])
    if gather:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if not by_name:
            state = _rekey_optimizer_state(state, names)
        inner = torch_optimizer(optimizer)
        set_optimizer_state_dict(transformer, inner, state, options=StateDictOptions(full_state_dict=True))
        return
    if by_name:
        state = _rekey_optimizer_state(state, {n: i for i, n in enumerate(names)})
    optimizer.load_state_dict(state)


@contextlib.contextmanager
def reference_policy(transformer: torch.nn.Module, frozen_copy: torch.nn.Module | None = None) -> Iterator[torch.nn.Module]:
    """The reference policy π_ref for the KL term: the LoRA'd transformer with its adapters disabled (the base
    weights are never trained), or, for full fine-tuning, a frozen copy kept from the start.

    Yields the module to call. ``transformer`` must be the unwrapped model (peft's adapter switches live there).
    """
    if frozen_copy is not None:
        yield frozen_copy
        return
    transformer.disable_adapters()
    try:
        yield transformer
    finally:
        transformer.enable_adapters()


def frozen_reference(transformer: torch.nn.Module) -> torch.nn.Module:
    """A frozen deep copy of ``transformer`` (full fine-tuning with a KL term)."""
    ref = copy.deepcopy(transformer).eval()
    ref.requires_grad_(False)
    return ref


class EMA:
    """Exponential moving average of the trainable parameters: ``ema ← decay·ema + (1−decay)·θ``."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params = params
        self.decay = decay
        self.shadow = [p.detach().clone().float() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().float(), 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Evaluate with the EMA weights; the live weights come back afterwards."""
        live = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                p.copy_(s.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(self.params, live):
                    p.copy_(v)

    def state_dict(self) -> dict:
        """Full CPU tensors. With FSDP-sharded (DTensor) parameters this gathers: call it on every rank."""
        return {"decay": self.decay, "shadow": [_full_tensor(s).cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError("EMA state does not match the trainable parameters")
        self.decay = state["decay"]
        self.shadow = [_like(s.to(local_shard(p).device).float(), p) for s, p in zip(state["shadow"], self.params)]


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a sharded (FSDP's ``DTensor``) tensor, or the tensor itself; under ``no_grad`` it is the
    tensor the ``DTensor`` holds, so writing into it writes the shard."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` wrapper (the one that owns ``state``)."""
    return getattr(optimizer, "optimizer", optimizer)


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` sharded as ``param`` is (every rank holds ``full``: no communication), or ``full`` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return full
