"""Held-out evaluation: the one protocol behind ``Trainer.evaluate`` and ``scripts/eval_geneval.py``.

>>> jobs = held_out_jobs(test_set, per_prompt=1, per_tag=48)                                   # doctest: +SKIP
>>> samples = score_jobs(adapter, reward, test_set, jobs, seed=0, sigmas=sampler.eval_sigmas,
...                      model_kw=model_kwargs(cfg.model), batch_size=64)                      # doctest: +SKIP
>>> samples.scalars()["eval/geneval"], samples.geneval()["per_tag"]                           # doctest: +SKIP

The protocol, in full:

- **which images** (:func:`held_out_jobs`): the held-out prompts (the first ``trainer.eval_num_prompts`` of them
  when set), ``trainer.eval_samples_per_prompt`` images each, raised so that every metadata tag gets at least
  ``trainer.eval_samples_per_tag`` images (:func:`eval_seed_counts`). Sample ``j`` of held-out prompt ``i``
  starts from the noise drawn by :func:`eval_generator` ``(trainer.eval_seed, i, j)`` — a stream of its own,
  independent of the training seed, so every run is judged on the same images, whatever the batching, the
  number of processes or the prompts a caller keeps.
- **which set**: the validation set (``data.val_file``, noise stream ``EVAL_STREAM``) is what training evaluates
  on and what probes, sweeps and tuning read; the test set (``data.test_file``, noise stream ``TEST_STREAM``: other
  noise even where the world has no other prompts) is scored only by ``scripts/paired_eval.py --split test``, for
  the numbers a claim reports.
- **how** (:func:`generate`, the adapter's ``generate``): the deterministic Euler ODE (``samplers.rollout``
  without an SDE step) over the held-out schedule (``Sampler.eval_sigmas``: ``sampler.eval_num_steps`` steps of the
  model scheduler's grid, or of ``sampler.shift``'s when set), classifier-free guidance as the model config says
  (``model.guidance_scale``, ``model.negative_prompt``), batched. A streaming model samples each stream with its own re-noising sampler
  instead (``cps`` at noise level 1, block by block), its re-noise draws from the sample's generator too.
- **scored and summarised** (:func:`score_jobs`, :class:`EvalSamples`): by the run's reward; the mean over
  samples of the reward and of each component, and for each GenEval reward (bare or inside ``reward=multi``)
  GenEval's overall score, the mean over tags of the per-tag means (:func:`rewards.geneval_summary`).

The trainer deals the jobs to its processes and gathers the scores back into job order; the script runs them all
in one process. Both score the same samples, so the script prints what the trainer's evaluation at iteration 0
logs for the same pipeline.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch

from rewards import geneval_prefixes, geneval_summary

from .builders import PromptSet, tag_rows
from .seeding import EVAL_STREAM, TEST_STREAM, seeded_generator

__all__ = [
    "EVAL_STREAM",
    "TEST_STREAM",
    "EvalSamples",
    "eval_generator",
    "eval_seed_counts",
    "gallery_jobs",
    "generate",
    "held_out_jobs",
    "score_jobs",
    "seeded_generator",
]

Job = tuple[int, int]  # (index of the prompt in the held-out set, index of its fixed seed)


def eval_generator(eval_seed: int, prompt: int, sample: int, stream: int = EVAL_STREAM) -> torch.Generator:
    """The CPU generator of held-out sample ``sample`` of prompt ``prompt`` (CPU: the same noise on any device), on
    the validation noise stream, or on ``TEST_STREAM`` for the test set."""
    return seeded_generator(eval_seed, stream, prompt, sample)


def eval_seed_counts(prompts: PromptSet, per_prompt: int, per_tag: int | None) -> list[int]:
    """Fixed seeds per held-out prompt: ``per_prompt`` each, raised so that every metadata ``tag`` gets at least
    ``per_tag`` images (``ceil(per_tag / prompts of the tag)`` per prompt): a tag-averaged score (GenEval's overall)
    is then not dominated by the noise of tags with one or two prompts."""
    counts = [per_prompt] * len(prompts)
    if per_tag is None or prompts.metadata is None:
        return counts
    sizes: dict[str, int] = {}
    for m in prompts.metadata:
        sizes[str(m.get("tag"))] = sizes.get(str(m.get("tag")), 0) + 1
    return [max(c, math.ceil(per_tag / sizes[str(m.get("tag"))])) for c, m in zip(counts, prompts.metadata)]


def held_out_jobs(
    prompts: PromptSet,
    per_prompt: int,
    per_tag: int | None,
    *,
    num_prompts: int | None = None,
    tags: Sequence[str] | None = None,
) -> list[Job]:
    """The ``(prompt, sample)`` pairs of a held-out evaluation, prompt-major.

    Args:
        prompts: the held-out prompt set (``data.val_file``).
        per_prompt, per_tag: ``trainer.eval_samples_per_prompt`` and ``trainer.eval_samples_per_tag`` (see
            :func:`eval_seed_counts`; counted over the first ``num_prompts`` prompts).
        num_prompts: keep the first ``num_prompts`` prompts (``trainer.eval_num_prompts``; None: all).
        tags: keep only the prompts of these metadata tags. A kept prompt keeps its index, hence its seeds and
            images: a tag's score is the one it has in the full evaluation.
    """
    total = len(prompts) if num_prompts is None else min(num_prompts, len(prompts))
    head = prompts.subset(range(total))
    counts = eval_seed_counts(head, per_prompt, per_tag)
    rows = range(total)
    if tags is not None:
        if head.metadata is None:
            raise ValueError(f"keeping tags {list(tags)} needs GenEval metadata; {prompts.source} has none")
        rows = tag_rows(head.metadata, list(tags), "tags", prompts.source)
    return [(i, j) for i in rows for j in range(counts[i])]


def gallery_jobs(jobs: Sequence[Job], prompts: PromptSet, size: int,
                 among: Sequence[int] | None = None) -> list[int]:
    """Which of ``jobs`` the held-out gallery shows: at most ``size`` job indices, spread over the metadata tags and
    then over the prompts, in job order. Deterministic (no random draw).

    Tags take turns (in sorted order), so every tag shows once there are at least as many slots as tags; within a
    tag its prompts take turns (held-out order), each prompt's samples in seed order, so a tag shows distinct prompts
    before a second sample of any. Without metadata tags, the prompts take turns. ``among`` restricts the choice to
    those job indices (the main process shows the jobs it generated).

    >>> prompts = PromptSet(["a triangle", "two squares", "a red circle"],
    ...                     [{"tag": "single"}, {"tag": "counting"}, {"tag": "colors"}], "held-out")
    >>> jobs = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)]
    >>> gallery_jobs(jobs, prompts, 3)
    [0, 3, 5]
    >>> gallery_jobs(jobs, prompts, 5)
    [0, 1, 3, 4, 5]
    """
    candidates = range(len(jobs)) if among is None else sorted(set(int(k) for k in among if 0 <= k < len(jobs)))
    by_tag: dict[str, dict[int, list[int]]] = {}  # tag -> prompt -> its job indices, in seed order
    for k in candidates:
        i = jobs[k][0]
        meta = prompts.metadata[i] if prompts.metadata is not None else None
        tag = str(meta.get("tag")) if isinstance(meta, dict) and meta.get("tag") is not None else ""
        by_tag.setdefault(tag, {}).setdefault(i, []).append(k)

    def turns(per_prompt: dict[int, list[int]]) -> list[int]:  # first sample of every prompt, then the second, ...
        queues = [per_prompt[i] for i in sorted(per_prompt)]
        return [q[r] for r in range(max(map(len, queues))) for q in queues if r < len(q)]

    queues = [turns(by_tag[tag]) for tag in sorted(by_tag)]
    chosen: list[int] = []
    for r in range(max(map(len, queues), default=0)):
        for q in queues:
            if r < len(q) and len(chosen) < size:
                chosen.append(q[r])
    return sorted(chosen)


@torch.no_grad()
def generate(
    adapter,
    prompts: list[str],
    generators: list[torch.Generator],
    *,
    sigmas: torch.Tensor,
    model_kw: dict[str, Any],
    autocast: Callable[[], ContextManager] = nullcontext,
    metadata: list[dict] | None = None,
) -> torch.Tensor:
    """Images ``[B, 3, H, W]`` in [0, 1] from the deterministic Euler ODE with CFG, one sample per generator: the
    adapter's own held-out sampler (``adapter.generate``). A streaming model samples each stream with its own
    few-step sampler instead (``StreamAdapter.generate``: its re-noise draws come from the sample's generator too),
    its segment prompts from ``metadata``.

    Args:
        adapter: a :class:`flowgrpo.models.FlowAdapter`.
        prompts: one prompt per sample.
        generators: one generator per sample; each draws its sample's initial noise.
        sigmas: the ``[T+1]`` schedule (``Sampler.eval_sigmas``).
        model_kw: :func:`flowgrpo.builders.model_kwargs` of the model node (size, guidance, negative prompt, T5 length).
        autocast: a context-manager factory around each velocity (the trainer's ``accelerator.autocast``).
    """
    return adapter.generate(prompts, metadata, generators, sigmas=sigmas, model_kw=model_kw, autocast=autocast)


@dataclass
class EvalSamples:
    """Scored held-out samples, one row per job.

    Attributes:
        jobs: ``(prompt, sample)`` per row.
        prompts: the held-out prompts of the rows (``prompts.subset`` by job), metadata aligned.
        scores: the reward per row, ``[n]``.
        components: every reward component per row, ``{name: [n]}``.
    """

    jobs: list[Job]
    prompts: PromptSet
    scores: torch.Tensor
    components: dict[str, torch.Tensor]

    def geneval(self, prefix: str | None = None) -> dict[str, Any]:
        """:func:`rewards.geneval_summary` of the rows: per-tag means, ``overall`` and ``overall_partial``.

        ``prefix`` names the GenEval reward inside ``reward=multi`` (``"geneval/"``); by default the only one there
        is. Raises ``ValueError`` when the reward has no GenEval components, or several and no ``prefix``.
        """
        if prefix is None:
            found = geneval_prefixes(self.components)
            if len(found) != 1:
                raise ValueError(f"{'no' if not found else 'several'} GenEval rewards among the components "
                                 f"{sorted(self.components)}{'' if not found else f'; pass prefix= one of {found}'}")
            prefix = found[0]
        return geneval_summary(self.components, self.prompts.metadata, prefix=prefix)

    def rows_by_tag(self) -> dict[str, list[int]]:
        """``{metadata tag: row indices}`` when the rows' metadata name at least two tags, else ``{}``."""
        metadata = self.prompts.metadata
        if not metadata:
            return {}
        groups: dict[str, list[int]] = {}
        for row, meta in enumerate(metadata):
            if isinstance(meta, dict) and meta.get("tag") is not None:
                groups.setdefault(str(meta["tag"]), []).append(row)
        return dict(sorted(groups.items())) if len(groups) > 1 else {}

    def scalars(self, tag: str = "eval") -> dict[str, float]:
        """What the trainer logs: ``{tag}/reward`` and ``{tag}/<component>``, means over the rows (NaN entries,
        e.g. a per-tag component outside its tag, skipped; NaN when all are), and per GenEval reward its overall
        score, ``{tag}/[prefix/]geneval`` and ``{tag}/[prefix/]geneval_partial`` (when it scored any tag). For a
        reward without GenEval components (which has its own per-tag summary) whose rows' metadata carry several
        ``tag`` values, the reward per tag too, ``{tag}/by_tag/<name>/reward`` (e.g. one- and two-object streams)."""
        result = {f"{tag}/reward": float(self.scores.mean())}
        for k, v in self.components.items():
            result[f"{tag}/{k}"] = float(torch.nanmean(v)) if torch.any(~torch.isnan(v)) else float("nan")
        if not geneval_prefixes(self.components):
            for name, rows in self.rows_by_tag().items():
                result[f"{tag}/by_tag/{name}/reward"] = float(self.scores[rows].mean())
        for prefix in geneval_prefixes(self.components):
            summary = geneval_summary(self.components, self.prompts.metadata, prefix=prefix)
            if summary["per_tag"]:
                result[f"{tag}/{prefix}geneval"] = summary["overall"]
                result[f"{tag}/{prefix}geneval_partial"] = summary["overall_partial"]
        return result


@torch.no_grad()
def score_jobs(
    adapter,
    reward,
    prompts: PromptSet,
    jobs: Sequence[Job],
    *,
    seed: int,
    sigmas: torch.Tensor,
    model_kw: dict[str, Any],
    batch_size: int,
    autocast: Callable[[], ContextManager] = nullcontext,
    on_batch: Callable[[int, list[str], torch.Tensor, Any], None] | None = None,
    between_batches: Callable[[], None] | None = None,
    stream: int = EVAL_STREAM,
) -> EvalSamples:
    """Generate (:func:`generate`) and score the images of ``jobs``, ``batch_size`` at a time, in job order.

    Args:
        adapter, sigmas, model_kw, autocast: as in :func:`generate`.
        reward: ``reward(images, prompts, metadata) -> RewardOutput``.
        prompts: the held-out prompt set the jobs index.
        jobs: ``(prompt, sample)`` pairs (:func:`held_out_jobs`, or a process's share of them).
        seed: ``trainer.eval_seed``.
        stream: the noise stream: ``EVAL_STREAM`` (validation) or ``TEST_STREAM`` (the test set).
        on_batch: called as ``on_batch(start, prompts, images, reward_output)`` after each batch (galleries, grids).
        between_batches: called before each batch after the first; raising there abandons the evaluation (the
            trainer honours a stop request so).
    """
    jobs = [(int(i), int(j)) for i, j in jobs]
    if not jobs:
        raise ValueError("no held-out jobs to score")
    batch_size = max(1, int(batch_size))
    rows = prompts.subset([i for i, _ in jobs])
    scores, components = [], {}
    for start in range(0, len(jobs), batch_size):
        if start and between_batches is not None:
            between_batches()
        part = rows.subset(range(start, min(start + batch_size, len(jobs))))
        generators = [eval_generator(seed, i, j, stream) for i, j in jobs[start : start + len(part)]]
        images = generate(adapter, part.prompts, generators, sigmas=sigmas, model_kw=model_kw, autocast=autocast,
                          metadata=part.metadata)
        out = reward(images, part.prompts, part.metadata)
        scores.append(out.scores)
        for k, v in out.components.items():
            components.setdefault(k, []).append(v)
        if on_batch is not None:
            on_batch(start, part.prompts, images, out)
    return EvalSamples(jobs=jobs, prompts=rows, scores=torch.cat(scores),
                       components={k: torch.cat(v) for k, v in components.items()})
