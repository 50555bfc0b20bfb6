"""The trainer's held-out evaluation: :mod:`flowgrpo.evaluation`'s protocol (fixed seeds, a deterministic ODE, the
EMA weights when enabled) over the trainer's processes, reward and held-out prompts.

:class:`HeldOut` is a mixin of :class:`~flowgrpo.trainer.Trainer`: :meth:`HeldOut.evaluate` is what the loop records
(``trainer.eval_*``); :meth:`HeldOut.held_out_samples` gives the per-sample scores behind its means and
:meth:`HeldOut.held_out_key` what they depend on besides the weights (``scripts/`` compare runs with them).

What the mixin reads from its trainer: ``cfg``, ``acc``, ``device``, ``rank``, ``world``, ``adapter``, ``reward``,
``val_set``, ``sampler``, ``batch``, ``model_kw``, ``ema``, ``gallery``, ``iteration``, ``_check_stop``,
``_gallery_log``.
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from .evaluation import EVAL_STREAM, EvalSamples, gallery_jobs, held_out_jobs, score_jobs

__all__ = ["HeldOut"]


def _dealt(jobs: int, rank: int, world: int) -> list[int]:
    """The job indices process ``rank`` of ``world`` runs, round-robin; past ``jobs - 1`` they are padding (every
    process runs as many jobs, so that a gather has equal shapes)."""
    return list(range(rank, math.ceil(jobs / world) * world, world))


class HeldOut:
    """Held-out evaluation of a :class:`~flowgrpo.trainer.Trainer` (a mixin: see the module's docstring for what it
    reads)."""

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
        if self.val_set is None:
            return {}
        jobs = self.eval_jobs()
        # the gallery (main process) shows some of the jobs this process generates, spread over tags and prompts
        mine = [k for k in _dealt(len(jobs), self.rank, self.world) if k < len(jobs)]
        shown = (set(gallery_jobs(jobs, self.val_set, self.gallery.max_rows, among=mine)) if self.gallery is not None
                 else set())
        kept = {}

        def keep_shown(start, prompts, images, out):  # reads the batch; the scores are computed as without it
            for p in range(start, start + len(prompts)):
                if p < len(mine) and mine[p] in shown:
                    r = p - start
                    kept[mine[p]] = (prompts[r], images[r].detach().cpu(), out.scores[r].detach().cpu(),
                                     {k: v[r].detach().cpu() for k, v in out.components.items()})

        # inside the loop a stop request abandons the evaluation between its batches (Trainer._Abandon)
        result = self.held_out_samples(jobs, on_batch=keep_shown if shown else None,
                                       between_batches=lambda: self._check_stop("evaluation")).scalars(tag)
        if self.gallery is not None and kept:
            rows = [kept[k] for k in sorted(kept)]
            self._gallery_log(self.iteration, [r[0] for r in rows], torch.stack([r[1] for r in rows]),
                              rewards=torch.stack([r[2] for r in rows]),
                              components={k: torch.stack([r[3][k] for r in rows]) for k in rows[0][3]}, tag=tag)
        return result

    def eval_jobs(self) -> list:
        """The held-out ``(prompt, sample)`` jobs :meth:`evaluate` scores (``trainer.eval_*``)."""
        t = self.cfg.trainer
        return held_out_jobs(self.val_set, t.eval_samples_per_prompt, t.eval_samples_per_tag,
                             num_prompts=t.eval_num_prompts)

    def held_out_key(self, jobs: list, stream: int = EVAL_STREAM) -> str:
        """A hash of what :meth:`held_out_samples` reads besides the weights: the model, reward and held-out data,
        the jobs and their seed, the evaluation schedule, the rollout batch and the precision. Two trainers with
        equal keys and equal weights (e.g. both untrained, whatever their algorithm or ``trainer.seed``) score the
        same samples, so a tool comparing runs can score an untrained model once."""
        import hashlib

        def plain(node):
            return OmegaConf.to_container(node, resolve=True)

        what = {"model": plain(self.cfg.model), "reward": plain(self.cfg.reward), "data": plain(self.cfg.data),
                "jobs": [list(j) for j in jobs], "eval_seed": self.cfg.trainer.eval_seed, "stream": stream,
                "sigmas": self.sampler.eval_sigmas.tolist(), "batch": self.batch.rollout_batch_per_process,
                "mixed_precision": self.cfg.trainer.mixed_precision}
        if getattr(self.reward, "version", None) is not None:  # the same config under other rules scores otherwise
            what["reward_version"] = self.reward.version
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def held_out_samples(self, jobs: list, on_batch=None, between_batches=None, prompts=None,
                         stream: int = EVAL_STREAM) -> EvalSamples:
        """Every held-out ``(prompt, sample)`` job of ``jobs`` generated and scored as :meth:`evaluate` does (its
        seeds, sampler, EMA weights when enabled), dealt over the processes and gathered back in job order: the
        per-sample scores behind its means. ``on_batch`` sees this process's batches, ``between_batches`` is called
        before each of them after the first (``score_jobs``; every process runs as many batches). A progress bar
        counts the main process's samples on a terminal (none on another process, or when the output is not one).
        ``prompts`` and ``stream`` default to the validation set and its noise; the reporting command passes the
        test set and ``TEST_STREAM``."""
        prompts = self.val_set if prompts is None else prompts
        t = self.cfg.trainer
        # every process runs the same number of jobs (a gather needs equal shapes): padding repeats the last job and
        # is dropped after the gather
        mine = _dealt(len(jobs), self.rank, self.world)
        bar = tqdm(total=len(mine), desc=f"held-out evaluation @ {self.iteration}", unit="sample", leave=False,
                   dynamic_ncols=True, disable=None if self.acc.is_main_process else True)

        def counted(start, prompts, images, out):
            bar.update(len(prompts))
            if on_batch is not None:
                on_batch(start, prompts, images, out)

        with bar, self.ema.swapped_in() if self.ema is not None else nullcontext():
            local = score_jobs(self.adapter, self.reward, prompts, [jobs[min(k, len(jobs) - 1)] for k in mine],
                               seed=t.eval_seed, sigmas=self.sampler.eval_sigmas, model_kw=self.model_kw,
                               batch_size=self.batch.rollout_batch_per_process, autocast=self.acc.autocast,
                               on_batch=counted, between_batches=between_batches, stream=stream)
        index = self.acc.gather(torch.tensor([k if k < len(jobs) else -1 for k in mine], device=self.device))
        valid = index >= 0
        position = torch.empty(len(jobs), dtype=torch.long, device=self.device)  # gathered row of each job
        position[index[valid]] = valid.nonzero().flatten()

        def gathered(v: torch.Tensor) -> torch.Tensor:
            return self.acc.gather(v.to(self.device).contiguous())[position]

        return EvalSamples(jobs=jobs, prompts=prompts.subset([i for i, _ in jobs]),
                           scores=gathered(local.scores),
                           components={k: gathered(v) for k, v in local.components.items()})
