#!/usr/bin/env python
r"""Did a run learn? Its checkpoint against the model it started from, on the same held-out samples (JSON).

    python scripts/paired_eval.py outputs/RUN                         # the run's newest checkpoint, its eval settings
    python scripts/paired_eval.py RUN_A RUN_B --prompts 100 --samples 2 --out paired.json
    python scripts/paired_eval.py RUN --split test --prompts 100 --samples 2   # the test set, for a reported claim
    python scripts/paired_eval.py RUN --prompts-file assets/prompts/streams_val.jsonl   # another held-out file
    python scripts/paired_eval.py RUN --raw             # a run that keeps an EMA: its trained weights instead

Each run is rebuilt from its ``config.yaml`` (the model it trained, its reward and held-out prompts); the base model
(the run's starting weights) and the run's newest intact checkpoint (or ``--checkpoint``) then score the same
held-out jobs with the trainer's evaluation protocol: the first ``--prompts`` held-out prompts, ``--samples`` per
prompt, sample ``j`` of prompt ``i`` from the noise seeded by ``(trainer.eval_seed, i, j)``.

``--split val`` (the default) scores the validation set the run evaluated on (``data.val_file``, the validation
noise stream): for probes, sweeps and choosing knobs. ``--split test`` scores the test set (``data.test_file``, the
test noise stream, which nothing else draws): the set a published claim is measured on, once its knobs are chosen.
This script is the only reader of the test set. Because both see the
same noise, the change per sample is paired: its mean is the run's gain and its standard error (std / √n) says
whether an evaluation of this size resolves it — a gain within about two standard errors of zero is not shown.
Runs of the same model and evaluation share one base scoring. A run that keeps an EMA of its weights
(``trainer.ema.enabled``) is evaluated as its own evaluations are, with the EMA swapped in; ``--raw`` evaluates the
trained weights instead (the report says which: ``weights``).

Reported per run and for every reward component: base mean, trained mean, mean change, its standard error, the
share of samples that improved / got worse, and every sample's two scores; when the held-out prompts carry several
metadata tags, the reward per tag too (``by_tag/<tag>/reward``, e.g. one- and two-object streams apart).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowgrpo import jsonio  # noqa: E402  (strict JSON: NaN / inf as null)


SPLITS = {"val": "validation", "test": "test"}


def paired(base: list[float], trained: list[float]) -> dict:
    """Mean of each, mean change, its standard error, and the share of samples that went up / down, over the samples
    scored in both (a component undefined for a sample, such as a segment the stream does not have, is NaN)."""
    pairs = [(a, b) for a, b in zip(base, trained) if math.isfinite(a) and math.isfinite(b)]
    if not pairs:
        return {"n": 0}
    base, trained = [a for a, _ in pairs], [b for _, b in pairs]
    diff = [b - a for a, b in pairs]
    n = len(diff)
    se = statistics.stdev(diff) / math.sqrt(n) if n > 1 else float("nan")
    return {"n": n, "base": statistics.fmean(base), "trained": statistics.fmean(trained),
            "change": statistics.fmean(diff), "stderr": se,
            "improved": sum(d > 0 for d in diff) / n, "worse": sum(d < 0 for d in diff) / n}


def score(trainer, jobs, prompts, stream) -> dict[str, list[float]]:
    """Per-job reward and components of ``trainer``'s current weights on ``prompts`` with the noise of ``stream``, as
    its held-out evaluation scores them."""
    out = trainer.held_out_samples(jobs, prompts=prompts, stream=stream)
    scores = {"reward": out.scores.float().tolist()}
    scores.update({k: v.float().tolist() for k, v in sorted(out.components.items()) if v.ndim == 1})
    for tag, rows in out.rows_by_tag().items():  # e.g. one- and two-object streams apart
        scores[f"by_tag/{tag}/reward"] = [scores["reward"][i] for i in rows]
    return scores


def evaluate_run(run: Path, args, base_cache: dict) -> dict:
    from omegaconf import OmegaConf

    from flowgrpo.builders import checked_prompts
    from flowgrpo.evaluation import EVAL_STREAM, TEST_STREAM, held_out_jobs
    from flowgrpo.trainer import Trainer

    config = run / "config.yaml"
    if not config.is_file():
        raise SystemExit(f"{run}: no config.yaml; give a run directory written by train.py")
    cfg = OmegaConf.load(config)
    cfg.trainer.resume = None
    cfg.logger.name = "none"
    cfg.trainer.gallery_every = 0
    if "val_file" not in cfg.data:
        raise SystemExit(f"{run}: its config.yaml has no data.val_file (a run from before validation and test sets "
                         "were apart): add data.val_file, the held-out file it evaluated on, to its config.yaml")
    split_file = f"{args.split}_file"
    if args.prompts_file is not None:  # e.g. the two-object streams of another held-out file, reported apart
        cfg.data[split_file] = str(args.prompts_file)
    with tempfile.TemporaryDirectory(prefix="paired-eval-") as scratch:
        trainer = Trainer(cfg, scratch)
        # the trainer built (and checked) the validation set; the test set is read here, and only here
        prompts = trainer.val_set if args.split == "val" else checked_prompts(cfg, trainer.reward, "test")
        if prompts is None:
            raise SystemExit(f"{run}: data.{split_file} is null: no {SPLITS[args.split]} prompts to evaluate on "
                             "(give --prompts-file)")
        stream = TEST_STREAM if args.split == "test" else EVAL_STREAM
        jobs = held_out_jobs(prompts, args.samples, None, num_prompts=args.prompts or cfg.trainer.eval_num_prompts)
        key = trainer.held_out_key(jobs, stream)  # the data config in it names the split's file
        t0 = time.perf_counter()
        if key not in base_cache:
            base_cache[key] = score(trainer, jobs, prompts, stream)
        base = base_cache[key]
        trainer.cfg.trainer.resume = str(args.checkpoint or run)
        if not trainer.maybe_resume():
            raise SystemExit(f"{run}: no intact checkpoint to evaluate (trainer.checkpoint_every=0 writes none)")
        if args.raw:
            trainer.ema = None  # the evaluation swaps in an EMA only when the trainer keeps one
        weights = "raw" if trainer.ema is None else f"ema (decay {cfg.trainer.ema.decay:g})"
        trained = score(trainer, jobs, prompts, stream)
        seconds = time.perf_counter() - t0
    metrics = {k: paired(base[k], trained[k]) for k in base if k in trained}
    return {"run": str(run), "iteration": trainer.iteration, "split": args.split, "prompts_file": str(prompts.source), "weights": weights, "jobs": [list(j) for j in jobs],
            "seconds": seconds,
            "metrics": metrics, "samples": {"base": base, "trained": trained}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (train.py's hydra.run.dir)")
    p.add_argument("--checkpoint", type=Path, default=None, help="a checkpoint to use instead (one run only)")
    p.add_argument("--prompts", type=int, default=0, help="held-out prompts (0: the run's trainer.eval_num_prompts)")
    p.add_argument("--samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--split", choices=sorted(SPLITS), default="val",
                   help="val: the validation set (data.val_file), for choosing; test: the test set (data.test_file, "
                        "its own noise), for reporting")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="held-out prompts to use instead of the split's file (JSONL); the split's noise stream")
    p.add_argument("--raw", action="store_true",
                   help="the trained weights of a run that keeps an EMA (default: the EMA, as its evaluations use)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: print only the summary)")
    args = p.parse_args(argv)
    if args.checkpoint is not None and len(args.runs) > 1:
        raise SystemExit("--checkpoint names one checkpoint: give one run with it")
    if args.threads:
        torch.set_num_threads(args.threads)
    base_cache: dict = {}
    report = {"prompts": args.prompts, "samples": args.samples, "split": args.split, "runs": [],
              "prompts_file": str(args.prompts_file) if args.prompts_file is not None else None}
    for run in args.runs:
        report["runs"].append(evaluate_run(run, args, base_cache))
        if args.out:
            args.out.write_text(jsonio.dumps(report, indent=2))
    summary = [{"run": r["run"], "iteration": r["iteration"], "weights": r["weights"],
                **{k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in r["metrics"].items()
                   if k == "reward" or (k.startswith("by_tag/") and k.endswith("/reward"))}}
               for r in report["runs"]]
    print(jsonio.dumps(summary, indent=2))
    return report


if __name__ == "__main__":
    main()
