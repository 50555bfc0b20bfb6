"""Wan text-to-video (``WanPipeline``: Wan 2.1 T2V, Wan 2.2 TI2V-5B) as a flow adapter."""

from __future__ import annotations

from typing import ClassVar

import torch
from diffusers import WanPipeline
from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

from ..registry import TEMPORAL_FACTORS
from .base import FlowAdapter, PromptEmbeds

__all__ = ["WanAdapter", "use_fast_channel_norms"]


class _ChannelRMSNorm(WanRMS_norm):
    """``WanRMS_norm`` whose channel-first normalisation on CPU is written as a sum of squares.

    ``F.normalize(x, dim=1)`` on a ``[B, C, T, H, W]`` CPU tensor runs ``linalg_vector_norm`` as a strided reduction
    over the channels: 22 ms for ``[8, 32, 4, 64, 64]`` on 2 cores, against 3 ms for the sum of squares, square root
    and division written out, and about 40% of a Wan VAE decode of the embedded world. The values are the same up
    to float rounding (relative differences of a few 1e-7: the norm is summed in another order); GPUs, float64 and
    channel-last norms keep the original forward.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.channel_first or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float16,
                                                                                  torch.bfloat16):
            return super().forward(x)
        xf = x.float()  # as the original: half types are normalised in float32
        norm = xf.mul(xf).sum(dim=1, keepdim=True).sqrt_().clamp_min_(1e-12)  # F.normalize's eps
        return (xf / norm).to(x.dtype) * self.scale * self.gamma + self.bias


def use_fast_channel_norms(vae: torch.nn.Module) -> int:
    """Swap every ``WanRMS_norm`` of ``vae`` for :class:`_ChannelRMSNorm` in place (same parameters, same state
    dict); returns how many were swapped."""
    swapped = 0
    for module in vae.modules():
        if type(module) is WanRMS_norm:
            module.__class__ = _ChannelRMSNorm
            swapped += 1
    return swapped


class WanAdapter(FlowAdapter):
    r"""
    Adapter for `WanPipeline` with one transformer (Wan 2.1 T2V 1.3B / 14B, Wan 2.2 TI2V 5B text-to-video).

    Latents are `[B, C, F, H/s, W/s]` with F = (num_frames − 1)/4 + 1 and s the VAE's spatial factor, float32 as
    the pipeline keeps them: C = 16, s = 8 for Wan 2.1; C = 48, s = 16 for Wan 2.2 TI2V (its VAE patchifies 2x2
    pixels before three x2 downsamplings). Height and width must be multiples of s times the transformer's 2x2
    patch (16 for Wan 2.1, 32 for Wan 2.2). The transformer takes σ·1000: one value per sample, or one per latent
    token with Wan 2.2's `expand_timesteps` (the pipeline's `[B, F·h/2·w/2]` layout). Decoding un-normalises with
    the VAE's own per-channel `latents_mean` / `latents_std` (16 or 48 of them). Wan ships a UniPC scheduler: it is
    replaced by `FlowMatchEulerDiscreteScheduler` with the same `flow_shift` (our samplers step Euler on explicit
    sigmas). Two-expert pipelines (Wan 2.2 A14B, `transformer_2`) are not supported.

    Example:
        ```py
        >>> from flowgrpo.models import WanAdapter, build_tiny_pipeline
        >>> adapter = WanAdapter.from_pipeline(build_tiny_pipeline("wan"))
        >>> x = adapter.prepare_noise(1, height=32, width=32, num_frames=9)
        >>> x.shape
        torch.Size([1, 16, 3, 4, 4])
        ```
    """

    pipeline_class = WanPipeline
    family = "wan"
    is_video = True
    per_frame_sigmas = True
    #: Output pixels (frames x height x width) one VAE call decodes: a batch is decoded in chunks of whole clips
    #: under this budget (at least one clip per call), so decoding memory stays flat in the number of rollouts a
    #: process scores at once (one call is the pipeline's own decode, bit for bit; chunks agree with it to 1e-6).
    #: 2**25 puts 630 clips of the embedded 64x64 world in one call, 2 clips of 480x832x33 per call, and 1 clip of
    #: 704x1280x49 (several GB each).
    decode_pixels_per_call: ClassVar[int] = 2**25
    #: The same budget on CPU, where a call that outgrows the caches is slower per clip: 64 clips of the embedded
    #: world (13x64x64) decode in 4.4-5.1 s as one call and in 2.3 s as calls of 8-19 clips (2 cores).
    cpu_decode_pixels_per_call: ClassVar[int] = 2**20
    #: Pixel frames per latent frame after the first (pixel frame 0 is latent frame 0): Wan's VAE compresses time 4x
    #: (2.1 and 2.2 alike). Read on the class, what a config is checked against before a pipeline loads; on an
    #: adapter, its own VAE's (``scale_factor_temporal``).
    temporal_factor: int = TEMPORAL_FACTORS["wan"]

    def __init__(self, pipe: WanPipeline):
        if getattr(pipe, "transformer_2", None) is not None or pipe.transformer is None:
            raise NotImplementedError(
                "WanAdapter supports single-transformer Wan pipelines; this one has `transformer_2` (Wan 2.2 A14B "
                "two-expert) or no `transformer`."
            )
        super().__init__(pipe)
        self.temporal_factor = pipe.vae_scale_factor_temporal
        if pipe.vae is not None:
            use_fast_channel_norms(pipe.vae)  # the pipeline's VAE, so pipe(...) decodes as the adapter does

    def _encode(self, prompts, negative_prompt, max_sequence_length) -> PromptEmbeds:
        embeds, negative = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=negative_prompt is not None,
            device=self.pipe._execution_device,
            **self._pipeline_kwargs(max_sequence_length),
        )
        # As the pipeline: embeddings in the transformer's dtype (the T5 may run in another one).
        return PromptEmbeds(embeds.to(self.dtype), None, None if negative is None else negative.to(self.dtype))

    def _latent_shape(self, batch_size, height, width, num_frames) -> tuple[int, ...]:
        if num_frames is None:
            raise ValueError("Wan generates videos: pass num_frames.")
        temporal, spatial = self.temporal_factor, self.pipe.vae_scale_factor_spatial
        if (num_frames - 1) % temporal:
            raise ValueError(f"Wan needs num_frames = {temporal}·k + 1; got {num_frames}.")
        _, patch_h, patch_w = self.pipe.transformer.config.patch_size
        if height % (spatial * patch_h) or width % (spatial * patch_w):
            multiple = (spatial * patch_h, spatial * patch_w)
            raise ValueError(f"Wan needs height, width divisible by {multiple}; got {height}x{width}.")
        channels = self.pipe.transformer.config.in_channels
        return (batch_size, channels, (num_frames - 1) // temporal + 1, height // spatial, width // spatial)

    def _forward(self, x, timestep, cond, guidance_scale, *, transformer) -> torch.Tensor:
        if timestep.ndim == 2:
            # One timestep per latent frame [B, F]: each frame's patches (patch_size (1, p, q)) share it. The
            # transformer embeds per-token timesteps [B, F·(h/p)·(w/q)] (its Wan 2.2 path), tokens frame-major.
            _, patch_h, patch_w = transformer.config.patch_size
            per_frame = (x.shape[-2] // patch_h) * (x.shape[-1] // patch_w)
            timestep = timestep.repeat_interleave(per_frame, dim=1)
        elif self.pipe.config.get("expand_timesteps", False):
            # Wan 2.2 TI2V: one timestep per latent token (2x2 patches), as the pipeline's mask[:, ::2, ::2].
            tokens = x[0, 0, :, ::2, ::2].numel()
            timestep = timestep[:, None].expand(-1, tokens)
        return transformer(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=cond.prompt_embeds,
            return_dict=False,
        )[0]

    def _decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=latents.device, dtype=latents.dtype).view(shape)
        # Written as the pipeline writes it (divide by 1/std), which keeps the output bit-identical.
        inv_std = 1.0 / torch.tensor(vae.config.latents_std, device=latents.device, dtype=latents.dtype).view(shape)
        _, _, frames, height, width = latents.shape
        pixels_per_clip = (
            ((frames - 1) * self.temporal_factor + 1)
            * height * self.pipe.vae_scale_factor_spatial
            * width * self.pipe.vae_scale_factor_spatial
        )
        budget = self.decode_pixels_per_call
        if latents.device.type == "cpu":
            budget = min(budget, self.cpu_decode_pixels_per_call)
        chunk = max(1, budget // pixels_per_clip)
        out = None  # written part by part: the videos are held once, not once in parts and again joined
        for start in range(0, latents.shape[0], chunk):
            part = latents[start:start + chunk]
            video = vae.decode(part / inv_std + mean, return_dict=False)[0]
            video = self.pipe.video_processor.postprocess_video(video, output_type="pt")
            if chunk >= latents.shape[0]:
                return video
            if out is None:
                out = video.new_empty((latents.shape[0], *video.shape[1:]))
            out[start:start + chunk] = video
            del video
        return out
