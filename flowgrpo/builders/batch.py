"""The batch arithmetic of one iteration (:class:`BatchPlan`): global sizes from ``cfg.trainer`` split over the
processes, asserted to divide, and printed at start-up (:meth:`BatchPlan.banner`)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from ..config import validate
from ..registry import load_algorithms

__all__ = ["BatchPlan", "batch_plan"]


@dataclass
class BatchPlan:
    """The batch arithmetic of one iteration; all counts are per iteration."""

    num_processes: int
    prompts: int  # N, global
    group_size: int  # G
    rollouts: int  # M = N·G, global
    rollouts_per_process: int  # m = M / P
    rollout_batch_per_process: int  # samples per rollout forward on one process
    rollout_chunks: int  # rollout forwards-per-step batches on one process
    trained_steps: int  # K per rollout
    trained_steps_note: str
    train_micro_batch: int  # samples per training forward on one process
    accumulation: int  # A micro-batches per optimizer update
    updates_per_iteration: int  # U (over all inner epochs)
    inner_epochs: int

    @property
    def backward_per_update(self) -> int:
        """Backward passes accumulated into one optimizer update (micro-batches × trained steps)."""
        return self.accumulation * self.trained_steps

    def banner(self) -> str:
        P = self.num_processes
        lines = [
            f"batch plan: {self.prompts} prompts × {self.group_size} samples = {self.rollouts} rollouts/iteration "
            f"over {P} process{'es' if P > 1 else ''} → {self.rollouts_per_process} per process "
            f"(rollout forward: {self.rollout_batch_per_process} samples × {self.rollout_chunks} chunk"
            f"{'s' if self.rollout_chunks > 1 else ''})",
            f"            {self.trained_steps} trained steps each ({self.trained_steps_note}); "
            f"training micro-batch {self.train_micro_batch} per process",
            f"            {self.accumulation} accumulation step{'s' if self.accumulation != 1 else ''} × "
            f"{self.trained_steps} trained steps = "
            f"{self.backward_per_update} backward passes per update → {self.updates_per_iteration} optimizer "
            f"update{'s' if self.updates_per_iteration != 1 else ''} per iteration "
            f"({self.inner_epochs} inner epoch{'s' if self.inner_epochs != 1 else ''})",
        ]
        return "\n".join(lines)


def batch_plan(cfg: DictConfig, num_processes: int = 1, trained_steps: tuple[int, str] | None = None) -> BatchPlan:
    """Derive per-process batch sizes from the global ones in ``cfg.trainer`` and assert they divide evenly.

    ``trained_steps`` is the algorithm's ``(K, note)`` (``Algorithm.trained_steps()``): steps each sample trains;
    omitted, the divisibility is checked alone (before the model and the algorithm are built) and K is 0.

    Raises:
        ValueError: a size that does not divide, naming the knob(s) to change.
    """
    validate(cfg)
    t = cfg.trainer
    P = int(num_processes)
    if P < 1:
        raise ValueError(f"num_processes must be >= 1, got {P}")
    N, G = t.prompts_per_iteration, t.group_size
    M = N * G
    if M % P:
        raise ValueError(
            f"trainer.prompts_per_iteration × trainer.group_size = {N} × {G} = {M} rollouts do not split over "
            f"{P} processes: make {M} a multiple of {P} (change trainer.prompts_per_iteration or trainer.group_size)"
        )
    m = M // P
    R = M if t.rollout_batch_size is None else t.rollout_batch_size
    if R % P or M % R:
        raise ValueError(
            f"trainer.rollout_batch_size={R} must be a multiple of the {P} processes and divide the {M} rollouts "
            f"of an iteration (trainer.prompts_per_iteration × trainer.group_size); or set it to null (all at once)"
        )
    B, A = t.train_batch_size, t.gradient_accumulation_steps
    if B % P:
        raise ValueError(f"trainer.train_batch_size={B} (global) must be a multiple of the {P} processes")
    algorithms = load_algorithms()  # the registry's classes say whether an update keeps groups whole
    algorithm = algorithms.get(cfg.algo.name)  # an unknown name is reported by build_algorithm, naming algo.name
    if algorithm is not None and algorithm.declare_needs(cfg.algo).whole_groups and (B // P) % G:
        raise ValueError(f"algo={cfg.algo.name} trains whole groups per micro-batch: the per-process micro-batch "
                         f"(trainer.train_batch_size={B} / {P} processes = {B // P}) must be a multiple of "
                         f"trainer.group_size={G}")
    if M % (B * A):
        raise ValueError(
            f"trainer.train_batch_size × trainer.gradient_accumulation_steps = {B} × {A} = {B * A} samples per "
            f"optimizer update must divide the {M} rollouts of an iteration: change trainer.train_batch_size or "
            f"trainer.gradient_accumulation_steps (or trainer.prompts_per_iteration / trainer.group_size)"
        )
    K, note = trained_steps if trained_steps is not None else (0, "decided by the algorithm")
    updates = t.inner_epochs * M // (B * A)
    return BatchPlan(
        num_processes=P, prompts=N, group_size=G, rollouts=M, rollouts_per_process=m,
        rollout_batch_per_process=R // P, rollout_chunks=M // R, trained_steps=K, trained_steps_note=note,
        train_micro_batch=B // P, accumulation=A, updates_per_iteration=updates, inner_epochs=t.inner_epochs,
    )
