r"""Streaming Wan checkpoints (Self-Forcing, CausVid, LongLive) loaded into diffusers' ``WanTransformer3DModel``.

The streaming Wan 2.1 models are trained in their authors' own code, which wraps Wan-AI's original ``WanModel``
(or its causal copy ``CausalWanModel``) in a ``WanDiffusionWrapper`` whose transformer is the attribute ``model``.
Their releases are therefore torch pickles of wrapper state dicts in the **original Wan layout** behind a
``model.`` prefix, e.g. ``{"generator": {"model.blocks.0.self_attn.q.weight": ...}, "generator_ema": {...}}``
(Self-Forcing: ``trainer/distillation.py`` saves ``generator``, ``critic`` and ``generator_ema``; CausVid:
``minimal_inference/autoregressive_inference.py`` reads ``model.pt["generator"]``). LongLive trains a LoRA on top
and ships it in a second pickle, ``{"generator_lora": <peft state dict>, "critic_lora": ..., "step": ...}``
(NVlabs/LongLive, ``trainer/distillation.py``, ``save``; LongLive files cited here are those of its Wan2.1-1.3B
release, the tree before its "LongLive 2.0" commit). The causal attention of those repositories is not a
weight: the transformer is plain Wan, and :class:`flowgrpo.models.CausalWan` makes the loaded model stream.

diffusers has the key converter for the original layout (``convert_wan_transformer_to_diffusers`` in
``diffusers.loaders.single_file_utils``) but ``from_single_file`` does not read these pickles: the generator sits
under a top-level entry, behind ``model.`` (the converter strips only ``model.diffusion_model.``; with
``model.`` left in place no key would match the model), and a LoRA must be folded in first. This module does
those steps, then reuses diffusers' converter unchanged:

1. read the file (``torch.load(weights_only=True, mmap=True)``: a training checkpoint also holds the critic,
   which is then never read from disk; or a ``.safetensors`` state dict),
2. pick the generator: ``key`` if given; else ``generator`` when a LoRA is merged (LongLive trains its LoRA on the
   ``generator`` weights: ``trainer/distillation.py`` loads ``base_checkpoint["generator"]`` before wrapping,
   and ``configs/longlive_inference.yaml`` sets ``use_ema: false``) and ``generator_ema`` otherwise when present
   (Self-Forcing's README runs its DMD checkpoint with ``--use_ema``), then ``generator``,
3. drop FSDP / activation-checkpoint / ``torch.compile`` tokens from the names (EMA shadows gathered from nested
   FSDP units carry ``_fsdp_wrapped_module.``; LongLive's ``inference.py`` removes it the same way) and strip the
   wrapper prefix (``model.``, or ``model.diffusion_model.``, or none),
4. merge the LoRA, ``W ← W + (alpha / r)·B·A`` per target module, exactly what peft's ``merge_and_unload`` computes
   for a ``LoraConfig(r, lora_alpha)`` without rsLoRA/DoRA, and the function its unmerged peft model computes
   (LongLive's 1.3B ``inference.py`` runs that peft model; its later ``scripts/merge_lora_generator.py`` merges
   with peft; here no peft model is built, so the 1.3B weights are not instantiated twice),
5. convert to diffusers keys (``self_attn``→``attn1``, ``cross_attn``→``attn2``, ``q/k/v/o``→``to_q/to_k/to_v/
   to_out.0``, ``ffn.0/2``→``ffn.net.0.proj/ffn.net.2``, ``modulation``→``scale_shift_table``, ``head.head``→
   ``proj_out``, the time/text embedders, and the original ``norm3`` (the affine cross-attention norm) →
   diffusers ``norm2``), checking that no two keys collide.

Everything that does not fit fails loudly, naming the file and the keys: a missing entry, a layout that is not
Wan's, keys left over outside the transformer, LoRA targets that do not exist, shapes that disagree, and — when
the transformer is built — any missing or unexpected key.

Example:
    ```py
    >>> from flowgrpo.models import CausalWan, load_streaming_wan_transformer
    >>> transformer = load_streaming_wan_transformer(
    ...     "checkpoints/self_forcing_dmd.pt", "wan_models/Wan2.1-T2V-1.3B-Diffusers", torch_dtype="bfloat16")
    >>> wan = CausalWan(transformer, block_frames=3)       # Self-Forcing's 3-latent-frame blocks
    ```
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import torch
from diffusers import WanTransformer3DModel

from .load import parse_dtype

__all__ = ["build_streaming_wan_transformer", "load_streaming_wan_state_dict", "load_streaming_wan_transformer",
           "merge_lora"]

log = logging.getLogger(__name__)

AUTO = "auto"
#: the top-level entries the streaming repositories save (Self-Forcing, CausVid, LongLive).
GENERATOR_KEYS = ("generator", "generator_ema")
LORA_KEY = "generator_lora"
#: wrapper prefixes around the transformer's own names, longest first.
_PREFIXES = ("model.diffusion_model.", "model.", "")
#: name tokens inserted by FSDP units, activation-checkpoint wrappers and torch.compile.
_WRAPPER_TOKENS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
#: peft's prefix of a ``PeftModel``'s LoRA state dict (``get_peft_model_state_dict``).
_PEFT_PREFIX = "base_model.model."
#: ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` (peft drops the adapter name when it saves; a raw
#: ``state_dict()`` keeps it, ``.lora_A.default.weight``).
_LORA_RE = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.(?P<adapter>[^.]+))?\.weight")

# Top-level module names of Wan-AI's WanModel (T2V; I2V adds img_emb; VACE adds vace_*), and the names that tell
# the two layouts apart.
_ORIGINAL_TOP = ("patch_embedding", "text_embedding", "time_embedding", "time_projection", "blocks", "head",
                 "img_emb", "vace_blocks", "vace_patch_embedding")
_ORIGINAL_MARKS = re.compile(r"^(time_embedding|text_embedding|time_projection|head)\.|\.(self_attn|cross_attn)\.")
_DIFFUSERS_MARKS = re.compile(r"^(condition_embedder\.|proj_out\.|scale_shift_table$|norm_out\.)|\.attn[12]\.")

_SHOW = 12  # keys listed in an error message before "and N more"


class _EntryError(KeyError):
    """A missing entry: a ``KeyError`` whose message prints as written (``KeyError`` quotes its message)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _listing(keys, limit: int = _SHOW) -> str:
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", … and {len(keys) - limit} more" if len(keys) > limit else "")


# ------------------------------------------------------------------------------------------------- reading files


def _read(path: Path, *, weights_only: bool) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"No checkpoint file at {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        except RuntimeError as err:  # files from torch.save(_use_new_zipfile_serialization=False) cannot be mapped
            if "mmap" not in str(err):
                raise
            return torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if not weights_only:
            raise
        raise ValueError(
            f"{path} holds objects that torch.load(weights_only=True) refuses to unpickle ({err}). If you trust "
            f"the file, pass weights_only=False."
        ) from err


def _entries(obj: Any) -> str:
    return _listing(obj.keys()) if isinstance(obj, Mapping) else f"none (it holds a {type(obj).__name__})"


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _checked_state_dict(obj: Any, path: Path, entry: str | None) -> dict[str, torch.Tensor]:
    where = f"{path}" + (f"[{entry!r}]" if entry is not None else "")
    if not isinstance(obj, Mapping) or not obj:
        raise ValueError(f"{where} is not a state dict (a non-empty dict of tensors): it is a {type(obj).__name__}")
    odd = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if odd:
        raise ValueError(f"{where} is not a state dict: entries that are not tensors: {_listing(odd)}")
    return dict(obj)


def _pick_generator(obj: Any, path: Path, key: str | None, prefer_ema: bool) -> tuple[dict, str | None]:
    """The generator's state dict in the file, and the entry it came from (``None``: the file is the state dict)."""
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            raise _EntryError(f"{path} has no entry {key!r}; its top-level keys are: {_entries(obj)}")
        return _checked_state_dict(obj[key], path, key), key
    if _is_state_dict(obj):
        return dict(obj), None
    if isinstance(obj, Mapping):
        order = ("generator_ema", "generator") if prefer_ema else ("generator", "generator_ema")
        for name in order + ("model",):  # "model": the fallback of LongLive's inference.py
            if name in obj and isinstance(obj[name], Mapping):
                return _checked_state_dict(obj[name], path, name), name
    raise _EntryError(
        f"{path} holds no generator state dict: expected an entry {' or '.join(map(repr, GENERATOR_KEYS))} (or a "
        f"plain state dict); its top-level keys are: {_entries(obj)}. Pass key=<entry> to choose one."
    )


# ----------------------------------------------------------------------------------------------- names and layout


def _clean(name: str) -> str:
    for token in _WRAPPER_TOKENS:
        name = name.replace(token, "")
    return name


def _strip_wrapper(state_dict: Mapping[str, torch.Tensor], path: Path, ignore: Sequence[str]) -> tuple[dict, str]:
    """Drop wrapper tokens and ignored keys, then the wrapper prefix shared by the keys; leftovers are an error."""
    cleaned: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        c = _clean(k)
        if any(c.startswith(p) for p in ignore):
            continue
        if c in cleaned:
            raise ValueError(f"{path}: keys {k!r} and another one both name {c!r} once wrapper tokens are removed")
        cleaned[c] = v
    if not cleaned:
        raise ValueError(f"{path}: no keys left after ignore={list(ignore)}")
    # The longest prefix most keys share ("" always qualifies); the keys outside it are leftovers.
    prefix = next(p for p in _PREFIXES if 2 * sum(k.startswith(p) for k in cleaned) > len(cleaned))
    outside = [k for k in cleaned if not k.startswith(prefix)]
    if outside:
        raise ValueError(
            f"{path}: keys left over outside the transformer (which sits under {prefix!r}): {_listing(outside)}. "
            f"If they belong to the training wrapper (e.g. a discriminator head), drop them with "
            f"ignore=({', '.join(repr(k.split('.')[0] + '.') for k in sorted(outside)[:2])})."
        )
    return {k[len(prefix):]: v for k, v in cleaned.items()}, prefix


def _layout(keys, path: Path) -> str:
    original = [k for k in keys if _ORIGINAL_MARKS.search(k)]
    diffusers = [k for k in keys if _DIFFUSERS_MARKS.search(k)]
    if original and diffusers:
        raise ValueError(
            f"{path}: the keys mix the original Wan layout ({_listing(original, 3)}) and diffusers' "
            f"({_listing(diffusers, 3)}); expected one of them"
        )
    if original:
        leftover = [k for k in keys if k.split(".")[0] not in _ORIGINAL_TOP]
        if leftover:
            raise ValueError(
                f"{path}: keys left over that are not part of a Wan transformer (original layout: top-level "
                f"modules {', '.join(_ORIGINAL_TOP)}): {_listing(leftover)}. Pass ignore=(<prefix>, ...) to drop them."
            )
        return "original"
    if diffusers:
        return "diffusers"
    raise ValueError(
        f"{path}: not a Wan transformer state dict in the original Wan layout (e.g. 'blocks.0.self_attn.q.weight', "
        f"'head.head.weight', under 'model.') nor in diffusers' (e.g. 'blocks.0.attn1.to_q.weight'); keys found: "
        f"{_listing(keys, 6)}"
    )


def _to_diffusers(state_dict: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    converted = convert_wan_transformer_to_diffusers(dict(state_dict))  # it pops from what it is given
    if len(converted) != len(state_dict):
        raise ValueError(f"{path}: converting to diffusers' layout mapped {len(state_dict)} keys onto "
                         f"{len(converted)}: two keys collided; is this a Wan 2.1 transformer?")
    return converted


# ------------------------------------------------------------------------------------------------------ LoRA


def merge_lora(
    state_dict: Mapping[str, torch.Tensor],
    lora_state_dict: Mapping[str, torch.Tensor],
    *,
    lora_alpha: float | None = None,
    source: str = "the LoRA",
) -> tuple[dict[str, torch.Tensor], list[str]]:
    r"""
    Merge a peft LoRA state dict into a state dict: ``W ← W + (lora_alpha / r)·B·A`` for every target module.

    Args:
        state_dict (`Mapping[str, torch.Tensor]`): the base weights, with the transformer's own names (no wrapper
            prefix), in the layout the LoRA was trained in.
        lora_state_dict (`Mapping[str, torch.Tensor]`): as peft's ``get_peft_model_state_dict`` writes it:
            ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight`` ``[out, r]`` (the
            ``base_model.model.`` prefix, an adapter name such as ``.default``, a ``model.`` wrapper prefix and FSDP
            tokens are tolerated). ``<module>.weight`` must be a 2-D weight of ``state_dict``.
        lora_alpha (`float`, *optional*): peft's ``lora_alpha``; the scaling is ``lora_alpha / r`` with ``r`` read
            from each module's ``lora_A`` (peft's default, ``use_rslora=False``). ``None``: ``lora_alpha = r``
            (scaling 1), LongLive's own default (``alpha or rank``, ``utils/lora_utils.py``); its released LoRA
            has rank = alpha = 256.
        source (`str`): how error messages name the LoRA.

    Returns:
        `(dict, list[str])`: a new state dict (merged in float32, cast back to each weight's dtype; untouched
        tensors shared) and the merged module names.

    Raises:
        ValueError: a key that is not a LoRA A/B weight (DoRA magnitudes, LoRA biases and embedding LoRAs are not
            supported), an A without its B, a target missing from ``state_dict``, or shapes that disagree.
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    odd = []
    for key, value in lora_state_dict.items():
        m = _LORA_RE.fullmatch(_clean(key))
        if m is None or not isinstance(value, torch.Tensor):
            odd.append(key)
            continue
        module = m["module"].removeprefix(_PEFT_PREFIX)
        pairs.setdefault(module, {})[m["which"]] = value
    if odd:
        raise ValueError(f"{source}: keys that are not LoRA A/B weights as peft saves them "
                         f"('<module>.lora_A.weight', '<module>.lora_B.weight'): {_listing(odd)}")
    if not pairs:
        raise ValueError(f"{source} holds no LoRA weights")
    unpaired = [m for m, ab in pairs.items() if len(ab) != 2]
    if unpaired:
        raise ValueError(f"{source}: modules with only one of lora_A / lora_B: {_listing(unpaired)}")
    # The LoRA may name modules from the transformer (LongLive wraps generator.model) or from the wrapper ("model.").
    prefix = next((p for p in _PREFIXES
                   if all(m.startswith(p) and f"{m[len(p):]}.weight" in state_dict for m in pairs)), None)
    if prefix is None:
        missing = [m for m in pairs if f"{m}.weight" not in state_dict]
        weights = [k for k in state_dict if k.endswith(".weight")]
        raise ValueError(f"{source}: target modules with no weight in the checkpoint: {_listing(missing)}; "
                         f"checkpoint weights look like {_listing(weights, 3)}")
    merged = dict(state_dict)
    names = []
    for module, ab in sorted(pairs.items()):
        key = f"{module[len(prefix):]}.weight"
        weight, a, b = state_dict[key], ab["A"], ab["B"]
        r = a.shape[0]
        if weight.ndim != 2 or a.ndim != 2 or b.ndim != 2 or b.shape != (weight.shape[0], r) \
                or a.shape[1] != weight.shape[1]:
            raise ValueError(f"{source}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                             f"the weight {key} {tuple(weight.shape)} (expected [r, in] and [out, r] of a Linear)")
        scaling = (r if lora_alpha is None else lora_alpha) / r
        merged[key] = (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)
        names.append(module[len(prefix):])
    return merged, names


def _find_lora(obj: Any, path: Path, lora_path: Path | None, lora_key: str | None, weights_only: bool):
    """The LoRA state dict to merge (or ``None``) and a description of where it came from."""
    if lora_path is None:
        if lora_key is None:
            return None, None
        name = LORA_KEY if lora_key == AUTO else lora_key
        if isinstance(obj, Mapping) and name in obj:
            return obj[name], f"{path}[{name!r}]"
        if lora_key == AUTO:
            return None, None
        raise _EntryError(f"{path} has no LoRA entry {lora_key!r}; its top-level keys are: {_entries(obj)}")
    lora_obj = _read(lora_path, weights_only=weights_only)
    if lora_key is None or (lora_key == AUTO and not (isinstance(lora_obj, Mapping) and LORA_KEY in lora_obj)):
        return lora_obj, str(lora_path)  # the file is the LoRA state dict itself (LongLive accepts both)
    name = LORA_KEY if lora_key == AUTO else lora_key
    if not isinstance(lora_obj, Mapping) or name not in lora_obj:
        raise _EntryError(f"{lora_path} has no LoRA entry {name!r}; its top-level keys are: {_entries(lora_obj)}")
    return lora_obj[name], f"{lora_path}[{name!r}]"


# ------------------------------------------------------------------------------------------------------ loaders


def load_streaming_wan_state_dict(
    path: str | os.PathLike,
    *,
    key: str | None = None,
    lora_path: str | os.PathLike | None = None,
    lora_key: str | None = AUTO,
    lora_alpha: float | None = None,
    ignore: Sequence[str] = (),
    weights_only: bool = True,
) -> dict[str, torch.Tensor]:
    r"""
    Read a streaming Wan checkpoint (Self-Forcing, CausVid, LongLive) and return its transformer's state dict in
    diffusers' ``WanTransformer3DModel`` layout, with a LoRA merged in if there is one.

    Args:
        path (`str` or `os.PathLike`): a ``.pt`` / ``.pth`` torch pickle (``{"generator": ..., "generator_ema":
            ...}``, or a plain state dict) or a ``.safetensors`` state dict. Keys in the original Wan layout behind
            ``model.`` (or ``model.diffusion_model.``, or no prefix), or already in diffusers' layout (returned
            as they are).
        key (`str`, *optional*): the entry holding the generator. Default: ``"generator"`` when a LoRA is merged
            (the weights LongLive trains its LoRA on), else ``"generator_ema"`` when present, else ``"generator"``
            (or ``"model"``). The choice is logged at INFO level.
        lora_path (`str` or `os.PathLike`, *optional*): a separate LoRA file (LongLive's ``lora.pt``).
        lora_key (`str`, *optional*, defaults to `"auto"`): the entry holding the LoRA. ``"auto"``:
            ``"generator_lora"`` if the LoRA file (or, without ``lora_path``, the checkpoint) has it; a LoRA file
            without it is the LoRA state dict itself; a checkpoint without it has no LoRA. ``None``: never read a
            LoRA from the checkpoint; ``lora_path`` is then the LoRA state dict itself. Any other name must exist.
        lora_alpha (`float`, *optional*): peft's ``lora_alpha`` the LoRA was trained with (the file does not record
            it); ``None`` means ``alpha = r`` (LongLive's released LoRA: rank = alpha = 256). See :func:`merge_lora`.
        ignore (`Sequence[str]`): key prefixes, as named in the file, to drop before anything else (e.g. parts of
            a training wrapper that are not the transformer).
        weights_only (`bool`, defaults to `True`): ``torch.load``'s safe mode; pass ``False`` only for a file you
            trust that holds other Python objects.

    Returns:
        `dict[str, torch.Tensor]`: diffusers-layout keys (``blocks.0.attn1.to_q.weight``, ...), stored dtypes.

    Raises:
        FileNotFoundError: no file at ``path`` / ``lora_path``.
        KeyError: the requested entry is missing (the message names the file and the keys found).
        ValueError: a layout that is neither Wan's original nor diffusers', keys left over outside the
            transformer, a LoRA that does not fit, or a pickle that needs ``weights_only=False``.
    """
    path = Path(path)
    if path.suffix == ".safetensors" and key is not None:
        raise ValueError(f"{path} is a safetensors file, a single state dict: key={key!r} does not apply")
    obj = _read(path, weights_only=weights_only)
    lora, lora_source = _find_lora(obj, path, None if lora_path is None else Path(lora_path), lora_key, weights_only)
    state_dict, entry = _pick_generator(obj, path, key, prefer_ema=lora is None)
    state_dict, prefix = _strip_wrapper(state_dict, path, ignore)
    layout = _layout(list(state_dict), path)
    log.info("%s: generator weights from %s (%d tensors, wrapper prefix %r, %s Wan layout)", path,
             "the whole file" if entry is None else f"entry {entry!r}", len(state_dict), prefix, layout)
    if lora is not None:
        if layout != "original":
            raise ValueError(f"{path}: merging a LoRA needs the original Wan layout (the names LongLive's LoRA "
                             f"uses); this checkpoint is in diffusers' layout")
        if not isinstance(lora, Mapping):
            raise ValueError(f"{lora_source} is not a LoRA state dict: it is a {type(lora).__name__}")
        state_dict, merged = merge_lora(state_dict, lora, lora_alpha=lora_alpha, source=lora_source)
        log.info("%s: merged the LoRA of %s into %d linear layers (alpha %s)", path, lora_source, len(merged),
                 "= rank" if lora_alpha is None else lora_alpha)
    if layout == "diffusers":
        return state_dict
    return _to_diffusers(state_dict, path)


def _transformer_config(config_or_pretrained: Any) -> dict:
    """A ``WanTransformer3DModel`` config from a dict / model config, a model, or a diffusers directory or hub id."""
    if isinstance(config_or_pretrained, WanTransformer3DModel):
        config = dict(config_or_pretrained.config)
    elif isinstance(config_or_pretrained, Mapping):
        config = dict(config_or_pretrained)
    elif isinstance(config_or_pretrained, (str, os.PathLike)):
        where = Path(config_or_pretrained)
        if where.is_file():
            config = json.loads(where.read_text(encoding="utf-8"))
        elif where.is_dir():
            for candidate in (where / "config.json", where / "transformer" / "config.json"):
                if candidate.is_file():
                    config = json.loads(candidate.read_text(encoding="utf-8"))
                    break
            else:
                raise OSError(f"{where} has neither a config.json nor transformer/config.json: pass a diffusers Wan "
                              f"pipeline directory, its transformer subfolder, or a config dict")
        else:
            try:
                config = dict(WanTransformer3DModel.load_config(str(config_or_pretrained), subfolder="transformer"))
            except OSError as err:
                raise OSError(f"Could not read a WanTransformer3DModel config from {str(config_or_pretrained)!r} "
                              f"(neither a local path nor a cached hub id with a transformer/ subfolder): {err}"
                              ) from err
    else:
        raise TypeError(f"config_or_pretrained: expected a config dict, a WanTransformer3DModel, or a path / hub id; "
                        f"got {type(config_or_pretrained).__name__}")
    cls = config.get("_class_name", WanTransformer3DModel.__name__)
    if cls != WanTransformer3DModel.__name__:
        raise ValueError(f"the config is for {cls}, not {WanTransformer3DModel.__name__}")
    return config


def load_streaming_wan_transformer(
    path: str | os.PathLike,
    config_or_pretrained: Any,
    *,
    torch_dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    **kwargs,
) -> WanTransformer3DModel:
    r"""
    Build a diffusers ``WanTransformer3DModel`` from a config and load a streaming Wan checkpoint into it, strictly.

    Args:
        path (`str` or `os.PathLike`): the checkpoint (see :func:`load_streaming_wan_state_dict`).
        config_or_pretrained: the architecture: a config dict, a ``WanTransformer3DModel`` (its config is used;
            the model itself is not touched), a diffusers Wan pipeline directory (its ``transformer/config.json``,
            e.g. ``Wan2.1-T2V-1.3B-Diffusers``), a transformer directory, a ``config.json``, or a cached hub id.
        torch_dtype (`str` or `torch.dtype`, defaults to `"float32"`): the weights' dtype; the modules diffusers
            keeps in float32 (``WanTransformer3DModel._keep_in_fp32_modules``) stay float32, as with
            ``from_pretrained``.
        device (`str` or `torch.device`, defaults to `"cpu"`): where the model goes.
        kwargs: passed to :func:`load_streaming_wan_state_dict` (``key``, ``lora_path``, ``lora_key``,
            ``lora_alpha``, ``ignore``, ``weights_only``).

    Returns:
        `WanTransformer3DModel`: in eval mode; plain bidirectional Wan until wrapped in
        :class:`flowgrpo.models.CausalWan`.

    Raises:
        ValueError: missing or unexpected keys, or shapes that differ from the config's (all listed), besides the
            errors of :func:`load_streaming_wan_state_dict`.
    """
    dtype = parse_dtype(torch_dtype)
    model = _empty_module(config_or_pretrained)
    _assign(model, load_streaming_wan_state_dict(path, **kwargs), dtype, str(path))
    return model.to(device).eval()


def build_streaming_wan_transformer(
    config_or_pretrained: Any,
    *,
    torch_dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> WanTransformer3DModel:
    r"""
    The module :func:`load_streaming_wan_transformer` builds, without a checkpoint: the same construction, each
    parameter assigned an uninitialised tensor of the dtype the loader would give it. For planning a run on fake
    tensors (``flowgrpo.planner``), where a streaming model has no weights file; never for sampling.

    Args:
        config_or_pretrained: the architecture, as for :func:`load_streaming_wan_transformer`.
        torch_dtype (`str` or `torch.dtype`): as for :func:`load_streaming_wan_transformer` (the float32 modules
            stay float32).
        device (`str` or `torch.device`): where the empty tensors are made.

    Returns:
        `WanTransformer3DModel`: in eval mode, values undefined.
    """
    dtype = parse_dtype(torch_dtype)
    model = _empty_module(config_or_pretrained)
    empty = {k: torch.empty(v.shape, dtype=v.dtype, device=device) for k, v in model.state_dict().items()}
    _assign(model, empty, dtype, "an empty state dict")
    return model.to(device).eval()


def _empty_module(config_or_pretrained: Any) -> WanTransformer3DModel:
    """The transformer of a config, its parameters on the meta device (no random init of 1.3B weights); buffers real."""
    from accelerate import init_empty_weights

    config = _transformer_config(config_or_pretrained)
    with init_empty_weights():
        return WanTransformer3DModel.from_config(config)


def _assign(model: WanTransformer3DModel, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, source: str) -> None:
    """Load ``state_dict`` into ``model`` strictly (every key, every shape), each floating tensor in ``dtype`` but the
    modules diffusers keeps in float32."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    shapes = [f"{k}: checkpoint {tuple(state_dict[k].shape)}, model {tuple(v.shape)}"
              for k, v in expected.items() if k in state_dict and state_dict[k].shape != v.shape]
    if missing or unexpected or shapes:
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing: {_listing(missing)}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected: {_listing(unexpected)}")
        if shapes:
            problems.append(f"{len(shapes)} with another shape: " + "; ".join(shapes[:_SHOW]))
        raise ValueError(f"{source} does not fit the WanTransformer3DModel config ({'; '.join(problems)}). Check that "
                         f"the config is the checkpoint's architecture (Wan2.1-T2V-1.3B for Self-Forcing, CausVid "
                         f"and LongLive)")
    keep = model._keep_in_fp32_modules or []
    weights = {}
    for name, tensor in state_dict.items():
        if tensor.is_floating_point():
            fp32 = any(m in name.split(".") for m in keep)  # diffusers' own rule (models/model_loading_utils.py)
            tensor = tensor.to(torch.float32 if fp32 else dtype)
        weights[name] = tensor
    model.load_state_dict(weights, strict=True, assign=True)
