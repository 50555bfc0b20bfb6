"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``) as a flow adapter."""

from __future__ import annotations

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from .base import FlowAdapter, PromptEmbeds

__all__ = ["SD3Adapter"]


class SD3Adapter(FlowAdapter):
    r"""
    Adapter for `StableDiffusion3Pipeline` (SD3, SD3.5 Medium/Large, and our tiny ``shapes`` model).

    Latents are `[B, C, H/8, W/8]` as the pipeline's; the transformer takes the timestep σ·1000; CFG is the
    pipeline's (`guidance_scale > 1`, negative prompt default `""`). Text embeddings come from the pipeline's
    `encode_prompt` (two CLIPs + T5, or zeros in place of T5 when the pipeline has none).

    Example:
        ```py
        >>> from flowgrpo.models import SD3Adapter, build_tiny_pipeline
        >>> adapter = SD3Adapter.from_pipeline(build_tiny_pipeline("sd3"))
        >>> cond = adapter.encode_prompts(["a red circle"], guidance_scale=4.5)
        >>> x = adapter.prepare_noise(1, height=32, width=32)
        >>> adapter.velocity(x, 1.0, cond, guidance_scale=4.5).shape
        torch.Size([1, 4, 16, 16])
        ```
    """

    pipeline_class = StableDiffusion3Pipeline
    family = "sd3"

    def _schedule_kwargs(self, num_steps, height, width, num_frames) -> dict:
        config = self.pipe.scheduler.config
        if not config.get("use_dynamic_shifting", False):
            return {}  # SD3 / SD3.5 checkpoints: fixed shift from the scheduler config
        if height is None or width is None:
            raise ValueError("This SD3 scheduler shifts by resolution (use_dynamic_shifting): pass height and width.")
        # As the pipeline's __call__: mu from the number of image tokens, with SD3's default max_shift 1.16.
        patch = self.pipe.transformer.config.patch_size
        seq_len = (height // self.pipe.vae_scale_factor // patch) * (width // self.pipe.vae_scale_factor // patch)
        mu = calculate_shift(
            seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.16),
        )
        return {"mu": mu}

    def _encode(self, prompts, negative_prompt, max_sequence_length) -> PromptEmbeds:
        embeds, negative, pooled, negative_pooled = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=negative_prompt is not None,
            device=self.pipe._execution_device,
            **self._pipeline_kwargs(max_sequence_length),
        )
        return PromptEmbeds(embeds, pooled, negative, negative_pooled)

    def _latent_shape(self, batch_size, height, width, num_frames) -> tuple[int, ...]:
        multiple = self.pipe.vae_scale_factor * self.pipe.transformer.config.patch_size
        if height % multiple or width % multiple:
            raise ValueError(f"SD3 needs height and width divisible by {multiple}; got {height}x{width}.")
        scale = self.pipe.vae_scale_factor
        return (batch_size, self.pipe.transformer.config.in_channels, height // scale, width // scale)

    def _forward(self, x, timestep, cond, guidance_scale, *, transformer) -> torch.Tensor:
        return transformer(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=cond.prompt_embeds,
            pooled_projections=cond.pooled_prompt_embeds,
            return_dict=False,
        )[0]
