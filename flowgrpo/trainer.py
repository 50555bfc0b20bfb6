"""The GRPO loop. One iteration is six phases, in this order and named so below:

1. **plan** — pick this iteration's prompts; the algorithm decides which steps are stochastic and trained.
2. **rollout** — G samples per prompt, batched, no grad; latents and exact log-probs recorded. The algorithm's
   :class:`~flowgrpo.rollout.Rollout` samples them (``self.rollout_engine``).
3. **score** — decode and run the reward, keeping every component.
4. **advantage** — group-relative normalisation over the *global* batch (gathered across processes).
5. **update** — the algorithm's loss (``Algorithm.loss``: PPO-clip on rescored log-probs for the GRPO family) over
   micro-batches × the steps it planned to train, one gradient accumulation spanning them, clipping, optimizer,
   EMA. The algorithm reaches the model only through :class:`~flowgrpo.context.TrainerContext` (velocity,
   reference policy, seeded generators).
6. **log / checkpoint** — scalars, galleries, atomic checkpoints. What a checkpoint holds, resuming, and the
   checkpoint an exception leaves are :class:`~flowgrpo.run_state.RunState`'s, a mixin of :class:`Trainer`.

Determinism across process counts: every random draw that shapes a sample (its prompt, initial noise, SDE
noise, the order its trained steps are visited in) comes from a generator seeded by ``(seed, iteration,
global index)`` (:mod:`flowgrpo.seeding`), never from a process-local stream, so a 2-process run equals a
1-process run with the same global batch, and a resumed run equals one that never stopped.
"""

from __future__ import annotations

import copy
import json
import math
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .advantages import RewardAggregator, advantage_stats, component_group_stats
from .algorithms import Batch, build_algorithm
from .build import (batch_plan, build_adapter, build_sampler, check_output_dir, checkpoint_bytes, model_kwargs, preflight,
                    prompt_pools)
from .checkpoint import CheckpointManager, GracefulStop, atomic_write_text
from .context import TrainerContext
from .curriculum import CGPOCurriculum
from .evaluation import EvalSamples, held_out_jobs, score_jobs
from .finetune import EMA, frozen_reference, gathers_state, prepare_trainable
from .gallery import Gallery
from .rollout import SamplingModel
from .run_state import RunState
from .runlog import log, run_log
from .seeding import ORDER_STREAM, PROMPTS_STREAM
from .seeding import seeded_generator as _gen

__all__ = ["Trainer", "Batch", "TrainerContext", "NonFiniteError"]


def available_memory(device: torch.device) -> int | None:
    """Bytes free on ``device``: the GPU's free memory, or on a CPU the host's ``MemAvailable`` (Linux); None when
    it cannot be told."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer updates were skipped (a non-finite loss or gradient norm, or an update beyond
    ``trainer.max_update_ratio``); the run stops, its weights as they were before those updates."""



def degenerate_flags(samples: torch.Tensor, max_side: int = 128) -> torch.Tensor:
    """float ``[B]``: 1 where a decoded image ``[B, 3, H, W]`` or clip ``[B, T, 3, H, W]`` is flat or pure noise
    (:func:`rewards.images.degenerate`), judged on every ``s``-th pixel so that large images stay cheap (a strided
    subsample keeps a flat image flat and noise noise)."""
    from rewards.images import degenerate

    stride = max(1, min(samples.shape[-2:]) // max_side)
    flags = degenerate(samples[..., ::stride, ::stride].detach().cpu())
    return torch.tensor([flag is not None for flag in flags], dtype=torch.float32)


class Trainer(RunState):
    """GRPO over a diffusers pipeline, configured by the composed Hydra config ``cfg`` (``conf/train.yaml``).

    Args:
        cfg: the composed, validated config.
        output_dir: the run directory (the same on every process; rank 0 chooses it, see ``flowgrpo.cli``).
        accelerator: an ``accelerate.Accelerator``; one is created from ``cfg.trainer`` when omitted.
    """

    def __init__(self, cfg: DictConfig, output_dir: str | Path, accelerator=None):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.cfg = cfg
        t = cfg.trainer
        self.out = Path(output_dir)
        self.acc = accelerator or Accelerator(mixed_precision=t.mixed_precision, cpu=not torch.cuda.is_available())
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        batch_plan(cfg, self.world)  # divisibility, before the model loads; K comes from the algorithm below
        self.device = self.acc.device
        # Reward ↔ model, output directory, prompt files and their metadata: checked before any weights load.
        checked = preflight(cfg, self.out)
        # Same global RNG on every process and in every run: LoRA initialisation draws from it.
        set_seed(t.seed)
        if torch.cuda.is_available() and t.allow_tf32:
            torch.backends.cuda.matmul.allow_tf32 = True

        # Model, trainable weights, reference, EMA.
        self.adapter = build_adapter(cfg.model, device=self.device)
        self.model_kw = model_kwargs(cfg.model)
        for module in self.adapter.pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.requires_grad_(False)
        self.unwrapped = self.adapter.pipe.transformer
        self.params = prepare_trainable(self.unwrapped, cfg.model)
        self.ref_copy = frozen_reference(self.unwrapped) if cfg.model.finetune == "full" and cfg.algo.kl_beta > 0 else None
        check_output_dir(self.out, checkpoint_bytes(sum(p.numel() for p in self.params), t.ema.enabled))

        # Sampler schedules and the algorithm (it decides the trained steps per sample, K).
        self.sampler = build_sampler(cfg.sampler, adapter=self.adapter, model=cfg.model)
        # a streaming model (flowgrpo.models.StreamAdapter) generates block by block: the plans get a chunk axis
        self.chunked = bool(getattr(self.adapter, "chunked", False))
        chunks = self.adapter.num_chunks(cfg.model.num_frames) if self.chunked else 1
        self.algorithm = build_algorithm(cfg.algo, cfg.sampler, self.sampler.sigmas, chunks=chunks)
        self.batch = batch_plan(cfg, self.world, trained_steps=self.algorithm.trained_steps())
        self._check_rollout_memory()
        # phase 2's engine, the algorithm's choice (flowgrpo.rollout): it samples through the adapter with the run's
        # guidance, noise size and autocast, and honours a stop request between its chunks of rows
        sampling = SamplingModel(self.adapter, guidance=self.model_kw["guidance"], size=self.model_kw["size"],
                                 autocast=self.acc.autocast)
        self.rollout_engine = self.algorithm.make_rollout(sampling, seed=t.seed,
                                                          batch_size=self.batch.rollout_batch_per_process,
                                                          between_chunks=lambda: self._check_stop("rollout"))
        self.policy = TrainerContext(self)
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, betas=tuple(t.adam_betas), eps=t.adam_eps,
                                           weight_decay=t.weight_decay)
        self.lr_scheduler = self._lr_scheduler()
        # accumulation spans samples × trained steps: one optimizer update per A micro-batches × K steps
        self.acc.gradient_accumulation_steps = self.batch.accumulation * max(1, self.batch.trained_steps)
        wrapped, self.optimizer = self.acc.prepare(self.unwrapped, self.optimizer)
        self.adapter.transformer = wrapped
        # FSDP2 replaces the trained parameters with sharded ones: clipping, the EMA and the algorithms use these
        self.params = [p for p in self.unwrapped.parameters() if p.requires_grad]
        self.ema = EMA(self.params, t.ema.decay) if t.ema.enabled else None

        # Reward, prompts.
        self.reward = checked.reward
        self.aggregator = None
        if cfg.reward.aggregate.name != "sum":
            if not hasattr(self.reward, "weights"):
                raise ValueError(f"reward.aggregate.name={cfg.reward.aggregate.name!r} needs a multi-component reward "
                                 f"(reward=multi); {cfg.reward.name!r} has no per-component weights")
            self.aggregator = RewardAggregator(cfg.reward.aggregate, self.reward.weights,
                                               global_std=cfg.algo.global_std, clip=cfg.algo.adv_clip)
        self.train_set, self.test_set = checked.train_set, checked.test_set
        self.prompt_pools = prompt_pools(self.train_set, cfg.data.sampling)
        self.curriculum = None
        if cfg.data.sampling == "cgpo":  # CGPO's curriculum over the GenEval tags (flowgrpo.curriculum)
            c = cfg.data.curriculum
            self.curriculum = CGPOCurriculum([m["tag"] for m in self.train_set.metadata], lam=c.lam,
                                             variance_cap=c.variance_cap, floor=c.floor, history=c.history, ema=c.ema)

        # Bookkeeping.
        self.iteration = 0
        self.updates = 0
        self.skipped_updates = 0  # optimizer updates skipped for a non-finite loss or gradient
        self._consecutive_skips = 0
        self._update_guard: bool | None = None  # the divergence check applies (decided at the first update)
        self._diverged = False  # the current weights produced non-finite samples: never checkpointed
        self.history: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []
        self.ckpt = CheckpointManager(self.out / "checkpoints", keep=t.keep_checkpoints or 10**9)
        self.gallery = None
        self.logger = None
        self._stop = None
        self._last_batch: Batch | None = None
        # Crash checkpoints: the state of the last completed iteration, taken at the start of each one (without the
        # weights), a host copy of the LoRA weights / optimizer / EMA taken before the iteration's first optimizer
        # step, and which iteration's checkpoint this process wrote last.
        self._snapshot: dict | None = None
        self._weights_snapshot: dict | None = None
        self._weights_touched = False
        self._saved: tuple[int, Path] | None = None
        self._phase: str | None = None
        self._metrics_stale = False  # a metrics.jsonl write failed: the next one rewrites the file whole
        if self.acc.is_main_process:
            from .build import build_logger

            self.logger = build_logger(cfg.logger, output_dir=self.out, config=OmegaConf.to_container(cfg, resolve=True))
            self.gallery = Gallery(self.out, wandb_run=getattr(self.logger, "run", None), max_rows=t.gallery_size)

    # ------------------------------------------------------------------ set-up helpers
    def _lr_scheduler(self):
        from diffusers.optimization import get_scheduler

        t = self.cfg.trainer
        total = t.iterations * self.batch.updates_per_iteration
        name = {"constant": "constant_with_warmup"}.get(t.lr_scheduler, t.lr_scheduler)
        return get_scheduler(name, self.optimizer, num_warmup_steps=t.warmup_updates, num_training_steps=total)

    def _print(self, *msg) -> None:
        if self.acc.is_main_process:
            log.info(" ".join(str(m) for m in msg))

    def banner(self) -> str:
        n_train = sum(p.numel() for p in self.params)
        n_all = sum(p.numel() for p in self.unwrapped.parameters())
        return "\n".join([
            self.batch.banner(),
            f"algorithm: {self.algorithm.describe()}",
            f"trainable: {n_train:,} of {n_all:,} transformer parameters ({self.cfg.model.finetune}); "
            f"reward: {self.reward_label()}; train prompts {len(self.train_set)}, held-out "
            f"{len(self.test_set) if self.test_set else 0}; output: {self.out}",
        ])

    def reward_label(self) -> str:
        """The reward's config name, or its own ``describe()`` line (name, version, settings) when it has one."""
        describe = getattr(self.reward, "describe", None)
        return describe() if callable(describe) else str(self.cfg.reward.name)

    # ------------------------------------------------------------------ conditioning
    def _encode(self, prompts: list[str], metadata: list[dict] | None = None):
        g = self.model_kw["guidance"]
        kwargs = {k: v for k, v in g.items() if k != "guidance_scale"}
        if self.chunked:  # a stream's conditioning: its segment prompts and where they switch (the metadata)
            kwargs.update(metadata=metadata, num_frames=self.cfg.model.num_frames)
        with torch.no_grad():
            return self.adapter.encode_prompts(prompts, self.model_kw["negative_prompt"],
                                               guidance_scale=g["guidance_scale"],
                                               max_sequence_length=self.model_kw["max_sequence_length"], **kwargs)

    # ------------------------------------------------------------------ 1. plan
    def plan(self, iteration: int) -> Batch:
        """This iteration's prompts (same on every process) and the algorithm's plan; keep this process's rows."""
        t, G = self.cfg.trainer, self.cfg.trainer.group_size
        N = t.prompts_per_iteration
        gen = _gen(t.seed, PROMPTS_STREAM, iteration)
        if self.curriculum is not None:  # data.sampling=cgpo: from the tables earlier iterations left
            idx = self.curriculum.draw(N, gen)
        elif len(self.prompt_pools) == 1:  # uniform over the training prompts
            idx = torch.randint(0, len(self.train_set), (N,), generator=gen).tolist()
        else:  # data.sampling=tag_balanced: a tag uniformly, then a prompt of that tag uniformly
            tags = torch.randint(0, len(self.prompt_pools), (N,), generator=gen).tolist()
            picks = torch.rand(N, generator=gen).tolist()
            idx = [self.prompt_pools[k][int(u * len(self.prompt_pools[k]))] for k, u in zip(tags, picks)]
        plan = self.algorithm.plan(N, G, generator=_gen(t.seed, PROMPTS_STREAM, iteration, 1))
        # Prompts are dealt to processes round-robin, so a group never straddles two processes.
        mine = list(range(self.rank, N, self.world))
        rows = torch.tensor([p * G + g for p in mine for g in range(G)], dtype=torch.long)
        local = self.train_set.subset([idx[p] for p in mine])
        prompts = [p for p in local.prompts for _ in range(G)]
        metadata = None if local.metadata is None else [m for m in local.metadata for _ in range(G)]
        cond = self._encode(local.prompts, local.metadata).repeat_interleave(G)
        return Batch(prompts=prompts, metadata=metadata, global_rows=rows, cond=cond, plan=plan.subset(rows),
                     extras={"prompt_ids": idx})

    # ------------------------------------------------------------------ 2. rollout
    def rollout(self, batch: Batch, iteration: int, *, trained_weights: bool = False) -> Batch:
        """Sample the batch's trajectories with the algorithm's rollout (``self.rollout_engine``, a
        :class:`~flowgrpo.rollout.Rollout`) and the weights the algorithm samples from (``Algorithm.sampling_policy``:
        the trained ones for the GRPO family; an old policy for KVPO and DiffusionNFT), or with ``trained_weights``
        the weights being trained whatever the algorithm samples with (what a diagnostic of an update's effect
        re-rolls)."""
        self.policy.iteration, self.policy.epoch = iteration, 0
        with nullcontext() if trained_weights else self.algorithm.sampling_policy(self.policy):
            return self.rollout_engine(batch, iteration)

    # ------------------------------------------------------------------ 3. score
    @torch.no_grad()
    def score(self, batch: Batch) -> Batch:
        final = self.adapter.join_chunks(batch.latents[:, :, -1]) if batch.plan.chunked else batch.latents[:, -1]
        decoded = self.adapter.decode(final).float()
        # finite latents can still decode to NaN or inf (weights that blew the latents up without making them
        # infinite): caught here, before the reward reads them (clamping would hide an inf)
        self._check_finite(decoded, self.iteration, "the decoded samples")
        batch.images = decoded.clamp(0, 1)
        out = self.reward(batch.images, batch.prompts, batch.metadata)
        batch.rewards = out.scores.to(self.device)
        batch.components = {k: v.to(self.device) for k, v in out.components.items()}
        batch.degenerate = degenerate_flags(batch.images).to(self.device)
        return batch

    # ------------------------------------------------------------------ 4. advantage
    def advantage(self, batch: Batch) -> Batch:
        """Normalise over the gathered global batch (process blocks are whole groups), keep this process's slice."""
        rewards = self.acc.gather(batch.rewards.contiguous())
        local = self.algorithm.local_advantages(batch)
        if local is not None:  # relative to something inside each group: this process's groups are whole
            adv = self.acc.gather(local.to(self.device).contiguous())
        elif self.aggregator is None:
            adv = self.algorithm.advantages(rewards, self.cfg.trainer.group_size)
        else:  # reward.aggregate: per-component advantages from the gathered components
            comps = {k: self.acc.gather(batch.components[k].contiguous()) for k in self.aggregator.weights}
            adv = self.aggregator(comps, self.cfg.trainer.group_size).to(rewards.device)
        n = len(batch.prompts)
        if self.curriculum is not None:  # the same gathered rewards on every process: the same tables everywhere
            N, G = self.cfg.trainer.prompts_per_iteration, self.cfg.trainer.group_size
            order = [p for k in range(self.world) for p in range(k, N, self.world)]  # prompts in gathered order
            self.curriculum.update([batch.extras["prompt_ids"][p] for p in order], rewards.view(N, G))
        batch.advantages = adv[self.rank * n : (self.rank + 1) * n].to(self.device)
        batch.global_rewards = rewards
        batch.global_advantages = adv
        return batch

    # ------------------------------------------------------------------ 5. update
    def transitions(self, batch: Batch, iteration: int, epoch: int) -> torch.Tensor:
        """``[n, K]`` trained step indices per row (the plan's ``train_mask``), each row's order shuffled by its own
        seeded generator: the order the update visits them in. For an algorithm with ``group_steps`` the generator
        is the group's, so the members of a group (which train the same steps) visit them together."""
        mask = batch.plan.train_mask.flatten(1)  # a chunk axis: steps are flat indices c·T' + i
        steps = torch.stack([row.nonzero().squeeze(1) for row in mask]) if len(mask) else torch.zeros(0, 0, dtype=torch.long)
        keys = batch.global_rows // batch.plan.group_size if self.algorithm.group_steps else batch.global_rows
        seed = self.cfg.trainer.seed
        order = torch.stack([torch.randperm(steps.shape[1], generator=_gen(seed, ORDER_STREAM, iteration, epoch, int(r)))
                             for r in keys])
        return torch.gather(steps, 1, order)

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        """The algorithm's loss over micro-batches × trained steps; one ``accelerate.accumulate`` spans them."""
        t = self.cfg.trainer
        micro = self.batch.train_micro_batch
        n = len(batch.prompts)
        if batch.plan.trained_per_row != self.batch.trained_steps:
            raise RuntimeError(f"the plan trains {batch.plan.trained_per_row} steps per sample but the algorithm "
                               f"announced {self.batch.trained_steps} (Algorithm.trained_steps and plan disagree)")
        stats: dict[str, list[float]] = {}
        self.adapter.transformer.train()
        self.policy.iteration = iteration
        window_finite = True  # every loss of the current accumulation window was finite
        for epoch in range(t.inner_epochs):
            self.policy.epoch = epoch
            steps = self.transitions(batch, iteration, epoch)
            for start in range(0, n, micro):
                rows = torch.arange(start, min(start + micro, n))
                for j in range(steps.shape[1]):
                    s = steps[rows, j]
                    with self.acc.accumulate(self.adapter.transformer):
                        loss, info = self.algorithm.loss(self.policy, batch, rows, s)
                        window_finite &= bool(torch.isfinite(loss.detach()))
                        self.acc.backward(loss)
                        info = {k: float(v) for k, v in info.items()}
                        if self.acc.sync_gradients:
                            info["grad_norm"] = self._clip()
                            # fp16's GradScaler skips overflowing steps itself (and lowers its scale): there only a
                            # non-finite loss counts here
                            finite_grad = math.isfinite(info["grad_norm"]) or self.acc.scaler is not None
                            if self._agree_finite(window_finite and finite_grad):
                                self._before_weights_change()
                                before = self._pre_step_copy()
                                self.optimizer.step()
                                ratio = self._undo_if_diverged(before)
                                if ratio is None:
                                    self._consecutive_skips = 0
                                    self.lr_scheduler.step()
                                    self.updates += 1
                                    if self.ema is not None and self.updates % t.ema.update_every == 0:
                                        self.ema.update()
                                else:  # rolled back: the weights are as they were before the step
                                    info["update_ratio"] = ratio
                                    self._skip_update(iteration, info["grad_norm"], ratio)
                            else:  # a non-finite loss or gradient: the weights stay as they were
                                self._skip_update(iteration, info["grad_norm"])
                            window_finite = True
                        self.optimizer.zero_grad(set_to_none=True)
                    info["loss"] = float(loss.detach())
                    for k, v in info.items():
                        stats.setdefault(k, []).append(v)
        self.adapter.transformer.eval()
        out = {f"train/{k}": sum(v) / len(v) for k, v in stats.items()}
        out["train/lr"] = self.lr_scheduler.get_last_lr()[0]
        out["train/skipped_updates"] = self.skipped_updates
        return out

    def _agree_finite(self, finite: bool) -> bool:
        """Whether every process saw a finite accumulation window (the gradient norm is already global; a local
        non-finite loss with finite gradients is not), so all of them skip or step together."""
        if self.world == 1:
            return finite
        flag = torch.tensor([0.0 if finite else 1.0], device=self.device)
        return bool(self.acc.reduce(flag, reduction="sum").item() == 0)

    def _skip_update(self, iteration: int, grad_norm: float, ratio: float | None = None) -> None:
        """Count a skipped optimizer update — its loss or gradient was not finite, or (``ratio``) it moved the trained
        weights by ``ratio`` times their norm, beyond ``trainer.max_update_ratio``, and was rolled back; stop the run
        after ``trainer.max_skipped_updates`` in a row (the weights, and so every checkpoint, stay as before)."""
        self.skipped_updates += 1
        self._consecutive_skips += 1
        limit = self.cfg.trainer.max_skipped_updates
        why = (f"non-finite loss or gradient norm ({grad_norm})" if ratio is None else
               f"the update moved the trained weights by {ratio:.3g} times their norm (trainer.max_update_ratio="
               f"{self.cfg.trainer.max_update_ratio}; gradient norm {grad_norm:.3g}), a divergence: rolled back")
        self._print(f"iteration {iteration + 1}: {why}; update skipped "
                    f"({self._consecutive_skips} in a row, {self.skipped_updates} in all)")
        if self._consecutive_skips >= limit:
            # the skipped steps left the weights as they were: the crash checkpoint of the last completed iteration
            # (written as this error propagates) holds weights from before them, and is the one to resume from
            raise NonFiniteError(
                f"{self._consecutive_skips} optimizer updates in a row were skipped, the last for {why} "
                f"(iteration {iteration + 1}; trainer.max_skipped_updates={limit}); the weights were not changed by "
                "them. Lower trainer.lr (a resume with another trainer.lr also needs trainer.resume_force=true), "
                "check the reward and the data, or raise trainer.max_skipped_updates.")

    def _pre_step_copy(self) -> dict | None:
        """What an optimizer step may have to be undone to: copies of the trained LoRA weights and the optimizer
        state (small), when ``trainer.max_update_ratio`` is set. Full fine-tuning (a copy would cost the model's size
        again) and FSDP (sharded weights) run without the check."""
        if self._update_guard is None:  # LoRA on one process or under DDP (replicated weights)
            t = self.cfg.trainer
            self._update_guard = (t.max_update_ratio is not None and self.cfg.model.finetune == "lora"
                                  and not gathers_state(self.acc))
        if not self._update_guard:
            return None
        return {"params": [p.detach().clone() for p in self.params],
                "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def _undo_if_diverged(self, before: dict | None) -> float | None:
        """None when the step stays; else the ratio ``||Δθ|| / ||θ||`` of the step just taken, which exceeded
        ``trainer.max_update_ratio`` or is not finite, after putting the weights and the optimizer back."""
        if before is None:
            return None
        with torch.no_grad():
            old = torch.sqrt(sum(c.double().pow(2).sum() for c in before["params"]))
            moved = torch.sqrt(sum((p.detach().double() - c.double()).pow(2).sum()
                                   for p, c in zip(self.params, before["params"])))
            ratio = float(moved / old.clamp_min(1e-12))
        if math.isfinite(ratio) and ratio <= self.cfg.trainer.max_update_ratio:
            return None
        with torch.no_grad():
            for p, c in zip(self.params, before["params"]):
                p.copy_(c)
        self.optimizer.load_state_dict(before["optimizer"])
        return ratio if math.isfinite(ratio) else float("inf")

    def _clip(self) -> float:
        max_norm = self.cfg.trainer.max_grad_norm
        norm = self.acc.clip_grad_norm_(self.params, max_norm if max_norm is not None else float("inf"))
        return float(norm)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, tag: str = "eval") -> dict[str, float]:
        """Held-out evaluation with :mod:`flowgrpo.evaluation`'s protocol (``scripts/eval_geneval.py`` runs the same):
        a deterministic ODE (``sampler.eval_num_steps``) with CFG from fixed seeds (``trainer.eval_samples_per_prompt``
        per prompt, raised to at least ``trainer.eval_samples_per_tag`` per tag; sample j of prompt i seeded by
        ``(trainer.eval_seed, i, j)``, so runs with different ``trainer.seed`` are judged on the same images), with EMA
        weights when enabled. The (prompt, seed) jobs are dealt round-robin over processes and the scores gathered
        back into job order, so any number of processes scores the same samples as one.

        Returns the mean over samples of the reward and of each component (``{tag}/reward``, ``{tag}/<component>``)
        and, for a GenEval reward (bare or inside ``reward=multi``), GenEval's overall score: the mean over tags of
        the per-tag means (``{tag}/[prefix/]geneval``, ``{tag}/[prefix/]geneval_partial``), so tags weigh equally
        whatever their prompt counts.
        """
        if self.test_set is None:
            return {}
        jobs = self.eval_jobs()
        first = []

        def keep_first(start, prompts, images, out):  # the gallery shows the main process's first batch
            if start == 0:
                first.append((prompts, images, out))

        # inside the loop a stop request abandons the evaluation between its batches (Trainer._Abandon)
        result = self.held_out_samples(jobs, on_batch=keep_first,
                                       between_batches=lambda: self._check_stop("evaluation")).scalars(tag)
        if self.gallery is not None and first:
            prompts, images, out = first[0]
            self._gallery_log(self.iteration, prompts, images, rewards=out.scores, components=out.components, tag=tag)
        return result

    def eval_jobs(self) -> list:
        """The held-out ``(prompt, sample)`` jobs :meth:`evaluate` scores (``trainer.eval_*``)."""
        t = self.cfg.trainer
        return held_out_jobs(self.test_set, t.eval_samples_per_prompt, t.eval_samples_per_tag,
                             num_prompts=t.eval_num_prompts)

    def held_out_key(self, jobs: list) -> str:
        """A hash of what :meth:`held_out_samples` reads besides the weights: the model, reward and held-out data,
        the jobs and their seed, the evaluation schedule, the rollout batch and the precision. Two trainers with
        equal keys and equal weights (e.g. both untrained, whatever their algorithm or ``trainer.seed``) score the
        same samples, so a tool comparing runs can score an untrained model once."""
        import hashlib

        def plain(node):
            return OmegaConf.to_container(node, resolve=True)

        what = {"model": plain(self.cfg.model), "reward": plain(self.cfg.reward), "data": plain(self.cfg.data),
                "jobs": [list(j) for j in jobs], "eval_seed": self.cfg.trainer.eval_seed,
                "sigmas": self.sampler.eval_sigmas.tolist(), "batch": self.batch.rollout_batch_per_process,
                "mixed_precision": self.cfg.trainer.mixed_precision}
        if getattr(self.reward, "version", None) is not None:  # the same config under other rules scores otherwise
            what["reward_version"] = self.reward.version
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def held_out_samples(self, jobs: list, on_batch=None, between_batches=None) -> EvalSamples:
        """Every held-out ``(prompt, sample)`` job of ``jobs`` generated and scored as :meth:`evaluate` does (its
        seeds, sampler, EMA weights when enabled), dealt over the processes and gathered back in job order: the
        per-sample scores behind its means. ``on_batch`` sees this process's batches, ``between_batches`` is called
        before each of them after the first (``score_jobs``; every process runs as many batches)."""
        t = self.cfg.trainer
        # every process runs the same number of jobs (a gather needs equal shapes): padding repeats the last job and
        # is dropped after the gather
        per_proc = math.ceil(len(jobs) / self.world)
        mine = list(range(self.rank, per_proc * self.world, self.world))
        with self.ema.swapped_in() if self.ema is not None else nullcontext():
            local = score_jobs(self.adapter, self.reward, self.test_set, [jobs[min(k, len(jobs) - 1)] for k in mine],
                               seed=t.eval_seed, sigmas=self.sampler.eval_sigmas, model_kw=self.model_kw,
                               batch_size=self.batch.rollout_batch_per_process, autocast=self.acc.autocast,
                               on_batch=on_batch, between_batches=between_batches)
        index = self.acc.gather(torch.tensor([k if k < len(jobs) else -1 for k in mine], device=self.device))
        valid = index >= 0
        position = torch.empty(len(jobs), dtype=torch.long, device=self.device)  # gathered row of each job
        position[index[valid]] = valid.nonzero().flatten()

        def gathered(v: torch.Tensor) -> torch.Tensor:
            return self.acc.gather(v.to(self.device).contiguous())[position]

        return EvalSamples(jobs=jobs, prompts=self.test_set.subset([i for i, _ in jobs]),
                           scores=gathered(local.scores),
                           components={k: gathered(v) for k, v in local.components.items()})

    # ------------------------------------------------------------------ the loop
    def step(self) -> dict[str, float]:
        """One full iteration (phases 1–5); returns its scalars. ``self.iteration`` advances at the end."""
        it = self.iteration
        timings: dict[str, float] = {}
        self._snapshot = self._light_state()  # the last completed iteration, for a crash checkpoint
        self._weights_snapshot, self._weights_touched = None, False

        def timed(name, fn, *a):
            self._phase = name
            t0 = time.perf_counter()
            result = fn(*a)
            timings[f"time/{name}"] = time.perf_counter() - t0
            return result

        batch = timed("plan", self.plan, it)
        self._check_stop("plan")
        batch = timed("rollout", self.rollout, batch, it)
        self._check_finite_rollout(batch, it)
        self._check_stop("rollout")
        batch = timed("score", self.score, batch)
        batch = timed("advantage", self.advantage, batch)
        self._check_stop("score")
        train = timed("update", self.update, batch, it)
        self.algorithm.end_iteration(self.policy)
        self.iteration += 1
        self._last_batch = batch
        scalars = self._scalars(batch, train, timings)
        return scalars

    class _Abandon(Exception):
        pass

    def rollout_bytes(self) -> int:
        """What one iteration's rollouts keep on one process: every state of every trajectory (float32; twice with
        an algorithm that records the SDE means) and the decoded samples the reward reads."""
        m, c = self.batch.rollouts_per_process, self.cfg.model
        frames = c.get("num_frames")
        latent_adapter = self.adapter.frames if self.chunked else self.adapter
        latent = math.prod(latent_adapter._latent_shape(1, c.height, c.width, frames)[1:])
        states = (int(self.cfg.sampler.num_steps) + 1) * (2 if self.algorithm.records_means else 1)
        pixels = 3 * c.height * c.width * (frames or 1)
        return 4 * m * (states * latent + pixels)

    def _check_rollout_memory(self, available: int | None = None) -> None:
        """Refuse, before the first rollout, a batch whose trajectories cannot fit: more than 80% of the memory
        left on the device (host RAM on a CPU), with the numbers and the keys that set them."""
        if available is None:
            available = available_memory(self.device)
        if available is None:
            return
        need = self.rollout_bytes()
        if need <= 0.8 * available:
            return
        t = self.cfg.trainer
        gib = 2 ** 30
        raise MemoryError(
            f"one iteration's rollouts keep {need / gib:.1f} GiB on each process ({self.batch.rollouts_per_process} "
            f"samples = trainer.prompts_per_iteration={t.prompts_per_iteration} x trainer.group_size={t.group_size}"
            f"{f' / {self.world} processes' if self.world > 1 else ''}, {int(self.cfg.sampler.num_steps) + 1} states "
            f"each at sampler.num_steps={self.cfg.sampler.num_steps}, plus the decoded samples), but only "
            f"{available / gib:.1f} GiB is available on {self.device}. Lower trainer.group_size or "
            "trainer.prompts_per_iteration, or use more processes.")

    def _check_finite_rollout(self, batch: Batch, iteration: int) -> None:
        """Samples that are not finite mean the weights that drew them have diverged: stop here, before a reward
        reads NaN pixels, and keep no checkpoint of those weights (``_crash_checkpoint``; one already on disk is
        marked and never resumed from)."""
        final = batch.latents[:, :, -1] if batch.plan.chunked else batch.latents[:, -1]
        self._check_finite(final, iteration, "the rollout's samples")

    def _check_finite(self, samples: torch.Tensor, iteration: int, what: str) -> None:
        """``NonFiniteError`` when a row of ``samples`` (final latents, or the decoded images or clips) is not finite,
        on every process together; after an update the weights are taken for diverged (see
        :meth:`_check_finite_rollout`)."""
        bad = int((~torch.isfinite(samples.reshape(samples.shape[0], -1)).all(dim=1)).sum())
        if self.world > 1:  # every process stops together
            bad = int(self.acc.reduce(torch.tensor([float(bad)], device=self.device), reduction="sum").item())
        if not bad:
            return
        self._diverged = True
        older = [path for step, path in self.ckpt.checkpoints() if step < iteration]
        if not iteration:  # nothing was trained yet: the model itself, or its precision, is the fault
            raise NonFiniteError(
                f"iteration 1: {bad} of {what} are not finite before any update: check model.pretrained "
                f"({self.cfg.model.pretrained}) and the precision (model.torch_dtype, model.vae_dtype, "
                "trainer.mixed_precision). No checkpoint is written.")
        raise NonFiniteError(
            f"iteration {iteration + 1}: {bad} of {what} are not finite: the weights after iteration {iteration} "
            f"have diverged. No checkpoint of them is kept for resuming; the newest checkpoint from before them: "
            f"{older[-1] if older else 'none'}. Lower trainer.lr or trainer.max_update_ratio, or check the data.")

    def _stop_requested(self) -> bool:
        """Whether any process got SIGTERM/SIGINT (signals reach ranks at different moments: they agree first)."""
        if self._stop is None:
            return False
        requested = self._stop.requested
        if self.world > 1:
            flag = torch.tensor([float(requested)], device=self.device)
            requested = bool(self.acc.reduce(flag, reduction="sum").item() > 0)
        return requested

    def _check_stop(self, phase: str) -> None:
        if self._stop_requested():
            raise Trainer._Abandon(phase)

    def _scalars(self, batch: Batch, train: dict, timings: dict) -> dict[str, float]:
        rewards = batch.global_rewards
        out = {"iteration": self.iteration, "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std())}
        gathered = {}
        for k, v in batch.components.items():
            g = gathered[k] = self.acc.gather(v.contiguous())
            out[f"reward/{k}"] = float(torch.nanmean(g)) if torch.any(~torch.isnan(g)) else float("nan")
        if batch.degenerate is not None:  # a collapsing model (all black, flat, noise) shows here first
            out["reward/degenerate_fraction"] = float(self.acc.gather(batch.degenerate.contiguous()).mean())
        weighted = list(getattr(self.reward, "weights", None) or ())  # reward=multi: how saturated each term is
        if weighted:
            out.update({f"groups/{k}": v for k, v in
                        component_group_stats(gathered, weighted, self.cfg.trainer.group_size).items()})
        out.update({f"adv/{k}": v for k, v in advantage_stats(batch.global_advantages, rewards,
                                                              self.cfg.trainer.group_size).items()})
        if self.aggregator is not None:
            out.update({f"{self.aggregator.name}/{k}": v for k, v in self.aggregator.diagnostics().items()})
        if self.curriculum is not None:
            out.update({f"curriculum/{k}": v for k, v in self.curriculum.diagnostics().items()})
        out.update(train)
        out.update(timings)
        out["time/iteration"] = sum(timings.values())
        nfe = self.acc.gather(torch.tensor([batch.nfe], device=self.device)).sum()
        out["nfe/rollout"] = float(nfe)
        out["updates"] = self.updates
        return out

    def fit(self) -> dict[str, Any]:
        """Run (or resume) the whole training; returns a summary with the evaluations. What it reports also goes
        to ``train.log`` in the run dir (main process), with the traceback of an exception that ends it."""
        with run_log(self.out, main=self.acc.is_main_process):
            return self._fit()

    def _fit(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        t = self.cfg.trainer
        self._stop = None
        self.maybe_resume()
        self._print(self.banner())
        # metrics.jsonl: rewritten from the (restored) history, then one line per iteration / evaluation as they
        # happen, so a crash or a kill loses nothing that was measured
        self._metrics_path = self.out / "metrics.jsonl"
        if self.acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            self._append_metrics(None)
        if t.eval_before and self.iteration == 0 and not self.evals:
            self._record_eval()
        bar = tqdm(total=t.iterations, initial=self.iteration, disable=not self.acc.is_main_process,
                   desc=self.algorithm.name, dynamic_ncols=True)
        stopped, light = None, None
        # An exception in here (reward server down, OOM, a bug) checkpoints the last completed iteration and writes
        # summary.json with the error before it propagates (_on_crash).
        with self._crash_guard(bar), GracefulStop() as stop:
            self._stop = stop
            while self.iteration < t.iterations:
                try:
                    scalars = self.step()
                except Trainer._Abandon as phase:
                    stopped = f"stop requested during {phase}; iteration {self.iteration + 1} abandoned"
                    light = self._snapshot  # the weights have not moved; the rest is as the iteration began
                    break
                self._snapshot = None
                self.history.append(scalars)
                self._append_metrics(scalars)
                bar.update(1)
                bar.set_postfix(reward=f"{scalars['reward/mean']:.3f}")
                if self.logger is not None and self.iteration % t.log_every == 0:
                    self.logger.log(scalars, step=self.iteration)
                if self.gallery is not None and t.gallery_every and self.iteration % t.gallery_every == 0:
                    b = self._last_batch
                    columns = {**b.components, **self.algorithm.gallery_columns(b)}
                    self._gallery_log(self.iteration, b.prompts, b.images, rewards=b.rewards, components=columns,
                                      advantages=b.advantages, group_size=t.group_size, tag="train",  # all its prompts
                                      notes=self.algorithm.gallery_notes(b), marks=self.algorithm.gallery_marks(b))
                last = self.iteration == t.iterations
                if t.eval_every and self.iteration % t.eval_every == 0 and not (last and t.eval_at_end):
                    if not self._record_eval():
                        stopped = f"stop requested during the evaluation after iteration {self.iteration}; abandoned"
                        break
                if self._stop_requested():
                    stopped = "stop requested; finished the iteration"
                    break
                if t.checkpoint_every and self.iteration % t.checkpoint_every == 0 and not last:
                    self.save_checkpoint()
            # the final evaluation still honours a stop request: the checkpoint below is written either way
            if stopped is None and t.eval_at_end and not self._record_eval():
                stopped = "stop requested during the final evaluation; abandoned (a resume runs it)"
        bar.close()
        with self._crash_guard(bar):
            path = self.save_checkpoint(light)
        self._snapshot = None
        summary = self.summary(path, stopped)
        if self.logger is not None:
            self.logger.finish()
        return summary

    def _io_warning(self, what: str, err: OSError) -> None:
        where = f" ({err.filename})" if getattr(err, "filename", None) else ""
        warnings.warn(f"could not write {what}{where}: {err.strerror or err}; the run goes on", RuntimeWarning,
                      stacklevel=3)

    def _gallery_log(self, step: int, *args, **kwargs) -> None:
        """``Gallery.log``; a filesystem error (disk full, ...) is a warning: a gallery is not worth the run."""
        try:
            self.gallery.log(step, *args, **kwargs)
        except OSError as err:
            tag = kwargs.get("tag", "train")
            self._io_warning(f"the {tag} gallery of iteration {step} under {self.out / 'gallery'}", err)

    def _append_metrics(self, row: dict | None) -> None:
        """Append ``row`` to metrics.jsonl; ``None``, or after a failed write, rewrite it whole from the history and
        evaluations. A filesystem error (disk full, ...) is a warning: the rows stay in memory and in checkpoints,
        and the next write that succeeds rewrites the file."""
        path = getattr(self, "_metrics_path", None)
        if path is not None and self.acc.is_main_process:
            try:
                if row is None or self._metrics_stale:
                    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in self.history + self.evals))
                else:
                    with open(path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                self._metrics_stale = False
            except OSError as err:
                self._metrics_stale = True
                self._io_warning(str(path), err)

    def _record_eval(self) -> bool:
        """Evaluate and record the result; False when a stop request abandoned the evaluation (nothing recorded)."""
        try:
            result = self.evaluate()
        except Trainer._Abandon:
            return False
        if not result:
            return True
        result["iteration"] = self.iteration
        self.evals.append(result)
        self._append_metrics(result)
        if self.logger is not None:
            self.logger.log(result, step=self.iteration)
        self._print("eval @ {}: ".format(self.iteration) + ", ".join(
            f"{k.split('/', 1)[1]}={v:.3f}" for k, v in result.items() if k.startswith("eval/") and "/" not in k[5:]))
        return True

    def summary(self, checkpoint: Path | None, stopped: str | None) -> dict[str, Any]:
        first, last = (self.evals[0], self.evals[-1]) if self.evals else ({}, {})
        summary = {"iterations": self.iteration, "updates": self.updates, "skipped_updates": self.skipped_updates,
                   "checkpoint": str(checkpoint) if checkpoint else None,
                   "stopped": stopped, "eval_first": first, "eval_last": last}
        if self.acc.is_main_process:
            lines = [f"done: {self.iteration} iterations, {self.updates} optimizer updates" + (f" ({stopped})" if stopped else "")]
            for key in sorted(k for k in last if k.startswith("eval/") and k.count("/") == 1):
                if key in first:  # a component undefined on every sample (NaN) has no change to report
                    change = last[key] - first[key]
                    lines.append(f"  {key}: {first[key]:.3f} → {last[key]:.3f}" + (f" ({change:+.3f})" if math.isfinite(change) else ""))
            if checkpoint:
                lines.append(f"  checkpoint: {checkpoint}")
            log.info("\n".join(lines))
        return summary
