r"""``load_stream_pipeline``: a :class:`StreamingWanPipeline` from a streaming model's config node (``model=...`` with
``model.family=causal_wan``, e.g. ``conf/model/self_forcing_wan.yaml``).

Two ways to get there:

* **a base pipeline and a streaming checkpoint** (``model.stream.checkpoint``): ``model.pretrained`` is the
  diffusers ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` (hub id or local snapshot) and gives the text encoder, tokenizer,
  VAE and the transformer's config; the checkpoint (Self-Forcing's ``self_forcing_dmd.pt``, LongLive's
  ``longlive_base.pt`` with ``model.stream.lora_checkpoint`` merged) is converted by
  :func:`~flowgrpo.models.load_streaming_wan_transformer` into the transformer (the base's own transformer
  weights are never read);
* **a streaming model directory** (``model.stream.checkpoint: null``): ``model.pretrained`` is a directory written
  by :meth:`StreamingWanPipeline.save_pretrained` (a ``WanPipeline`` plus ``stream_config.json``);
* **a published architecture at random initialisation** (``model.pretrained=random-init:wan21_1_3b``, with
  ``model.stream.checkpoint: null`` and ``model.stream.lora_checkpoint: null``): the ``WanPipeline`` that
  :func:`~flowgrpo.models.random_init.build_random_pipeline` builds (Wan2.1-1.3B's transformer with random weights,
  a one-layer text-encoder stand-in), made causal as the other two are. Weights do not change what a step costs,
  so this is what ``scripts/gpu_check.py`` measures a streaming model's iteration with; nothing is read from disk.

The stream settings are the config's either way: ``model.stream.*`` (block size, steps and shift, sink, window,
cache, context noise, re-cache) and the model's frame size, guidance, negative prompt and text length. A streaming
model directory whose ``stream_config.json`` says otherwise is loaded with the config's values and a warning.

Example:
    ```py
    >>> from flowgrpo.models import load_stream_pipeline
    >>> pipe = load_stream_pipeline(cfg.model, device="cuda")      # cfg: python -m flowgrpo.stream --preset ...
    >>> out = pipe(["a red kite rising", "a red kite diving"], switch_frames=[41], num_frames=cfg.model.num_frames)
    ```
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, fields
from typing import Any, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

from ..paths import looks_local, resolve_path  # the config layer's rule: absolute, else cwd, else repo root
from .load import RANDOM_PREFIX, check_tokenizers, parse_dtype, set_vae_dtype
from .stream_pipeline import STREAM_CONFIG_NAME, StreamConfig, StreamingWanPipeline

__all__ = ["load_stream_pipeline", "stream_config_of", "stream_pipeline_of"]

log = logging.getLogger(__name__)

#: ``StreamConfig`` fields that are the model's own keys (``model.<name>``); the rest are ``model.stream.<name>``.
MODEL_KEYS = ("height", "width", "guidance_scale", "negative_prompt", "max_sequence_length")


def _node(model: DictConfig | Mapping[str, Any]) -> DictConfig:
    return model if isinstance(model, DictConfig) else OmegaConf.create(dict(model))


def _required(node: DictConfig, key: str, full: str, hint: str) -> Any:
    if OmegaConf.is_missing(node, key):
        raise ValueError(f"{full} is required (??? in the preset): {hint}")
    return node[key]


def stream_config_of(model: DictConfig | Mapping[str, Any]) -> StreamConfig:
    """The :class:`StreamConfig` a ``model`` node describes: ``model.stream.*`` plus the model's frame size,
    guidance scale, negative prompt and text length."""
    m = _node(model)
    if m.get("stream") is None:
        raise ValueError("model.stream is null: a streaming model (model.family=causal_wan) sets its stream settings "
                         "there")
    values = {}
    for f in fields(StreamConfig):
        node, key = (m, f.name) if f.name in MODEL_KEYS else (m.stream, f.name)
        values[f.name] = None if OmegaConf.is_missing(node, key) else node[key]
    return StreamConfig(**values)


def _local_file(path: str, key: str, what: str) -> str:
    found = resolve_path(path)
    if found is None or not found.is_file():
        raise FileNotFoundError(f"{key}={path!r}: no such file (relative paths are looked up under the working "
                                f"directory, then the repository root). Set {key} to {what}.")
    return str(found)


def _base(pretrained: str) -> tuple[str, bool]:
    """``(path or hub id, is a local directory)`` of ``model.pretrained``."""
    found = resolve_path(pretrained)
    if found is not None:
        return str(found), found.is_dir()
    if looks_local(pretrained):
        raise FileNotFoundError(
            f"model.pretrained={pretrained!r}: no such directory (relative paths are looked up under the working "
            f"directory, then the repository root). Set model.pretrained to the diffusers Wan2.1-T2V-1.3B pipeline "
            f"(a local snapshot of Wan-AI/Wan2.1-T2V-1.3B-Diffusers, or that hub id in the Hugging Face cache), or "
            f"to a streaming model directory with model.stream.checkpoint=null.")
    return pretrained, False


def load_stream_pipeline(
    model: DictConfig | Mapping[str, Any],
    *,
    device: str | torch.device = "cpu",
) -> StreamingWanPipeline:
    r"""
    Load a streaming Wan from a ``model`` config node (``model.family=causal_wan``).

    Args:
        model (`DictConfig` or mapping): the composed ``model`` node (``conf/model/self_forcing_wan.yaml``,
            ``conf/model/longlive_wan.yaml``, with the paths set), validated or not.
        device (`str` or `torch.device`, defaults to `"cpu"`): where the pipeline is moved.

    Returns:
        `StreamingWanPipeline`: its transformer made causal with the config's stream settings.

    Raises:
        ValueError: a required key left unset (``model.stream.checkpoint``, ``model.stream.lora_checkpoint``,
            ``model.pretrained``), a family that is not ``causal_wan``, a streaming model directory expected
            but not given, a streaming checkpoint given with ``model.pretrained=random-init:<arch>`` (whose
            weights are random), or an architecture that is not a Wan; the message names the key.
        FileNotFoundError: a path that does not exist, naming its key.
        OSError: ``model.pretrained`` cannot be loaded as a ``WanPipeline``.
    """
    from diffusers import WanPipeline, WanTransformer3DModel

    from .wan_checkpoints import load_streaming_wan_transformer

    m = _node(model)
    if m.family != "causal_wan":
        raise ValueError(f"model.family={m.family!r} is not a streaming model: load_stream_pipeline takes "
                         f"model.family='causal_wan' (e.g. model=self_forcing_wan); load the others with "
                         f"flowgrpo.builders.build_adapter")
    config = stream_config_of(m)
    s = m.stream
    pretrained = _required(m, "pretrained", "model.pretrained",
                           "set it to the diffusers Wan2.1-T2V-1.3B pipeline (hub id or local snapshot)")
    checkpoint = _required(s, "checkpoint", "model.stream.checkpoint",
                           "set it to the streaming checkpoint file (e.g. --set model.stream.checkpoint=PATH/"
                           "self_forcing_dmd.pt), or to null when model.pretrained is a streaming model directory")
    lora = _required(s, "lora_checkpoint", "model.stream.lora_checkpoint",
                     "set it to the LoRA file merged into the checkpoint (e.g. --set model.stream.lora_checkpoint="
                     "PATH/lora.pt), or to null for none")
    if str(pretrained).startswith(RANDOM_PREFIX):
        return _random_stream_pipeline(m, str(pretrained), checkpoint, lora, device)
    base, is_dir = _base(pretrained)
    kwargs = OmegaConf.to_container(m.pipeline_kwargs, resolve=True) if "pipeline_kwargs" in m else {}
    dtype = parse_dtype(m.get("torch_dtype", "float32"))

    if checkpoint is None:
        if lora is not None:
            raise ValueError("model.stream.lora_checkpoint is merged into model.stream.checkpoint, which is null: "
                             "set both, or neither for a streaming model directory")
        saved = os.path.join(base, STREAM_CONFIG_NAME)
        if not (is_dir and os.path.isfile(saved)):
            raise FileNotFoundError(
                f"model.stream.checkpoint is null, so model.pretrained={pretrained!r} must be a streaming model "
                f"directory (a WanPipeline with {STREAM_CONFIG_NAME}), and it is not. Set model.stream.checkpoint to "
                f"the streaming checkpoint file, loaded into the transformer of model.pretrained.")
        with open(saved) as f:
            own = json.load(f)
        differ = {k: (v, own[k]) for k, v in asdict(config).items() if k in own and own[k] != v}
        if differ:
            log.warning("%s: the config's stream settings replace the directory's: %s", saved,
                        ", ".join(f"{k}={v!r} (saved: {w!r})" for k, (v, w) in sorted(differ.items())))
    else:
        ckpt = _local_file(checkpoint, "model.stream.checkpoint",
                           "the streaming checkpoint file (Self-Forcing's self_forcing_dmd.pt, LongLive's "
                           "longlive_base.pt)")
        lora_path = None if lora is None else _local_file(lora, "model.stream.lora_checkpoint",
                                                          "the LoRA file (LongLive's lora.pt), or null")
        try:  # the base transformer's config (transformer/config.json); its weights are never read
            architecture = dict(WanTransformer3DModel.load_config(base, subfolder="transformer"))
        except OSError as err:
            raise _load_error(pretrained, err) from err
        kwargs["transformer"] = load_streaming_wan_transformer(
            ckpt, architecture, torch_dtype=dtype, key=s.checkpoint_key, lora_path=lora_path, lora_alpha=s.lora_alpha)
    try:
        index = WanPipeline.load_config(base)
    except OSError as err:
        raise _load_error(pretrained, err) from err
    for name, value in index.items():  # diffusers saves a missing optional component as [null, null]
        if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] is None and value[1] is None:
            kwargs.setdefault(name, None)
    try:
        pipe = WanPipeline.from_pretrained(base, dtype=dtype, **kwargs)
    except OSError as err:
        raise _load_error(pretrained, err) from err
    check_tokenizers(pipe, f"model.pretrained={pretrained!r}")
    return stream_pipeline_of(pipe, m, device=device)


def _random_stream_pipeline(m: DictConfig, pretrained: str, checkpoint: Any, lora: Any,
                            device: str | torch.device) -> StreamingWanPipeline:
    """``model.pretrained=random-init:<arch>``: the randomly initialised ``WanPipeline`` of ``<arch>``, made causal
    by :func:`stream_pipeline_of`. No file is read, so a streaming checkpoint (or LoRA) to load is refused."""
    from diffusers import WanPipeline

    from .random_init import ARCHITECTURES, build_random_pipeline

    for key, value in (("model.stream.checkpoint", checkpoint), ("model.stream.lora_checkpoint", lora)):
        if value is not None:
            raise ValueError(f"{key}={value!r} with model.pretrained={pretrained!r}: a random-init model has random "
                             f"weights and loads no checkpoint; set {key}=null, or set model.pretrained to the "
                             f"diffusers Wan2.1-T2V-1.3B pipeline to load the checkpoint into")
    arch = pretrained[len(RANDOM_PREFIX):]
    if arch not in ARCHITECTURES:  # build_random_pipeline says so too, but not which key
        raise ValueError(f"model.pretrained={pretrained!r}: unknown architecture {arch!r}; choose one of "
                         f"{', '.join(RANDOM_PREFIX + a for a in ARCHITECTURES)}")
    pipe = build_random_pipeline(arch, torch_dtype=parse_dtype(m.get("torch_dtype", "float32")))
    if not isinstance(pipe, WanPipeline):
        raise ValueError(f"model.pretrained={pretrained!r} is not a Wan architecture: a streaming model "
                         f"(model.family=causal_wan) is a causal Wan, e.g. model.pretrained={RANDOM_PREFIX}wan21_1_3b")
    return stream_pipeline_of(pipe, m, device=device)


def stream_pipeline_of(pipe, model: DictConfig | Mapping[str, Any], *,
                       device: str | torch.device = "cpu") -> StreamingWanPipeline:
    """The :class:`StreamingWanPipeline` a ``model`` node makes of an assembled ``WanPipeline`` (its components in
    eval mode on ``device``, the VAE in ``model.vae_dtype``, the transformer made causal with the node's stream
    settings): the last step of :func:`load_stream_pipeline`, shared with the planner, which assembles the pipeline
    from architecture configs instead of weights."""
    m = _node(model)
    config = stream_config_of(m)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.to(device)
    set_vae_dtype(pipe, m.get("vae_dtype"))
    pipe.set_progress_bar_config(disable=True)
    return StreamingWanPipeline(pipe, config)


def _load_error(pretrained: str, err: Exception) -> OSError:
    return OSError(
        f"Could not load the Wan pipeline of model.pretrained={pretrained!r}: {err}\nSet model.pretrained to the "
        f"diffusers Wan2.1-T2V-1.3B pipeline (a local snapshot of Wan-AI/Wan2.1-T2V-1.3B-Diffusers, or that hub id "
        f"in the Hugging Face cache), or to a streaming model directory with model.stream.checkpoint=null."
    )
