"""TaRoS vs the weighted sum on a hackable composite reward: GenEval + a quickly saturating JPEG term.

    python scripts/bench_multireward.py                              # sd3_shapes, 3 seeds x {sum, taros}
    python scripts/bench_multireward.py --seeds 0,1,2,3 --iterations 80 --jobs 2 --out multireward.json
    python scripts/bench_multireward.py --model tiny_sd3 --iterations 2 --seeds 0 --eval-num-prompts 2  # smoke

Each run is the real trainer (``python train.py`` defaults: the embedded world, MixGRPO) with ``reward=multi``
(GenEval shapes detector, weight 1, plus ``jpeg_compressibility`` = −kB at quality 95, weight ``--jpeg-weight``),
the same budget and seeds for every aggregator; only ``reward.aggregate.name`` differs:

* ``sum`` — the weighted sum, group-normalised like any scalar reward (Flow-GRPO's multi-score). In a group whose
  GenEval verdicts agree (common), the sum's spread is the JPEG term's alone, and normalising it turns a
  compressibility difference of a few bytes into a full-size advantage: the run optimises the hackable term;
* ``taros`` — ``rewards.aggregate.TaRoS`` (per-component saturation-aware normalisation, intra-group sparsity).

Reported per aggregator (mean and std over seeds): the held-out GenEval (overall strict and partial, GenEval's
mean over tags) and the held-out JPEG term (−kB) before and after training; JSON to ``--out`` and a PNG of the
held-out curves beside it. Evaluation uses fixed seeds, so the "before" numbers are shared by every run of a seed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from bench_iteration import compose, pool_results  # noqa: E402

METRICS = {
    "geneval": "eval/geneval/geneval",                  # GenEval overall (strict), mean over tags
    "geneval_partial": "eval/geneval/geneval_partial",  # Flow-GRPO partial credit, mean over tags
    "jpeg": "eval/jpeg_compressibility",                # −kB at quality 95 (higher = more compressible)
}


def run(job: tuple[str, int, dict]) -> dict:
    """One training run; returns its held-out curve (a worker process: sets its own thread count)."""
    aggregator, seed, opts = job
    import torch

    torch.set_num_threads(opts["threads"])
    from flowgrpo.trainer import Trainer

    out_dir = Path(opts["root"]) / f"{aggregator}-{seed}"
    overrides = [f"model={opts['model']}", "reward=multi", f"reward.aggregate.name={aggregator}",
                 f"reward.kwargs.components.1.weight={opts['jpeg_weight']}", "logger=none",
                 f"trainer.seed={seed}", f"trainer.iterations={opts['iterations']}", "trainer.eval_every=0",
                 "trainer.gallery_every=0", "trainer.checkpoint_every=0", f"trainer.output_dir={out_dir}",
                 *([f"trainer.eval_num_prompts={opts['eval_num_prompts']}"] if opts["eval_num_prompts"] else []),
                 *opts["set"]]
    trainer = Trainer(compose(overrides), out_dir)

    def point() -> dict:
        result = trainer.evaluate()
        missing = [k for k in METRICS.values() if k not in result]
        if missing:
            raise KeyError(f"held-out evaluation lacks {missing}: is reward=multi's GenEval component named "
                           f"'geneval'? got {sorted(result)}")
        return {"iteration": trainer.iteration, **{name: result[key] for name, key in METRICS.items()}}

    curve, train, clock = [point()], [], 0.0
    while trainer.iteration < opts["iterations"]:
        t0 = time.perf_counter()
        scalars = trainer.step()
        clock += time.perf_counter() - t0
        train.append({"iteration": trainer.iteration,
                      "geneval": scalars.get("reward/geneval"), "jpeg": scalars.get("reward/jpeg_compressibility"),
                      "zero_std_group_fraction": scalars.get("adv/zero_std_group_fraction")})
        if trainer.iteration % opts["eval_every"] == 0 or trainer.iteration == opts["iterations"]:
            curve.append(point())
    return {"aggregator": aggregator, "seed": seed, "train_seconds": round(clock, 1), "curve": curve, "train": train}


def _stats(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4),
            "std": round(statistics.pstdev(values), 4) if len(values) > 1 else 0.0,
            "values": [round(v, 4) for v in values]}


def summarise(runs: list[dict]) -> dict:
    out = {}
    for agg in dict.fromkeys(r["aggregator"] for r in runs):
        mine = [r for r in runs if r["aggregator"] == agg]
        row = {}
        for name in METRICS:
            before = [r["curve"][0][name] for r in mine]
            after = [r["curve"][-1][name] for r in mine]
            row[name] = {"before": _stats(before), "after": _stats(after),
                         "change": _stats([a - b for a, b in zip(after, before)])}
        row["train_seconds"] = _stats([r["train_seconds"] for r in mine])
        out[agg] = row
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.4))
    aggs = list(report["summary"])
    for ax, name in zip(axes, METRICS):
        for i, agg in enumerate(aggs):
            for j, r in enumerate(x for x in report["runs"] if x["aggregator"] == agg):
                ax.plot([p["iteration"] for p in r["curve"]], [p[name] for p in r["curve"]], color=f"C{i}",
                        marker="o", ms=3, alpha=0.8, label=agg if j == 0 else None)
        ax.set(xlabel="iteration", ylabel=f"held-out {name}" + (" (−kB)" if name == "jpeg" else ""))
    axes[0].legend(fontsize=8)
    fig.suptitle(f"GenEval + {report['jpeg_weight']}·JPEG compressibility, {report['iterations']} iterations, "
                 f"seeds {report['seeds']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sd3_shapes", help="conf/model option")
    parser.add_argument("--aggregators", default="sum,taros", help="reward.aggregate.name values, comma-separated")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated trainer seeds (≥3 for the report)")
    parser.add_argument("--iterations", type=int, default=60, help="training iterations per run (same budget)")
    parser.add_argument("--eval-every", type=int, default=20, help="iterations between held-out evaluations")
    parser.add_argument("--eval-num-prompts", type=int, default=None, help="held-out prompts (default: all)")
    parser.add_argument("--jpeg-weight", type=float, default=0.1, help="weight of jpeg_compressibility (GenEval: 1)")
    parser.add_argument("--set", action="append", default=[], help="extra Hydra override for every run (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: cores / jobs)")
    parser.add_argument("--out", type=Path, default=Path("multireward.json"), help="JSON path (PNG beside it)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="multireward-") as root:  # the runs' scratch output dirs
        opts = {"model": args.model, "iterations": args.iterations, "eval_every": args.eval_every,
                "eval_num_prompts": args.eval_num_prompts, "jpeg_weight": args.jpeg_weight, "set": args.set,
                "threads": threads, "root": root}
        jobs = [(agg, seed, opts) for seed in seeds for agg in args.aggregators.split(",")]
        finished = {(r["aggregator"], r["seed"]): r for r in pool_results(run, jobs, args.jobs)}
    runs = [finished[agg, seed] for agg, seed, _ in jobs]
    report = {"model": args.model, "iterations": args.iterations, "seeds": seeds, "jpeg_weight": args.jpeg_weight,
              "overrides": args.set, "wall_seconds": round(time.time() - t0, 1), "summary": summarise(runs),
              "runs": runs}
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    return report


if __name__ == "__main__":
    main()
