"""``load_adapter``: a model adapter from a config's family and path (or hub id)."""

from __future__ import annotations

import importlib.util
import os

import torch

from .base import FlowAdapter
from .flux import FluxAdapter  # noqa: F401  (each adapter module registers its family)
from .sd3 import SD3Adapter  # noqa: F401
from .tiny import build_tiny_pipeline
from .wan import WanAdapter  # noqa: F401

__all__ = ["ADAPTERS", "load_adapter", "parse_dtype"]

#: family → adapter class: the adapters register themselves by their ``family`` (``FlowAdapter.__init_subclass__``).
ADAPTERS: dict[str, type[FlowAdapter]] = FlowAdapter._registry
ATTENTION_BACKENDS = ("sdpa", "xformers")
TINY_PREFIX = "tiny-random:"
RANDOM_PREFIX = "random-init:"  # published architectures at random init, for cost measurements

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}  # fmt: skip


def parse_dtype(torch_dtype: str | torch.dtype) -> torch.dtype:
    """`"bf16"` / `"bfloat16"` / `torch.bfloat16` → `torch.bfloat16` (likewise float16, float32)."""
    if isinstance(torch_dtype, torch.dtype):
        return torch_dtype
    name = str(torch_dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"Unknown dtype {torch_dtype!r} for `model.torch_dtype`; expected one of {sorted(_DTYPES)}.")
    return _DTYPES[name]


def set_vae_dtype(pipe, vae_dtype: str | None) -> None:
    """Cast the pipeline's VAE to ``vae_dtype`` (``model.vae_dtype``; None: leave it). The adapters' ``decode`` casts
    the latents to the VAE's dtype and returns float32."""
    if vae_dtype is None:
        return
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # .to(dtype) warns about fp32-kept modules even when there are none
    try:
        pipe.vae.to(parse_dtype(vae_dtype))
    finally:
        diffusers_logging.set_verbosity(level)


def _where(pretrained: str) -> str:
    if os.path.isabs(pretrained) or pretrained.startswith("."):
        return f"local path {pretrained!r}"
    resolved = os.path.abspath(pretrained)
    return f"{pretrained!r} (neither a local path — {resolved} — nor a cached hub id)"


def _load_error(pretrained: str, family: str, err: Exception) -> OSError:
    return OSError(
        f"Could not load the {family} pipeline from {_where(pretrained)}: {err}\n"
        f"Set the config key `model.pretrained` to a local diffusers pipeline directory (with model_index.json) "
        f"or a hub id available offline (in the Hugging Face cache), or to 'tiny-random:{family}' for the tiny "
        f"random twin."
    )


# A tokenizer loaded from a missing hub id offline can come back nearly empty instead of raising.
_MIN_TOKENIZER_SIZE = 32
_PROBE = "a photo of a red circle left of a blue square"


def check_tokenizers(pipe, source: str) -> None:
    """Fail loudly on a tokenizer that cannot tokenize: a tiny vocabulary, or any unknown token in a plain
    lowercase English sentence (which CLIP's byte-level BPE and T5's sentencepiece always cover)."""
    for name, tokenizer in pipe.components.items():
        if not name.startswith("tokenizer") or tokenizer is None:
            continue
        ids = tokenizer(_PROBE, add_special_tokens=False).input_ids
        unknown = sum(i == tokenizer.unk_token_id for i in ids)
        if len(tokenizer) < _MIN_TOKENIZER_SIZE or not ids or unknown:
            raise OSError(
                f"`{name}` loaded from {source} is broken ({len(tokenizer)} tokens; {unknown}/{len(ids)} tokens "
                f"of a probe sentence unknown), which is what a tokenizer missing from disk looks like offline. "
                f"Check that {source} holds a complete pipeline, or set `model.pretrained` accordingly."
            )


def drop_zero_t5(pipe) -> bool:
    """Drop an SD3 pipeline's T5 if every one of its weights is zero, and say whether it did.

    Such a T5 outputs exactly zero for every prompt, which is what SD3 feeds in T5's place when it has none:
    `assets/tiny-sd3-shapes` ships one (trained without T5) only so that plain `from_pretrained` loads it.
    Without it the prompt embeddings are the same, bit for bit, and no T5 runs (nor warns that a short
    `max_sequence_length` truncates the prompt).
    """
    from transformers import T5EncoderModel

    t5 = getattr(pipe, "text_encoder_3", None)
    if not isinstance(t5, T5EncoderModel):
        return False
    norm = t5.encoder.final_layer_norm.weight  # checked first: a real T5's is nonzero, so its other weights are not read
    if norm.is_meta or norm.any() or any(p.any() for p in t5.parameters()):
        return False
    pipe.register_modules(text_encoder_3=None, tokenizer_3=None)
    return True


def _check_attention(attention: str) -> None:
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"Unknown `model.attention` {attention!r}; expected one of {ATTENTION_BACKENDS}.")
    if attention == "xformers" and importlib.util.find_spec("xformers") is None:
        raise ImportError(
            "`model.attention=xformers` needs the xformers package: `pip install flowgrpo[xformers]` "
            "(or use `model.attention=sdpa`, PyTorch's fused attention)."
        )


def load_adapter(
    family: str,
    pretrained: str,
    *,
    torch_dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attention: str = "sdpa",
    vae_dtype: str | torch.dtype | None = None,
    **pipeline_kwargs,
) -> FlowAdapter:
    r"""
    Load a diffusers pipeline and wrap it in the adapter of its family.

    Args:
        family (`str`): `"sd3"`, `"flux"` or `"wan"` (config `model.family`).
        pretrained (`str`): a local pipeline directory or a hub id (config `model.pretrained`), loaded with the
            pipeline's `from_pretrained(dtype=...)` so that modules diffusers keeps in float32 stay so;
            `"tiny-random:<family>"` builds the tiny random-initialised twin in memory instead.
        torch_dtype (`str` or `torch.dtype`, defaults to `"float32"`): `"float32"`, `"bfloat16"`, `"float16"`.
        device (`str` or `torch.device`, defaults to `"cpu"`): where the pipeline is moved after loading.
        attention (`str`, defaults to `"sdpa"`): `"sdpa"` (PyTorch fused attention, nothing to do) or `"xformers"`.
        vae_dtype (`str` or `torch.dtype`, *optional*): cast the VAE to this dtype after loading (`None`: keep
            `torch_dtype`). The VAE only decodes the rollout's final latents for the reward, so a bfloat16 decoder
            is a speed knob: about 2x faster on a CPU with AVX512-BF16 for the embedded world (pixels within 4/255),
            but slower on CPUs without native bfloat16.
        pipeline_kwargs: passed to `from_pretrained` (e.g. `revision`, `variant`, a component to override).
            Components saved as `None` (an SD3 without T5, a Wan without `transformer_2`) are passed as `None`
            automatically; an SD3 T5 whose weights are all zero is dropped (`drop_zero_t5`: the same embeddings).

    Returns:
        `FlowAdapter`: an `SD3Adapter`, `FluxAdapter` or `WanAdapter`.

    Raises:
        OSError: the pipeline (or one of its tokenizers) cannot be loaded; the message names `model.pretrained`.
        ValueError: unknown family, dtype or `model.attention`.
        ImportError: `attention="xformers"` without xformers installed.

    Example:
        ```py
        >>> adapter = load_adapter("sd3", "tiny-random:sd3")
        >>> adapter.family, adapter.dtype
        ('sd3', torch.float32)
        ```
    """
    if family not in ADAPTERS:
        raise ValueError(f"Unknown `model.family` {family!r}; expected one of {sorted(ADAPTERS)}.")
    _check_attention(attention)  # fail before minutes of loading
    adapter_cls = ADAPTERS[family]
    dtype = parse_dtype(torch_dtype)

    if pretrained.startswith(TINY_PREFIX):
        tiny_family = pretrained[len(TINY_PREFIX) :]
        if tiny_family != family:
            raise ValueError(f"`model.pretrained={pretrained}` does not match `model.family={family}`.")
        pipe = build_tiny_pipeline(family, torch_dtype=dtype)
        check_tokenizers(pipe, pretrained)
    elif pretrained.startswith(RANDOM_PREFIX):
        from .random_init import build_random_pipeline

        pipe = build_random_pipeline(pretrained[len(RANDOM_PREFIX) :], torch_dtype=dtype)
        if not isinstance(pipe, adapter_cls.pipeline_class):
            raise ValueError(f"`model.pretrained={pretrained}` is not a {family} architecture (`model.family`).")
    else:
        pipeline_cls = adapter_cls.pipeline_class
        try:
            index = pipeline_cls.load_config(pretrained)
        except OSError as err:
            raise _load_error(pretrained, family, err) from err
        # diffusers saves a missing optional component as [null, null] but will not load it back unless told.
        for name, value in index.items():
            if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] is None and value[1] is None:
                pipeline_kwargs.setdefault(name, None)
        try:
            pipe = pipeline_cls.from_pretrained(pretrained, dtype=dtype, **pipeline_kwargs)
        except OSError as err:
            raise _load_error(pretrained, family, err) from err
        if family == "sd3":
            drop_zero_t5(pipe)
        check_tokenizers(pipe, _where(pretrained))
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.eval()  # from_pretrained does this already; make it explicit for every module
    pipe.to(device)
    set_vae_dtype(pipe, vae_dtype)
    pipe.set_progress_bar_config(disable=True)
    if attention == "xformers":
        pipe.enable_xformers_memory_efficient_attention()
    # "sdpa": diffusers' default attention processors already call torch's scaled_dot_product_attention.
    return adapter_cls.from_pipeline(pipe)
