"""Tiny random-initialised twins of the SD3, FLUX and Wan pipelines.

They have the real pipeline classes and component classes, only with a few layers of width 32, so
every code path of the adapters (prompt encoding, noise layout, CFG, timestep conventions, decoding)
runs on a CPU in milliseconds. Tokenizers are built in memory (no model hub on our machines)
and survive ``save_pretrained`` / ``from_pretrained``.

The component sizes follow diffusers' own ``get_dummy_components`` in its pipeline tests
(``tests/pipelines/{stable_diffusion_3,flux,wan}``), with the following modifications: in-memory
tokenizers instead of ``hf-internal-testing`` downloads, a VAE with two blocks (scale factor 2, so latents
are smaller than images as in the real models), FLUX with ``guidance_embeds=True`` and FLUX-dev's dynamic
shifting scheduler config, Wan with ``UMT5EncoderModel`` (as Wan ships) and ``shift=5.0``. The Wan 2.2
TI2V-5B layout (``build_tiny_pipeline("wan", ti2v=True)``) follows ``tests/pipelines/wan/test_wan_22.py``.
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

__all__ = ["build_tiny_pipeline", "tiny_clip_tokenizer", "tiny_t5_tokenizer"]

_WIDTH = 32  # hidden size of every tiny text encoder


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte-level alphabet: each of the 256 bytes mapped to a printable unicode symbol."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))


def tiny_clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
    """A working byte-level CLIP tokenizer with no merges: 256 symbols, their ``</w>`` forms, BOS and EOS.

    Every string tokenizes to bytes (never to unknown), which is all a random text encoder needs.
    Ids: symbols 0–255, word-final symbols 256–511, ``<|startoftext|>`` 512, ``<|endoftext|>`` 513 (also pad).
    """
    symbols = list(_bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({s + "</w>": 256 + i for i, s in enumerate(symbols)})
    vocab["<|startoftext|>"] = 512
    vocab["<|endoftext|>"] = 513
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def tiny_t5_tokenizer() -> T5Tokenizer:
    """A working character-level T5 (unigram) tokenizer: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, then ASCII."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(chr(c), -2.0) for c in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def clip_text_config(tokenizer: CLIPTokenizer, **overrides) -> CLIPTextConfig:
    """A small CLIP text config whose special-token ids come from ``tokenizer``; ``overrides`` resize it."""
    # eos_token_id != 2 makes CLIP pool at the first EOS token (the modern path), as the real checkpoints do.
    config = dict(
        vocab_size=len(tokenizer),
        hidden_size=_WIDTH,
        intermediate_size=37,
        projection_dim=_WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="gelu",
    )
    config.update(overrides)
    return CLIPTextConfig(**config)


def _t5_kwargs(tokenizer: T5Tokenizer) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        d_model=_WIDTH,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def _image_vae(latent_channels: int) -> AutoencoderKL:
    # Two blocks: vae_scale_factor 2. Scaling/shift factors non-trivial so decode must apply them.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(4, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=1,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )


def _sd3(seed: int, with_t5: bool = False) -> StableDiffusion3Pipeline:
    torch.manual_seed(seed)
    # joint_attention_dim = 2 x CLIP width: the concatenated CLIP embeddings are padded to it (SD3 convention).
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=2 * _WIDTH,
        pooled_projection_dim=2 * _WIDTH,
    )
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_clip_tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder = CLIPTextModelWithProjection(clip_text_config(tokenizer))
    torch.manual_seed(seed + 2)
    text_encoder_2 = CLIPTextModelWithProjection(clip_text_config(tokenizer_2))
    text_encoder_3 = tokenizer_3 = None
    if with_t5:
        tokenizer_3 = tiny_t5_tokenizer()
        torch.manual_seed(seed + 3)
        kwargs = _t5_kwargs(tokenizer_3)
        kwargs["d_model"] = 2 * _WIDTH  # T5 width is the joint attention width
        text_encoder_3 = T5EncoderModel(T5Config(**kwargs))
    torch.manual_seed(seed + 4)
    vae = _image_vae(latent_channels=4)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # SD3 / SD3.5 ship shift 3
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


def _flux(seed: int) -> FluxPipeline:
    torch.manual_seed(seed)
    # in_channels = 4 x latent channels: FLUX packs 2x2 latent patches into the channel axis.
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_WIDTH,
        pooled_projection_dim=_WIDTH,
        guidance_embeds=True,  # FLUX-dev style distilled guidance, so that path is exercised
        axes_dims_rope=[4, 4, 8],
    )
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder = CLIPTextModel(clip_text_config(tokenizer))
    torch.manual_seed(seed + 2)
    text_encoder_2 = T5EncoderModel(T5Config(**_t5_kwargs(tokenizer_2)))
    torch.manual_seed(seed + 3)
    vae = _image_vae(latent_channels=4)
    # FLUX.1-dev's scheduler config: resolution-dependent shift (mu) instead of a fixed one.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )


def _wan(seed: int, ti2v: bool = False) -> WanPipeline:
    if ti2v:
        return _wan22_ti2v(seed)
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],  # spatial x8, temporal x4, as the real Wan VAE
    )
    tokenizer = tiny_t5_tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder = UMT5EncoderModel(UMT5Config(**_t5_kwargs(tokenizer)))
    torch.manual_seed(seed + 2)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=_WIDTH,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    # Real Wan pipelines ship UniPC; our RL steps are Euler, so the twin compares Euler with Euler.
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
        transformer_2=None,
    )


def _wan22_ti2v(seed: int) -> WanPipeline:
    """Wan 2.2 TI2V-5B's layout at toy width: one transformer on 48 latent channels, per-token timesteps
    (``expand_timesteps``), and the Wan 2.2 VAE (z_dim 48, residual blocks, 2x2 pixel patchify on 12 channels:
    spatial x16 = 8 from its blocks x 2 from the patch, temporal x4). Sizes follow diffusers' Wan 2.2 5B pipeline
    test; the per-channel latent statistics are non-trivial (the real ones are not 0/1), so decoding must apply
    them."""
    torch.manual_seed(seed)
    z_dim = 48
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=z_dim,
        in_channels=12,       # 3 RGB channels x the 2x2 patch
        out_channels=12,
        is_residual=True,
        patch_size=2,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[round(-0.3 + 0.6 * i / (z_dim - 1), 4) for i in range(z_dim)],
        latents_std=[round(0.5 + 0.7 * ((7 * i) % z_dim) / (z_dim - 1), 4) for i in range(z_dim)],
    )
    tokenizer = tiny_t5_tokenizer()
    torch.manual_seed(seed + 1)
    text_encoder = UMT5EncoderModel(UMT5Config(**_t5_kwargs(tokenizer)))
    torch.manual_seed(seed + 2)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=z_dim,
        out_channels=z_dim,
        text_dim=_WIDTH,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,  # as the real model: frames up to 1024 patches per axis (the preset is 22x40)
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)  # TI2V-5B ships UniPC with flow_shift 5.0
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
        transformer_2=None,
        expand_timesteps=True,
    )


_BUILDERS = {"sd3": _sd3, "flux": _flux, "wan": _wan}


def build_tiny_pipeline(
    family: str, seed: int = 0, *, torch_dtype: torch.dtype = torch.float32, **kwargs
) -> DiffusionPipeline:
    r"""
    Build a tiny random-initialised pipeline of the given family, in memory and deterministically.

    Args:
        family (`str`):
            One of `"sd3"`, `"flux"`, `"wan"`.
        seed (`int`, defaults to 0):
            Seeds the components; the same `(family, seed)` always gives the same weights.
        torch_dtype (`torch.dtype`, defaults to `torch.float32`):
            Built in float32, then cast (fine for random weights, unlike casting real checkpoints).
        kwargs:
            Family options. `sd3`: `with_t5=False` adds a tiny T5 as `text_encoder_3`. `wan`: `ti2v=True` builds
            the Wan 2.2 TI2V-5B layout instead of Wan 2.1's (48 latent channels, the x16 patchifying VAE,
            per-token timesteps).

    Returns:
        A `StableDiffusion3Pipeline`, `FluxPipeline` or `WanPipeline` on CPU with every module in eval mode.

    Example:
        ```py
        >>> pipe = build_tiny_pipeline("sd3")
        >>> image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="pt").images
        >>> image.shape
        torch.Size([1, 3, 32, 32])
        ```
    """
    if family not in _BUILDERS:
        raise ValueError(f"Unknown model family {family!r}; expected one of {sorted(_BUILDERS)}.")
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        pipe = _BUILDERS[family](1000 * seed, **kwargs)
    # Constructed modules start in train mode; T5 dropout would make prompt embeddings random.
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    if torch_dtype != torch.float32:
        pipe.to(dtype=torch_dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe
