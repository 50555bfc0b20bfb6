r"""Streaming text-to-video with prompt switches: a ``WanPipeline``'s text encoder and VAE around a causal Wan.

:class:`StreamingWanPipeline` makes long videos block by block with :class:`~flowgrpo.models.CausalWan` and the
few-step streaming sampler (Self-Forcing's: :func:`samplers.chunked_rollout` with the ``cps`` kernel at noise
level 1, the trainer's streaming sampler); the prompt may change at given frames (a new
segment), where the cache is re-written under the new prompt (:meth:`CausalWan.recache`). Its settings (block
size, steps and shift, sink, window, context noise, guidance) live in ``stream_config.json`` beside the diffusers
components, so a streaming model directory is a plain ``WanPipeline`` directory plus that file:

    >>> from flowgrpo.models import StreamingWanPipeline                     # doctest: +SKIP
    >>> pipe = StreamingWanPipeline.from_pretrained("assets/tiny-causal-wan-shapes")
    >>> out = pipe(["a red circle moving left", "a red circle moving up"], switch_frames=[25], num_frames=49)
    >>> out.videos.shape                                                     # [B, T, 3, H, W] in [0, 1]
    torch.Size([1, 49, 3, 64, 64])

Frames: Wan's VAE maps pixel frame 0 to latent frame 0 and pixel frames ``4k-3 .. 4k`` to latent frame ``k``
(temporal factor 4), so a video of ``num_frames = 4n + 1`` frames is ``n + 1`` latent frames, generated in blocks of
``block_frames`` latent frames. A switch at pixel frame ``p`` takes effect at the block that holds latent frame
``ceil(p / 4)``, rounded up to a block start.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Sequence

import torch
from diffusers import WanPipeline

from samplers import ChunkedTrajectory, chunked_rollout, stream_noise, stream_sde_mask, stream_sigmas

from ..jsonio import dumps
from .causal_wan import CausalWan
from .wan import WanAdapter

__all__ = ["StreamConfig", "StreamOutput", "StreamingWanPipeline", "STREAM_CONFIG_NAME"]

STREAM_CONFIG_NAME = "stream_config.json"


@dataclass
class StreamConfig:
    """How a causal Wan streams (saved as ``stream_config.json`` next to the pipeline's components).

    Args:
        block_frames: latent frames per block.
        num_steps: denoising steps per block (the few-step list ``1000·(1 − j/S)`` warped by ``shift``).
        shift: the static shift of that list (Self-Forcing: 4 steps, shift 5).
        sink_frames: latent frames at the start every block attends to (whole blocks).
        window_frames: the newest latent frames a block attends to, itself included (whole blocks); ``None``: all.
        cache_frames: most latent frames kept cached (``None``: all written ones).
        context_sigma: noise level of the context the write pass stores (0: the clean block).
        recache: at a prompt switch, re-write the window under the new prompt (LongLive); ``False``: keep the cache
            as written and only change the prompt of the blocks that follow. Sample as the model was trained.
        guidance_scale: classifier-free guidance (1: off); the negative prompt's stream has its own cache rows.
        negative_prompt: the unconditional prompt.
        max_sequence_length: text tokens (``None``: the pipeline's default).
        height, width: default frame size in pixels (``None``: pass them to the call).
    """

    block_frames: int = 1
    num_steps: int = 4
    shift: float = 5.0
    sink_frames: int = 1
    window_frames: int | None = None
    cache_frames: int | None = None
    context_sigma: float = 0.0
    recache: bool = True
    guidance_scale: float = 1.0
    negative_prompt: str = ""
    max_sequence_length: int | None = None
    height: int | None = None
    width: int | None = None

    @classmethod
    def from_dict(cls, values: dict) -> "StreamConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown stream settings {unknown}; known: {sorted(known)}")
        return cls(**values)


@dataclass
class StreamOutput:
    """``videos``: ``[B, T, 3, H, W]`` float in [0, 1] (``None`` with ``output_type="latent"``); ``latents``:
    ``[B, C, F, h, w]``; ``trajectory``: what the sampler recorded (every block's states and re-noise
    log-probabilities); ``switch_blocks``: the block each segment
    after the first starts at; ``segment_of_block``: the segment every block was made under."""

    videos: torch.Tensor | None
    latents: torch.Tensor
    trajectory: ChunkedTrajectory
    switch_blocks: list
    segment_of_block: list


class StreamingWanPipeline:
    r"""
    Streaming generation with prompt switches over a ``WanPipeline`` whose transformer is made causal in place.

    Args:
        pipe (`WanPipeline`): text encoder, tokenizer, VAE, transformer (a causal-trained one).
        config (`StreamConfig`): streaming settings.
    """

    def __init__(self, pipe: WanPipeline, config: StreamConfig | None = None):
        self.pipe = pipe
        self.config = config or StreamConfig()
        c = self.config
        self.adapter = WanAdapter(pipe)
        self.wan = CausalWan(pipe.transformer, block_frames=c.block_frames, sink_frames=c.sink_frames,
                             window_frames=c.window_frames, cache_frames=c.cache_frames,
                             context_sigma=c.context_sigma)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **overrides) -> "StreamingWanPipeline":
        """Load a streaming model directory (a ``WanPipeline`` directory with ``stream_config.json``); keyword
        arguments that are :class:`StreamConfig` fields override its settings, the rest go to
        ``WanPipeline.from_pretrained``."""
        names = {f.name for f in fields(StreamConfig)}
        settings = {k: overrides.pop(k) for k in list(overrides) if k in names}
        config_file = os.path.join(path, STREAM_CONFIG_NAME)
        values = {}
        if os.path.isfile(config_file):
            with open(config_file) as f:
                values = json.load(f)
        elif not settings:
            raise FileNotFoundError(f"{config_file} not found: a streaming model directory holds its stream settings "
                                    "there (or pass them as keyword arguments, e.g. block_frames=3, num_steps=4)")
        values.update(settings)
        return cls(WanPipeline.from_pretrained(path, **overrides), StreamConfig.from_dict(values))

    def save_pretrained(self, path: str | os.PathLike) -> None:
        self.pipe.save_pretrained(path)
        with open(os.path.join(path, STREAM_CONFIG_NAME), "w") as f:
            f.write(dumps(asdict(self.config), indent=2))  # strict JSON

    # ------------------------------------------------------------------------------------------------ layout
    @property
    def temporal_factor(self) -> int:
        """Pixel frames per latent frame after the first: its Wan adapter's (:attr:`WanAdapter.temporal_factor`)."""
        return self.adapter.temporal_factor

    def latent_frames(self, num_frames: int) -> int:
        t = self.temporal_factor
        if num_frames < 1 or (num_frames - 1) % t:
            raise ValueError(f"num_frames must be {t}·k + 1, got {num_frames}")
        frames = (num_frames - 1) // t + 1
        if frames % self.config.block_frames:
            raise ValueError(f"num_frames={num_frames} is {frames} latent frames, not whole blocks of "
                             f"{self.config.block_frames}")
        return frames

    def switch_block(self, pixel_frame: int) -> int:
        """The block a prompt switch at ``pixel_frame`` takes effect at (see the module docstring)."""
        latent = math.ceil(pixel_frame / self.temporal_factor)
        return math.ceil(latent / self.config.block_frames)

    def layout(self, num_segments: int, switch_frames: Sequence[int], num_frames: int) -> tuple[list, list]:
        """(switch_blocks, segment_of_block) of a stream, checked."""
        blocks = self.latent_frames(num_frames) // self.config.block_frames
        switch_frames = list(switch_frames)
        if len(switch_frames) != num_segments - 1:
            raise ValueError(f"{num_segments} prompts per stream need {num_segments - 1} switch_frames, "
                             f"got {switch_frames}")
        switch_blocks = [self.switch_block(p) for p in switch_frames]
        bounds = [0, *switch_blocks, blocks]
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"switch_frames {switch_frames} fall on blocks {switch_blocks}: each segment needs at "
                             f"least one block of its own, within the {blocks} blocks of {num_frames} frames")
        segment_of_block = [sum(k >= s for s in switch_blocks) for k in range(blocks)]
        return switch_blocks, segment_of_block

    # ------------------------------------------------------------------------------------------------ generation
    def _encode(self, prompts: list[str]):
        c = self.config
        return self.adapter.encode_prompts(prompts, c.negative_prompt, guidance_scale=c.guidance_scale,
                                           max_sequence_length=c.max_sequence_length)

    @torch.no_grad()
    def __call__(
        self,
        prompts: Sequence[str] | Sequence[Sequence[str]],
        *,
        switch_frames: Sequence[int] = (),
        num_frames: int,
        height: int | None = None,
        width: int | None = None,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        renoise: torch.Tensor | None = None,
        output_type: str = "pt",
    ) -> StreamOutput:
        """Generate a batch of streams. ``prompts``: one stream's segment prompts (a list of str), or one such list
        per batch row (all rows switch at the same ``switch_frames``, pixel frames where segments 1.. start).
        ``noise`` / ``renoise`` (:func:`samplers.stream_noise` shapes) make the draws explicit; otherwise they are
        drawn from ``generator``."""
        rows = [list(prompts)] if prompts and isinstance(prompts[0], str) else [list(p) for p in prompts]
        if not rows or any(len(r) != len(rows[0]) for r in rows):
            raise ValueError("every stream of a batch needs the same number of segment prompts")
        c = self.config
        batch, segments = len(rows), len(rows[0])
        switch_blocks, segment_of_block = self.layout(segments, switch_frames, num_frames)
        height, width = height or c.height, width or c.width
        if height is None or width is None:
            raise ValueError("pass height= and width= (pixels), or set them in the stream config")
        shape = self.adapter._latent_shape(1, height, width, num_frames)[1:]
        channels, frames, h, w = shape
        blocks = frames // c.block_frames
        block_shape = (channels, c.block_frames, h, w)
        if noise is None or renoise is None:
            noise, renoise = stream_noise(batch, blocks, c.num_steps, block_shape, generator=generator)
        noise, renoise = noise.to(self.adapter.device), renoise.to(self.adapter.device)
        if noise.shape != (batch, blocks, *block_shape):
            raise ValueError(f"noise must be {(batch, blocks, *block_shape)}, got {tuple(noise.shape)}")
        if renoise.shape != (batch, blocks, c.num_steps - 1, *block_shape):
            raise ValueError(f"renoise must be {(batch, blocks, c.num_steps - 1, *block_shape)}, "
                             f"got {tuple(renoise.shape)}")
        embeds = [self._encode([r[s] for r in rows]) for s in range(segments)]
        cfg = embeds[0].has_negative
        texts = [e.for_cfg().prompt_embeds if cfg else e.prompt_embeds for e in embeds]
        scale = c.guidance_scale
        done: list[torch.Tensor] = []
        bf = c.block_frames
        self.wan.reset()

        # the sampler's conditioning is the block index: the stream's state lives in self.wan
        def velocity(x, sigma, k):
            x_in = torch.cat([x, x]) if cfg else x
            t = torch.full((x_in.shape[0],), 1000.0 * sigma, device=x.device)
            v = self.wan(x_in, t, texts[segment_of_block[k]], frame_offset=k * bf).float()
            if cfg:
                v_uncond, v_cond = v.chunk(2)
                v = v_uncond + scale * (v_cond - v_uncond)
            return v

        def commit(x0, k):
            done.append(x0)
            x_in = torch.cat([x0, x0]) if cfg else x0
            self.wan.write(x_in, texts[segment_of_block[k]], frame_offset=k * bf,
                           noise=self._context_noise(x_in, generator))
            if c.recache and segment_of_block[k + 1] != segment_of_block[k]:
                start = self.wan.recache_start((k + 1) * bf)
                if start < (k + 1) * bf:
                    past = torch.cat(done, 2)[:, :, start:]
                    past = torch.cat([past, past]) if cfg else past
                    self.wan.recache(past, texts[segment_of_block[k + 1]], frame_offset=start,
                                     noise=self._context_noise(past, generator))
            return k + 1

        sigmas = torch.cat([stream_sigmas(c.num_steps, c.shift), torch.zeros(1)])
        trajectory = chunked_rollout(velocity, commit, noise, sigmas, stream_sde_mask(c.num_steps), cond=0,
                                     kernel="cps", noise_level=1.0, step_noise=renoise)
        latents = torch.cat(trajectory.final.unbind(1), dim=2)  # the blocks joined along the frame axis
        videos = None if output_type == "latent" else self.adapter.decode(latents)
        return StreamOutput(videos, latents, trajectory, switch_blocks, segment_of_block)

    def _context_noise(self, like: torch.Tensor, generator) -> torch.Tensor | None:
        if self.config.context_sigma == 0:
            return None
        return torch.randn(like.shape, generator=generator, dtype=like.dtype).to(like.device)
