"""Flow-OPD (arXiv 2605.08063): on-policy distillation of several single-reward teachers into one student.

Stage 1 trains one teacher per reward with plain GRPO (``python train.py reward=geneval ...``, ``reward=jpeg...``): each
run's checkpoint is a teacher. Stage 2, this algorithm: the student samples Flow-GRPO trajectories (every step an SDE
step), each prompt is routed to a teacher, and the teacher's Gaussian transition from the same state gives a dense
per-step reward, the negative reverse KL

    KL_t = KL(π_θ(·|x_t) ‖ π_T(·|x_t)) = ‖μ_θ − μ_T‖² / (2 s²)      (student and teacher share the kernel's std s)
    A_t  = clip(kl_scale · r_t  [+ task_weight · A_group], ±adv_clip)          kl_scale = −1: the reward is −KL
    L    = mean( max(−A_t·ρ, −A_t·clip(ρ, 1 ± ε)) ) + mar_beta · KL(π_θ ‖ π_MAR)

with Flow-GRPO's per-step ratio ``ρ`` and PPO clip. The last term, MAR (the paper's manifold regulariser), keeps the
student near a task-agnostic policy on all data: the reference (LoRA disabled) unless ``algo.mar`` names a checkpoint.

What ``r_t`` is (``algo.kl_reward``) decides whether the distillation learns at all:

* ``exact``: the closed-form ``KL_t`` (``samplers.sde_kl``, on the scale of ``algo.logprob_reduction``). It depends on
  the state ``x_t`` only, not on the step ``x_{t+1}`` taken from it, so as a detached advantage (``algo.detach_kl``,
  what the paper prescribes) its policy gradient ``E[A_t ∇log π_θ(x_{t+1}|x_t)]`` is zero: the distillation term
  only adds noise and MAR pulls the student back to the reference (measured: the held-out scores stay at the base
  model's). The authors' code keeps the KL's gradient in the advantage (``algo.detach_kl=false``): the loss then
  gains a direct ``−kl_scale·ρ·∇KL_t`` pull towards the teacher (the GKD objective), which is what moves their
  student; it also drops the step's ``|Δσ|`` from the KL (their values are ``KL/|Δσ|``).
* ``sampled`` (default): the log-ratio of the step actually taken, ``log π_θ(x_{t+1}|x_t) − log π_T(x_{t+1}|x_t)``,
  summed over the sample's latent elements and detached — the on-policy distillation estimator. Its mean over
  ``x_{t+1} ~ π_θ`` is ``KL_t``, and because it depends on the step taken its policy gradient on the reduced ratio is
  ``E[r_t ∇log π_θ] = ∇KL_t`` on the ratio's scale: in expectation the authors' direct pull, reached through the
  likelihood ratio with the reward detached, as the paper asks.

Routing (``algo.routing``): ``alternate``, the authors' multi-task loop — each iteration distils one teacher, cycling
through ``algo.schedule`` (teacher names; repeat a name to give it more iterations; empty = each teacher once, in
``algo.teachers`` order); ``metadata`` — each prompt's teacher is its metadata field ``algo.route_key``.
``algo.task_weight > 0`` adds the group advantage of the task reward (the authors' "mixed" mode).

Defaults are the authors' (``CostaliyA/Flow-OPD``, ``mix_opd_8gpu``) except ``kl_reward``: Flow-GRPO's kernel on
every step, 9 of 10 steps trained, ``clip_range 1e-4``, ``kl_scale −1``, ``adv_clip 5``, MAR weight 0.04 against the
base model, and their best cold start (``algo.cold_start``): before the first rollout the student's trainable weights become the average of
the teachers' (each tensor averaged, as their LoRA merge); a resumed run keeps its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch

from samplers import sde_kl, sde_step

from ..config import ConfigError
from ..knobs import knob
from .base import Batch, Needs, UpdateContext
from .grpo import GRPO, GRPOConfig
from .losses import ppo_clip_loss, reduce_log_prob
from .old_policy import OldPolicy

__all__ = ["FlowOPDConfig", "FlowOPD"]

ROUTINGS = ("alternate", "metadata")
KL_REWARDS = ("sampled", "exact")


@dataclass
class FlowOPDConfig(GRPOConfig):
    """``algo=flow_opd``: the authors' defaults; ``algo.teachers`` must name at least one teacher checkpoint."""

    kl_beta: float = knob(0.0, ge=0)  # Flow-GRPO's KL to the reference is replaced by MAR (mar_beta)
    timestep_fraction: float = knob(0.9, gt=0, le=1)  # 9 of 10 SDE steps trained (the authors' int(10 * 0.99))
    timestep_selection: str = knob("first", choices=("random", "first"))  # the first ones, as Flow-GRPO's trainer
    teachers: Dict[str, str] = field(default_factory=dict)  # name -> a teacher run's dir / checkpoint (same model)
    routing: str = knob("alternate", choices=ROUTINGS)  # alternate: one teacher per iteration; metadata: per prompt
    schedule: List[str] = field(default_factory=list)  # alternate: teacher names cycled per iteration; [] = each once
    route_key: str = "task"  # metadata: the prompt metadata field naming its teacher
    kl_scale: float = -1.0  # A_t = kl_scale * r_t (negative: the reward is -KL)
    kl_reward: str = knob("sampled", choices=KL_REWARDS)  # sampled: log-ratio at the taken step; exact: closed-form KL
    task_weight: float = knob(0.0, ge=0)  # > 0: add the task reward's group advantage (the authors' mixed mode)
    detach_kl: bool = True  # kl_reward=exact: the reward carries no gradient (the paper); false: the authors' code
    mar_beta: float = knob(0.04, ge=0)  # weight of KL(pi_theta || pi_MAR) on all data
    mar: Optional[str] = None  # checkpoint of the MAR policy; null = the reference (LoRA disabled)
    cold_start: bool = True  # start the student at the average of the teachers' trainable weights


def _attached_sampled_reward(kl_reward: str, detach_kl: bool) -> str | None:
    if kl_reward == "sampled" and not detach_kl:
        return ("algo.detach_kl=false is the exact KL's direct pull (algo.kl_reward=exact); the sampled reward is a "
                "log-ratio with no gradient: set algo.kl_reward=exact, or drop algo.detach_kl")
    return None


class FlowOPD(GRPO):
    """Flow-OPD's distillation stage. See the module docstring.

    Args:
        base_sigmas: ``[T+1]`` schedule.
        **kwargs: the sampler's kernel / noise level / solver and fields of :class:`FlowOPDConfig`.
    """

    name = "flow_opd"
    config_class = FlowOPDConfig

    @classmethod
    def declare_needs(cls, algo_cfg) -> Needs:  # MAR regresses to the reference unless algo.mar names a checkpoint
        return dataclasses.replace(super().declare_needs(algo_cfg), reference=algo_cfg.mar_beta > 0 and not algo_cfg.mar)

    def __init__(self, base_sigmas: torch.Tensor, **kwargs) -> None:
        super().__init__(base_sigmas, **kwargs)
        cfg = self.cfg
        if not cfg.teachers:
            raise ValueError("algo=flow_opd needs teachers, one run trained on one reward each: "
                             "+algo.teachers.NAME=RUN_DIR_OR_CHECKPOINT")
        contradiction = _attached_sampled_reward(cfg.kl_reward, cfg.detach_kl)
        if contradiction:
            raise ConfigError(contradiction)
        unknown = [s for s in cfg.schedule if s not in cfg.teachers]
        if unknown:
            raise ValueError(f"algo.schedule names {unknown}, which algo.teachers does not have "
                             f"({', '.join(cfg.teachers)})")
        self.schedule = list(cfg.schedule) or list(cfg.teachers)
        self.policies = {name: OldPolicy() for name in cfg.teachers}  # loaded on first use
        self.mar = OldPolicy() if cfg.mar else None
        self.plans = 0  # plans made: the alternate routing's position
        self.started = False  # the cold start is done (or not asked for)

    @classmethod
    def check_config(cls, algo_cfg, sampler_cfg) -> list[str]:
        errors = []
        if not algo_cfg.teachers:
            errors.append("algo.teachers is empty: name at least one teacher checkpoint (algo.teachers.NAME=PATH)")
        paths = {f"algo.teachers.{k}": v for k, v in dict(algo_cfg.teachers).items()}
        if algo_cfg.mar:
            paths["algo.mar"] = algo_cfg.mar
        errors += [f"{key}={path}: no such run or checkpoint" for key, path in paths.items() if not Path(path).exists()]
        contradiction = _attached_sampled_reward(algo_cfg.get("kl_reward", "sampled"), algo_cfg.get("detach_kl", True))
        return errors + ([contradiction] if contradiction else [])

    # ------------------------------------------------------------------------------------------ phases

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None):
        plan = super().plan(num_prompts, group_size, generator=generator)
        if self.cfg.routing == "alternate":
            plan.info["teacher"] = self.schedule[self.plans % len(self.schedule)]
        self.plans += 1
        return plan

    @contextlib.contextmanager
    def sampling_policy(self, ctx: UpdateContext) -> Iterator[None]:
        """Before the first rollout, the cold start (``algo.cold_start``): the teachers' average becomes the student."""
        if self.cfg.cold_start and not self.started:
            teachers = [ctx.stored_weights(path) for path in self.cfg.teachers.values()]
            with torch.no_grad():
                for i, p in enumerate(ctx.params):
                    p.copy_(torch.stack([t[i] for t in teachers]).mean(dim=0))
        self.started = True
        yield

    def teacher_of(self, batch: Batch, rows: torch.Tensor) -> list[str]:
        """The teacher of each row."""
        if self.cfg.routing == "alternate":
            return [batch.plan.info["teacher"]] * len(rows)
        key = self.cfg.route_key
        if batch.metadata is None or any(key not in batch.metadata[r] for r in rows.tolist()):
            raise KeyError(f"algo.routing=metadata needs the prompt metadata field algo.route_key={key!r}")
        names = [str(batch.metadata[r][key]) for r in rows.tolist()]
        unknown = sorted(set(names) - set(self.cfg.teachers))
        if unknown:
            raise KeyError(f"prompts routed to {unknown} (metadata {key!r}), which algo.teachers does not have")
        return names

    @contextlib.contextmanager
    def _swapped(self, ctx: UpdateContext, policy: OldPolicy, path: str) -> Iterator[None]:
        if policy.weights is None:
            policy.weights = [w.clone() for w in ctx.stored_weights(path)]
        with policy.swapped_in(ctx.params):
            yield

    def loss(self, ctx: UpdateContext, batch: Batch, rows: torch.Tensor,
             steps: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.cfg
        plan = batch.plan
        flat = torch.as_tensor(steps, dtype=torch.long).cpu()
        rows, steps = self._check_transitions(plan, rows, flat)
        x = batch.latents[rows, steps]
        sigma, sigma_next = plan.sigmas[steps].to(x.device), plan.sigmas[steps + 1].to(x.device)
        cond = batch.cond[rows]
        # the teachers' and the MAR policy's velocities first (no grad): swapping weights in changes the parameters
        names = self.teacher_of(batch, rows)
        v_teacher = None
        with torch.no_grad():
            for name in dict.fromkeys(names):
                sel = torch.tensor([n == name for n in names])
                with self._swapped(ctx, self.policies[name], cfg.teachers[name]):
                    part = ctx.velocity(x[sel], sigma[sel], batch.cond[rows[sel]])
                v_teacher = part.new_empty(x.shape) if v_teacher is None else v_teacher
                v_teacher[sel.to(x.device)] = part
            if cfg.mar_beta > 0:
                with (self._swapped(ctx, self.mar, cfg.mar) if self.mar is not None else ctx.reference()):
                    v_mar = ctx.velocity(x, sigma, cond)
        step, v, _ = self._transition(ctx, batch, rows, steps)
        numel = x[0].numel()
        kind = dict(kernel=plan.kernel, noise_level=plan.noise_level)
        kl = reduce_log_prob(sde_kl(v, v_teacher, sigma, sigma_next, **kind), numel, cfg.logprob_reduction)
        if cfg.kl_reward == "sampled":
            # the log-ratio of the step taken, summed over the sample: its mean over x' ~ π_θ is the KL summed, and
            # its policy gradient on the reduced ratio is ∇KL on the ratio's scale (see the module docstring)
            taken = batch.latents[rows, steps + 1]
            teacher_log_prob = sde_step(v_teacher, x, sigma, sigma_next, prev_sample=taken, **kind).log_prob
            adv = cfg.kl_scale * (step.log_prob - teacher_log_prob).detach()
        else:
            adv = cfg.kl_scale * (kl.detach() if cfg.detach_kl else kl)
        if cfg.task_weight > 0:
            adv = adv + cfg.task_weight * batch.advantages[rows].to(adv.device)
        adv = adv.clamp(-cfg.adv_clip, cfg.adv_clip)
        log_prob, old, weights = self.ratio_terms(batch, step, rows, flat)
        loss, info = ppo_clip_loss(log_prob, old, adv, clip_range=cfg.clip_range, weights=weights.to(x.device),
                                   detach_advantages=cfg.detach_kl)
        info["teacher_kl"] = kl.detach().mean()
        if cfg.mar_beta > 0:
            mar = reduce_log_prob(sde_kl(v, v_mar, sigma, sigma_next, **kind), numel, cfg.logprob_reduction).mean()
            loss = loss + cfg.mar_beta * mar
            info["mar_kl"] = mar.detach()
        return loss, info

    def state_dict(self) -> dict:
        return {"plans": self.plans, "started": self.started}

    def load_state_dict(self, state: dict) -> None:
        self.plans = int(state.get("plans", 0))
        self.started = bool(state.get("started", True))

    def describe(self) -> str:
        cfg = self.cfg
        route = (f"one teacher per iteration ({', '.join(self.schedule)})" if cfg.routing == "alternate"
                 else f"teacher by prompt metadata {cfg.route_key!r}")
        tail = super().describe().split(": ", 1)[1]
        reward = ("the step's log-ratio to the teacher" if cfg.kl_reward == "sampled" else
                  f"the exact KL to the teacher ({'detached' if cfg.detach_kl else 'with its gradient'})")
        return (f"flow_opd (Flow-OPD): reward {cfg.kl_scale:g} x {reward} per step, {route}; MAR weight "
                f"{cfg.mar_beta:g} ({'checkpoint' if cfg.mar else 'the reference'}); {tail}")
