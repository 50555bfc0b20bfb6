"""KVPO's rollout: each prompt's unrouted reference run, and its branches forked from it with routed context
(:class:`BranchedRollout`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from samplers import chunked_rollout, stream_sde_mask

from ...offload import HostCopy
from ...rollout import Rollout, SamplingModel
from ...seeding import ALGO_STREAM, seeded_generator
from ..base import Batch
from .routing import stacked_route_fn

if TYPE_CHECKING:
    from .algorithm import KVPO

__all__ = ["BranchedRollout"]


class BranchedRollout(Rollout):
    """KVPO's rollout (:meth:`KVPO.make_rollout`): each group's reference run (its last row) streams the whole video
    unrouted; its ``G`` branches start from its state at the group's fork block and continue with the same noise
    draws, routed during the plan's blocks. So every branch's blocks before the fork are the reference run's
    (copied, computed once) and a branch differs from it only by what its routed blocks attended (and, after the
    fork, by the float rounding of another batch).

    A group whose routing plan has ``G' < G`` distinct selections (a small pool, :func:`plan_routing`) streams its
    first ``G'`` branches only; its other branch rows keep the reference run's blocks and weigh nothing
    (``extras["active_branch"]``: the rows streamed as branches).

    With ``algo.branch_source=noise`` (the control of routing) the branches fork at the same block and stream the
    same blocks after it, all under the unrouted context; each draws fresh noise (initial and re-noise draws) in the
    plan's ``P`` blocks from the fork, where a routed branch attends its own frames, and shares the group's noise in
    every other block, as a routed branch does. Every branch streams (the plan's selections are not used).

    With ``algo.local_reward=blocks`` each row's metadata (a copy) names its group's routed pixel frames as its
    ``window``, which the long-video reward scores on their own (``window/<name>``).

    Records every block's step inputs (``latents``) and clean predictions (``extras["x0"]``), and each group's
    state before its fork (``extras["fork_cond"]``: the replay starts there; in host memory with
    ``offload_context``). Only those states are kept, not one per block: at Wan2.1-1.3B size a block's KV cache is
    gigabytes. Branches stream ``algo.branch_batch`` at a time
    (each holds a KV cache).

    The velocity is the one the update replays with (the training guidance, ``Needs.training_guidance``), so a
    branch's replay under its own routing reproduces what it recorded. The draws (routing plans, initial noise and
    re-noise) come from the generators an update context gives at inner epoch 0,
    ``(trainer.seed, ALGO_STREAM, iteration, 0, prompt index, k)``; a noise branch ``g``'s own draws
    ``(..., prompt index, 2, g)``.

    Args:
        algorithm: the :class:`KVPO` whose plans it samples (its routing options and ``routing_plan``).
        model, seed, batch_size, between_chunks, offload_context: :class:`~flowgrpo.rollout.Rollout`'s (the
            branches are batched by ``algo.branch_batch``, not ``batch_size``).
    """

    def __init__(self, algorithm: "KVPO", model: SamplingModel, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.algorithm = algorithm

    def _stream(self):
        adapter = self.model.adapter
        if not callable(getattr(adapter, "stream_layout", None)):
            raise TypeError(f"{type(adapter).__name__} is not a streaming model (model.family=causal_wan)")
        return adapter

    def layout(self) -> dict[str, Any]:
        """The streaming model's geometry (``adapter.stream_layout()``): ``block_frames``, ``sink_frames``,
        ``window_frames``, ``cache_frames``, ``recache``."""
        return self._stream().stream_layout()

    def _generator(self, iteration: int, *keys: int) -> torch.Generator:
        return seeded_generator(self.seed, ALGO_STREAM, iteration, 0, *keys)

    @torch.no_grad()
    def __call__(self, batch: Batch, iteration: int) -> Batch:
        algo = self.algorithm
        adapter = self._stream()
        plan = batch.plan
        G1 = plan.group_size
        G = G1 - 1
        layout = self.layout()
        if layout["window_frames"] is None:
            raise ValueError("algo=kvpo routes the frames outside a block's window: the model needs a window "
                             "(model.stream.window_frames)")
        training = algo.rollout_guidance()  # KVPO: the guidance its update replays with
        velocity_of = self.model.velocity_fn(None, guidance=None if training else {"guidance_scale": 1.0})
        n = len(batch.prompts)
        groups = n // G1
        K, S = algo.num_chunks, algo.num_steps
        segments = batch.cond.segments
        routed = algo.cfg.branch_source == "routed"
        plans, forks, streamed = [], [], []
        for p in range(groups):
            gid = int(batch.global_rows[p * G1]) // G1
            # the draw depends on the run's seed, the iteration and the prompt's global index alone
            seed = int(torch.randint(2**31 - 1, (1,), generator=self._generator(iteration, gid, 1)))
            rp = algo.routing_plan(layout, segments[p * G1].tolist(), num_branches=G, seed=seed,
                                   iteration=int(iteration), prompt_index=gid)
            plans.append(rp)
            forks.append(rp.fork_frame // layout["block_frames"])
            if routed:  # as many branches as distinct selections (noise branches need none)
                algo.note_short(rp)
            streamed.append(min(G, rp.num_branches) if routed else G)
        if algo.cfg.local_reward == "blocks":  # the reward also scores each group's routed frames (window/<name>)
            if batch.metadata is None:
                raise ValueError("algo.local_reward=blocks scores the routed frames named in each stream's metadata; "
                                 "the batch has none (data: a streams JSONL)")
            t = adapter.temporal_factor  # latent frame f holds pixel frames t·f - t + 1 .. t·f (frame 0: pixel 0)
            batch.metadata = [{**m, "window": [max(0, t * plans[r // G1].fork_frame - t + 1),
                                               t * (plans[r // G1].end_frame - 1) + 1]}
                              for r, m in enumerate(batch.metadata)]
        # common random numbers: one draw of every noise per prompt, for all its rows
        gens = [self._generator(iteration, int(batch.global_rows[p * G1]) // G1, 0) for p in range(groups)]
        noise = self.model.noise(len(gens), gens)  # [groups, K, C, F, h, w]
        renoise = torch.stack([torch.randn((K, S - 1, *noise.shape[2:]), generator=g) for g in gens]).to(noise.device)
        own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # noise branches: row -> its draws in its P blocks
        if not routed:
            for p in range(groups):
                P = min(plans[p].blocks, K - forks[p])
                for g in range(G):
                    gen = self._generator(iteration, int(batch.global_rows[p * G1]) // G1, 2, g)
                    own[p * G1 + g] = (torch.randn((P, *noise.shape[2:]), generator=gen).to(noise.device),
                                       torch.randn((P, S - 1, *noise.shape[2:]), generator=gen).to(noise.device))

        def draws(rows: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
            """Block ``k``'s initial noise and re-noise draws of branch ``rows``: the group's, or a noise branch's own
            in its ``P`` blocks from the fork."""
            groups_of = torch.tensor([r // G1 for r in rows])
            x, z = noise[groups_of, k:k + 1], renoise[groups_of, k:k + 1]  # copies (indexed)
            for i, r in enumerate(rows):
                if r in own and 0 <= k - forks[r // G1] < len(own[r][0]):
                    x[i, 0], z[i, 0] = own[r][0][k - forks[r // G1]], own[r][1][k - forks[r // G1]]
            return x, z
        # Self-Forcing's sampler, recording each step's clean prediction (the TVE replay compares against them)
        sample = dict(sigmas=plan.sigmas, sde_mask=stream_sde_mask(S), kernel="cps", noise_level=1.0, record_x0=True)

        # the reference runs, one per group, unrouted from the first block to the last; their state is kept at the
        # blocks where some group forks
        ref_rows = torch.arange(groups) * G1 + G
        ref = chunked_rollout(velocity_of, adapter.commit, noise, cond=batch.cond[ref_rows], step_noise=renoise,
                              keep_cond=lambda k, cond: cond if k in forks else None, **sample)
        at_fork = {k: ref.conds[k] for k in set(forks)}
        latents = ref.latents.repeat_interleave(G1, 0)  # every row starts as its reference run ...
        x0 = ref.x0.repeat_interleave(G1, 0)
        log_probs = ref.log_probs.repeat_interleave(G1, 0)
        # ... and the branches take over from their fork, block by block, at most algo.branch_batch rows at a time
        # (each holds a KV cache); within a chunk, rows join at their own group's fork, so each call makes one block
        # and the write pass after it is this loop's
        order = sorted((p * G1 + g for p in range(groups) for g in range(streamed[p])),
                       key=lambda r: (forks[r // G1], r))
        size = algo.cfg.branch_batch or len(order)
        for chunk in (order[i:i + size] for i in range(0, len(order), size)):
            active: list[int] = []  # branch rows being streamed, in the order of `cond`
            cond = None
            for k in range(forks[chunk[0] // G1], K):
                joining = [r for r in chunk if forks[r // G1] == k]
                if joining:
                    start = at_fork[k][torch.tensor([r // G1 for r in joining])]
                    cond = start if cond is None else type(start).cat([cond, start])
                    active += joining
                idx = torch.tensor(active)
                route = (stacked_route_fn([plans[r // G1] for r in active], [r % G1 for r in active]) if routed
                         else None)  # noise branches: the unrouted context

                def velocity(x, sigma, cond):
                    with adapter.wan.routed(route):
                        return velocity_of(x, sigma, cond)

                def commit(x0_k, cond):
                    with adapter.wan.routed(route):
                        return adapter.commit(x0_k, cond)

                x_k, z_k = draws(active, k)
                part = chunked_rollout(velocity, commit, x_k, cond=cond, step_noise=z_k, keep_cond=False, **sample)
                latents[idx, k], x0[idx, k], log_probs[idx, k] = part.latents[:, 0], part.x0[:, 0], part.log_probs[:, 0]
                if k + 1 < K:
                    cond = commit(part.final[:, 0], cond)
        batch.latents, batch.log_probs = latents, log_probs
        batch.final = batch.latents[:, :, -1]
        batch.chunk_conds = None
        keep = HostCopy.of if self.offload_context else (lambda cond: cond)  # the replay's start, for the update
        batch.nfe = (groups * K + sum(b * (K - f) for b, f in zip(streamed, forks))) * S
        fork_rows = torch.tensor([forks[r // G1] for r in range(n)], dtype=torch.long)
        active_rows = torch.tensor([r % G1 < streamed[r // G1] for r in range(n)], dtype=torch.bool)
        batch.extras.update({"x0": x0, "routing": plans, "fork_block": fork_rows, "active_branch": active_rows,
                             "branch_source": algo.cfg.branch_source,
                             "fork_segment": segments[torch.arange(n), fork_rows],
                             "fork_cond": [keep(at_fork[f][p]) for p, f in enumerate(forks)],
                             "temporal_factor": adapter.temporal_factor})
        return batch

