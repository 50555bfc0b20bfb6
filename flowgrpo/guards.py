"""What stops a run before it goes wrong, and says why: memory, non-finite samples, diverging updates, stop requests.

:class:`Guards` is a mixin of :class:`~flowgrpo.trainer.Trainer`, beside :class:`~flowgrpo.run_state.RunState` (which
writes the checkpoint a stopped or crashed run leaves):

- **memory** — :meth:`Guards._check_rollout_memory`: a batch whose trajectories (:meth:`Guards.rollout_bytes`) cannot
  fit is refused before the first rollout, naming the keys that set it.
- **non-finite samples** — :meth:`Guards._check_finite_rollout` / :meth:`Guards._check_finite`: samples that are not
  finite stop the run (:class:`NonFiniteError`) before a reward reads them, and mark the weights that drew them as
  diverged (never checkpointed).
- **diverging updates** — :meth:`Guards._agree_finite`, :meth:`Guards._pre_step_copy`,
  :meth:`Guards._undo_if_diverged`, :meth:`Guards._skip_update`: an optimizer update with a non-finite loss or
  gradient, or one that moves the trained weights beyond ``trainer.max_update_ratio``, is skipped (rolled back),
  every process together; too many in a row stop the run.
- **degenerate samples** — :func:`degenerate_flags`: which decoded samples are flat or pure noise (logged as
  ``reward/degenerate_fraction``; a collapsing model shows there first).
- **stop requests** — :meth:`Guards._stop_requested` / :meth:`Guards._check_stop`: SIGTERM / SIGINT, agreed on by
  every process, abandon the current phase (``Guards._Abandon``).

What the mixin reads from its trainer: ``cfg``, ``acc``, ``device``, ``world``, ``batch``, ``adapter``,
``algorithm``, ``ckpt``, ``params``, ``optimizer``, ``_stop``, ``_print``; and the counters it keeps:
``skipped_updates``, ``_consecutive_skips``, ``_update_guard``, ``_diverged``.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

import torch

from .finetune import gathers_state

if TYPE_CHECKING:
    from .algorithms import Batch

__all__ = ["Guards", "NonFiniteError", "available_memory", "degenerate_flags"]


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


class Guards:
    """Memory, finiteness, divergence and stop-request checks of a :class:`~flowgrpo.trainer.Trainer` (a mixin: see
    the module's docstring for what it reads)."""

    def rollout_bytes(self) -> int:
        """What one iteration's rollouts keep on one process: every state of every trajectory (float32; twice with
        an algorithm that records the SDE means) and the decoded samples the reward reads."""
        m, c = self.batch.rollouts_per_process, self.cfg.model
        frames = c.get("num_frames")
        latent = math.prod(self.adapter.frames._latent_shape(1, c.height, c.width, frames)[1:])
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
        self._check_finite(batch.final, iteration, "the rollout's samples")

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
            raise Guards._Abandon(phase)

    class _Abandon(Exception):
        pass

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
