"""The GRPO loop. One iteration is six phases, in this order and named so below:

1. **plan** — pick this iteration's prompts; the algorithm decides which steps are stochastic and trained.
2. **rollout** — G samples per prompt, batched, no grad; latents and exact log-probs recorded. The algorithm's
   :class:`~flowgrpo.rollout.Rollout` samples them (``self.rollout_engine``).
3. **score** — decode and run the reward, keeping every component.
4. **advantage** — the algorithm's (``Algorithm.advantages``, its one owner) from the rewards of the *global* batch
   (gathered across processes); then the prompt curriculum, where there is one, learns from those rewards.
5. **update** — the algorithm's loss (``Algorithm.loss``: PPO-clip on rescored log-probs for the GRPO family) over
   micro-batches × the steps it planned to train, one gradient accumulation spanning them, clipping, optimizer,
   EMA. The algorithm reaches the model only through :class:`~flowgrpo.context.TrainerContext` (velocity,
   reference policy, seeded generators).
6. **log / checkpoint** — scalars, galleries, held-out evaluations (:class:`~flowgrpo.held_out.HeldOut`), atomic
   checkpoints, resuming (:class:`~flowgrpo.run_state.RunState`), run guards (:class:`~flowgrpo.guards.Guards`).

Determinism across process counts: every random draw that shapes a sample (its prompt, initial noise, SDE
noise, the order its trained steps are visited in) comes from a generator seeded by ``(seed, iteration,
global index)`` (:mod:`flowgrpo.seeding`), never from a process-local stream, so a 2-process run equals a
1-process run with the same global batch, and a resumed run equals one that never stopped.
"""

from __future__ import annotations

import math
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .advantages import advantage_stats, component_group_stats
from .algorithms import Batch, Scores, build_algorithm
from .builders import (batch_plan, build_adapter, build_aggregator, build_logger, build_sampler, check_output_dir,
                    checkpoint_bytes, model_kwargs, preflight, prompt_pools)
from .checkpoint import CheckpointManager, GracefulStop, atomic_write_text
from .context import TrainerContext
from .curriculum import CGPOCurriculum
from .finetune import EMA, frozen_reference, prepare_trainable
from .gallery import Gallery
from .guards import Guards, NonFiniteError, degenerate_flags
from .held_out import HeldOut
from .jsonio import dumps  # metrics.jsonl: strict JSON (NaN / inf as null)
from .rollout import SamplingModel
from .run_state import RunState
from .runlog import bar_paused, log, run_log
from .seeding import ORDER_STREAM, PROMPTS_STREAM
from .seeding import seeded_generator as _gen
from .train_metrics import train_scalars

__all__ = ["Trainer", "Batch", "TrainerContext", "NonFiniteError", "degenerate_flags"]


class Trainer(RunState, HeldOut, Guards):
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
        check_output_dir(self.out, checkpoint_bytes(sum(p.numel() for p in self.params), t.ema.enabled))

        # the reward, and for reward.aggregate its aggregator, handed to the algorithm (phase 4 is the algorithm's)
        self.reward = checked.reward
        self.aggregator = build_aggregator(cfg, self.reward)
        # Sampler schedules and the algorithm (it decides the trained steps per sample, K, and declares its needs).
        self.sampler = build_sampler(cfg.sampler, adapter=self.adapter, model=cfg.model)
        # the chunks a sample is generated in (an image or a clip: one; a streaming model's video: its blocks)
        chunks = self.adapter.num_chunks(cfg.model.num_frames)
        self.algorithm = build_algorithm(cfg.algo, cfg.sampler, self.sampler.sigmas, chunks=chunks,
                                         aggregator=self.aggregator)
        # a fully fine-tuned model keeps a frozen copy as the reference, for an algorithm that declares it needs one
        self.ref_copy = (frozen_reference(self.unwrapped)
                         if cfg.model.finetune == "full" and self.algorithm.needs.reference else None)
        self.batch = batch_plan(cfg, self.world, trained_steps=self.algorithm.trained_steps())
        self._check_rollout_memory()
        # phase 2's engine, the algorithm's choice (flowgrpo.rollout): it samples through the adapter with the run's
        # guidance, noise size and autocast, and honours a stop request between its chunks of rows
        sampling = SamplingModel(self.adapter, guidance=self.model_kw["guidance"], size=self.model_kw["size"],
                                 autocast=self.acc.autocast)
        self.rollout_engine = self.algorithm.make_rollout(
            sampling, seed=t.seed, batch_size=self.batch.rollout_batch_per_process,
            between_chunks=lambda: self._check_stop("rollout"), offload_context=t.offload_kept_context)
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

        # Prompts.
        self.train_set, self.val_set = checked.train_set, checked.val_set
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
            self.logger = build_logger(cfg.logger, output_dir=self.out, config=OmegaConf.to_container(cfg, resolve=True))
            self.gallery = Gallery(self.out, logger=self.logger, max_rows=t.gallery_size, fps=cfg.logger.fps)

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
            f"reward: {self.reward_label()}; train prompts {len(self.train_set)}, validation "
            f"{len(self.val_set) if self.val_set else 0}; output: {self.out}",
        ])

    def reward_label(self) -> str:
        """The reward's config name, or its own ``describe()`` line (name, version, settings) when it has one."""
        describe = getattr(self.reward, "describe", None)
        return describe() if callable(describe) else str(self.cfg.reward.name)

    # ------------------------------------------------------------------ conditioning
    def _encode(self, prompts: list[str], metadata: list[dict] | None = None):
        g = self.model_kw["guidance"]
        kwargs = {k: v for k, v in g.items() if k != "guidance_scale"}
        # a stream's conditioning is its segment prompts and where they switch (the metadata); one chunk's, the prompt
        kwargs.update(metadata=metadata, num_frames=self.cfg.model.num_frames)
        with torch.no_grad():
            return self.adapter.encode_prompts(prompts, self.model_kw["negative_prompt"],
                                               guidance_scale=g["guidance_scale"],
                                               max_sequence_length=self.model_kw["max_sequence_length"], **kwargs)

    # ------------------------------------------------------------------ the loop: step (1–5), log_and_checkpoint (6)
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
        self._bar = bar = tqdm(total=t.iterations, initial=self.iteration, disable=not self.acc.is_main_process,
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
                bar.update(1)
                bar.set_postfix(reward=f"{scalars['reward/mean']:.3f}")
                stopped = self.log_and_checkpoint(scalars)  # 6. log / checkpoint
                if stopped is not None:
                    break
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
        self.learn_curriculum(batch)
        self._check_stop("score")
        train = timed("update", self.update, batch, it)
        self.algorithm.end_iteration(self.policy)
        self.iteration += 1
        self._last_batch = batch
        return self._scalars(batch, train, timings)

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
        the trained ones, or an old policy of the algorithm's own), or with ``trained_weights``
        the weights being trained whatever the algorithm samples with (what a diagnostic of an update's effect
        re-rolls)."""
        self.policy.iteration, self.policy.epoch = iteration, 0
        with nullcontext() if trained_weights else self.algorithm.sampling_policy(self.policy):
            return self.rollout_engine(batch, iteration)

    # ------------------------------------------------------------------ 3. score
    @torch.no_grad()
    def score(self, batch: Batch) -> Batch:
        decoded = self.adapter.decode(self.adapter.join_chunks(batch.final)).float()
        # finite latents can still decode to NaN or inf (weights that blew the latents up without making them
        # infinite): caught here, before the reward reads them (clamping would hide an inf)
        self._check_finite(decoded, self.iteration, "the decoded samples")
        batch.images = decoded.clamp_(0, 1)  # in place: long videos are held once (the decode returns a new tensor)
        out = self.reward(batch.images, batch.prompts, batch.metadata)
        batch.rewards = out.scores.to(self.device)
        batch.components = {k: v.to(self.device) for k, v in out.components.items()}
        batch.degenerate = degenerate_flags(batch.images).to(self.device)
        # scored: from here on only the gallery reads the pixels, after the update, so they wait on the host (the
        # decoded videos of a long-stream preset would otherwise hold tens of GiB of the GPU through the update)
        batch.images = batch.images.cpu()
        return batch

    # ------------------------------------------------------------------ 4. advantage
    def advantage(self, batch: Batch) -> Batch:
        """The algorithm's advantages of the whole batch (``Algorithm.advantages`` on the gathered :class:`Scores`;
        process blocks are whole groups); keep this process's slice."""
        scores = Scores(batch, gather=self.acc.gather)
        adv = self.algorithm.advantages(scores)
        n = len(batch.prompts)
        batch.advantages = adv[self.rank * n : (self.rank + 1) * n].to(self.device)
        batch.global_rewards = scores.rewards
        batch.global_advantages = adv
        return batch

    def learn_curriculum(self, batch: Batch) -> None:
        """``data.sampling=cgpo``: the curriculum's tables learn this iteration's gathered rewards (the same on every
        process: the same tables everywhere), for the prompts later iterations draw."""
        if self.curriculum is None:
            return
        N, G = self.cfg.trainer.prompts_per_iteration, self.cfg.trainer.group_size
        order = [p for k in range(self.world) for p in range(k, N, self.world)]  # prompts in gathered order
        self.curriculum.update([batch.extras["prompt_ids"][p] for p in order], batch.global_rewards.view(N, G))

    # ------------------------------------------------------------------ 5. update
    def transitions(self, batch: Batch, iteration: int, epoch: int) -> torch.Tensor:
        """``[n, K]`` trained step indices per row (the plan's ``train_mask``), each row's order shuffled by its own
        seeded generator: the order the update visits them in. For an algorithm that needs ``whole_groups`` the
        generator is the group's, so the members of a group (which train the same steps) visit them together."""
        mask = batch.plan.train_mask.flatten(1)  # a chunk axis: steps are flat indices c·T' + i
        steps = torch.stack([row.nonzero().squeeze(1) for row in mask]) if len(mask) else torch.zeros(0, 0, dtype=torch.long)
        keys = batch.global_rows // batch.plan.group_size if self.algorithm.needs.whole_groups else batch.global_rows
        seed = self.cfg.trainer.seed
        order = torch.stack([torch.randperm(steps.shape[1], generator=_gen(seed, ORDER_STREAM, iteration, epoch, int(r)))
                             for r in keys])
        return torch.gather(steps, 1, order)

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        """The algorithm's loss over micro-batches × trained steps (one ``accelerate.accumulate`` spans them)."""
        t = self.cfg.trainer
        micro = self.batch.train_micro_batch
        n = len(batch.prompts)
        if batch.plan.trained_per_row != self.batch.trained_steps:
            raise RuntimeError(f"the plan trains {batch.plan.trained_per_row} steps per sample but the algorithm "
                               f"announced {self.batch.trained_steps} (Algorithm.trained_steps and plan disagree)")
        infos: list[dict[str, float]] = []  # one per micro-batch × trained step (× inner epoch), in the order run
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
                                before = self._pre_step_copy()
                                self._before_weights_change(before)
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
                    infos.append(info)
        self.adapter.transformer.eval()
        # the whole global batch's train/* scalars, not this process's share: every process's infos gathered
        gather = None if self.world == 1 else lambda t: self.acc.gather(t.to(self.device)).view(self.world, -1).cpu()
        out = {f"train/{k}": v for k, v in train_scalars(infos, gather).items()}
        out["train/lr"] = self.lr_scheduler.get_last_lr()[0]
        out["train/skipped_updates"] = self.skipped_updates
        return out

    def _clip(self) -> float:
        max_norm = self.cfg.trainer.max_grad_norm
        norm = self.acc.clip_grad_norm_(self.params, max_norm if max_norm is not None else float("inf"))
        return float(norm)

    # ------------------------------------------------------------------ 6. log / checkpoint (checkpoints: RunState)
    def _scalars(self, batch: Batch, train: dict, timings: dict) -> dict[str, float]:
        rewards = batch.global_rewards
        out = {"iteration": self.iteration, "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std())}
        gathered = {}
        for k, v in batch.components.items():
            g = gathered[k] = self.acc.gather(v.contiguous())
            out[f"reward/{k}"] = float(torch.nanmean(g)) if torch.any(~torch.isnan(g)) else float("nan")
        if batch.degenerate is not None:  # a collapsing model (all black, flat, noise) shows here first
            out["reward/degenerate_fraction"] = float(self.acc.gather(batch.degenerate.contiguous()).mean())
        weighted = list(getattr(self.reward, "weights", None) or ())  # reward=multi: each term's spread and Hoyer
        if weighted:  # index, and how closely the final advantage follows it
            stats = component_group_stats(gathered, weighted, self.cfg.trainer.group_size, batch.global_advantages)
            out.update({f"groups/{k}": v for k, v in stats.items()})
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

    def log_and_checkpoint(self, scalars: dict[str, float]) -> str | None:
        """Phase 6 after an iteration: its scalars to the history, metrics.jsonl and the logger, the training gallery,
        the evaluations ``trainer.eval_every`` asks for, and a checkpoint every ``trainer.checkpoint_every``
        iterations. Returns why the run stops here (a stop request), or None."""
        t = self.cfg.trainer
        self.history.append(scalars)
        self._append_metrics(scalars)
        if self.logger is not None and self.iteration % t.log_every == 0:
            self.logger.log(scalars, step=self.iteration)
        if self.gallery is not None and t.gallery_every and self.iteration % t.gallery_every == 0:
            b = self._last_batch
            shown = self.algorithm.gallery(b)
            self._gallery_log(self.iteration, b.prompts, b.images, rewards=b.rewards,
                              components={**b.components, **shown.columns}, advantages=b.advantages,
                              group_size=t.group_size, tag="train",  # all its prompts
                              notes=shown.notes, marks=shown.marks)
        last = self.iteration == t.iterations
        if t.eval_every and self.iteration % t.eval_every == 0 and not (last and t.eval_at_end):
            if not self._record_eval():
                return f"stop requested during the evaluation after iteration {self.iteration}; abandoned"
        if self._stop_requested():
            return "stop requested; finished the iteration"
        if t.checkpoint_every and self.iteration % t.checkpoint_every == 0 and not last:
            self.save_checkpoint()
        return None

    def _record_eval(self) -> bool:
        """Evaluate and record the result; False when a stop request abandoned the evaluation (nothing recorded)."""
        try:
            with bar_paused(getattr(self, "_bar", None)):  # the iteration bar's s/it leaves evaluations out
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

    def _append_metrics(self, row: dict | None) -> None:
        """Append ``row`` to metrics.jsonl; ``None``, or after a failed write, rewrite it whole from the history and
        evaluations. A filesystem error (disk full, ...) is a warning: the rows stay in memory and in checkpoints,
        and the next write that succeeds rewrites the file. Strict JSON: NaN / inf values are written as null."""
        path = getattr(self, "_metrics_path", None)
        if path is not None and self.acc.is_main_process:
            try:
                if row is None or self._metrics_stale:
                    atomic_write_text(path, "".join(dumps(r) + "\n" for r in self.history + self.evals))
                else:
                    with open(path, "a") as f:
                        f.write(dumps(row) + "\n")
                self._metrics_stale = False
            except OSError as err:
                self._metrics_stale = True
                self._io_warning(str(path), err)

    def _gallery_log(self, step: int, *args, **kwargs) -> None:
        """``Gallery.log``; a filesystem error (disk full, ...) is a warning: a gallery is not worth the run."""
        try:
            self.gallery.log(step, *args, **kwargs)
        except OSError as err:
            tag = kwargs.get("tag", "train")
            self._io_warning(f"the {tag} gallery of iteration {step} under {self.out / 'gallery'}", err)

    def _io_warning(self, what: str, err: OSError) -> None:
        where = f" ({err.filename})" if getattr(err, "filename", None) else ""
        warnings.warn(f"could not write {what}{where}: {err.strerror or err}; the run goes on", RuntimeWarning,
                      stacklevel=3)

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
