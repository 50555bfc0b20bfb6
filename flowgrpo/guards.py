"""What stops a run before it goes wrong, and says why: memory, non-finite samples, diverging updates, stop requests.

:class:`Guards` is a mixin of :class:`~flowgrpo.trainer.Trainer`, beside :class:`~flowgrpo.run_state.RunState` (which
writes the checkpoint a stopped or crashed run leaves):

- **memory** — :meth:`Guards._check_rollout_memory`: a batch whose trajectories (:meth:`Guards.rollout_bytes`) and
  largest forward (:meth:`Guards.forward_bytes`) cannot fit is refused before the first rollout, naming the keys that
  set it.
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

from .finetune import gathers_state, local_shard, torch_optimizer

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


#: forward fits already measured in this process, by model set-up: a process that builds several trainers of one
#: model (scripts/bench_iteration.py's configurations side by side, a sweep, the tests) measures it once
_FORWARD_FITS: dict[str, tuple | None] = {}


def forward_peaks(trainer, n: int) -> tuple[int, int]:
    """Bytes of the tensors alive at the peak of ``trainer``'s rollout velocity call (with its guidance and autocast)
    and of its decode, each on ``n`` samples, run on fake tensors: shapes and dtypes, no memory (ops whose inputs are
    all real, the text conditioning's, run for real: a few small tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .memory import MemoryTracker

    c, adapter, guidance = trainer.cfg.model, trainer.adapter, trainer.model_kw["guidance"]
    cond = trainer._encode([""]).repeat_interleave(n)

    def velocity(x):
        with trainer.acc.autocast():
            adapter.velocity(x, torch.full((n,), 0.5, device=x.device), cond, **guidance)

    peaks = []
    for fn in (velocity, adapter.decode):
        tracker = MemoryTracker()
        tracker.small_real = 65536  # the few values code reads back (shapes, schedules) stay real
        # no random draw reaches the run's generators (what small factories make is real)
        with torch.random.fork_rng(devices=[]), torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True), tracker:
            fn(torch.zeros(adapter._latent_shape(n, c.height, c.width, c.get("num_frames")), device=trainer.device))
        peaks.append(tracker.peak)
    return peaks[0], peaks[1]


def _forward_fit(trainer) -> tuple | None:
    """``((fixed, per sample) of a rollout velocity call, (fixed, per sample) of a decode)`` in bytes, from
    :func:`forward_peaks` at 2 and 4 samples, after a first call at 1 that is not counted (what a model does once,
    on its first call, is not a cost of every call: the adapter puts its VAE in channels-last memory on its first
    decode); None (and a warning) when the adapter cannot run on fake tensors."""
    import json
    import warnings

    from omegaconf import OmegaConf

    key = json.dumps([OmegaConf.to_container(trainer.cfg.model, resolve=True),
                      str(trainer.cfg.trainer.mixed_precision), str(trainer.device)], sort_keys=True, default=str)
    if key not in _FORWARD_FITS:
        try:
            forward_peaks(trainer, 1)
            two, four = forward_peaks(trainer, 2), forward_peaks(trainer, 4)
            _FORWARD_FITS[key] = tuple((max(2 * a - b, 0), max((b - a) // 2, 0)) for a, b in zip(two, four))
        except Exception as err:  # an adapter whose forward reads values back: the check counts the stored rollouts
            warnings.warn(f"the rollout memory check could not measure the model's forward on fake tensors "
                          f"({type(err).__name__}: {err}); it counts the stored rollouts only", RuntimeWarning,
                          stacklevel=3)
            _FORWARD_FITS[key] = None
    return _FORWARD_FITS[key]


class Guards:
    """Memory, finiteness, divergence and stop-request checks of a :class:`~flowgrpo.trainer.Trainer` (a mixin: see
    the module's docstring for what it reads)."""

    def rollout_bytes(self) -> int:
        """What one iteration's rollouts keep on one process: every state of every trajectory (float32; twice with
        an algorithm that records the SDE means) and the decoded samples the reward reads."""
        m, c = self.batch.rollouts_per_process, self.cfg.model
        frames = c.get("num_frames")
        latent = math.prod(self.adapter.frames._latent_shape(1, c.height, c.width, frames)[1:])
        states = (int(self.cfg.sampler.num_steps) + 1) * (2 if self.algorithm.needs.record_means else 1)
        pixels = 3 * c.height * c.width * (frames or 1)
        return 4 * m * (states * latent + pixels)

    def forward_bytes(self) -> int | None:
        """The largest forward of one iteration on one process, besides the weights: a rollout forward of
        ``trainer.rollout_batch_size`` samples (per process; with guidance, as the rollout calls it) or the decode of
        every rollout the score phase runs at once, whichever is larger. Measured, not guessed: the adapter's own
        velocity call and decode run on fake tensors (shapes, no memory; only the text conditioning computes) at 2
        and 4 samples, and the peak of the tensors alive is extended linearly to the batch (activations grow with
        the batch). None for a streaming model (its forwards carry a cache) or when the adapter cannot run on fake
        tensors (a warning)."""
        if self.adapter.num_chunks(self.cfg.model.num_frames) > 1:  # a streaming model: its forwards carry a cache
            return None
        fit = _forward_fit(self)
        if fit is None:
            return None
        (v0, v1), (d0, d1) = fit
        chunk, m = self.batch.rollout_batch_per_process, self.batch.rollouts_per_process
        return int(max(v0 + v1 * chunk, d0 + d1 * m))

    def _check_rollout_memory(self, available: int | None = None) -> None:
        """Refuse, before the first rollout, a batch that cannot fit: its trajectories and decoded samples
        (:meth:`rollout_bytes`) plus its largest forward (:meth:`forward_bytes`) over 80% of the memory left on the
        device (host RAM on a CPU), with the numbers and the keys that set them."""
        if available is None:
            available = available_memory(self.device)
        if available is None:
            return
        kept, forward = self.rollout_bytes(), self.forward_bytes()
        need = kept + (forward or 0)
        if need <= 0.8 * available:
            return
        t = self.cfg.trainer
        gib = 2 ** 30
        largest = ("" if forward is None else
                   f", and its largest forward takes {forward / gib:.1f} GiB more (a rollout forward of "
                   f"{self.batch.rollout_batch_per_process} samples, trainer.rollout_batch_size="
                   f"{t.rollout_batch_size}, or decoding the {self.batch.rollouts_per_process} samples)")
        raise MemoryError(
            f"one iteration's rollouts keep {kept / gib:.1f} GiB on each process ({self.batch.rollouts_per_process} "
            f"samples = trainer.prompts_per_iteration={t.prompts_per_iteration} x trainer.group_size={t.group_size}"
            f"{f' / {self.world} processes' if self.world > 1 else ''}, {int(self.cfg.sampler.num_steps) + 1} states "
            f"each at sampler.num_steps={self.cfg.sampler.num_steps}, plus the decoded samples){largest}: "
            f"{need / gib:.1f} GiB, but only {available / gib:.1f} GiB is available on {self.device}. Lower "
            "trainer.group_size or trainer.prompts_per_iteration (or trainer.rollout_batch_size, for the rollout "
            "forward), or use more processes.")

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
        """What an optimizer step may have to be undone to, when ``trainer.max_update_ratio`` is set: copies of the
        trained weights and of the optimizer state. LoRA keeps them on the device (they are small); full
        fine-tuning on the host (the model's size and the optimizer's moments again: host memory instead of the
        GPU's, at the price of a device-to-host copy per update). Under FSDP each process copies its own shards."""
        if self._update_guard is None:
            self._update_guard = self.cfg.trainer.max_update_ratio is not None
        if not self._update_guard:
            return None
        host = self.cfg.model.finetune != "lora"

        def keep(t: torch.Tensor) -> torch.Tensor:
            t = local_shard(t).detach()
            return t.to("cpu", copy=True) if host else t.clone()

        with torch.no_grad():
            return {"norm2": sum(local_shard(p).detach().double().pow(2).sum().to(self.device) for p in self.params),
                    "params": [keep(p) for p in self.params],
                    "optimizer": {p: {k: keep(v) if torch.is_tensor(v) else copy.deepcopy(v) for k, v in s.items()}
                                  for p, s in torch_optimizer(self.optimizer).state.items()}}

    def _undo_if_diverged(self, before: dict | None) -> float | None:
        """None when the step stays; else the ratio ``||Δθ|| / ||θ||`` of the step just taken, which exceeded
        ``trainer.max_update_ratio`` or is not finite, after putting the weights and the optimizer back. Sharded
        (FSDP) weights: the squared norms of every process's shards are summed, so all processes agree."""
        if before is None:
            return None
        with torch.no_grad():
            norms = torch.stack([
                before["norm2"],
                sum((local_shard(p).detach().double() - c.to(local_shard(p).device).double()).pow(2).sum().to(self.device)
                    for p, c in zip(self.params, before["params"]))])
            if gathers_state(self.acc):
                norms = self.acc.reduce(norms, reduction="sum")
            old, moved = torch.sqrt(norms)
            ratio = float(moved / old.clamp_min(1e-12))
        if math.isfinite(ratio) and ratio <= self.cfg.trainer.max_update_ratio:
            return None
        with torch.no_grad():
            for p, c in zip(self.params, before["params"]):
                local_shard(p).copy_(c)
            state = torch_optimizer(self.optimizer).state
            for p in [p for p in state if p not in before["optimizer"]]:
                del state[p]  # state the undone step created (its first): gone, as before it
            for p, saved in before["optimizer"].items():
                live = state[p]
                for k in [k for k in live if k not in saved]:
                    del live[k]
                for k, v in saved.items():
                    if torch.is_tensor(v) and torch.is_tensor(live.get(k)):
                        local_shard(live[k]).copy_(v)
                    else:
                        live[k] = v
        return ratio if math.isfinite(ratio) else float("inf")
