"""What the update trains: LoRA adapters (peft) or every transformer weight; the frozen reference policy for
the KL term; an EMA of the trainable weights."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch

__all__ = ["prepare_trainable", "reference_policy", "EMA"]


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
                target_modules=list(lora.target_modules),
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


def trainable_state(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name → tensor of the trainable parameters (CPU copies), for checkpoints."""
    return {n: p.detach().cpu().clone() for n, p in transformer.named_parameters() if p.requires_grad}


def load_trainable_state(transformer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    if params.keys() != state.keys():
        missing, extra = params.keys() - state.keys(), state.keys() - params.keys()
        raise ValueError(f"checkpoint does not match the trainable parameters (missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(extra)[:3]}): was it written with another model.lora / model.finetune?")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(state[n])


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
        return {"decay": self.decay, "shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError("EMA state does not match the trainable parameters")
        self.decay = state["decay"]
        self.shadow = [s.to(p.device).float() for s, p in zip(state["shadow"], self.params)]
