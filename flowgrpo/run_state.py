"""A run's state and its life on disk: what a checkpoint holds, writing it, resuming from one, and the checkpoint
and ``summary.json`` an exception leaves behind.

:class:`RunState` is a mixin of :class:`~flowgrpo.trainer.Trainer` (phase 6, checkpoint, and the crash handling
around the loop); :mod:`flowgrpo.checkpoint` makes the writes safe, this module decides what is written and when:

- **state** — :meth:`RunState.state_dict` / :meth:`RunState.load_state_dict`: the trained weights, optimizer, LR
  schedule, EMA, the algorithm's, aggregator's and curriculum's state, RNG, history and evaluations, the config.
- **checkpoint** — :meth:`RunState.save_checkpoint`: atomic, with the LoRA (or transformer) in diffusers format and
  the run's identity (:meth:`RunState.run_identity`) in the manifest.
- **resume** — :meth:`RunState.maybe_resume`: ``trainer.resume`` (``auto``, a path), refusing a config that changes
  what the checkpoint's run computes.
- **crash** — :meth:`RunState._crash_guard`: an exception in the loop checkpoints the last completed iteration (from
  the snapshot taken at the start of each iteration) and writes ``summary.json`` with the error before it propagates.

What the mixin reads from its trainer: ``cfg``, ``acc``, ``out``, ``ckpt``, ``adapter``, ``unwrapped``,
``optimizer``, ``lr_scheduler``, ``ema``, ``algorithm``, ``aggregator``, ``curriculum``, ``reward``, ``logger``,
``iteration``, ``updates``, ``skipped_updates``, ``history``, ``evals``, ``_print``; and the crash bookkeeping the
loop keeps: ``_snapshot``, ``_weights_snapshot``, ``_weights_touched``, ``_saved``, ``_phase``, ``_diverged``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from .jsonio import dumps
from .checkpoint import (CheckpointManager, asks_resume, atomic_write_text, capture_rng_state, find_runs,
                         restore_rng_state, resume_config_changes, save_lora_weights, save_transformer_weights)
from .errors import UserError
from .finetune import (gathers_state, load_optimizer_state, load_trainable_state, optimizer_state, torch_optimizer,
                       trainable_names, trainable_state)
from .runlog import log

__all__ = ["RunState", "ResumeRefused"]

# Hydra's default run dir, <root>/YYYY-MM-DD/HH-MM-SS (conf/train.yaml; flowgrpo.train's HH-MM-SS_2, ... for a second
# call in the same second): trainer.resume=auto searches <root>.
_RUN_DAY, _RUN_TIME = re.compile(r"\d{4}-\d{2}-\d{2}"), re.compile(r"\d{2}-\d{2}-\d{2}(?:_\d+)?")


class ResumeRefused(UserError, ValueError):
    """A resume refused because this run's config would change what the checkpoint's run computes (or lacks state
    this run needs); the message lists why and the ways on."""


def _cpu_copy(obj):
    """A copy of nested dicts / lists / tuples with every tensor cloned onto the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _cpu_copy(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


class RunState:
    """State, checkpoint, resume and crash handling of a :class:`~flowgrpo.trainer.Trainer` (a mixin: see the
    module's docstring for what it reads)."""

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs. Under FSDP a collective (full tensors gathered onto rank 0): call it on every
        rank, as ``save_checkpoint`` does; only rank 0's result is complete."""
        gather = gathers_state(self.acc)
        return {
            "iteration": self.iteration,
            "updates": self.updates,
            "skipped_updates": self.skipped_updates,
            "trainable": trainable_state(self.unwrapped, gather=gather),
            "optimizer": optimizer_state(self.unwrapped, self.optimizer, gather=gather),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "ema": None if self.ema is None else self.ema.state_dict(),
            "algorithm": self.algorithm.state_dict(),
            "aggregator": None if self.aggregator is None else self.aggregator.state_dict(),
            "curriculum": None if self.curriculum is None else self.curriculum.state_dict(),
            "rng": capture_rng_state(),
            "history": self.history,
            "evals": self.evals,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s result (under FSDP every rank passes the full state and keeps its shards)."""
        gather = gathers_state(self.acc)
        load_trainable_state(self.unwrapped, state["trainable"], gather=gather)
        load_optimizer_state(self.unwrapped, self.optimizer, state["optimizer"], gather=gather)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.ema is not None and state.get("ema") is not None:
            self.ema.load_state_dict(state["ema"])
        self.algorithm.load_state_dict(state["algorithm"])
        if self.aggregator is not None:
            if state.get("aggregator") is None:
                raise ResumeRefused("the checkpoint has no reward-aggregator state but this run sets "
                                    f"reward.aggregate.name={self.aggregator.name!r}")
            self.aggregator.load_state_dict(state["aggregator"])
        if self.curriculum is not None:
            if state.get("curriculum") is None:
                raise ResumeRefused("the checkpoint has no CGPO curriculum state but this run sets data.sampling=cgpo")
            self.curriculum.load_state_dict(state["curriculum"])
        restore_rng_state(state["rng"])
        self.iteration = state["iteration"]
        self.updates = state["updates"]
        self.skipped_updates = state.get("skipped_updates", 0)
        self.history = list(state.get("history", []))
        self.evals = list(state.get("evals", []))

    def _light_state(self) -> dict[str, Any]:
        """``state_dict()`` without the trained weights, optimizer, EMA and config: copies, cheap enough to take at
        the start of every iteration (what a crash checkpoint falls back to)."""
        return {
            "iteration": self.iteration,
            "updates": self.updates,
            "skipped_updates": self.skipped_updates,
            "lr_scheduler": copy.deepcopy(self.lr_scheduler.state_dict()),
            "algorithm": _cpu_copy(self.algorithm.state_dict()),
            "aggregator": None if self.aggregator is None else _cpu_copy(self.aggregator.state_dict()),
            "curriculum": None if self.curriculum is None else _cpu_copy(self.curriculum.state_dict()),
            "rng": capture_rng_state(),
            "history": list(self.history),
            "evals": list(self.evals),
        }

    def _weights_state(self) -> dict[str, Any]:
        """The trained weights, optimizer and EMA parts of ``state_dict()`` as host copies (no FSDP gather)."""
        return {"trainable": trainable_state(self.unwrapped),
                "optimizer": _cpu_copy(optimizer_state(self.unwrapped, self.optimizer)),
                "ema": None if self.ema is None else _cpu_copy(self.ema.state_dict())}

    def run_identity(self) -> dict[str, Any]:
        """What makes two runs the same experiment for ``trainer.resume=auto``: the experiment preset (when started
        through Hydra), the model, algorithm, sampler, reward and data names, the reward's version when it declares
        one (a run scored under other rules is another experiment), and the seed. Every checkpoint's manifest
        records it."""
        experiment = None
        try:
            from hydra.core.hydra_config import HydraConfig

            if HydraConfig.initialized():
                experiment = HydraConfig.get().runtime.choices.get("experiment")
        except Exception:  # no Hydra run (a Trainer built in Python): no preset name
            experiment = None
        c = self.cfg
        identity = {"experiment": None if experiment is None else str(experiment), "model": str(c.model.pretrained),
                    "algo": str(c.algo.name), "sampler": str(c.sampler.name), "reward": str(c.reward.name),
                    "data": str(c.data.name), "seed": int(c.trainer.seed)}
        if getattr(self.reward, "version", None) is not None:
            identity["reward_version"] = int(self.reward.version)
        return identity

    # ------------------------------------------------------------------ checkpoint
    def save_checkpoint(self, light: dict[str, Any] | None = None) -> Path | None:
        """Atomic checkpoint of everything needed to resume, plus the LoRA in diffusers format (rank 0 writes; under
        FSDP every rank first takes part in gathering the full state). ``light``: a ``_light_state()`` taken earlier
        whose entries replace the live ones (the weights must not have moved since)."""
        gather = gathers_state(self.acc)  # raises for DeepSpeed / FSDP1 before anything is written
        self.acc.wait_for_everyone()
        path = None
        state = self.state_dict() if gather or self.acc.is_main_process else None
        if self.acc.is_main_process:
            state.update(light or {})
            path = self._write_checkpoint(state, gather)
        self.acc.wait_for_everyone()
        return path

    def _write_checkpoint(self, state: dict[str, Any], gather: bool) -> Path:
        trained = state["trainable"]
        writers = {}
        if self.cfg.model.finetune == "lora":
            writers["lora"] = lambda d: save_lora_weights(self.adapter.pipe, d, transformer=self.unwrapped,
                                                          state_dict=trained)
        elif gather:  # the module's own state dict holds this rank's shards: write the gathered weights
            writers["transformer"] = lambda d: save_transformer_weights(self.unwrapped, d, trained)
        else:  # the fine-tuned transformer in diffusers format: swap it into the pipeline with from_pretrained
            writers["transformer"] = lambda d: self.unwrapped.save_pretrained(d, safe_serialization=True)
        path = self.ckpt.save(state["iteration"], state, writers=writers, meta={"run": self.run_identity()})
        self._saved = (state["iteration"], path)
        return path

    # ------------------------------------------------------------------ resume
    def maybe_resume(self) -> bool:
        """Restore ``trainer.resume``'s checkpoint; says what it resumed from, or that there was nothing to resume.

        ``auto``: the newest intact checkpoint of this run dir, then of earlier runs of the same experiment
        (:meth:`run_identity`, newest run first) under ``trainer.resume_search_dir`` — by default, when the run dir
        is Hydra's timestamped ``<root>/YYYY-MM-DD/HH-MM-SS``, under ``<root>``; none at all: a fresh start, said so.
        (A run dir that holds a run's files but no checkpoint was refused before: :func:`flowgrpo.cli._claim`.)
        A path: a run dir, a checkpoint root or a checkpoint dir (then the older ones beside it). A corrupt or
        incomplete checkpoint is named in a warning and the next older one is tried; none intact: CheckpointError.
        """
        # At start-up: raises for set-ups whose checkpoints would not be complete (DeepSpeed, FSDP1). Under FSDP2
        # self.params are the sharded parameters (re-read after accelerate.prepare), so clipping and the EMA see them.
        gathers_state(self.acc)
        resume = self.cfg.trainer.resume
        if not asks_resume(resume):
            return False
        if str(resume).strip().lower() == "auto":
            candidates, searched = self._auto_candidates()
            if not candidates:
                self._print(f"trainer.resume=auto: nothing to resume ({searched}); starting fresh")
                return False
        else:
            candidates = self.ckpt.resume_candidates(resume)
        path, state = self.ckpt.load_intact(candidates)
        self._check_resume_config(path, state.get("config"))
        self.load_state_dict(state)
        elsewhere = "" if path.parent == self.ckpt.root else f"; this run writes to {self.out}"
        self._print(f"trainer.resume={resume}: resumed from {path} after iteration {self.iteration}{elsewhere}")
        return True

    def _check_resume_config(self, path: Path, saved: dict | None) -> None:
        """Refuse a resume whose config changes what the checkpoint's run meant, listing the differences and the
        key that forces it; harmless differences (length, logging, evaluation cadence, ...) are said and pass."""
        meaningful, harmless = resume_config_changes(saved, OmegaConf.to_container(self.cfg, resolve=True))
        if harmless:
            self._print(f"trainer.resume: {path} ran with other settings that do not change the run: "
                        + "; ".join(harmless))
        if not meaningful:
            return
        listing = "\n  ".join(meaningful)
        if self.cfg.trainer.resume_force:
            self._print(f"trainer.resume_force=true: resuming {path} with a config that changes the run:\n  {listing}")
            return
        raise ResumeRefused(f"trainer.resume: {path} was written by a run with another config, and resuming it with "
                         f"this one would change what that run computes:\n  {listing}\nResume with the checkpoint's "
                         "settings, start a fresh run (another output dir, trainer.resume=null), or set "
                         "trainer.resume_force=true to resume anyway.")

    def _auto_candidates(self) -> tuple[list[Path], str]:
        """``trainer.resume=auto``'s checkpoints, newest first, and where it looked (for the nothing-found line)."""
        own = self.ckpt.candidates()
        search = self.cfg.trainer.get("resume_search_dir")
        if search is None and _RUN_DAY.fullmatch(self.out.parent.name) and _RUN_TIME.fullmatch(self.out.name):
            search = self.out.parent.parent
        if search is None:
            return own, (f"no checkpoint in {self.ckpt.root}; earlier runs are searched from a timestamped run dir "
                         f"or with trainer.resume_search_dir")
        runs = find_runs(search, {"run": self.run_identity()}, exclude=[self.out])
        earlier = [c for run in runs for c in CheckpointManager(run / "checkpoints").candidates()]
        return own + earlier, (f"no checkpoint in {self.ckpt.root} nor in an earlier run of this experiment "
                               f"under {search}")

    # ------------------------------------------------------------------ crash
    def _before_weights_change(self, before: dict | None = None) -> None:
        """Called before each optimizer step with the update guard's pre-step copy (``before``, None when
        ``trainer.max_update_ratio`` is off): the first step of an iteration keeps the trained weights, optimizer and
        EMA as they were, so an error later in the iteration can still checkpoint the last completed one. LoRA takes
        host copies here (they are small). Full fine-tuning reuses the guard's host copy of the weights and the
        optimizer (plus a host copy of the EMA when it is on), held until the iteration ends; with the guard off it
        keeps nothing (a second copy of the model would be the price). Not under FSDP (gathering is a collective)."""
        if self._snapshot is None or self._weights_touched:
            return
        self._weights_touched = True
        if not self.acc.is_main_process or gathers_state(self.acc):
            return
        if self.cfg.model.finetune == "lora":
            self._weights_snapshot = self._weights_state()
        elif before is not None:
            self._weights_snapshot = self._weights_from_step_copy(before)

    def _weights_from_step_copy(self, before: dict) -> dict[str, Any]:
        """:meth:`_weights_state`'s layout built from the update guard's host copies (``Guards._pre_step_copy``):
        ``trainable`` by parameter name, ``optimizer`` in ``torch.optim.Optimizer.state_dict`` form."""
        names = trainable_names(self.unwrapped)
        if len(names) != len(before["params"]):
            raise RuntimeError(f"the update guard copied {len(before['params'])} tensors for {len(names)} trained "
                               "parameters")
        inner = torch_optimizer(self.optimizer)
        live = inner.state_dict()  # param_groups with integer parameter ids; its state is replaced by the copies
        index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
        optimizer = {"state": {index[id(p)]: s for p, s in before["optimizer"].items()},
                     "param_groups": copy.deepcopy(live["param_groups"])}
        return {"trainable": dict(zip(names, before["params"])), "optimizer": optimizer,
                "ema": None if self.ema is None else _cpu_copy(self.ema.state_dict())}

    @contextlib.contextmanager
    def _crash_guard(self, bar=None):
        try:
            yield
        except Exception as err:
            if bar is not None:
                bar.close()
            self._on_crash(err)
            raise

    def _on_crash(self, err: Exception) -> None:
        """An exception inside the training loop: checkpoint the last completed iteration, write ``summary.json``
        with the error, add a note saying how to resume; the caller re-raises. The main process writes, without
        collectives (the other processes may be waiting in one); nothing here hides the original error."""
        in_step = self._snapshot is not None
        # iterations are numbered from 1, as in metrics.jsonl and the checkpoints: an error inside a step is in the
        # iteration after the last completed one; one between iterations is in the bookkeeping of the last completed
        failed = self._snapshot["iteration"] + 1 if in_step else self.iteration
        phase = self._phase if in_step else "between iterations (logging, gallery, evaluation or checkpoint)"
        if not self.acc.is_main_process:
            return
        checkpoint, note = None, None
        try:
            checkpoint, note = self._crash_checkpoint()
        except Exception as save_err:  # e.g. the disk is full too: report it, keep the original error
            note = f"the crash checkpoint could not be written: {type(save_err).__name__}: {save_err}"
        done = self._snapshot if in_step else {"iteration": self.iteration, "updates": self.updates,
                                               "skipped_updates": self.skipped_updates, "evals": self.evals}
        resume_from = checkpoint or self.ckpt.latest()
        if checkpoint:
            kept = f"checkpoint of the {done['iteration']} completed iterations: {checkpoint}"
        elif resume_from:
            kept = f"no crash checkpoint ({note}); newest checkpoint on disk: {resume_from}"
        else:
            kept = f"no checkpoint ({note})"
        line = (f"error in iteration {failed} ({phase}): {type(err).__name__}: {err}\n{kept}\n"
                + (f"resume with trainer.resume={self.out}" if resume_from else
                   "nothing to resume from: run again once the error is fixed (in this run dir: with "
                   "trainer.overwrite=true)"))
        evals = done["evals"]
        summary = {"iterations": done["iteration"], "updates": done["updates"],
                   "skipped_updates": done["skipped_updates"], "checkpoint": str(checkpoint) if checkpoint else None,
                   "stopped": f"error in iteration {failed}",
                   "error": {"type": type(err).__name__, "message": str(err), "iteration": failed, "phase": phase},
                   "resume_from": str(resume_from) if resume_from else None, "note": note,
                   "eval_first": evals[0] if evals else {}, "eval_last": evals[-1] if evals else {}}
        try:
            atomic_write_text(self.out / "summary.json", dumps(summary, indent=2, default=str) + "\n")
        except OSError as write_err:
            line += f"\n(could not write {self.out / 'summary.json'}: {write_err.strerror or write_err})"
        log.error(line)
        err.add_note(line)
        if self.logger is not None:
            try:
                self.logger.finish()
            except Exception:  # the logger's own failure must not replace the error being reported
                pass

    def _crash_checkpoint(self) -> tuple[Path | None, str | None]:
        """Write (or find) the checkpoint of the last completed iteration; ``(None, why)`` when that state is not at
        hand, when nothing was done yet (no iteration and no evaluation: a fresh run is the same), or when its weights
        diverged (then a checkpoint of them already on disk is marked so)."""
        if self._diverged:
            done = self.iteration if self._snapshot is None else self._snapshot["iteration"]
            path = self.ckpt.path(done)  # written at the end of the iteration whose weights give non-finite samples
            if path.is_dir():
                self.ckpt.mark_diverged(path, f"iteration {done + 1}'s rollout from these weights was not finite")
            return None, "the weights of the last completed iteration produce non-finite samples: no checkpoint of them"
        if gathers_state(self.acc):
            return None, "under FSDP the full state is gathered by every process together, which an error prevents"
        light = self._snapshot
        iteration = self.iteration if light is None else light["iteration"]
        if iteration == 0 and not (self.evals if light is None else light["evals"]):
            # a checkpoint of nothing done (no iteration, no evaluation) would be the start of a fresh run: none is
            # written, and none is recommended
            return None, "no iteration completed: a fresh run starts from the same state"
        if self._saved is not None and self._saved[0] == iteration and self._saved[1].is_dir():
            return self._saved[1], None  # this iteration's checkpoint was already written
        if light is None:  # between iterations: the live state is the last completed iteration's
            return self._write_checkpoint(self.state_dict(), False), None
        if self._weights_touched and self._weights_snapshot is None:
            return None, ("the error came after this iteration's first optimizer step and full fine-tuning with "
                          "trainer.max_update_ratio=null keeps no copy of the weights before it")
        weights = self._weights_snapshot if self._weights_touched else self._weights_state()
        state = {**light, **weights, "config": OmegaConf.to_container(self.cfg, resolve=True)}
        return self._write_checkpoint(state, False), None
