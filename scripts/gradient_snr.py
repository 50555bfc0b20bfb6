"""Is this reward learnable at this batch size? Agreement of independent policy-gradient estimates, as JSON.

    python scripts/gradient_snr.py                                        # the embedded default (MixGRPO, GenEval)
    python scripts/gradient_snr.py --batches 6 --set sampler=sde --set algo=grpo --set algo.kl_beta=0
    python scripts/gradient_snr.py --set reward=jpeg_compressibility       # a dense reward, for comparison

The trainer's plan for one iteration (same prompts) is rolled out ``--batches`` times with independent noise
(initial and SDE), scored, normalised, and the algorithm's loss of the trained steps is back-propagated exactly
as phase 5 does (for the GRPO family ratio 1: the pure policy gradient) into the trainable weights. For independent estimates
``g_k = s + n_k`` of the expected gradient ``s``, the mean pairwise cosine estimates ``|s|² / (|s|² + E|n|²)``:
near 0 means one batch's update is almost all noise, and reaching a signal-to-noise ratio of 1 needs about
``1 / cosine`` such batches (``batches_for_snr_1``; null unless the mean exceeds twice its jackknife standard
error). Few batches resolve only large agreements: on the embedded world a reward that visibly learns in 20
iterations (JPEG compressibility) and GenEval both measure near 0 with 6 batches.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from bench_iteration import emit, scratch_trainer  # noqa: E402


def policy_gradient(trainer, noise_iteration: int, plan_iteration: int = 0) -> torch.Tensor:
    """The flattened gradient of phase 5's loss (first inner epoch) for one rollout of the plan of
    ``plan_iteration`` with the noise streams of ``noise_iteration``."""
    batch = trainer.plan(plan_iteration)
    batch = trainer.advantage(trainer.score(trainer.rollout(batch, noise_iteration)))
    for p in trainer.params:
        p.grad = None
    steps = trainer.transitions(batch, plan_iteration, 0)
    micro = trainer.batch.train_micro_batch
    trainer.policy.iteration, trainer.policy.epoch = plan_iteration, 0
    for start in range(0, len(batch.prompts), micro):
        rows = torch.arange(start, min(start + micro, len(batch.prompts)))
        for j in range(steps.shape[1]):
            loss, _ = trainer.algorithm.loss(trainer.policy, batch, rows, steps[rows, j])
            loss.backward()
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in trainer.params])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=6, help="independent rollouts of the same plan (≥2)")
    parser.add_argument("--set", action="append", default=[], help="Hydra override (repeatable)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error("--batches must be >= 2 (cosines are between pairs)")
    torch.set_num_threads(args.threads)
    trainer, scratch = scratch_trainer(args.set, "gradient-snr-")  # noqa: F841 (the run directory lives with it)
    grads = [policy_gradient(trainer, noise_iteration=1000 + k) for k in range(args.batches)]
    n = len(grads)
    cos = {(i, j): float(torch.nn.functional.cosine_similarity(grads[i], grads[j], dim=0))
           for i, j in itertools.combinations(range(n), 2)}
    cosines = list(cos.values())
    mean = statistics.fmean(cosines)
    # jackknife over batches (pairs sharing a batch are correlated): the standard error of the mean cosine
    loo = [statistics.fmean(v for (i, j), v in cos.items() if k not in (i, j)) for k in range(n)] if n > 2 else [mean]
    jack = statistics.fmean(loo)
    stderr = ((n - 1) / n * sum((m - jack) ** 2 for m in loo)) ** 0.5 if n > 2 else float("nan")
    report = {
        "overrides": args.set,
        "rollouts_per_batch": trainer.batch.rollouts,
        "trained_steps": trainer.batch.trained_steps,
        "trainable_parameters": sum(p.numel() for p in trainer.params),
        "batches": args.batches,
        "mean_pairwise_cosine": round(mean, 4),
        "standard_error": round(stderr, 4),  # jackknife over batches; |mean| < 2 SE: no agreement resolved
        "min_pairwise_cosine": round(min(cosines), 4),
        "max_pairwise_cosine": round(max(cosines), 4),
        "gradient_norms": [round(float(g.norm()), 6) for g in grads],
        "batches_for_snr_1": round(1 / mean, 1) if mean > 2 * stderr else None,  # None: not resolved
    }
    return emit(report, args.out)


if __name__ == "__main__":
    main()
