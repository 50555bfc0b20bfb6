"""What an algorithm is to the trainer: a plan for the rollout, an advantage, and the loss of its own update.

The trainer's loop is ``plan → rollout → score → advantage → update → log/checkpoint``. An algorithm fills phase 1
(:meth:`Algorithm.plan` → :class:`RolloutPlan`: which steps are stochastic, which are trained), chooses the rollout
of phase 2 (:meth:`Algorithm.make_rollout` → a :class:`~flowgrpo.rollout.Rollout`; the default integrates the plan),
owns phase 4 (:meth:`Algorithm.advantages`, from the gathered :class:`Scores`; a multi-component reward's aggregator
is handed to it) and the loss of phase 5 (:meth:`Algorithm.loss`), and declares what it needs of the trainer and the
rollout (:attr:`Algorithm.needs`, a :class:`Needs`: a reference policy, recorded means, ...). The trainer owns the loop
around them: accumulation, clipping, the optimizer, EMA, logging, checkpoints. It reaches the model only through an
:class:`UpdateContext`, so an algorithm never touches the trainer's modules directly. The whole contract, with a
worked example: ``docs/extending.md``.

>>> algo = build_algorithm(cfg.algo, cfg.sampler, sigmas)                    # doctest: +SKIP
>>> plan = algo.plan(num_prompts, group_size, generator=gen)                 # phase 1
>>> rollout = algo.make_rollout(model, seed=seed, batch_size=8)              # once
>>> batch = rollout(batch, iteration)                                        # phase 2: batch.plan sampled
>>> adv = algo.advantages(Scores(batch, gather=accelerator.gather))         # phase 4
>>> loss, info = algo.loss(ctx, batch, rows, steps)                          # phase 5, per micro-batch and step
>>> algo.end_iteration()                                                     # after the update

A new algorithm is one module in this package (it is imported by the package, and registers itself by its
``name``) with a config schema (``config_class``, a :class:`~flowgrpo.config.AlgoConfig` subclass) and one
``conf/algo/<name>.yaml`` option; the trainer does not change.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, ContextManager, Iterator

import torch
from omegaconf import OmegaConf

from samplers import KERNELS, SOLVERS, compress_tail, sde_bounds

from ..advantages import group_advantages
from ..config import AlgoConfig
from ..registry import ALGORITHMS, register_algorithm  # name → Algorithm subclass, filled as classes are defined
from ..rollout import PlanRollout, Rollout, SamplingModel

__all__ = ["RolloutPlan", "Batch", "Needs", "Scores", "GalleryNotes", "UpdateContext", "Algorithm", "ALGORITHMS",
           "build_algorithm"]


@dataclass
class RolloutPlan:
    """One iteration's rollout, decided in phase 1 for the whole (global) batch.

    Attributes:
        sigmas: ``[T'+1]`` float32 schedule the rollout integrates, shared by the batch (MixGRPO-Flash: the
            compressed tail; else the sampler's ``T``-step schedule).
        sde_mask: ``[N, T']`` bool, stochastic steps per sample; ``N = prompts × group_size``, group members
            consecutive (rows ``p·G … p·G+G−1`` are prompt ``p``). All False for an ODE-only rollout. A stateful
            model generating chunk by chunk (streaming video) has a chunk axis: ``[N, C, T']``, each chunk integrated
            over ``sigmas`` (the streaming rollout of :mod:`flowgrpo.rollout`).
        train_mask: the shape of ``sde_mask``: the steps the update trains, the same number per row. Trained steps
            are addressed by their index in the row's flattened mask (``c·T' + i`` with a chunk axis:
            :meth:`chunk_step`). For policy-gradient
            algorithms a subset of ``sde_mask`` (the stored transitions whose log-prob is rescored); for
            forward-process algorithms (DiffusionNFT) the noise levels of the schedule the clean sample is
            re-noised to.
        solver: ``"euler"`` | ``"dpm++2m"`` (ODE steps after a row's last SDE step), for ``samplers.rollout``.
        kernel: SDE kernel (``samplers.KERNELS``); noise_level: its ``a`` / ``η``.
        group_size: ``G``.
        info: what else the plan fixed for the whole batch: logs (window start, Flash steps) and batch-wide
            constants (Flash-GRPO's ``inv_lambda_mean``); kept by :meth:`subset`.
        tail_ratio: ``< 1``: each row integrates the steps after its own last SDE step on a compressed grid of
            ``max(1, ⌊n·ratio⌋)`` steps (``samplers.compress_tail``; Flash-GRPO, whose SDE step differs per prompt).
            ``sigmas`` stays the full grid: every trained step (never after a row's last SDE step) and the states
            around it are on it. The rollout then stores each row's states up to one after its last SDE step and
            its final sample (index ``T'``); states in between were never visited on this grid and are NaN.
    """

    sigmas: torch.Tensor
    sde_mask: torch.Tensor
    train_mask: torch.Tensor
    solver: str
    kernel: str
    noise_level: float
    group_size: int = 1
    info: dict[str, Any] = field(default_factory=dict)
    tail_ratio: float = 1.0

    def __post_init__(self) -> None:
        self.sigmas = torch.as_tensor(self.sigmas, dtype=torch.float32)
        steps = self.sigmas.shape[0] - 1
        if self.sde_mask.dtype != torch.bool or self.sde_mask.ndim not in (2, 3) or self.sde_mask.shape[-1] != steps:
            raise ValueError(f"sde_mask must be bool [N, {steps}] or [N, C, {steps}], got {self.sde_mask.dtype} "
                             f"{tuple(self.sde_mask.shape)}")
        if self.train_mask.shape != self.sde_mask.shape or self.train_mask.dtype != torch.bool:
            raise ValueError("train_mask must be a bool tensor of sde_mask's shape")
        counts = self.train_mask.flatten(1).sum(1)
        if counts.numel() and not bool((counts == counts[0]).all()):
            raise ValueError("every row must train the same number of steps (train_mask row sums differ)")
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

    @property
    def num_chunks(self) -> int:
        """``C``: chunks generated one after the other (1 without a chunk axis)."""
        return self.sde_mask.shape[1] if self.sde_mask.ndim == 3 else 1

    @property
    def trained_per_row(self) -> int:
        """Trained steps per row (the same for every row)."""
        return int(self.train_mask[0].sum()) if self.num_rows else 0

    def chunk_step(self, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chunks, steps)`` of flat trained-step indices (``c·T' + i``); chunks are 0 without a chunk axis."""
        steps = torch.as_tensor(steps, dtype=torch.long)
        return torch.div(steps, self.num_steps, rounding_mode="floor"), steps % self.num_steps

    def first_sde_step(self) -> torch.Tensor:
        """``LongTensor[N]``: each row's first SDE step (``T'`` when none). Steps before it are deterministic, so
        when a group shares its initial noise the rollout integrates that prefix once per prompt
        (:meth:`shared_prefix`) and branches the group there."""
        if self.num_chunks > 1:
            raise ValueError("a plan with a chunk axis has no shared deterministic prefix (each chunk starts from its own noise)")
        return sde_bounds(self.sde_mask)[0]

    def last_sde_step(self) -> torch.Tensor:
        """``LongTensor[N]``: each row's last SDE step (−1 when none)."""
        if self.num_chunks > 1:
            raise ValueError("a plan with a chunk axis has no per-row tail (each chunk is integrated on the full grid)")
        return sde_bounds(self.sde_mask)[1]

    def row_sigmas(self, last_sde: int) -> torch.Tensor:
        """The grid a row whose last SDE step is ``last_sde`` integrates: ``sigmas``, or with ``tail_ratio < 1``
        its compressed tail (``samplers.compress_tail``; rows without an SDE step keep the full grid)."""
        if self.tail_ratio >= 1 or last_sde < 0:
            return self.sigmas
        return compress_tail(self.sigmas, last_sde, self.tail_ratio)

    def shared_prefix(self) -> torch.Tensor:
        """``LongTensor[P]``: per group, the number of leading steps that are ODE for every member (the min of
        :meth:`first_sde_step` over the group) — computed once per prompt under shared noise."""
        return self.first_sde_step().view(-1, self.group_size).amin(dim=1)

    def subset(self, rows: torch.Tensor) -> "RolloutPlan":
        """The plan of some rows (e.g. one process's whole groups, in order); ``sigmas`` and ``info`` — which holds
        batch-wide quantities such as Flash-GRPO's weight normalisation — are kept, so an algorithm's loss weights
        are the same as on the full plan."""
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        return dataclasses.replace(self, sde_mask=self.sde_mask[rows], train_mask=self.train_mask[rows])

    def trained_transitions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, steps)`` of every trained step, row-major; ``steps`` index the row's flattened mask."""
        rows, steps = self.train_mask.flatten(1).nonzero(as_tuple=True)
        return rows, steps


@dataclass
class Batch:
    """One iteration's rollouts on one process: what the rollout recorded and the update reads.

    Rows are prompt-major: the G members of a prompt are consecutive.
    """

    prompts: list[str]                 # per row
    metadata: list[dict] | None        # per row
    global_rows: torch.Tensor          # [n] index of each row in the global batch
    cond: Any                          # the adapter's conditioning (PromptEmbeds, ...), per row
    plan: RolloutPlan                  # rows of this process
    latents: torch.Tensor | None = None             # [n, T'+1, ...] every state ([n, C, T'+1, ...] with chunks)
    log_probs: torch.Tensor | None = None           # [n, T'] exact log π_old of each SDE step ([n, C, T']); 0 on ODE
    means: torch.Tensor | None = None               # [n, T', ...] each SDE step's Gaussian mean under the sampling
                                                    # policy, NaN on ODE steps; only for an algorithm that
                                                    # declares ``Needs.record_means`` (GRPO-Guard), else None
    chunk_conds: list[Any] | None = None            # with chunks: chunk c's conditioning (text + the state written
                                                    # by the chunks before it), per row: what rescoring needs
    chunk_rows: list[torch.Tensor] | None = None    # with chunks, [n] each: the row of chunk_conds[c] that holds
                                                    # batch row r, -1 where not kept (None: every row, in order)
    final: torch.Tensor | None = None               # [n, ...] each row's clean sample ([n, C, ...] its chunks), a view
                                                    # of latents: adapter.decode(adapter.join_chunks(final))
    images: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    components: dict[str, torch.Tensor] = field(default_factory=dict)
    degenerate: torch.Tensor | None = None          # [n] 1.0 where the decoded sample is flat or pure noise
    advantages: torch.Tensor | None = None          # [n] this process's rows
    global_rewards: torch.Tensor | None = None      # [N·G] gathered from every process
    global_advantages: torch.Tensor | None = None   # [N·G]
    nfe: int = 0                                    # sample-steps of velocity evaluations on this process
    extras: dict[str, Any] = field(default_factory=dict)  # what the plan, an algorithm's own rollout or its phase 4
                                                          # recorded for the update; the loss only reads it


@dataclass(frozen=True)
class Needs:
    """What an algorithm needs of the trainer and of the rollout, declared (:attr:`Algorithm.needs`) so the trainer
    never infers it from the algorithm's knobs.

    Attributes:
        reference: the update calls ``ctx.reference()`` (a KL or regression term to the initial policy). Only then
            does a fully fine-tuned model keep a frozen copy, and an undeclared call raises.
        shared_noise: the ``G`` members of a group start from one initial noise (the rollout then integrates their
            common deterministic prefix once per prompt).
        record_means: the rollout keeps each SDE step's mean under the sampling policy (``Batch.means``).
        training_guidance: ``ctx.velocity`` applies the run's guidance (CFG), as the rollout sampled with it; False:
            the conditional velocity (guidance scale 1).
        whole_groups: the loss couples the members of a group at one trained step (DGPO): the trainer visits every
            member's trained steps in the same order, and each training micro-batch holds whole groups.
    """

    reference: bool = False
    shared_noise: bool = False
    record_means: bool = False
    training_guidance: bool = True
    whole_groups: bool = False


class Scores:
    """Phase 4's input: this process's scored batch and the rewards of the whole (global) batch, gathered from every
    process in process order (each process holds whole groups, so the gathered rows are whole groups too).

    Args:
        batch: this process's batch after phase 3 (``rewards``, ``components``).
        gather: concatenates a per-process tensor over processes (``accelerator.gather``); the identity (the
            default) on one process.

    Attributes:
        batch: as given; rewards: ``[N·G]`` the gathered rewards; group_size: ``G``.
    """

    def __init__(self, batch: Batch, gather=None):
        self.batch = batch
        self._gather = gather if gather is not None else (lambda t: t)
        self.rewards = self.gather(batch.rewards)
        self.group_size = batch.plan.group_size

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[n]`` values of this process's rows → ``[N·G]`` of the whole batch (on the rewards' device)."""
        return self._gather(local.to(self.batch.rewards.device).contiguous())

    def components(self, names) -> dict[str, torch.Tensor]:
        """The named reward components of the whole batch (``{name: [N·G]}``), gathered."""
        return {k: self._gather(self.batch.components[k].contiguous()) for k in names}


@dataclass
class GalleryNotes:
    """What an algorithm adds to the training gallery (:meth:`Algorithm.gallery`), all per row.

    Attributes:
        columns: values shown beside the reward components (``{name: [n]}``).
        notes: per row, more pieces for the label of the grid (None: the reward and the advantage only).
        marks: ``[n, 2]`` the first and last pixel frame of a window to point out (NaN: none; None: nothing).
    """

    columns: dict[str, torch.Tensor] = field(default_factory=dict)
    notes: list[list[str]] | None = None
    marks: torch.Tensor | None = None


class UpdateContext:
    """How an algorithm's update reaches the model; the trainer provides one (a test can provide its own).

    Attributes:
        params: the trainable parameters (what the optimizer updates), in ``named_parameters`` order.
        updates: optimizer updates so far.
        iteration: the iteration being updated; epoch: its inner epoch (``trainer.inner_epochs``). What an
            algorithm may key per-update caches by.

    These attributes and the methods below are everything an algorithm reads of its context.
    """

    params: list[torch.nn.Parameter]
    updates: int = 0
    iteration: int = 0
    epoch: int = 0

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Any) -> torch.Tensor:
        """The trained policy's velocity at ``(x, σ)`` (``σ`` a scalar, ``[B]``, or per token as the adapter
        allows), with the training-time guidance and autocast; differentiable. Inside :meth:`reference` it is the
        reference policy's."""
        raise NotImplementedError

    def reference(self) -> ContextManager[None]:
        """A context in which :meth:`velocity` is the reference policy (LoRA disabled, or the frozen copy of a
        fully fine-tuned model). Use under ``torch.no_grad()``; only an algorithm that declares
        ``Needs.reference`` may call it."""
        raise NotImplementedError

    def generator(self, *keys: int) -> torch.Generator:
        """A CPU generator seeded by the run's seed, the iteration, the inner epoch and ``keys`` (e.g. a global row
        and a step): the same draws on any number of processes and after a resume."""
        raise NotImplementedError

    def stored_weights(self, path: str) -> list[torch.Tensor]:
        """The trainable parameters saved by an earlier run of the same model set-up, in :attr:`params` order: ``path``
        is a run directory, a checkpoint root or a checkpoint directory (its newest intact checkpoint). For policies an
        algorithm uses beside the trained one (Flow-OPD's teachers); swap them in as :class:`OldPolicy` does."""
        raise NotImplementedError

    # A streaming (stateful, chunk-by-chunk) model also offers these, for an update that replays whole streams
    # (an algorithm's own rollout reaches the model through flowgrpo.rollout.SamplingModel instead).

    def commit(self, x0: torch.Tensor, cond: Any) -> Any:
        """Write the finished chunk ``x0`` into the model's state (no grad); the next chunk's conditioning. ``cond``
        is not changed."""
        raise NotImplementedError

    def routed(self, route) -> ContextManager[None]:
        """A context in which a streaming model's blocks attend the cached frames ``route(frame_offset, num_frames,
        cached_positions)`` picks (one list, or one row per stream) instead of their sink + window."""
        raise NotImplementedError

    def teacher_forced_velocity(self, clean: torch.Tensor, noisy: torch.Tensor, sigma: torch.Tensor,
                                cond: Any, routes=None) -> torch.Tensor:
        """A streaming model's velocity of every block of whole streams in one teacher-forced forward per stream:
        ``noisy`` ``[n, K, ...]`` blocks at ``sigma`` ``[n, K]``, each against the clean context the stream's cache
        held (built from ``clean``, the committed blocks), under its own segment's prompt; no guidance. Block
        ``k``'s output equals :meth:`velocity` at ``(noisy[:, k], sigma[:, k])`` under block ``k``'s conditioning
        without guidance. ``routes``: per stream, the route it was streamed under (as :meth:`routed` takes, one
        list per call) or ``None`` (unrouted; the default). Differentiable; inside :meth:`reference` it is the
        reference policy's."""
        raise NotImplementedError


class Algorithm:
    """Base class: ``name`` registers the subclass for :func:`build_algorithm`; ``config_class`` is its schema.

    The constructor takes the schedule, the sampler's kernel / noise level / solver, and the fields of
    ``config_class`` as keywords (their defaults are the schema's): ``GRPO(sigmas, timestep_fraction=0.5)``. The
    config instance is ``self.cfg`` (``algo.cfg.global_std``). ``aggregator``: a multi-component reward's
    :class:`~flowgrpo.advantages.RewardAggregator` (``reward.aggregate``), which phase 4 then uses.

    Shared behaviour: group-relative advantages (``algo.global_std``, ``algo.adv_clip``), or the aggregator handed
    in for a multi-component reward; no state. Subclasses implement :meth:`plan`, :meth:`loss` and
    :meth:`trained_steps`, declare what they need (:attr:`needs`) and override what their paper changes.

    Distributed use: call :meth:`plan` for the *global* batch with a generator seeded identically on every
    process (then slice rows), and :meth:`advantages` on the gathered rewards, so every process agrees.
    """

    name: ClassVar[str] = ""
    config_class: ClassVar[type] = AlgoConfig
    #: trains a streaming model (``model.family=causal_wan``): its plans have a chunk axis, one chunk per block
    streaming: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            # its class by name, and its schema for `algo/<name>.yaml`'s defaults list (flowgrpo.registry)
            register_algorithm(cls)

    def __init__(
        self,
        base_sigmas: torch.Tensor,
        *,
        kernel: str = "flow_grpo",
        noise_level: float = 0.7,
        solver: str = "euler",
        cfg: Any = None,
        chunks: int = 1,
        aggregator: Any = None,
        **options: Any,
    ) -> None:
        sigmas = torch.as_tensor(base_sigmas, dtype=torch.float32).detach().cpu()
        if sigmas.ndim != 1 or sigmas.shape[0] < 2 or bool((sigmas.diff() >= 0).any()):
            raise ValueError("base_sigmas must be a strictly decreasing [T+1] schedule (the sampler's sigmas)")
        if kernel not in KERNELS:
            raise ValueError(f"sampler.kernel={kernel!r} is not one of {', '.join(KERNELS)}")
        if solver not in SOLVERS:
            raise ValueError(f"sampler.solver={solver!r} is not one of {', '.join(SOLVERS)}")
        known = {f.name for f in dataclasses.fields(self.config_class)} - {"name"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no option {', '.join(unknown)} (its schema "
                            f"{self.config_class.__name__} has: {', '.join(sorted(known))})")
        if cfg is None:
            cfg = self.config_class(name=self.name, **options)
        elif options:
            cfg = dataclasses.replace(cfg, **options)
        from ..config import validate

        validate(OmegaConf.create({"algo": OmegaConf.structured(cfg)}).algo)  # errors name algo.<key>
        if chunks < 1 or (chunks > 1 and not self.streaming):
            raise ValueError(f"{type(self).__name__} generates in one chunk; chunks={chunks} needs a streaming "
                             "algorithm")
        self.cfg = cfg
        self.num_chunks = int(chunks)
        self.base_sigmas = sigmas
        self.kernel = kernel
        self.noise_level = float(noise_level)
        self.solver = solver
        self.aggregator = aggregator

    @classmethod
    def from_config(cls, algo_cfg, sampler_cfg, base_sigmas: torch.Tensor, chunks: int = 1,
                    aggregator: Any = None) -> "Algorithm":
        """Build from the ``algo`` and ``sampler`` nodes (see :func:`build_algorithm`)."""
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls.config_class), algo_cfg))
        return cls(base_sigmas, kernel=sampler_cfg.kernel, noise_level=float(sampler_cfg.noise_level),
                   solver=sampler_cfg.solver, cfg=cfg, chunks=chunks, aggregator=aggregator)

    @classmethod
    def check_config(cls, algo_cfg, sampler_cfg) -> list[str]:
        """Constraints between this algorithm's config and the sampler's, checked by ``flowgrpo.config.validate``
        before anything is built: one message per violation, naming the keys."""
        return []

    @property
    def num_steps(self) -> int:
        """``T`` of the base schedule."""
        return self.base_sigmas.shape[0] - 1

    @classmethod
    def declare_needs(cls, algo_cfg) -> Needs:
        """What this algorithm needs of the trainer and the rollout (:class:`Needs`) with the config ``algo_cfg`` (its
        schema instance or the ``algo`` node), known before anything is built. The default reads the schema's shared
        knobs: a reference policy when ``algo.kl_beta > 0`` (the KL / regression term to it), one noise per group
        with ``algo.shared_noise``, the training guidance with ``algo.cfg_in_training``. An algorithm whose reference
        term has another knob, that reads recorded means or that couples a group's members says so here."""
        return Needs(reference=algo_cfg.kl_beta > 0, shared_noise=bool(algo_cfg.shared_noise),
                     training_guidance=bool(algo_cfg.cfg_in_training))

    @property
    def needs(self) -> Needs:
        """:meth:`declare_needs` of this instance's config."""
        return self.declare_needs(self.cfg)

    def baseline_members(self, group_size: int) -> torch.Tensor:
        """``[G]`` bool: the members of a group that are a baseline sampled beside the trained ones and never
        trained (KVPO: its last member, the unrouted reference run); none by default. What a diagnostic separates."""
        return torch.zeros(group_size, dtype=torch.bool)

    # ---------------------------------------------------------------------------------------- phases

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None) -> RolloutPlan:
        """Phase 1: this iteration's rollout plan for ``num_prompts × group_size`` rows."""
        raise NotImplementedError

    def trained_steps(self) -> tuple[int, str]:
        """``(K, note)``: steps each sample trains per inner epoch (every plan's ``trained_per_row``), and why, for
        the start-up banner; the trainer accumulates gradients over micro-batches × K."""
        raise NotImplementedError

    def make_rollout(self, model: SamplingModel, **engine: Any) -> Rollout:
        """Phase 2's engine (:mod:`flowgrpo.rollout`): what samples this algorithm's plans. The default,
        :class:`~flowgrpo.rollout.PlanRollout`, with the options this algorithm declares (:attr:`needs`): one initial
        noise per group (``shared_noise``) and each SDE step's mean recorded (``record_means``). An algorithm that samples
        in its own way (KVPO's routed branches) returns a :class:`~flowgrpo.rollout.Rollout` of its own.

        Args:
            model: what the rollout samples through (:class:`~flowgrpo.rollout.SamplingModel`).
            engine: :class:`~flowgrpo.rollout.Rollout`'s keywords (``seed``, ``batch_size``, ``between_chunks``).
        """
        needs = self.needs
        return PlanRollout(model, shared_noise=needs.shared_noise, record_means=needs.record_means, **engine)

    def gallery(self, batch: Batch) -> GalleryNotes:
        """What the training gallery shows of this algorithm beside the rewards (:class:`GalleryNotes`: KVPO's
        branch, its policy probability and its routed frames); nothing by default. Reads the batch and the
        algorithm's own state, never writes either."""
        return GalleryNotes()

    @contextlib.contextmanager
    def sampling_policy(self, ctx: UpdateContext) -> Iterator[None]:
        """Phase 2 runs inside this context: the weights the rollout samples with. The trained weights, unless
        the algorithm samples from a policy of its own (DiffusionNFT's old policy)."""
        yield

    def advantages(self, scores: Scores) -> torch.Tensor:
        """Phase 4, its one owner: ``[N·G]`` advantages of the whole batch from the gathered :class:`Scores`; every
        process computes the same. The aggregator's, when one was handed in (``reward.aggregate``), else
        :meth:`reward_advantages` of the gathered rewards. An algorithm whose advantages are relative to something
        inside each group (KVPO: its reference run) computes them from ``scores.batch``'s whole groups and returns
        ``scores.gather(local)``; it may record per-row quantities for its loss in ``batch.extras`` here."""
        if self.aggregator is not None:
            comps = scores.components(self.aggregator.weights)
            return self.aggregator(comps, scores.group_size).to(scores.rewards.device)
        return self.reward_advantages(scores.rewards, scores.group_size)

    def reward_advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """The advantages of a reward vector ``[N·G]``: ``group_advantages(rewards, G, global_std=algo.global_std,
        clip=algo.adv_clip)`` (the GRPO family may shape them: SLAS)."""
        return group_advantages(rewards, group_size, global_std=self.cfg.global_std, clip=self.cfg.adv_clip)

    def loss(self, ctx: UpdateContext, batch: Batch, rows: torch.Tensor,
             steps: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """Phase 5: the loss of one micro-batch at one trained step per row.

        Args:
            ctx: the model access (:class:`UpdateContext`).
            batch: this process's rollouts, advantages included.
            rows: ``[b]`` rows of ``batch``; steps: ``[b]`` one trained step of each (``batch.plan.train_mask``).

        Returns:
            ``(loss, info)``: a 0-d tensor to backpropagate, and scalars to log (floats or 0-d tensors) as
            ``train/<key>``: the trainer logs each key's mean over the iteration's micro-batches on every process
            (:func:`flowgrpo.train_metrics.train_scalars`), a key ending in ``_max`` / ``_min`` being a micro-batch's
            extreme. Which keys appear may depend on the config and the step, not on a process's samples.
        """
        raise NotImplementedError

    def end_iteration(self, ctx: UpdateContext | None = None) -> None:
        """Called once after each iteration's update (MixGRPO moves its window; DiffusionNFT moves its old
        policy)."""

    def state_dict(self) -> dict:
        """What an exact resume needs (window position, old-policy weights)."""
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
        return f"advantage ({'global' if self.cfg.global_std else 'group'} std, clip ±{self.cfg.adv_clip:g})"

    def _make_plan(self, sigmas, sde_mask, train_mask, group_size, *, tail_ratio: float = 1.0, **info) -> RolloutPlan:
        return RolloutPlan(sigmas=sigmas, sde_mask=sde_mask, train_mask=train_mask, solver=self.solver,
                           kernel=self.kernel, noise_level=self.noise_level, group_size=group_size, info=info,
                           tail_ratio=tail_ratio)

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
        if rows.numel() and not bool(plan.train_mask.flatten(1)[rows, steps].all()):
            raise ValueError("asked for a step the plan does not train (train_mask is False)")
        return rows, steps


def build_algorithm(algo_cfg, sampler_cfg, base_sigmas: torch.Tensor, *, chunks: int = 1,
                    aggregator: Any = None) -> Algorithm:
    """The :class:`Algorithm` named by ``algo_cfg.name`` (``flowgrpo.algorithms.ALGORITHMS``).

    Args:
        algo_cfg: the ``algo`` node (the algorithm's schema, an ``AlgoConfig`` subclass).
        sampler_cfg: the ``sampler`` node (``flowgrpo.config.SamplerConfig``): kernel, noise level, solver.
        base_sigmas: ``[sampler.num_steps + 1]`` training schedule (``flowgrpo.builders.Sampler.sigmas``: the model
            scheduler's own).
        chunks: the chunks a sample is generated in (``adapter.num_chunks``: 1, or a streaming model's blocks).
        aggregator: a multi-component reward's aggregator (``reward.aggregate``), handed to phase 4.

    Errors name the config key to change.
    """
    from ..config import ConfigError, algo_schema, validate

    validate(sampler_cfg)
    algo_schema(algo_cfg.name)  # an unknown name names algo.name and the registered ones
    validate(algo_cfg)
    errors = ALGORITHMS[algo_cfg.name].check_config(algo_cfg, sampler_cfg)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    sigmas = torch.as_tensor(base_sigmas, dtype=torch.float32)
    if sigmas.ndim != 1 or sigmas.shape[0] != sampler_cfg.num_steps + 1:
        raise ValueError(f"base_sigmas has shape {tuple(sigmas.shape)}; sampler.num_steps={sampler_cfg.num_steps} "
                         f"needs [{sampler_cfg.num_steps + 1}] (build it with flowgrpo.builders.build_sampler)")
    return ALGORITHMS[algo_cfg.name].from_config(algo_cfg, sampler_cfg, sigmas, chunks=chunks, aggregator=aggregator)
