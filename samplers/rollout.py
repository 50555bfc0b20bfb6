"""The rollout engine: integrate a velocity field from noise to data, SDE on chosen steps, ODE elsewhere,
recording every state and the exact log-probability of every stochastic transition."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .solvers import dpm_solver_2m_step
from .steps import ode_step, sde_step

__all__ = ["Trajectory", "RaggedTrajectory", "rollout", "ragged_rollout", "SOLVERS", "sde_bounds"]

SOLVERS = ("euler", "dpm++2m")
VelocityFn = Callable[[torch.Tensor, float], torch.Tensor]


def sde_bounds(sde_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, last)``: per row of a bool ``[B, T]`` mask, the index of its first SDE step (``T`` when it has none)
    and of its last (``−1`` when none). The solver rules hang on them: every row is deterministic before ``first``
    (groups sharing their noise share that prefix) and DPM-Solver++ runs only after ``last``."""
    mask = torch.as_tensor(sde_mask, dtype=torch.bool)
    steps = mask.shape[-1]
    idx = torch.arange(steps, device=mask.device)
    first = torch.where(mask, idx, torch.full_like(idx, steps)).amin(dim=-1)
    last = torch.where(mask, idx, torch.full_like(idx, -1)).amax(dim=-1)
    return first, last


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
    step_noise: torch.Tensor | None = None,
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
        generator: the SDE steps draw their noise from it (a list: row ``b`` from ``generator[b]`` alone).
        step_noise: instead of a generator, the draws themselves: ``[B, T', ...]`` standard normal, step ``i``
            using ``step_noise[:, i]`` on its SDE rows (the same arithmetic as a generator's draw). ``T' ≤ T``: the
            steps from ``T'`` on must be deterministic (a stream's final jump to σ = 0 needs no draw).
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
    if step_noise is not None:
        _check_step_noise(step_noise, noise, mask, generator)
    steps_idx = torch.arange(steps, device=device)
    last_sde = sde_bounds(mask)[1]  # DPM-Solver++ runs only after a row's last SDE step

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
        eps = None if step_noise is None or i >= step_noise.shape[1] else step_noise[:, i]
        if row_sde.all():
            step = sde_step(v, x, sigma, sigma_next, kernel=kernel, noise_level=noise_level, generator=generator,
                            noise=eps)
            out, log_probs[:, i] = step.prev_sample, step.log_prob
        elif row_sde.any():
            rows = row_sde.nonzero().squeeze(1)
            gen = [generator[r] for r in rows.tolist()] if isinstance(generator, (list, tuple)) else generator
            step = sde_step(v[rows], x[rows], sigma, sigma_next, kernel=kernel, noise_level=noise_level, generator=gen,
                            noise=None if eps is None else eps[rows])
            out = out.clone()
            out[rows] = step.prev_sample
            log_probs[rows, i] = step.log_prob
        x = out
        latents.append(x)
    return Trajectory(latents=torch.stack(latents, dim=1), log_probs=log_probs, sde_mask=mask, sigmas=sigmas, nfe=steps)


def _check_step_noise(step_noise: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor, generator) -> None:
    """``step_noise`` must be ``[B, T', ...]`` (``T' ≤ T``) like ``noise``, cover every SDE step, and come alone."""
    if generator is not None:
        raise ValueError("pass step_noise or a generator to draw the SDE noise from, not both")
    batch, steps = mask.shape
    drawn = step_noise.shape[1] if step_noise.ndim > 1 else -1
    if step_noise.shape[:1] != noise.shape[:1] or step_noise.shape[2:] != noise.shape[1:] or not 0 <= drawn <= steps:
        block = ", ".join(map(str, noise.shape[1:]))
        raise ValueError(f"step_noise must be [B, T', ...] = ({batch}, ≤{steps}, {block}), "
                         f"got {tuple(step_noise.shape)}")
    if mask[:, drawn:].any():
        raise ValueError(f"step_noise holds draws for the first {drawn} steps, but a later step is an SDE step")


def _rows(row_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return row_mask.view(-1, *([1] * (like.ndim - 1)))


@dataclass
class RaggedTrajectory:
    """What :func:`ragged_rollout` records: rows on grids of their own.

    Attributes:
        latents: ``[B, T+1, ...]`` float32, ``T`` the longest grid's steps; ``latents[b, i]`` is row ``b`` at its
            ``sigmas[b][i]``; NaN past the end of a shorter grid.
        log_probs: ``[B, T]`` exact log π of each SDE transition (0 on ODE steps and past a row's end).
        lengths: ``[B]`` steps of each row's grid.
        nfe: sample-steps evaluated (a row copied from its leader, or borrowing its velocity, costs nothing).
        calls: ``velocity_fn`` calls (one per step of the longest grid, whatever the rows).
        means: with ``record_means``, ``[B, T, ...]`` float32: the mean ``μ`` of each SDE transition's Gaussian
            (``x' = μ + s·z``; what the sampling policy predicted), NaN on ODE steps; else ``None``.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    lengths: torch.Tensor
    nfe: int
    calls: int
    means: torch.Tensor | None = None

    @property
    def final(self) -> torch.Tensor:
        """Each row's last state ``[B, ...]``."""
        return self.latents[torch.arange(self.latents.shape[0]), self.lengths]


@torch.no_grad()
def ragged_rollout(
    velocity_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    noise: torch.Tensor,
    sigmas: Sequence[torch.Tensor],
    sde_mask: Sequence[torch.Tensor],
    *,
    leaders: torch.Tensor | None = None,
    kernel: str = "flow_grpo",
    noise_level: float = 0.7,
    solver: str = "euler",
    generator: list[torch.Generator] | None = None,
    record_means: bool = False,
) -> RaggedTrajectory:
    """Sample rows whose grids differ, step-synchronously: one ``velocity_fn`` call per step for every row still
    running, each at its own σ (no grad). Row by row the result is what :func:`rollout` gives on that row's grid
    and mask with the same velocities and generator (same solver rules: Euler up to a row's last SDE step,
    DPM-Solver++(2M) after it with ``solver="dpm++2m"``).

    Args:
        velocity_fn: ``velocity_fn(x, sigma, rows) -> v`` with ``sigma`` ``[b]`` float32 and ``rows`` ``[b]`` the
            batch rows being evaluated (to pick their conditioning).
        noise: ``[B, ...]`` initial states at each grid's first σ.
        sigmas: ``B`` decreasing grids (lengths may differ).
        sde_mask: ``B`` bool masks, one per grid step.
        leaders: ``[B]`` optional: row ``b`` equals row ``leaders[b]`` (same noise, conditioning, grid and ODE steps)
            until its own first SDE step ``k``, so only the leader is integrated until then, and at ``k`` row ``b``
            takes its own SDE step from the leader's state and velocity (GRPO groups sharing their initial noise: the
            deterministic prefix and the first SDE step's velocity once per group). A leader is its own leader; rows
            must agree with their leader's grid up to ``σ_{k+1}``.
        kernel, noise_level, solver: as :func:`rollout`.
        generator: one generator per row (SDE draws of a row come from its own generator in step order).
        record_means: also keep each SDE transition's mean (:attr:`RaggedTrajectory.means`; as much memory as the
            states), for updates that compare the trained policy's mean with the sampling policy's.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown ODE solver {solver!r}; choose one of {SOLVERS}")
    batch, device = noise.shape[0], noise.device
    if len(sigmas) != batch or len(sde_mask) != batch:
        raise ValueError(f"got {len(sigmas)} grids and {len(sde_mask)} masks for a batch of {batch}")
    if generator is not None and len(generator) != batch:
        raise ValueError(f"got {len(generator)} generators for a batch of {batch}")
    grids = [torch.as_tensor(s, dtype=torch.float32).cpu() for s in sigmas]
    masks = [torch.as_tensor(m, dtype=torch.bool).cpu() for m in sde_mask]
    lengths = torch.tensor([g.shape[0] - 1 for g in grids])
    for b, (g, m) in enumerate(zip(grids, masks)):
        if g.shape[0] < 2 or torch.any(g[1:] >= g[:-1]):
            raise ValueError(f"row {b}: sigmas must be strictly decreasing with at least two values")
        if m.shape != (g.shape[0] - 1,):
            raise ValueError(f"row {b}: sde_mask has {m.shape[0]} steps but its sigmas describe {g.shape[0] - 1}")
    steps_max = int(lengths.max())
    sde = torch.zeros(batch, steps_max, dtype=torch.bool)
    sig = torch.full((batch, steps_max + 1), float("nan"))
    for b, (g, m) in enumerate(zip(grids, masks)):
        sde[b, : m.shape[0]], sig[b, : g.shape[0]] = m, g
    first, last = sde_bounds(sde)
    first = first.minimum(lengths)
    lead = torch.arange(batch) if leaders is None else torch.as_tensor(leaders, dtype=torch.long).cpu()
    if lead.shape != (batch,) or torch.any(lead[lead] != lead):
        raise ValueError("leaders must map each row to a row that is its own leader")
    for b in (lead != torch.arange(batch)).nonzero().flatten().tolist():
        k, a = int(first[b]), int(lead[b])
        stop = k + 1 if k == lengths[b] else k + 2  # the grid up to the first SDE step's target σ
        if stop > lengths[a] + 1 or not torch.equal(sig[b, :stop], sig[a, :stop]) or bool(sde[a, :k].any()) \
                or not torch.equal(noise[b], noise[a]):
            raise ValueError(f"row {b} differs from its leader {a} before its first SDE step (noise, grid or an SDE "
                             "step of the leader): it cannot start from the leader's state")

    x = noise.float().clone()
    latents = torch.full((batch, steps_max + 1, *noise.shape[1:]), float("nan"), dtype=torch.float32, device=device)
    latents[:, 0] = x
    log_probs = torch.zeros(batch, steps_max, dtype=torch.float32, device=device)
    means = (torch.full((batch, steps_max, *noise.shape[1:]), float("nan"), dtype=torch.float32, device=device)
             if record_means else None)
    prev_x0 = torch.zeros_like(x) if solver == "dpm++2m" else None
    own = lead == torch.arange(batch)
    nfe = calls = 0
    for i in range(steps_max):
        alive = i < lengths
        follow = ~own & (i < first) & alive  # still a copy of its leader at this step
        borrow = ~own & (i == first) & alive  # its own SDE step from the leader's state: the leader's velocity
        run = alive & ~follow
        rows = run.nonzero().flatten()
        if rows.numel() == 0:
            continue
        s, s_next = sig[rows, i], sig[rows, i + 1]
        dev_rows = rows.to(device)
        xr = x[dev_rows]
        evaluate = ~borrow[rows]
        at = torch.full((batch,), -1, dtype=torch.long)
        at[rows] = torch.arange(rows.numel())
        computed = velocity_fn(xr[evaluate.to(device)], s[evaluate].to(device), dev_rows[evaluate.to(device)]).float()
        v = computed.new_empty(xr.shape)
        v[evaluate.to(device)] = computed
        if borrow.any():
            owners = at[lead[rows[~evaluate]]]
            if torch.any(owners < 0) or not bool(evaluate[owners].all()):
                raise RuntimeError(f"step {i}: a row's leader is not evaluated at the row's first SDE step")
            v[(~evaluate).to(device)] = v[owners.to(device)]
        nfe, calls = nfe + int(evaluate.sum()), calls + 1
        out = ode_step(v, xr, s.to(device), s_next.to(device)).prev_sample
        if solver == "dpm++2m":
            x0 = xr - s.to(device).view(-1, *([1] * (xr.ndim - 1))) * v
            use = (i > last[rows]).tolist()
            hist = ((i - 1 > last[rows]) & (i > 0)).tolist()
            keys: dict[tuple, list[int]] = {}
            for j, r in enumerate(rows.tolist()):
                if use[j]:
                    prev = float(sig[r, i - 1]) if hist[j] else None
                    keys.setdefault((float(s[j]), float(s_next[j]), prev), []).append(j)
            for (a, b_, prev), js in keys.items():  # one call per distinct step: the scalar-σ solver, bit for bit
                js_t = torch.tensor(js, device=device)
                out[js_t] = dpm_solver_2m_step(xr[js_t], x0[js_t], a, b_,
                                               prev_x0_pred=None if prev is None else prev_x0[dev_rows[js_t]],
                                               prev_sigma=prev)
            prev_x0[dev_rows] = x0
        noisy = sde[rows, i]
        if noisy.any():
            js = noisy.nonzero().flatten()
            gen = None if generator is None else [generator[int(r)] for r in rows[js].tolist()]
            step = sde_step(v[js.to(device)], xr[js.to(device)], s[js].to(device), s_next[js].to(device), kernel=kernel,
                            noise_level=noise_level, generator=gen)
            out[js.to(device)] = step.prev_sample
            log_probs[dev_rows[js.to(device)], i] = step.log_prob
            if means is not None:
                means[dev_rows[js.to(device)], i] = step.mean
        x[dev_rows] = out
        latents[dev_rows, i + 1] = out
        if follow.any():  # copies ride along with their leader
            f = follow.nonzero().flatten().to(device)
            x[f] = x[lead[follow].to(device)]
            latents[f, i + 1] = x[f]
    return RaggedTrajectory(latents=latents, log_probs=log_probs, lengths=lengths, nfe=nfe, calls=calls, means=means)
