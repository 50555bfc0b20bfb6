"""Phase 2 of the loop, the rollout: sample a batch's trajectories for its plan.

A :class:`Rollout` is called as ``rollout(batch, iteration)``: it fills ``batch.latents``, ``batch.log_probs``,
``batch.final`` (each row's clean sample, or its clean chunks) and ``batch.nfe`` (and, where its options or its kind
say so, ``batch.means``, ``batch.chunk_conds`` with ``batch.chunk_rows``, and ``batch.extras``) with no gradient, and
returns the batch. The trainer calls it inside the algorithm's sampling policy
(:meth:`~flowgrpo.algorithms.Algorithm.sampling_policy`), so a rollout never chooses its weights.

Which rollout runs is the algorithm's choice (:meth:`~flowgrpo.algorithms.Algorithm.make_rollout`):

- :class:`PlanRollout`, the default, integrates the plan as it stands: ``plan.sde_mask``'s steps on the plan's
  kernel, the others with its ODE solver, rows batched in chunks of the rollout batch size. Its options are what an
  algorithm declares: ``shared_noise`` (one initial noise per group, whose deterministic prefix is then integrated
  once per prompt) and ``record_means`` (each SDE step's mean, for a ratio that reads it). A plan with
  ``tail_ratio < 1`` ends every row on its own compressed tail. A streaming model's plan (a chunk axis) is
  integrated block by block.
- an algorithm that samples in a way of its own returns a :class:`Rollout` subclass of its own (routed branches of
  a stream, for one).

Every rollout reaches the model through a :class:`SamplingModel` (the adapter with the run's guidance, noise size
and autocast) and draws from generators keyed by ``(trainer.seed, stream, iteration, global index)``
(:mod:`flowgrpo.seeding`), so the same batch samples the same trajectories on any number of processes.

>>> rollout = algorithm.make_rollout(SamplingModel(adapter, guidance=..., size=...),
...                                  seed=0, batch_size=8)                          # doctest: +SKIP
>>> batch = rollout(batch, iteration)                                               # doctest: +SKIP

An update reads what a rollout stored through :class:`StoredTransitions`: the states of some trained steps and the
velocity there under the conditioning each was sampled with, whatever the batch's chunk layout.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, ContextManager

import torch

from samplers import chunked_rollout, ragged_rollout

from .offload import HostCopy
from .seeding import NOISE_STREAM, SDE_STREAM, seeded_generator

if TYPE_CHECKING:
    from .algorithms.base import Batch

__all__ = ["SamplingModel", "Rollout", "PlanRollout", "StoredTransitions"]


class SamplingModel:
    """What a rollout samples through: the model adapter called with the run's guidance and under its autocast, and
    the size of its initial noise.

    Args:
        adapter: the model adapter (``flowgrpo.models``); its transformer is whatever weights are live when a
            velocity is called.
        guidance: the velocity's guidance keywords (``guidance_scale`` and the family's own;
            ``flowgrpo.builders.model_kwargs``' ``guidance``).
        size: ``prepare_noise``'s size keywords (``height``, ``width``, ``num_frames``).
        autocast: a context factory every velocity call runs in (``accelerator.autocast``).
    """

    def __init__(self, adapter, *, guidance: dict, size: dict,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext):
        self.adapter = adapter
        self.guidance = guidance
        self.size = size
        self.autocast = autocast

    def velocity_fn(self, cond, *, guidance: dict | None = None):
        """``velocity(x, sigma)`` under ``cond``; with ``cond=None``, ``velocity(x, sigma, cond)`` (a chunked
        rollout passes each chunk's conditioning). ``guidance`` replaces the run's guidance keywords."""
        guidance = self.guidance if guidance is None else guidance

        def velocity(x, sigma, chunk_cond=None):
            with self.autocast():
                return self.adapter.velocity(x, sigma, cond if chunk_cond is None else chunk_cond, **guidance)

        return velocity

    def noise(self, batch_size: int, generator, **kwargs) -> torch.Tensor:
        """``batch_size`` initial noises in the model's layout (``prepare_noise``: ``generator`` one per sample, or
        one per group with ``group_size=`` and ``shared=True``)."""
        return self.adapter.prepare_noise(batch_size, generator=generator, **kwargs, **self.size)


class Rollout:
    """Phase 2: ``rollout(batch, iteration)`` samples ``batch``'s trajectories for ``batch.plan`` (the module
    docstring says what it fills).

    Args:
        model: what it samples through (:class:`SamplingModel`).
        seed: the run's seed (``trainer.seed``): every draw is keyed by it.
        batch_size: samples per batched forward on this process (``BatchPlan.rollout_batch_per_process``).
        between_chunks: called before each chunk of rows after the first; raising there abandons the rollout
            (the trainer honours a stop request so).
        offload_context: keep the conditioning an update rescores under (a streaming model's KV caches) in host
            memory until the update reads it (``trainer.offload_kept_context``; :mod:`flowgrpo.offload`).
    """

    def __init__(self, model: SamplingModel, *, seed: int, batch_size: int,
                 between_chunks: Callable[[], None] | None = None, offload_context: bool = False):
        self.model = model
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.between_chunks = between_chunks
        self.offload_context = bool(offload_context)

    def __call__(self, batch: "Batch", iteration: int) -> "Batch":
        raise NotImplementedError

    def _next_chunk(self) -> None:
        if self.between_chunks is not None:
            self.between_chunks()


class PlanRollout(Rollout):
    """The default rollout: the plan's SDE and ODE steps, rows batched (``samplers.ragged_rollout``), or block by
    block for a streaming model's plan (``samplers.chunked_rollout``).

    Args:
        shared_noise: the members of a group start from one noise (``algo.shared_noise``); they are identical up to
            their first SDE step, so that prefix is integrated once per prompt and copied to the members.
        record_means: keep each SDE step's mean under the sampling policy (``Batch.means``; an algorithm that
            declares ``Needs.record_means``).
        model, seed, batch_size, between_chunks: :class:`Rollout`'s.
    """

    def __init__(self, model: SamplingModel, *, shared_noise: bool = False, record_means: bool = False, **kwargs):
        super().__init__(model, **kwargs)
        self.shared_noise = bool(shared_noise)
        self.record_means = bool(record_means)

    def _noise(self, n_groups: int, group_keys: list[int], rows_per_group: int, shared: bool,
               stream: tuple) -> torch.Tensor:
        if shared:
            gens = [seeded_generator(*stream, k) for k in group_keys]
            return self.model.noise(n_groups * rows_per_group, gens, group_size=rows_per_group, shared=True)
        gens = [seeded_generator(*stream, k * rows_per_group + j) for k in group_keys for j in range(rows_per_group)]
        return self.model.noise(n_groups * rows_per_group, gens)

    @torch.no_grad()
    def __call__(self, batch: "Batch", iteration: int) -> "Batch":
        """Sample the batch's trajectories in chunks of the rollout batch size.

        Rows are stepped together (``samplers.ragged_rollout``): one batched velocity call per step over every row
        still running, each at its own σ. When a group shares its initial noise (``shared_noise``), its members are
        identical up to their first SDE step, so that deterministic prefix is integrated once per prompt and then
        copied to the G members. With ``plan.tail_ratio < 1`` each row ends on its own compressed tail: the states
        up to one after its last SDE step are on the plan's grid, the final sample goes to the last index and the
        states in between, never visited, are NaN (``RolloutPlan.tail_ratio``).
        """
        plan = batch.plan
        G = plan.group_size
        n = len(batch.prompts)
        shared = self.shared_noise
        group_ids = (batch.global_rows // G)[::G].tolist()
        noise = self._noise(len(group_ids), group_ids, G, shared, (self.seed, NOISE_STREAM, iteration))
        sde_gens = [seeded_generator(self.seed, SDE_STREAM, iteration, int(r)) for r in batch.global_rows]
        if plan.sde_mask.ndim == 3:  # a chunk axis: a streaming model's blocks
            if self.record_means:
                raise ValueError("the algorithm records each SDE step's mean, which the streaming rollout does "
                                 "not: choose an algorithm for a streaming model")
            return self._sample_chunked(batch, noise, sde_gens)
        steps = plan.num_steps
        latents = torch.empty(n, steps + 1, *noise.shape[1:], dtype=torch.float32, device=noise.device)
        log_probs = torch.zeros(n, steps, dtype=torch.float32, device=noise.device)
        record = self.record_means
        means = (torch.full((n, steps, *noise.shape[1:]), float("nan"), dtype=torch.float32, device=noise.device)
                 if record else None)
        nfe = 0
        chunk = self.batch_size  # a chunk may split a group: its part in each chunk integrates the prefix once
        last = plan.last_sde_step() if plan.tail_ratio < 1 else None
        velocity = self.model.velocity_fn(None)
        for start in range(0, n, chunk):
            if start:
                self._next_chunk()  # a stop request is honoured between chunks, not after the whole batch
            rows = torch.arange(start, min(start + chunk, n))
            # each row on its grid: the plan's, or with a compressed tail the plan's up to one after its last SDE
            # step, then its own tail; every step is one batched call over the rows still running
            grids = [plan.sigmas if last is None else plan.row_sigmas(int(last[r])) for r in rows.tolist()]
            masks = [plan.sde_mask[r, : g.shape[0] - 1] for r, g in zip(rows.tolist(), grids)]
            # a group's ODE prefix once per chunk, by its first row in the chunk
            leaders = (torch.clamp(rows // G * G, min=start) - start) if shared else None
            traj = ragged_rollout(lambda x, sigma, sub, rows=rows: velocity(x, sigma, batch.cond[rows[sub.cpu()]]),
                                  noise[rows], grids, masks, leaders=leaders, kernel=plan.kernel,
                                  noise_level=plan.noise_level, solver=plan.solver,
                                  generator=[sde_gens[r] for r in rows.tolist()], record_means=record)
            nfe += traj.nfe
            final = traj.final  # gathered once: the property indexes the whole chunk
            for j, r in enumerate(rows.tolist()):
                m = int(traj.lengths[j])
                if m == steps:
                    latents[r], log_probs[r] = traj.latents[j, : steps + 1], traj.log_probs[j, :steps]
                    if record:
                        means[r] = traj.means[j, :steps]
                else:  # the states up to one after the last SDE step are on the plan's grid; then NaN, the final
                    l = int(last[r])
                    latents[r, : l + 2], latents[r, l + 2:steps] = traj.latents[j, : l + 2], float("nan")
                    latents[r, steps] = final[j]
                    log_probs[r, : l + 1] = traj.log_probs[j, : l + 1]
                    if record:
                        means[r, : l + 1] = traj.means[j, : l + 1]
        batch.latents, batch.log_probs, batch.means, batch.nfe = latents, log_probs, means, nfe
        batch.final = latents[:, -1]
        return batch

    def _sample_chunked(self, batch: "Batch", noise: torch.Tensor, sde_gens: list[torch.Generator]) -> "Batch":
        """A streaming model's rollout (``samplers.chunked_rollout``): block after block, each written into the
        model's cache by ``adapter.commit``. The update rescores a trained transition under the context it was
        sampled with, so a block's conditioning (text and KV cache) is kept for the rows that train a step of that
        block, and only for them (``batch.chunk_conds[c]`` over the rows ``batch.chunk_rows[c]`` names): every
        block's cache of every stream would cost a cache per block. With ``offload_context`` what is kept waits in
        host memory (:func:`flowgrpo.offload.to_host`)."""
        plan = batch.plan
        n = len(batch.prompts)
        chunk = self.batch_size
        trains = plan.train_mask.any(-1)  # [n, C]: does row r train a step of block c
        latents, log_probs, conds = [], [], []
        nfe = 0
        for start in range(0, n, chunk):
            if start:
                self._next_chunk()
            rows = torch.arange(start, min(start + chunk, n))

            def keep(c, cond, rows=rows):
                kept = trains[rows, c].nonzero().squeeze(1)
                if kept.numel() == 0:
                    return None
                cond = cond if kept.numel() == len(rows) else cond[kept]
                return rows[kept], HostCopy.of(cond) if self.offload_context else cond

            traj = chunked_rollout(self.model.velocity_fn(None), self.model.adapter.commit, noise[rows],
                                   plan.sigmas, plan.sde_mask[rows], cond=batch.cond[rows], kernel=plan.kernel,
                                   noise_level=plan.noise_level, solver=plan.solver,
                                   generator=[sde_gens[r] for r in rows.tolist()], keep_cond=keep)
            latents.append(traj.latents)
            log_probs.append(traj.log_probs)
            conds.append(traj.conds)
            nfe += traj.nfe * len(rows)
        batch.latents, batch.log_probs, batch.nfe = torch.cat(latents), torch.cat(log_probs), nfe
        batch.final = batch.latents[:, :, -1]
        batch.chunk_conds, batch.chunk_rows = [], []
        for c in range(plan.num_chunks):
            parts = [part[c] for part in conds if part[c] is not None]
            index = torch.full((n,), -1, dtype=torch.long)
            if not parts:
                batch.chunk_conds.append(None)
            else:
                kept = torch.cat([r for r, _ in parts])
                index[kept] = torch.arange(len(kept))
                batch.chunk_conds.append(parts[0][1] if len(parts) == 1 else type(parts[0][1]).cat([k for _, k in parts]))
            batch.chunk_rows.append(index)
        return batch


class StoredTransitions:
    """Stored transitions ``(rows, steps)`` of a rolled-out batch, as an update reads them, whatever the batch's chunk
    layout: an image or a clip is one chunk; a streaming model's row is ``C`` blocks, and a flat trained-step index
    ``c·T' + i`` is block ``c``'s step ``i`` (``RolloutPlan.chunk_step``), sampled under block ``c``'s conditioning
    (``batch.chunk_conds[c]``, the text and the cache the blocks before it wrote).

    Attributes:
        rows, steps: ``[b]`` rows of the batch and their steps within a chunk; chunks: ``[b]`` their chunks.
        x, x_next: ``[b, ...]`` the state before and after each step; sigma, sigma_next: ``[b]`` their noise levels.

    >>> t = StoredTransitions(batch, rows, steps)                                 # doctest: +SKIP
    >>> v = t.velocity(ctx.velocity)                                              # doctest: +SKIP
    """

    def __init__(self, batch: "Batch", rows: torch.Tensor, steps: torch.Tensor):
        plan = batch.plan
        self._batch = batch
        self.rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        self.chunks, self.steps = plan.chunk_step(steps)
        if batch.latents is None:
            raise ValueError("the batch holds no states (batch.latents): roll it out first")
        if plan.sde_mask.ndim == 3:
            self.x = batch.latents[self.rows, self.chunks, self.steps]
            self.x_next = batch.latents[self.rows, self.chunks, self.steps + 1]
        else:
            self.x, self.x_next = batch.latents[self.rows, self.steps], batch.latents[self.rows, self.steps + 1]
        self.sigma = plan.sigmas[self.steps].to(self.x.device)
        self.sigma_next = plan.sigmas[self.steps + 1].to(self.x.device)

    def velocity(self, velocity: Callable, x: torch.Tensor | None = None) -> torch.Tensor:
        """``velocity(x, sigma, cond)`` at the stored states (or at ``x``, states of the same rows and levels), each
        under the conditioning its row and chunk were sampled with: one call for an unchunked batch, one per chunk
        present otherwise (a streaming model's blocks do not batch across cache states)."""
        x = self.x if x is None else x
        batch = self._batch
        if batch.plan.sde_mask.ndim == 2:
            return velocity(x, self.sigma, batch.cond[self.rows])
        v = None
        for c in self.chunks.unique().tolist():
            sel = (self.chunks == c).nonzero().squeeze(1)
            rows = self.rows[sel]
            if batch.chunk_rows is not None:  # the rollout kept block c's conditioning for some rows only
                rows = batch.chunk_rows[c][rows]
                if bool((rows < 0).any()):
                    raise ValueError(f"block {c}'s conditioning was not kept for rows "
                                     f"{self.rows[sel][rows < 0].tolist()}: the rollout keeps it for the rows that "
                                     "train a step of the block (plan.train_mask)")
            cond = batch.chunk_conds[c][rows]
            if isinstance(cond, HostCopy):  # kept in host memory by an offloading rollout: brought back for the call
                cond = cond.to(x.device)
            part = velocity(x[sel], self.sigma[sel], cond)
            if v is None:
                v = part.new_empty(x.shape)
            v[sel] = part
        return v
