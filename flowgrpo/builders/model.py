"""Phase 0 of a run, the model: the adapter a ``model`` node names, and the plain keywords its calls take.

>>> adapter = build_adapter(cfg.model, device="cuda")     # doctest: +SKIP
>>> model_kwargs(cfg.model)["guidance"]                   # doctest: +SKIP
{'guidance_scale': 4.5}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ..config import STREAM_FAMILY, config_key, validate
from ..paths import REPO_ROOT, looks_local, resolve_path

__all__ = ["build_adapter", "model_kwargs"]


def build_adapter(model: DictConfig, *, device: str | torch.device = "cpu"):
    """``flowgrpo.models.load_adapter`` from a ``model`` node.

    ``model.pretrained`` is a local pipeline directory (relative: cwd, then the repo root), a hub id,
    ``tiny-random:<family>``, or ``random-init:<arch>``. A path that is clearly local but missing fails at once (no
    hub round-trip), naming ``model.pretrained``. A streaming model (``model.family=causal_wan``) is loaded by
    ``flowgrpo.models.load_stream_pipeline`` (``random-init:wan21_1_3b`` included) and seen through a
    ``flowgrpo.models.StreamAdapter``.
    """
    validate(model)
    if model.family == STREAM_FAMILY:
        from ..models import StreamAdapter, load_stream_pipeline

        return StreamAdapter(load_stream_pipeline(model, device=device))
    from ..models import load_adapter  # heavy (diffusers): import on use

    pretrained = model.pretrained
    if not pretrained.startswith(("tiny-random:", "random-init:")):
        local = resolve_path(pretrained)
        if local is not None:
            pretrained = str(local)
        elif looks_local(pretrained):
            raise FileNotFoundError(
                f"{config_key(model, 'pretrained')}={model.pretrained!r}: no such directory (looked under {Path.cwd()} "
                f"and {REPO_ROOT}). Set {config_key(model, 'pretrained')} to a diffusers pipeline directory (with "
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
