"""FLUX.1 (``FluxPipeline``) as a flow adapter.

Guidance, following ``FluxPipeline``'s semantics:

* ``guidance_scale`` feeds the transformer's guidance embedding when ``transformer.config.guidance_embeds``
  (FLUX.1-dev's distilled guidance, one branch); it is ignored otherwise (FLUX.1-schnell).
* ``true_cfg_scale > 1`` turns on true classifier-free guidance with the negative prompt, both branches in one
  batched forward. Unlike ``FluxPipeline``, a ``None`` negative prompt means ``""`` (as for SD3 and Wan) instead
  of silently disabling true CFG.

Layout: latents are kept **unpacked**, ``[B, C, H/8, W/8]`` (the numbers ``pipe(...)`` draws before packing).
Packing 2x2 patches into tokens is a permutation, so Euler / SDE steps and per-sample log-probs are identical in
either layout; keeping the spatial layout lets ``velocity`` and ``decode`` read the resolution off the tensor
instead of carrying height and width around. ``velocity`` packs, runs the transformer and unpacks.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from .base import FlowAdapter, PromptEmbeds

__all__ = ["FluxAdapter"]


class FluxAdapter(FlowAdapter):
    r"""
    Adapter for `FluxPipeline` (FLUX.1-dev / schnell and fine-tunes).

    Extra keyword of `encode_prompts` and `velocity`: `true_cfg_scale` (`float`, defaults to 1.0); see the module
    docstring. `guidance_scale` is the distilled guidance value (FluxPipeline's default is 3.5).

    Example:
        ```py
        >>> from flowgrpo.models import FluxAdapter, build_tiny_pipeline
        >>> adapter = FluxAdapter.from_pipeline(build_tiny_pipeline("flux"))
        >>> cond = adapter.encode_prompts(["a red circle"], max_sequence_length=32)
        >>> x = adapter.prepare_noise(1, height=32, width=32)
        >>> adapter.velocity(x, 1.0, cond, guidance_scale=3.5).shape
        torch.Size([1, 4, 16, 16])
        ```
    """

    pipeline_class = FluxPipeline
    family = "flux"

    def _cfg_active(self, guidance_scale: float, true_cfg_scale: float = 1.0) -> bool:
        return true_cfg_scale > 1.0

    def _cfg_scale(self, guidance_scale: float, true_cfg_scale: float = 1.0) -> float:
        return true_cfg_scale

    def _schedule_kwargs(self, num_steps, height, width, num_frames) -> dict:
        if height is None or width is None:
            raise ValueError("FLUX shifts its schedule by resolution: pass height and width to sigmas().")
        # As FluxPipeline.__call__: linspace(1, 1/N, N) shifted by mu(number of packed image tokens).
        config = self.pipe.scheduler.config
        scale = self.pipe.vae_scale_factor
        seq_len = (height // (scale * 2)) * (width // (scale * 2))
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if config.get("use_flow_sigmas", False):
            sigmas = None
        mu = calculate_shift(
            seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        return {"sigmas": sigmas, "mu": mu}

    def _encode(self, prompts, negative_prompt, max_sequence_length) -> PromptEmbeds:
        kwargs = dict(prompt_2=None, device=self.pipe._execution_device, **self._pipeline_kwargs(max_sequence_length))
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=prompts, **kwargs)
        negative = negative_pooled = None
        if negative_prompt is not None:
            negative, negative_pooled, _ = self.pipe.encode_prompt(prompt=negative_prompt, **kwargs)
        # text_ids are zeros([L, 3]) for every prompt: rebuilt in _forward instead of stored per batch.
        return PromptEmbeds(embeds, pooled, negative, negative_pooled)

    def _latent_shape(self, batch_size, height, width, num_frames) -> tuple[int, ...]:
        multiple = self.pipe.vae_scale_factor * 2  # VAE downsampling, then 2x2 packing
        if height % multiple or width % multiple:
            raise ValueError(f"FLUX needs height and width divisible by {multiple}; got {height}x{width}.")
        scale = self.pipe.vae_scale_factor
        return (batch_size, self.pipe.transformer.config.in_channels // 4, height // scale, width // scale)

    def _forward(self, x, timestep, cond, guidance_scale, true_cfg_scale: float = 1.0, *, transformer) -> torch.Tensor:
        batch, channels, height, width = x.shape
        dtype, device = x.dtype, x.device
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance = torch.full([batch], guidance_scale, device=device, dtype=torch.float32)
        packed = FluxPipeline._pack_latents(x, batch, channels, height, width)
        img_ids = FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, device, dtype)
        txt_ids = torch.zeros(cond.prompt_embeds.shape[1], 3, device=device, dtype=cond.prompt_embeds.dtype)
        out = transformer(
            hidden_states=packed,
            # FLUX's transformer multiplies by 1000 itself; the pipeline rounds t to the latents' dtype first.
            timestep=timestep.to(dtype) / 1000,
            guidance=guidance,
            pooled_projections=cond.pooled_prompt_embeds,
            encoder_hidden_states=cond.prompt_embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        out = out.view(batch, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(batch, channels, height, width)
