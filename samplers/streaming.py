r"""The streaming sampler: generation chunk by chunk (a streaming video model's blocks), each chunk's clean result
written into the model's state (its KV cache) before the next one, with the exact log-probability of every
stochastic transition. The trainer, held-out evaluation, KVPO's branches and :class:`StreamingWanPipeline` all
sample with :func:`chunked_rollout`, so a streaming trajectory means the same thing everywhere.

**Self-Forcing's sampler is one setting of it.** A block takes ``S`` steps over ``σ_0 = 1 > … > σ_{S−1}``
(:func:`stream_sigmas`) and a last jump to 0: at step ``j`` the model predicts the clean block
``x̂₀ = x_j − σ_j·v``; before the last step the prediction is re-noised, ``x_{j+1} = (1 − σ_{j+1})·x̂₀ +
σ_{j+1}·ε_j``; the last step's ``x̂₀`` is the block. (Self-Forcing, arXiv 2506.08009; CausVid, arXiv 2412.07772.)
That re-noise is the CPS kernel at noise level 1 (its std ``σ'·sin(π/2) = σ'`` leaves no ``ε̂`` term), and the
jump to 0 an Euler step (``x − σ·v = x̂₀``): :func:`chunked_rollout` over ``[σ_0, …, σ_{S−1}, 0]`` with
``kernel="cps", noise_level=1`` and :func:`stream_sde_mask`. Each re-noise is exactly
``N((1 − σ')·x̂₀, σ'²·I)``, a Gaussian whose mean depends on the model, so its log-density under new weights is
exact (CM-GRPO, arXiv 2605.15190) and PPO-style updates apply to streaming as to the image samplers.

**Noise, drawn or given.** The re-noise draws come from per-row generators (row ``b``'s from its own generator in
step order, so a row's stream does not depend on the batch it ran in), or are passed as tensors
(``step_noise``, e.g. from :func:`stream_noise`): runs given the same tensors share their random numbers, with no
RNG state to save and restore. Either way a step computes ``x' = a·x + b·v + std·ε`` (:func:`~samplers.sde_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .rollout import rollout
from .schedules import shift_sigmas

__all__ = ["ChunkedTrajectory", "chunked_rollout", "stream_sigmas", "stream_sde_mask", "stream_noise"]


def stream_sigmas(num_steps: int, shift: float = 5.0) -> torch.Tensor:
    """The ``num_steps`` noise levels of a block, ``[S]`` float32 from 1 down: the uniform timesteps
    ``1000·(1 − j/S)`` warped by the static ``shift`` (Self-Forcing: 4 steps, shift 5 → 1, 0.9375, 0.8333, 0.625).
    A block is integrated over these and then 0.

    >>> stream_sigmas(4, shift=5.0)
    tensor([1.0000, 0.9375, 0.8333, 0.6250])
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    base = 1.0 - torch.arange(num_steps, dtype=torch.float64) / num_steps
    return shift_sigmas(base, shift).float()


def stream_sde_mask(num_steps: int) -> torch.Tensor:
    """Bool ``[S]`` over a block's ``S`` steps (``[σ_0, …, σ_{S−1}, 0]``): the re-noise steps (all but the last)."""
    mask = torch.ones(num_steps, dtype=torch.bool)
    mask[-1] = False
    return mask


def stream_noise(batch: int, blocks: int, steps: int, block_shape, *, generator: torch.Generator | None = None,
                 device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every draw a stream needs, float32: ``noise`` ``[B, K, *block_shape]`` (each block's start) and ``renoise``
    ``[B, K, S−1, *block_shape]`` (the re-noise draws; :func:`chunked_rollout`'s ``step_noise``)."""
    shape = (batch, blocks, *block_shape)
    noise = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
    renoise = torch.randn((batch, blocks, max(steps - 1, 0), *block_shape), generator=generator,
                          dtype=torch.float32, device=device)
    return noise, renoise


@dataclass
class ChunkedTrajectory:
    """What a chunk-by-chunk (streaming) rollout records.

    Attributes:
        latents: ``[B, C, T+1, ...]``: every state of every chunk; ``latents[:, c, i]`` is chunk ``c`` at ``sigmas[i]``.
        log_probs: ``[B, C, T]`` exact log π of each SDE transition (0 on ODE steps).
        sde_mask: ``[B, C, T]`` bool.
        sigmas: ``[T+1]`` the schedule each chunk was integrated on.
        conds: ``C`` conditionings: ``conds[c]`` is what chunk ``c`` was denoised under (``conds[0]`` the initial one,
            then each one written by ``commit_fn`` after the chunk before). With these the update rescores any
            transition ``(b, c, i)`` exactly: ``velocity_fn(latents[b, c, i], sigmas[i], conds[c][b])``. What
            ``keep_cond`` kept of each (``None`` where nothing, every entry with ``keep_cond=False``).
        nfe: velocity calls per sample (``C · T``).
        x0: with ``record_x0``, ``[B, C, T, ...]`` float32: the clean prediction ``x − σ·v`` of every velocity call
            (KVPO replays and compares them); else ``None``.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    sde_mask: torch.Tensor
    sigmas: torch.Tensor
    conds: list[Any]
    nfe: int
    x0: torch.Tensor | None = None

    @property
    def final(self) -> torch.Tensor:
        """The clean chunks ``[B, C, ...]``."""
        return self.latents[:, :, -1]


@torch.no_grad()
def chunked_rollout(
    velocity_fn: Callable[[torch.Tensor, float, Any], torch.Tensor],
    commit_fn: Callable[[torch.Tensor, Any], Any],
    noise: torch.Tensor,
    sigmas: torch.Tensor | Sequence[float],
    sde_mask: torch.Tensor | Sequence[bool],
    *,
    cond: Any,
    kernel: str = "flow_grpo",
    noise_level: float = 0.7,
    solver: str = "euler",
    generator: torch.Generator | list[torch.Generator] | None = None,
    step_noise: torch.Tensor | None = None,
    keep_cond: bool | Callable[[int, Any], Any] = True,
    record_x0: bool = False,
) -> ChunkedTrajectory:
    """Stateful generation chunk by chunk (a streaming video model with a KV cache), no grad.

    Chunk ``c`` is integrated from ``noise[:, c]`` over ``sigmas`` by :func:`~samplers.rollout` with
    ``velocity_fn(x, sigma, cond_c)``; then ``commit_fn(x0_c, cond_c) -> cond_{c+1}`` writes its clean result into the
    model state (a separate no-grad pass, as a KV-cache write should be) for the chunks after it.

    Args:
        velocity_fn: ``velocity_fn(x, sigma, cond) -> v``.
        commit_fn: ``commit_fn(x0, cond) -> cond'``: the conditioning of the next chunk (not called after the last
            one). It must not modify ``cond`` in place: every chunk's conditioning is kept for rescoring. A caller
            whose state lives in the model may pass the block index as ``cond`` and return ``cond + 1``.
        noise: ``[B, C, ...]`` initial noise of every chunk.
        sigmas: ``[T+1]`` schedule of each chunk.
        sde_mask: bool ``[T]``, ``[C, T]`` or ``[B, C, T]``.
        cond: the conditioning of the first chunk (indexable by rows, like the adapters' ``PromptEmbeds``).
        kernel, noise_level, solver, generator: as :func:`~samplers.rollout`; per-sample generators continue from
            chunk to chunk.
        step_noise: instead of a generator, the SDE steps' standard normal draws ``[B, C, T', ...]`` (``T' ≤ T``,
            the steps from ``T'`` on deterministic; :func:`stream_noise`'s ``renoise``): chunk ``c``'s step ``i``
            uses ``step_noise[:, c, i]``.
        keep_cond: what the trajectory keeps of chunk ``c``'s conditioning, ``keep_cond(c, cond)`` (``None``:
            nothing); ``True`` all of it, ``False`` nothing. A streaming model's conditioning holds its KV cache, so
            keeping every chunk's costs a cache per chunk: a sampler that needs only the samples keeps none, an
            update that rescores some transitions keeps the rows and chunks it will read.
        record_x0: also keep every call's clean prediction (:attr:`ChunkedTrajectory.x0`; as much memory as the
            states).
    """
    batch, chunks = noise.shape[:2]
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32).cpu()
    steps = sigmas.shape[0] - 1
    mask = torch.as_tensor(sde_mask, dtype=torch.bool, device=noise.device)
    if mask.ndim == 1:
        mask = mask.expand(chunks, steps)
    if mask.ndim == 2:
        mask = mask.unsqueeze(0).expand(batch, chunks, steps)
    if mask.shape != (batch, chunks, steps):
        raise ValueError(f"sde_mask must be [T], [C, T] or [B, C, T] = ({batch}, {chunks}, {steps}), "
                         f"got {tuple(mask.shape)}")
    if step_noise is not None and step_noise.shape[:2] != (batch, chunks):
        raise ValueError(f"step_noise must be [B, C, T', ...] with B, C = {batch}, {chunks}, "
                         f"got {tuple(step_noise.shape)}")
    latents, log_probs, conds, x0 = [], [], [], []
    for c in range(chunks):
        conds.append(cond if keep_cond is True else None if keep_cond is False else keep_cond(c, cond))
        velocity = lambda x, sigma, cond=cond: velocity_fn(x, sigma, cond)  # noqa: E731
        if record_x0:
            velocity = _recording_x0(velocity, x0)
        traj = rollout(velocity, noise[:, c], sigmas, mask[:, c], kernel=kernel, noise_level=noise_level,
                       solver=solver, generator=generator,
                       step_noise=None if step_noise is None else step_noise[:, c])
        latents.append(traj.latents)
        log_probs.append(traj.log_probs)
        if c + 1 < chunks:
            cond = commit_fn(traj.final, cond)
    return ChunkedTrajectory(latents=torch.stack(latents, dim=1), log_probs=torch.stack(log_probs, dim=1),
                             sde_mask=mask, sigmas=sigmas, conds=conds, nfe=chunks * steps,
                             x0=torch.stack(x0, dim=1).unflatten(1, (chunks, steps)) if record_x0 else None)


def _recording_x0(velocity: Callable[[torch.Tensor, float], torch.Tensor],
                  out: list[torch.Tensor]) -> Callable[[torch.Tensor, float], torch.Tensor]:
    """``velocity`` that also appends each call's clean prediction ``x − σ·v`` (``[B, ...]`` float32) to ``out``;
    computed as a replay computes it (``v`` in float32, ``σ`` a float), so a replay of a recorded input under the
    same weights gives it back bit for bit."""

    def call(x: torch.Tensor, sigma: float) -> torch.Tensor:
        v = velocity(x, sigma).float()
        out.append(x - sigma * v)
        return v

    return call
