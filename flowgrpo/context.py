"""The trainer's side of the algorithm contract: :class:`TrainerContext`, the
:class:`~flowgrpo.algorithms.UpdateContext` an algorithm's update reaches the model through — the trained
transformer's velocity with the training guidance and autocast, the reference policy, generators keyed by the run's
seed, and a streaming model's cache operations. (A rollout reaches the model through
:class:`~flowgrpo.rollout.SamplingModel` instead.)
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from .algorithms import UpdateContext
from .finetune import gathers_state, reference_policy
from .seeding import ALGO_STREAM, seeded_generator

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["TrainerContext"]


class TrainerContext(UpdateContext):
    """The trainer's :class:`~flowgrpo.algorithms.UpdateContext`: the trained transformer (through accelerate's
    wrapper, with the training guidance and autocast), the reference policy, and generators keyed by the run's seed,
    the iteration and the inner epoch (set by the trainer before each update). The reference policy exists only for
    an algorithm that declares it (``Algorithm.needs.reference``)."""

    def __init__(self, trainer: "Trainer"):
        self._trainer = trainer
        self.iteration = 0
        self.epoch = 0
        self._module = None  # None: the adapter's own (wrapped) transformer

    def velocity(self, x, sigma, cond):
        t = self._trainer
        guidance = t.model_kw["guidance"] if t.algorithm.needs.training_guidance else {"guidance_scale": 1.0}
        with t.acc.autocast():
            return t.adapter.velocity(x, sigma, cond, transformer=self._module, **guidance)

    @contextlib.contextmanager
    def reference(self):
        t = self._trainer
        if not t.algorithm.needs.reference:  # no frozen copy was kept for it, and LoRA may not exist
            raise RuntimeError(f"algo={t.algorithm.name} called ctx.reference() without declaring it needs a reference "
                               "policy (Algorithm.needs: Needs.reference)")
        with reference_policy(t.unwrapped, t.ref_copy) as ref:
            saved, self._module = self._module, ref
            try:
                yield
            finally:
                self._module = saved

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self._trainer.params

    @property
    def updates(self) -> int:
        return self._trainer.updates

    def generator(self, *keys: int) -> torch.Generator:
        return seeded_generator(self._trainer.cfg.trainer.seed, ALGO_STREAM, self.iteration, self.epoch, *keys)

    def stored_weights(self, path: str) -> list[torch.Tensor]:
        t = self._trainer
        if gathers_state(t.acc):
            raise NotImplementedError("weights of another run are read into unsharded parameters only (no FSDP)")
        where, state = t.ckpt.load_intact(t.ckpt.resume_candidates(path))
        saved = state["trainable"]
        names = [n for n, p in t.unwrapped.named_parameters() if p.requires_grad]
        if set(names) != saved.keys():
            raise ValueError(f"{where} does not hold this run's trainable parameters (another model, model.lora or "
                             "model.finetune?)")
        return [saved[n].to(device=p.device, dtype=p.dtype) for n, p in zip(names, t.params)]

    @torch.no_grad()
    def commit(self, x0, cond):
        return self._trainer.adapter.commit(x0, cond)

    def routed(self, route):
        return self._trainer.adapter.routed(route)

    def teacher_forced_velocity(self, clean, noisy, sigma, cond, routes=None):
        with self._trainer.acc.autocast():
            return self._trainer.adapter.teacher_forced_velocity(clean, noisy, sigma, cond, routes=routes,
                                                                 transformer=self._module)
