"""What an algorithm is to the trainer: a plan for the rollout, an advantage, per-transition loss weights.

DESIGN.md's loop is ``plan → rollout → score → advantage → update → log/checkpoint``; an algorithm fills
phase 1 (:meth:`Algorithm.plan` → :class:`RolloutPlan`), may shape phase 4 (:meth:`Algorithm.advantages`) and
weights phase 5 (:meth:`Algorithm.loss_weights`, used by ``losses.ppo_clip_loss``). It never runs the loop.

>>> algo = build_algorithm(cfg.algo, cfg.sampler, sampler.sigmas)          # doctest: +SKIP
>>> plan = algo.plan(num_prompts, group_size, generator=gen)               # phase 1
>>> traj = samplers.rollout(v, noise, plan.sigmas, plan.sde_mask, kernel=plan.kernel,
...                         noise_level=plan.noise_level, solver=plan.solver)   # phase 2
>>> adv = algo.advantages(rewards, group_size)                             # phase 4
>>> rows, steps = plan.train_mask.nonzero(as_tuple=True)                   # phase 5: the trained transitions
>>> w = algo.loss_weights(plan, rows, steps)
>>> algo.end_iteration()                                                   # after the update
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from samplers import KERNELS, SOLVERS

from ..advantages import group_advantages

__all__ = ["RolloutPlan", "Algorithm", "ALGORITHMS", "build_algorithm"]

#: name → Algorithm subclass, filled by ``Algorithm.__init_subclass__``.
ALGORITHMS: dict[str, type["Algorithm"]] = {}


@dataclass
class RolloutPlan:
    """One iteration's rollout, decided in phase 1 for the whole (global) batch.

    Attributes:
        sigmas: ``[T'+1]`` float32 schedule the rollout integrates, shared by the batch (MixGRPO-Flash: the
            compressed tail; else the sampler's ``T``-step schedule).
        sde_mask: ``[N, T']`` bool, stochastic steps per sample; ``N = prompts × group_size``, group members
            consecutive (rows ``p·G … p·G+G−1`` are prompt ``p``).
        train_mask: ``[N, T']`` bool ⊆ ``sde_mask``: the transitions the update trains on.
        solver: ``"euler"`` | ``"dpm++2m"`` (ODE steps after a row's last SDE step), for ``samplers.rollout``.
        kernel: SDE kernel (``samplers.KERNELS``); noise_level: its ``a`` / ``η``.
        group_size: ``G``.
        info: what else the plan fixed for the whole batch: logs (window start, Flash steps) and batch-wide
            constants (Flash-GRPO's ``inv_lambda_mean``); kept by :meth:`subset`.
    """

    sigmas: torch.Tensor
    sde_mask: torch.Tensor
    train_mask: torch.Tensor
    solver: str
    kernel: str
    noise_level: float
    group_size: int = 1
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sigmas = torch.as_tensor(self.sigmas, dtype=torch.float32)
        steps = self.sigmas.shape[0] - 1
        if self.sde_mask.dtype != torch.bool or self.sde_mask.ndim != 2 or self.sde_mask.shape[1] != steps:
            raise ValueError(f"sde_mask must be bool [N, {steps}], got {self.sde_mask.dtype} "
                             f"{tuple(self.sde_mask.shape)}")
        if self.train_mask.shape != self.sde_mask.shape or self.train_mask.dtype != torch.bool:
            raise ValueError("train_mask must be a bool tensor of sde_mask's shape")
        if bool((self.train_mask & ~self.sde_mask).any()):
            raise ValueError("train_mask must be a subset of sde_mask (only stochastic steps have a log-prob)")
        if self.sde_mask.shape[0] % self.group_size:
            raise ValueError(f"{self.sde_mask.shape[0]} rows do not split into groups of {self.group_size}")
        if self.solver not in SOLVERS:
            raise ValueError(f"sampler.solver={self.solver!r} is not one of {', '.join(SOLVERS)}")
        if self.kernel not in KERNELS:
            raise ValueError(f"sampler.kernel={self.kernel!r} is not one of {', '.join(KERNELS)}")

    @property
    def num_steps(self) -> int:
        """``T'``, steps integrated (the NFE of one rollout, CFG aside)."""
        return self.sigmas.shape[0] - 1

    @property
    def num_rows(self) -> int:
        return self.sde_mask.shape[0]

    def first_sde_step(self) -> torch.Tensor:
        """``LongTensor[N]``: each row's first SDE step (``T'`` when none). Steps before it are deterministic, so
        when a group shares its initial noise the trainer integrates that prefix once per prompt
        (:meth:`shared_prefix`) and branches the group there."""
        steps = self.num_steps
        first = self.sde_mask.to(torch.uint8).argmax(dim=1)
        return torch.where(self.sde_mask.any(dim=1), first, torch.full_like(first, steps))

    def shared_prefix(self) -> torch.Tensor:
        """``LongTensor[P]``: per group, the number of leading steps that are ODE for every member (the min of
        :meth:`first_sde_step` over the group) — computed once per prompt under shared noise."""
        return self.first_sde_step().view(-1, self.group_size).amin(dim=1)

    def subset(self, rows: torch.Tensor) -> "RolloutPlan":
        """The plan of some rows (e.g. one process's whole groups, in order); ``sigmas`` and ``info`` — which holds
        batch-wide quantities such as Flash-GRPO's weight normalisation — are kept, so
        :meth:`Algorithm.loss_weights` gives the same weights as on the full plan."""
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        return dataclasses.replace(self, sde_mask=self.sde_mask[rows], train_mask=self.train_mask[rows])

    def trained_transitions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, steps)`` of every trained transition, row-major (``train_mask.nonzero``)."""
        rows, steps = self.train_mask.nonzero(as_tuple=True)
        return rows, steps


class Algorithm:
    """Base class: ``name`` registers the subclass for :func:`build_algorithm`.

    Shared behaviour: group-relative advantages (``algo.global_std``, ``algo.adv_clip``), unit loss weights,
    no state. Subclasses implement :meth:`plan` and override what their paper changes.

    Distributed use: call :meth:`plan` for the *global* batch with a generator seeded identically on every
    process (then slice rows), and :meth:`advantages` on the gathered rewards, so every process agrees.
    """

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            ALGORITHMS[cls.name] = cls

    def __init__(
        self,
        base_sigmas: torch.Tensor,
        *,
        kernel: str = "flow_grpo",
        noise_level: float = 0.7,
        solver: str = "euler",
        global_std: bool = False,
        adv_clip: float = 5.0,
        timestep_fraction: float = 1.0,
    ) -> None:
        sigmas = torch.as_tensor(base_sigmas, dtype=torch.float32).detach().cpu()
        if sigmas.ndim != 1 or sigmas.shape[0] < 2 or bool((sigmas.diff() >= 0).any()):
            raise ValueError("base_sigmas must be a strictly decreasing [T+1] schedule (the sampler's sigmas)")
        if kernel not in KERNELS:
            raise ValueError(f"sampler.kernel={kernel!r} is not one of {', '.join(KERNELS)}")
        if solver not in SOLVERS:
            raise ValueError(f"sampler.solver={solver!r} is not one of {', '.join(SOLVERS)}")
        if not 0 < timestep_fraction <= 1:
            raise ValueError(f"algo.timestep_fraction={timestep_fraction} must be in (0, 1]")
        self.base_sigmas = sigmas
        self.kernel = kernel
        self.noise_level = float(noise_level)
        self.solver = solver
        self.global_std = bool(global_std)
        self.adv_clip = float(adv_clip)
        self.timestep_fraction = float(timestep_fraction)

    @classmethod
    def from_config(cls, algo_cfg, sampler_cfg, base_sigmas: torch.Tensor, *, window=None) -> "Algorithm":
        """Build from the ``algo`` and ``sampler`` nodes (see :func:`build_algorithm`)."""
        return cls(base_sigmas, **cls._common_kwargs(algo_cfg, sampler_cfg))

    @staticmethod
    def _common_kwargs(algo_cfg, sampler_cfg) -> dict:
        return dict(kernel=sampler_cfg.kernel, noise_level=float(sampler_cfg.noise_level), solver=sampler_cfg.solver,
                    global_std=bool(algo_cfg.global_std), adv_clip=float(algo_cfg.adv_clip),
                    timestep_fraction=float(algo_cfg.timestep_fraction))

    @property
    def num_steps(self) -> int:
        """``T`` of the base schedule."""
        return self.base_sigmas.shape[0] - 1

    # ---------------------------------------------------------------------------------------- phases

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None) -> RolloutPlan:
        """Phase 1: this iteration's rollout plan for ``num_prompts × group_size`` rows."""
        raise NotImplementedError

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """Phase 4: ``group_advantages(rewards, G, global_std=algo.global_std, clip=algo.adv_clip)``."""
        return group_advantages(rewards, group_size, global_std=self.global_std, clip=self.adv_clip)

    def loss_weights(self, plan: RolloutPlan, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Phase 5: a float32 weight per trained transition ``(rows[i], steps[i])`` (indices into ``plan``).
        1 unless the algorithm rectifies (Flash-GRPO)."""
        rows, steps = self._check_transitions(plan, rows, steps)
        return torch.ones(rows.shape, dtype=torch.float32)

    def end_iteration(self) -> None:
        """Called once after each iteration's update (MixGRPO moves its window)."""

    def state_dict(self) -> dict:
        """What an exact resume needs (window position, RNG); plain python values."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""

    def describe(self) -> str:
        """One line for the start-up banner."""
        return f"{self.name}: {self.num_steps} steps, {self._kernel_text()}"

    # --------------------------------------------------------------------------------------- helpers

    def _kernel_text(self) -> str:
        level = "eta" if self.kernel == "dance" else "a"
        return f"{self.kernel} kernel ({level}={self.noise_level:g})"

    def _adv_text(self) -> str:
        return f"advantage ({'global' if self.global_std else 'group'} std, clip ±{self.adv_clip:g})"

    def _make_plan(self, sigmas, sde_mask, train_mask, group_size, **info) -> RolloutPlan:
        return RolloutPlan(sigmas=sigmas, sde_mask=sde_mask, train_mask=train_mask, solver=self.solver,
                           kernel=self.kernel, noise_level=self.noise_level, group_size=group_size, info=info)

    @staticmethod
    def _check_batch(num_prompts: int, group_size: int) -> int:
        if num_prompts < 1:
            raise ValueError(f"trainer.prompts_per_iteration must be >= 1, got {num_prompts}")
        if group_size < 1:
            raise ValueError(f"trainer.group_size must be >= 1, got {group_size}")
        return num_prompts * group_size

    @staticmethod
    def _check_transitions(plan: RolloutPlan, rows, steps) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        steps = torch.as_tensor(steps, dtype=torch.long).cpu()
        if rows.shape != steps.shape:
            raise ValueError(f"rows {tuple(rows.shape)} and steps {tuple(steps.shape)} must have the same shape")
        if rows.numel() and not bool(plan.train_mask[rows, steps].all()):
            raise ValueError("loss_weights asked for a transition the plan does not train (train_mask is False)")
        return rows, steps


def build_algorithm(algo_cfg, sampler_cfg, base_sigmas: torch.Tensor, *, window=None) -> Algorithm:
    """The :class:`Algorithm` named by ``algo_cfg.name`` (``"grpo"``, ``"mix_grpo"``, ``"flash_grpo"``).

    Args:
        algo_cfg: the ``algo`` node (``flowgrpo.config.AlgoConfig``).
        sampler_cfg: the ``sampler`` node (``flowgrpo.config.SamplerConfig``): kernel, noise level, solver,
            ``sde`` mode, window, compression.
        base_sigmas: ``[sampler.num_steps + 1]`` training schedule (``flowgrpo.build.Sampler.sigmas``: the model
            scheduler's own).
        window: optional ``samplers.SDEWindow`` to use instead of a new one from ``sampler.window`` — pass
            ``Sampler.window`` so the run has one window object whichever handle moves or saves it.

    Errors name the config key to change.
    """
    from . import flash_grpo, grpo, mix_grpo  # noqa: F401  (register the algorithms)
    from ..config import validate

    validate(algo_cfg)
    validate(sampler_cfg)
    name = algo_cfg.name
    if name not in ALGORITHMS:
        raise ValueError(f"algo.name={name!r} is not one of {', '.join(sorted(ALGORITHMS))}")
    sigmas = torch.as_tensor(base_sigmas, dtype=torch.float32)
    if sigmas.ndim != 1 or sigmas.shape[0] != sampler_cfg.num_steps + 1:
        raise ValueError(f"base_sigmas has shape {tuple(sigmas.shape)}; sampler.num_steps={sampler_cfg.num_steps} "
                         f"needs [{sampler_cfg.num_steps + 1}] (build it with flowgrpo.build.build_sampler)")
    return ALGORITHMS[name].from_config(algo_cfg, sampler_cfg, sigmas, window=window)
