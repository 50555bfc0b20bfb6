"""What every flow-matching model adapter shares.

An adapter wraps one diffusers pipeline and exposes the four things the trainer and samplers need:
``encode_prompts`` (once per batch), ``prepare_noise``, ``velocity(x, sigma, cond)`` (one transformer
forward, classifier-free guidance batched into it) and ``decode``. Sampling itself is not here: the
samplers are pure functions of explicit sigmas (``samplers.rollout``), and ``sigmas()`` gives them the
exact schedule the pipeline's own ``__call__`` would use.

Every adapter generates in *chunks*, each written into the model's state before the next: an image or a clip is one
chunk with no state (``num_chunks`` is 1, ``commit`` returns the conditioning unchanged, ``join_chunks`` the sample
itself), and a streaming model (``flowgrpo.models.StreamAdapter``) makes a video block by block. So the trainer and
the algorithms ask any adapter the same questions and never which kind it is.

Conventions (diffusers'): x_σ = (1−σ)·x₀ + σ·ε, the transformer predicts v ≈ ε − x₀, an Euler step is
x' = x + (σ'−σ)·v. Latents, velocities and sigmas are float32 whatever the model dtype; only the
transformer forward runs in the model dtype.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace
from contextlib import nullcontext
from typing import Any, Callable, ClassVar, ContextManager, Sequence

import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler
from diffusers.utils import logging as diffusers_logging
from diffusers.utils.torch_utils import randn_tensor

from samplers import rollout

__all__ = ["FlowAdapter", "PromptEmbeds"]

logger = diffusers_logging.get_logger(__name__)

GeneratorArg = torch.Generator | list[torch.Generator] | None


@dataclass
class PromptEmbeds:
    r"""
    Encoded prompts of one batch, batch-first, ready for ``FlowAdapter.velocity``.

    Every field is either `None` or a tensor whose first dimension is the batch, so indexing, repeating and
    moving apply field by field. The negative fields are set iff the prompts were encoded for classifier-free
    guidance.

    Args:
        prompt_embeds (`torch.Tensor`): token embeddings `[B, L, D]`.
        pooled_prompt_embeds (`torch.Tensor`, *optional*): pooled embeddings `[B, P]` (SD3, FLUX).
        negative_prompt_embeds (`torch.Tensor`, *optional*): negative token embeddings `[B, L, D]`.
        negative_pooled_prompt_embeds (`torch.Tensor`, *optional*): negative pooled embeddings `[B, P]`.
    """

    prompt_embeds: torch.Tensor
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None

    def _map(self, fn) -> "PromptEmbeds":
        return replace(self, **{f.name: None if (t := getattr(self, f.name)) is None else fn(t) for f in fields(self)})

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    @property
    def has_negative(self) -> bool:
        """Whether negative embeddings are present (the prompts were encoded for CFG)."""
        return self.negative_prompt_embeds is not None

    def __getitem__(self, index: int | slice | torch.Tensor | Sequence[int]) -> "PromptEmbeds":
        """Sub-batch. An integer keeps the batch dimension (`embeds[i]` has length 1)."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        elif not isinstance(index, (slice, torch.Tensor)):
            index = torch.as_tensor(index, dtype=torch.long)
        if isinstance(index, torch.Tensor):
            index = index.to(self.prompt_embeds.device)
        return self._map(lambda t: t[index])

    def repeat_interleave(self, repeats: int) -> "PromptEmbeds":
        """Repeat each prompt `repeats` times consecutively: prompts `[a, b]` → `[a, a, b, b]` for `repeats=2`,
        the layout of G group members per prompt."""
        return self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "PromptEmbeds":
        return self._map(lambda t: t.to(device=device, dtype=dtype))

    @classmethod
    def cat(cls, items: Sequence["PromptEmbeds"]) -> "PromptEmbeds":
        """Concatenate along the batch (all items must agree on which fields are set)."""
        out = {}
        for f in fields(cls):
            values = [getattr(item, f.name) for item in items]
            if any(v is None for v in values) and not all(v is None for v in values):
                raise ValueError(f"Cannot concatenate PromptEmbeds where only some have `{f.name}`.")
            out[f.name] = None if values[0] is None else torch.cat(values, dim=0)
        return cls(**out)

    def for_cfg(self) -> "PromptEmbeds":
        """The doubled batch `[negative; positive]` of one batched CFG forward (uncond first, as diffusers)."""
        if not self.has_negative:
            raise ValueError(
                "Classifier-free guidance needs negative embeddings: call `encode_prompts(..., guidance_scale=g)` "
                "with the same g > 1 you pass to `velocity`."
            )
        pooled = None
        if self.pooled_prompt_embeds is not None:
            pooled = torch.cat([self.negative_pooled_prompt_embeds, self.pooled_prompt_embeds], dim=0)
        return PromptEmbeds(torch.cat([self.negative_prompt_embeds, self.prompt_embeds], dim=0), pooled)


class TransformerAccess:
    """The pipeline's denoiser as an adapter exposes it (``self.pipe``; ``self._transformer``: a wrapper or None)."""

    pipe: DiffusionPipeline
    _transformer: torch.nn.Module | None = None

    @property
    def transformer(self) -> torch.nn.Module:
        """The denoiser `velocity` calls. Assign a wrapped module (DDP/FSDP/compiled) to have `velocity` use it;
        the pipeline keeps the unwrapped one, whose config the adapter reads."""
        return self.pipe.transformer if self._transformer is None else self._transformer

    @transformer.setter
    def transformer(self, module: torch.nn.Module | None) -> None:
        self._transformer = module

    @property
    def device(self) -> torch.device:
        return self.pipe.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pipe.transformer.dtype


class FlowAdapter(TransformerAccess):
    r"""
    Base class of the model adapters: a diffusers pipeline seen as a velocity field plus encoder and decoder.

    Subclasses set `pipeline_class`, `family`, `is_video` and implement the few family-specific hooks
    (`_encode`, `_latent_shape`, `_forward`, and optionally `_schedule_kwargs`; video families also `_decode_latents`).

    Attributes:
        pipe (`DiffusionPipeline`): the wrapped pipeline (its modules are the adapter's modules).
        family (`str`): `"sd3"`, `"flux"` or `"wan"`.
        is_video (`bool`): whether `decode` returns videos `[B, T, 3, H, W]` instead of images `[B, 3, H, W]`.
    """

    pipeline_class: ClassVar[type[DiffusionPipeline]]
    family: ClassVar[str]
    is_video: ClassVar[bool] = False
    per_frame_sigmas: ClassVar[bool] = False  # velocity takes sigma [B, F]: one noise level per latent frame
    _registry: ClassVar[dict[str, type["FlowAdapter"]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:
            FlowAdapter._registry[cls.family] = cls

    def __init__(self, pipe: DiffusionPipeline):
        if not isinstance(pipe, self.pipeline_class):
            raise TypeError(f"{type(self).__name__} wraps a {self.pipeline_class.__name__}, got {type(pipe).__name__}.")
        self.pipe = pipe
        self._transformer = None
        self._check_scheduler()

    @classmethod
    def from_pipeline(cls, pipe: DiffusionPipeline) -> "FlowAdapter":
        r"""
        Wrap an already built pipeline. Called on `FlowAdapter` itself, the family is picked from the pipeline type.

        Example:
            ```py
            >>> from flowgrpo.models import FlowAdapter, build_tiny_pipeline
            >>> FlowAdapter.from_pipeline(build_tiny_pipeline("flux")).family
            'flux'
            ```
        """
        if cls is FlowAdapter:
            for adapter_cls in FlowAdapter._registry.values():
                if isinstance(pipe, adapter_cls.pipeline_class):
                    return adapter_cls(pipe)
            known = ", ".join(c.pipeline_class.__name__ for c in FlowAdapter._registry.values())
            raise TypeError(f"No adapter for {type(pipe).__name__}; supported pipelines: {known}.")
        return cls(pipe)

    # ------------------------------------------------------------------ properties
    @property
    def num_train_timesteps(self) -> int:
        return self.pipe.scheduler.config.num_train_timesteps

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pipe={type(self.pipe).__name__}, dtype={self.dtype}, device={self.device})"

    # ------------------------------------------------------------------ schedule
    def _check_scheduler(self) -> None:
        scheduler = self.pipe.scheduler
        if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            return
        shift = getattr(scheduler.config, "flow_shift", None)
        if shift is None:
            raise TypeError(
                f"{type(self).__name__} needs a flow-matching scheduler; the pipeline has {type(scheduler).__name__} "
                "without `flow_shift`."
            )
        # Our rollouts are Euler steps on explicit sigmas; swap e.g. Wan's UniPC for the Euler scheduler with the
        # same shift so that `sigmas()` and `pipe(...)` (evaluation) describe the sampler we actually run.
        logger.warning(
            f"Replacing the pipeline's {type(scheduler).__name__} with FlowMatchEulerDiscreteScheduler(shift={shift})."
        )
        self.pipe.scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=scheduler.config.num_train_timesteps, shift=shift
        )

    def _schedule_kwargs(self, num_steps: int, height: int | None, width: int | None, num_frames: int | None) -> dict:
        """Extra `set_timesteps` arguments the pipeline's `__call__` passes (FLUX: `sigmas`, `mu`)."""
        return {}

    def sigmas(
        self, num_steps: int, *, height: int | None = None, width: int | None = None, num_frames: int | None = None
    ) -> torch.Tensor:
        r"""
        The noise levels of a `num_steps`-step sampling run, exactly as the pipeline's `__call__` schedules them.

        Computed by the pipeline's own scheduler (a copy, so its step index is untouched), which carries every
        option of the checkpoint's scheduler config (shift, dynamic shifting, terminal stretch, ...).

        Args:
            num_steps (`int`): number of sampling steps.
            height, width (`int`, *optional*): image size in pixels; needed where the shift depends on resolution
                (FLUX, and SD3 checkpoints with dynamic shifting).
            num_frames (`int`, *optional*): video length (Wan; the schedule does not depend on it).

        Returns:
            `torch.Tensor` of shape `[num_steps + 1]`, float32 on CPU, decreasing from σ₀ (≈1) to 0.
        """
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(num_steps, **self._schedule_kwargs(num_steps, height, width, num_frames))
        return scheduler.sigmas.detach().to("cpu", torch.float32)

    # ------------------------------------------------------------------ prompts
    def _cfg_active(self, guidance_scale: float) -> bool:
        """Whether two-branch classifier-free guidance runs (diffusers: `guidance_scale > 1`)."""
        return guidance_scale > 1.0

    def _cfg_scale(self, guidance_scale: float) -> float:
        """The scale that mixes the two CFG branches."""
        return guidance_scale

    def _encode(
        self, prompts: list[str], negative_prompt: list[str] | None, max_sequence_length: int | None
    ) -> PromptEmbeds:
        raise NotImplementedError

    @torch.no_grad()  # text encoders are frozen in RL; embeddings are computed once per batch and reused
    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompt: str | Sequence[str] | None = "",
        *,
        guidance_scale: float = 1.0,
        max_sequence_length: int | None = None,
        metadata: Sequence[dict] | None = None,
        num_frames: int | None = None,
        **cfg_kwargs,
    ) -> PromptEmbeds:
        r"""
        Encode prompts once, with the pipeline's own `encode_prompt`.

        Args:
            prompts (`list[str]`): one entry per batch element (repeat per group member with
                `PromptEmbeds.repeat_interleave`, not here, to encode each prompt once).
            negative_prompt (`str` or `list[str]`, *optional*, defaults to `""`): used only when CFG is active.
            guidance_scale (`float`, defaults to 1.0): the negative embeddings are included iff `guidance_scale > 1`,
                as in the pipelines. Pass the value you will pass to `velocity`.
            max_sequence_length (`int`, *optional*): T5 sequence length; the pipeline's default when `None`.
            metadata, num_frames: what a streaming model's conditioning is built from (each stream's segments);
                one chunk's conditioning is the prompt alone, so they are not read here.
            cfg_kwargs: family-specific guidance options (FLUX: `true_cfg_scale`).

        Returns:
            `PromptEmbeds` on the model's device, in the model's dtype.
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        negatives = None
        if self._cfg_active(guidance_scale, **cfg_kwargs):
            negatives = self._negative_list(negative_prompt, len(prompts))
        return self._encode(prompts, negatives, max_sequence_length)

    @staticmethod
    def _negative_list(negative_prompt: str | Sequence[str] | None, batch_size: int) -> list[str]:
        if negative_prompt is None:
            negative_prompt = ""  # as SD3 / Wan's `negative_prompt or ""`
        if isinstance(negative_prompt, str):
            return [negative_prompt] * batch_size
        negative_prompt = list(negative_prompt)
        if len(negative_prompt) != batch_size:
            raise ValueError(f"Got {len(negative_prompt)} negative prompts for {batch_size} prompts.")
        return negative_prompt

    @staticmethod
    def _pipeline_kwargs(max_sequence_length: int | None) -> dict:
        return {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}

    # ------------------------------------------------------------------ noise
    def _latent_shape(self, batch_size: int, height: int, width: int, num_frames: int | None) -> tuple[int, ...]:
        raise NotImplementedError

    def prepare_noise(
        self,
        batch_size: int,
        *,
        height: int,
        width: int,
        num_frames: int | None = None,
        generator: GeneratorArg = None,
        group_size: int = 1,
        shared: bool = False,
    ) -> torch.Tensor:
        r"""
        Initial noise x(σ=1) in the adapter's latent layout, as the pipeline draws it.

        With the same `generator` state and `shared=False` this is bit-for-bit the noise `pipe(...)` starts from
        (diffusers' `randn_tensor`, float32).

        Args:
            batch_size (`int`): number of samples B.
            height, width (`int`): output size in pixels.
            num_frames (`int`, *optional*): output video length (video families only).
            generator (`torch.Generator` or list of them, *optional*): with a list, one generator per drawn noise
                (B of them, or B / group_size with `shared=True`).
            group_size (`int`, defaults to 1): G consecutive samples form a group.
            shared (`bool`, defaults to `False`): one noise per group, repeated for its G members (the draws are
                those of a batch of B / G).

        Returns:
            float32 `torch.Tensor` on the model's device: `[B, C, h, w]` for images, `[B, C, f, h, w]` for videos.
        """
        draws = batch_size
        if shared:
            if batch_size % group_size:
                raise ValueError(f"batch_size {batch_size} is not a multiple of group_size {group_size}.")
            draws = batch_size // group_size
        shape = self._latent_shape(draws, height, width, num_frames)
        noise = randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)
        if shared and group_size > 1:
            noise = noise.repeat_interleave(group_size, dim=0)
        return noise

    # ------------------------------------------------------------------ velocity
    def _forward(
        self, x: torch.Tensor, timestep: torch.Tensor, cond: PromptEmbeds, guidance_scale: float, *,
        transformer: torch.nn.Module,
    ) -> torch.Tensor:
        """One forward of `transformer` on `x` (model dtype) at per-sample `timestep` (in [0, num_train_timesteps])."""
        raise NotImplementedError

    def velocity(
        self,
        x: torch.Tensor,
        sigma: float | torch.Tensor,
        cond: PromptEmbeds,
        *,
        guidance_scale: float = 1.0,
        transformer: torch.nn.Module | None = None,
        **kwargs,
    ) -> torch.Tensor:
        r"""
        The (guided) velocity v(x, σ) the pipeline would step with: `x' = x + (σ' − σ)·v`.

        Differentiable (no `no_grad` inside): the trainer backpropagates through it.

        Args:
            x (`torch.Tensor`): latents `[B, ...]` in the layout of `prepare_noise`.
            sigma (`float` or `torch.Tensor`): noise level: a scalar, one per sample `[B]`, or — for video families
                with `per_frame_sigmas` (Wan) — one per sample and latent frame `[B, F]` (streaming generation
                denoises frames at different levels).
            cond (`PromptEmbeds`): `len(cond) == B`; must hold negative embeddings when CFG is active.
            guidance_scale (`float`, defaults to 1.0): CFG scale; with `> 1` the unconditional and conditional
                branches run in ONE batched forward and v = v_u + g·(v_c − v_u).
            transformer (`torch.nn.Module`, *optional*): the denoiser to call instead of the adapter's own — e.g. a
                frozen reference copy for a KL term; defaults to `self.transformer`.
            kwargs: family-specific guidance options (FLUX: `true_cfg_scale`).

        Returns:
            float32 `torch.Tensor` shaped like `x`.
        """
        batch = x.shape[0]
        if len(cond) != batch:
            raise ValueError(f"cond has {len(cond)} prompts for a batch of {batch} latents.")
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
        if sigma.ndim == 2 and sigma.shape[0] == batch and sigma.shape[1] > 1:
            if not self.per_frame_sigmas:
                raise ValueError(f"{type(self).__name__} takes one sigma per sample, got sigma of shape "
                                 f"{tuple(sigma.shape)}; per-frame sigmas [B, F] need a video family (wan).")
            if sigma.shape[1] != x.shape[2]:
                raise ValueError(f"per-frame sigma has {sigma.shape[1]} frames, the latents {x.shape[2]}.")
        else:
            sigma = sigma.expand(batch) if sigma.ndim == 0 else sigma.reshape(batch)
        # The pipelines feed `scheduler.timesteps = sigmas * num_train_timesteps` (float32); same op, same bits.
        timestep = sigma * self.num_train_timesteps
        x_in = x.to(self.dtype)
        cfg = self._cfg_active(guidance_scale, **kwargs)
        if cfg:
            x_in, timestep, cond = torch.cat([x_in, x_in]), torch.cat([timestep, timestep]), cond.for_cfg()
        module = self.transformer if transformer is None else transformer
        v = self._forward(x_in, timestep, cond, guidance_scale=guidance_scale, transformer=module, **kwargs).float()
        if cfg:
            v_uncond, v_cond = v.chunk(2)
            v = v_uncond + self._cfg_scale(guidance_scale, **kwargs) * (v_cond - v_uncond)
        return v

    # ------------------------------------------------------------------ decode
    #: Output pixels one VAE call decodes for the image families: a batch is decoded in chunks of whole images under
    #: this budget, so decoding memory stays flat in the number of rollouts a process scores at once (the trainer's
    #: score phase decodes all of them). 2**24 is 64 images of 512x512 per call — about 24 GiB of the SD3 decoder's
    #: bf16 activations instead of 54 GiB for Flow-GRPO's 144 per GPU (scripts/plan.py) — and 4096 of the embedded
    #: world's 64x64, which stay one call. Chunks agree with one call to float rounding (each image is decoded alone
    #: either way).
    decode_pixels_per_call: ClassVar[int] = 2**24

    def _decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Image families (SD3, FLUX): un-scale ``[B, C, h, w]`` latents, run the 2-D VAE decoder and postprocess
        to ``[0, 1]`` pixels, as the pipelines do for ``output_type="pt"``, in chunks of
        :attr:`decode_pixels_per_call`; video families override this.

        The decoder runs in channels-last memory format (its modules are converted on first use): the same
        convolutions, 10-25% faster on CPU for the embedded world's 64 images (1-2 threads) and the layout cuDNN
        prefers on GPUs. Outputs agree with the default layout to float rounding.
        """
        vae = self.pipe.vae
        if not getattr(vae, "_flowgrpo_channels_last", False):
            vae.to(memory_format=torch.channels_last)
            vae._flowgrpo_channels_last = True
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        latents = latents.to(vae.dtype).contiguous(memory_format=torch.channels_last)
        scale = self.pipe.vae_scale_factor
        chunk = max(1, self.decode_pixels_per_call // (latents.shape[-2] * latents.shape[-1] * scale * scale))
        images = [self.pipe.image_processor.postprocess(vae.decode(part, return_dict=False)[0], output_type="pt")
                  for part in latents.split(chunk)]
        return images[0] if len(images) == 1 else torch.cat(images)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        r"""
        Decode final latents to pixels in [0, 1], as the pipeline's postprocessing for `output_type="pt"`.

        Not wrapped in `no_grad` (a differentiable reward may backpropagate); wrap the call when it is not needed.

        Returns:
            float32 images `[B, 3, H, W]`, or videos `[B, T, 3, H, W]` for video families.
        """
        return self._decode_latents(latents).float()

    # ------------------------------------------------------------------ chunks (one: an image or a clip)
    #: whether a sample is several chunks with state between them (a streaming model's blocks)
    chunked: ClassVar[bool] = False

    def num_chunks(self, num_frames: int | None = None) -> int:
        """Chunks generated one after the other for a sample: one (an image or a whole clip)."""
        return 1

    @property
    def frames(self) -> "FlowAdapter":
        """The adapter of one chunk's latent layout and decoding: this one."""
        return self

    def join_chunks(self, final: torch.Tensor) -> torch.Tensor:
        """The samples ``adapter.decode`` takes from each row's final chunks: one chunk is the sample itself."""
        return final

    def commit(self, x0: torch.Tensor, cond: PromptEmbeds) -> PromptEmbeds:
        """Write the finished chunk into the model's state; the next chunk's conditioning. One chunk leaves no state:
        ``cond`` itself."""
        return cond

    def routed(self, route) -> ContextManager[None]:
        """A streaming model's blocks attending routed cached frames (``StreamAdapter.routed``); one chunk has no
        cache to route."""
        raise TypeError(f"{type(self).__name__} is not a streaming model (model.family=causal_wan)")

    def teacher_forced_velocity(self, clean, noisy, sigma, cond, *, routes=None, transformer=None) -> torch.Tensor:
        """A streaming model's teacher-forced forward over whole streams (``StreamAdapter.teacher_forced_velocity``);
        one chunk has no context to force."""
        raise TypeError(f"{type(self).__name__} is not a streaming model (model.family=causal_wan)")

    @torch.no_grad()
    def generate(self, prompts: list[str], metadata: Sequence[dict] | None, generators: list[torch.Generator], *,
                 sigmas: torch.Tensor, model_kw: dict[str, Any],
                 autocast: Callable[[], ContextManager] = nullcontext) -> torch.Tensor:
        """Samples ``[B, 3, H, W]`` (videos ``[B, T, 3, H, W]``) in [0, 1] from the deterministic Euler ODE over
        ``sigmas`` with the run's guidance, one per generator (it draws the sample's initial noise); what the
        held-out evaluation samples (``flowgrpo.evaluation.generate``). ``metadata`` is not read (a streaming model's
        segments)."""
        guidance = model_kw["guidance"]
        extra = {k: v for k, v in guidance.items() if k != "guidance_scale"}
        cond = self.encode_prompts(prompts, model_kw["negative_prompt"], guidance_scale=guidance["guidance_scale"],
                                   max_sequence_length=model_kw["max_sequence_length"], **extra)
        noise = self.prepare_noise(len(prompts), generator=generators, **model_kw["size"])

        def velocity(x, sigma):
            with autocast():
                return self.velocity(x, sigma, cond, **guidance)

        trajectory = rollout(velocity, noise, sigmas, torch.zeros(sigmas.shape[0] - 1, dtype=torch.bool))
        return self.decode(trajectory.final).float().clamp_(0, 1)
