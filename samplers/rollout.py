"""The rollout engine: integrate a velocity field from noise to data, SDE on chosen steps, ODE elsewhere,
recording every state and the exact log-probability of every stochastic transition."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .solvers import dpm_solver_2m_step
from .steps import ode_step, sde_step

__all__ = ["Trajectory", "ChunkedTrajectory", "rollout", "chunked_rollout", "SOLVERS"]

SOLVERS = ("euler", "dpm++2m")
VelocityFn = Callable[[torch.Tensor, float], torch.Tensor]


@dataclass
class Trajectory:
    """What a rollout records.

    Attributes:
        latents: every state, ``[B, T+1, ...]`` float32; ``latents[:, i]`` is at ``sigmas[i]``.
        log_probs: ``[B, T]`` exact log π of each SDE transition (0 where the step was an ODE step).
        sde_mask: ``[B, T]`` bool, which transitions were stochastic (the trainable ones).
        sigmas: ``[T+1]`` the schedule that was integrated.
        nfe: number of ``velocity_fn`` calls (one per step, whatever the batch).
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    sde_mask: torch.Tensor
    sigmas: torch.Tensor
    nfe: int

    @property
    def final(self) -> torch.Tensor:
        """The last state ``[B, ...]``."""
        return self.latents[:, -1]


def _normalise_mask(sde_mask, batch: int, steps: int, device) -> torch.Tensor:
    mask = torch.as_tensor(sde_mask, dtype=torch.bool, device=device)
    if mask.ndim == 1:
        if mask.shape[0] != steps:
            raise ValueError(f"sde_mask has {mask.shape[0]} steps but sigmas describe {steps}")
        return mask.unsqueeze(0).expand(batch, steps)
    if mask.shape != (batch, steps):
        raise ValueError(f"sde_mask must be [T]={steps} or [B, T]=({batch}, {steps}), got {tuple(mask.shape)}")
    return mask


@torch.no_grad()
def rollout(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    sigmas: torch.Tensor | Sequence[float],
    sde_mask: torch.Tensor | Sequence[bool],
    *,
    kernel: str = "flow_grpo",
    noise_level: float = 0.7,
    solver: str = "euler",
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> Trajectory:
    """Sample a batch of trajectories (no grad).

    Args:
        velocity_fn: ``velocity_fn(x, sigma) -> v`` with ``sigma`` a float shared by the batch.
        noise: initial state at ``sigmas[0]`` (normally 1), ``[B, ...]``.
        sigmas: decreasing schedule ``[T+1]``.
        sde_mask: bool ``[T]`` or ``[B, T]``; True steps use ``sde_step`` with ``kernel``.
        solver: ODE solver for the deterministic steps. ``"dpm++2m"`` uses DPM-Solver++(2M) on the steps
            after a sample's last SDE step (MixGRPO-Flash); steps before it stay Euler, so the trained
            transitions are unchanged. The first DPM step after an SDE step has no history across the
            stochastic jump and is first order.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown ODE solver {solver!r}; choose one of {SOLVERS}")
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32).cpu()
    steps = sigmas.shape[0] - 1
    if steps < 1:
        raise ValueError("sigmas must hold at least two values")
    if torch.any(sigmas[1:] >= sigmas[:-1]):
        raise ValueError("sigmas must be strictly decreasing")
    batch = noise.shape[0]
    device = noise.device
    if isinstance(generator, (list, tuple)) and len(generator) != batch:
        raise ValueError(f"got {len(generator)} generators for a batch of {batch}")
    mask = _normalise_mask(sde_mask, batch, steps, device)
    steps_idx = torch.arange(steps, device=device)
    # Index of each sample's last SDE step (−1 when none): DPM-Solver++ runs only after it.
    last_sde = torch.where(mask, steps_idx, torch.full_like(steps_idx, -1)).amax(dim=1)

    x = noise.float()
    latents = [x]
    log_probs = torch.zeros(batch, steps, dtype=torch.float32, device=device)
    prev_x0: torch.Tensor | None = None
    for i in range(steps):
        sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
        v = velocity_fn(x, sigma).float()
        row_sde = mask[:, i]
        out = ode_step(v, x, sigma, sigma_next).prev_sample
        if solver == "dpm++2m":
            x0 = x - sigma * v
            use_dpm = steps_idx[i] > last_sde
            if use_dpm.any():
                # History only where the previous step was itself a deterministic post-window step.
                has_hist = (steps_idx[i] - 1 > last_sde) & (i > 0)
                dpm_first = dpm_solver_2m_step(x, x0, sigma, sigma_next)
                if prev_x0 is not None and has_hist.any():
                    dpm_second = dpm_solver_2m_step(x, x0, sigma, sigma_next, prev_x0_pred=prev_x0,
                                                    prev_sigma=float(sigmas[i - 1]))
                    dpm = torch.where(_rows(has_hist, x), dpm_second, dpm_first)
                else:
                    dpm = dpm_first
                out = torch.where(_rows(use_dpm, x), dpm, out)
            prev_x0 = x0
        if row_sde.all():
            step = sde_step(v, x, sigma, sigma_next, kernel=kernel, noise_level=noise_level, generator=generator)
            out, log_probs[:, i] = step.prev_sample, step.log_prob
        elif row_sde.any():
            rows = row_sde.nonzero().squeeze(1)
            gen = [generator[r] for r in rows.tolist()] if isinstance(generator, (list, tuple)) else generator
            step = sde_step(v[rows], x[rows], sigma, sigma_next, kernel=kernel, noise_level=noise_level, generator=gen)
            out = out.clone()
            out[rows] = step.prev_sample
            log_probs[rows, i] = step.log_prob
        x = out
        latents.append(x)
    return Trajectory(latents=torch.stack(latents, dim=1), log_probs=log_probs, sde_mask=mask, sigmas=sigmas, nfe=steps)


def _rows(row_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return row_mask.view(-1, *([1] * (like.ndim - 1)))


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
            transition ``(b, c, i)`` exactly: ``velocity_fn(latents[b, c, i], sigmas[i], conds[c][b])``.
        nfe: velocity calls per sample (``C · T``).
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    sde_mask: torch.Tensor
    sigmas: torch.Tensor
    conds: list[Any]
    nfe: int

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
) -> ChunkedTrajectory:
    """Stateful generation chunk by chunk (a streaming video model with a KV cache), no grad.

    Chunk ``c`` is integrated from ``noise[:, c]`` over ``sigmas`` by :func:`rollout` with
    ``velocity_fn(x, sigma, cond_c)``; then ``commit_fn(x0_c, cond_c) -> cond_{c+1}`` writes its clean result into the
    model state (a separate no-grad pass, as a KV-cache write should be) for the chunks after it.

    Args:
        velocity_fn: ``velocity_fn(x, sigma, cond) -> v``.
        commit_fn: ``commit_fn(x0, cond) -> cond'``: the conditioning of the next chunk. It must not modify ``cond``
            in place: every chunk's conditioning is kept for rescoring.
        noise: ``[B, C, ...]`` initial noise of every chunk.
        sigmas: ``[T+1]`` schedule of each chunk.
        sde_mask: bool ``[T]``, ``[C, T]`` or ``[B, C, T]``.
        cond: the conditioning of the first chunk (indexable by rows, like the adapters' ``PromptEmbeds``).
        kernel, noise_level, solver, generator: as :func:`rollout`; per-sample generators continue from chunk to
            chunk.
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
    latents, log_probs, conds = [], [], []
    for c in range(chunks):
        conds.append(cond)
        traj = rollout(lambda x, sigma, cond=cond: velocity_fn(x, sigma, cond), noise[:, c], sigmas, mask[:, c],
                       kernel=kernel, noise_level=noise_level, solver=solver, generator=generator)
        latents.append(traj.latents)
        log_probs.append(traj.log_probs)
        if c + 1 < chunks:
            cond = commit_fn(traj.final, cond)
    return ChunkedTrajectory(latents=torch.stack(latents, dim=1), log_probs=torch.stack(log_probs, dim=1),
                             sde_mask=mask, sigmas=sigmas, conds=conds, nfe=chunks * steps)
