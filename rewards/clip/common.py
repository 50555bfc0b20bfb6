"""Pieces shared by the CLIP-family rewards: prompt checks, de-duplicated prompt encoding, batching, CLIP configs."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["check_prompts", "clip_image_config", "encode_unique", "in_chunks", "load_hf_clip", "normalized", "pooled"]


def check_prompts(prompts, batch: int, reward: str) -> list[str]:
    """One prompt per image, as the reward contract has it (a lone string is an error: it hides batching bugs)."""
    if isinstance(prompts, str) or prompts is None:
        raise ValueError(f"{reward}: prompts must be a list of {batch} strings (one per image), got {type(prompts).__name__}")
    prompts = list(prompts)
    if len(prompts) != batch:
        raise ValueError(f"{reward}: got {batch} images but {len(prompts)} prompts")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise ValueError(f"{reward}: prompts[{i}] is {type(p).__name__}, expected str")
    return prompts


def in_chunks(n: int, size: int):
    """``slice`` objects covering ``range(n)`` in pieces of ``size`` (the reward's ``batch_size``)."""
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def encode_unique(prompts: Sequence[str], encode: Callable[[list[str]], torch.Tensor], batch_size: int) -> torch.Tensor:
    """``encode`` each distinct prompt once (a GRPO batch repeats each prompt G times) -> ``[len(prompts), D]``."""
    unique = list(dict.fromkeys(prompts))
    feats = torch.cat([encode(unique[s]) for s in in_chunks(len(unique), batch_size)])
    position = {p: i for i, p in enumerate(unique)}
    return feats[torch.tensor([position[p] for p in prompts], device=feats.device)]


def pooled(out) -> torch.Tensor:
    """transformers 5's ``get_*_features`` return an output object; the embedding is ``pooler_output``."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def normalized(x: torch.Tensor) -> torch.Tensor:
    """L2-normalised float32 embeddings (scores are computed in float32 whatever the model's dtype)."""
    return F.normalize(x.float(), dim=-1)


def clip_image_config(processor, *, reward: str, source: str) -> dict:
    """``size``, ``crop``, ``mean``, ``std`` of a transformers CLIP image processor, for
    :func:`rewards.clip.transforms.resize_center_crop` (which reproduces it; unsupported settings raise)."""
    size, crop = processor.size, processor.crop_size

    def get(d, key):
        return getattr(d, key, None) if not isinstance(d, dict) else d.get(key)

    shortest = get(size, "shortest_edge")
    crop_h, crop_w = get(crop, "height"), get(crop, "width")
    problems = []
    if not (getattr(processor, "do_resize", True) and shortest):
        problems.append(f"size={size} (expected a shortest_edge resize)")
    if not (getattr(processor, "do_center_crop", True) and crop_h and crop_h == crop_w):
        problems.append(f"crop_size={crop} (expected a square centre crop)")
    resample = getattr(processor, "resample", 3)
    if str(getattr(resample, "value", resample)).lower() not in ("3", "bicubic"):  # PIL's code, or torchvision's mode
        problems.append(f"resample={resample} (expected bicubic)")
    rescale = float(getattr(processor, "rescale_factor", 1 / 255))
    if abs(rescale - 1 / 255) > 1e-12 or not getattr(processor, "do_normalize", True):
        problems.append("rescale / normalize settings other than CLIP's")
    if problems:
        raise ValueError(f"{reward}: the image processor from {source!r} is not a CLIP one this reward reproduces: "
                         + "; ".join(problems))
    return {"size": int(shortest), "crop": int(crop_h), "mean": tuple(processor.image_mean), "std": tuple(processor.image_std)}


def load_hf_clip(model_path: str, processor_path: str, *, reward: str, model_kwarg: str, processor_kwarg: str,
                 device: torch.device, dtype: torch.dtype, with_tokenizer: bool = True):
    """A transformers ``CLIPModel`` checkpoint, its tokenizer and image settings, with errors naming path and keyword.

    Returns ``(model, tokenizer, image_config)``. transformers only warns when a checkpoint lacks weights or has
    other shapes (and initialises them at random): here that is an error, since the reward would be made up.
    """
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    from .._loading import MissingWeightsError, check_tokenizer, from_pretrained

    model, info = from_pretrained(CLIPModel.from_pretrained, model_path, reward=reward, what="CLIP model",
                                  kwarg=model_kwarg, dtype=dtype, output_loading_info=True)
    incomplete = list(info.get("missing_keys") or []) + [str(k[0] if isinstance(k, tuple) else k)
                                                         for k in info.get("mismatched_keys") or []]
    if incomplete:
        raise MissingWeightsError(reward, "CLIP model", model_path, model_kwarg,
                                  reason=f"the checkpoint lacks or mis-sizes {len(incomplete)} weights, e.g. {incomplete[:3]}")
    tokenizer = None
    if with_tokenizer:
        tokenizer = from_pretrained(AutoTokenizer.from_pretrained, processor_path, reward=reward, what="CLIP tokenizer",
                                    kwarg=processor_kwarg)
        check_tokenizer(tokenizer, processor_path, reward=reward, kwarg=processor_kwarg)
    processor = from_pretrained(AutoImageProcessor.from_pretrained, processor_path, reward=reward,
                                what="CLIP image processor config", kwarg=processor_kwarg)
    image_config = clip_image_config(processor, reward=reward, source=processor_path)
    return model.to(device).eval().requires_grad_(False), tokenizer, image_config
