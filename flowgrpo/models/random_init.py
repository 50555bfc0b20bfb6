"""Published architectures at random initialisation, for cost measurements (``scripts/gpu_check.py``).

Weights do not change what an iteration costs, so the denoiser and VAE are the published architectures at full
size; the text encoders are one-layer stand-ins with the published widths (they run once per iteration, outside
the loop that matters), and SD3.5 runs without T5, whose stream diffusers then fills with zeros of the full
sequence length — the transformer sees the real token count either way.

Config values follow the checkpoints' ``config.json`` files (stabilityai/stable-diffusion-3.5-medium,
Wan-AI/Wan2.1-T2V-1.3B-Diffusers) as published; they are written out here because no hub is reachable.
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, UMT5Config, UMT5EncoderModel

from .tiny import tiny_clip_tokenizer, tiny_t5_tokenizer

__all__ = ["ARCHITECTURES", "build_random_pipeline"]

ARCHITECTURES = ("sd35_medium", "wan21_1_3b")


def _clip_encoder(tokenizer, hidden: int) -> CLIPTextModelWithProjection:
    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden, projection_dim=hidden,
        num_hidden_layers=1, num_attention_heads=max(1, hidden // 64), max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )).eval()


def _sd35_medium(dtype: torch.dtype) -> StableDiffusion3Pipeline:
    transformer = SD3Transformer2DModel(
        sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
        pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False, sample_size=1024,
    )
    tok = tiny_clip_tokenizer()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=_clip_encoder(tok, 768), tokenizer=tok,           # CLIP-L width
        text_encoder_2=_clip_encoder(tok, 1280), tokenizer_2=tiny_clip_tokenizer(),  # CLIP-G width
        text_encoder_3=None, tokenizer_3=None,
    )
    return pipe.to(dtype=dtype)  # then float32 again where from_pretrained would keep it (below)


def _wan21_1_3b(dtype: torch.dtype) -> WanPipeline:
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
    )
    vae = AutoencoderKLWan()  # the class defaults are the Wan 2.1 VAE
    tok = tiny_t5_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tok), d_model=4096, d_kv=64, d_ff=256, num_layers=1, num_heads=8,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id,
    )).eval()
    pipe = WanPipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                       text_encoder=text_encoder, tokenizer=tok)
    return pipe.to(dtype=dtype)  # then float32 again where from_pretrained would keep it (below)


def build_random_pipeline(arch: str, *, torch_dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """A randomly initialised pipeline of a published architecture (see :data:`ARCHITECTURES`)."""
    builders = {"sd35_medium": _sd35_medium, "wan21_1_3b": _wan21_1_3b}
    if arch not in builders:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHITECTURES}")
    torch.manual_seed(seed)
    pipe = builders[arch](torch_dtype)
    for module in pipe.components.values():  # what from_pretrained(torch_dtype=...) keeps in float32
        for name in getattr(module, "_keep_in_fp32_modules", None) or []:
            for sub_name, sub in module.named_modules():
                if name in sub_name.split("."):
                    sub.float()
    pipe.set_progress_bar_config(disable=True)
    return pipe
