"""TaRoS vs the weighted sum on hackable composite rewards, images and video (JSON + PNG).

    python scripts/bench_multireward.py                              # image composite: sd3_shapes, 3 seeds x {sum, taros}
    python scripts/bench_multireward.py --composite video --iterations 40 --eval-every 20   # wan_shapes, video composite
    python scripts/bench_multireward.py --seeds 0,1,2,3 --iterations 80 --jobs 2 --weight jpeg_compressibility=0.2
    python scripts/bench_multireward.py --model tiny_sd3 --iterations 2 --seeds 0 --eval-num-prompts 2  # smoke

Each run is the real trainer with a ``reward=multi`` composite, the same budget and seeds for every aggregator;
only ``reward.aggregate.name`` differs. The composites (``--composite``):

* ``image`` (default model ``sd3_shapes``, the default algorithm): GenEval (shapes detector, weight 1) plus
  ``jpeg_compressibility`` (−kB at quality 95, weight 0.1) — a term that is easy to move and unrelated to the task;
* ``video`` (default model ``wan_shapes``, ``data=motion_shapes``, Flow-GRPO on its 3 noisiest steps):
  ``reward=video_composite`` — video GenEval (partial credit, weight 1) plus pixel temporal consistency and
  per-frame sharpness. Both extra terms have shortcuts the task does not want: a frozen clip maximises
  consistency, and a static object already satisfies "standing still".

Aggregators: ``sum`` — the weighted sum, group-normalised like any scalar reward (Flow-GRPO's multi-score). In a
group whose task verdicts agree (common), the sum's spread is the other terms' alone, and normalising it turns a
tiny difference into a full-size advantage: the run optimises the easy term. ``taros`` —
``rewards.aggregate.TaRoS`` (arXiv 2511.19356: per-group softmax weights of the raw components from their means
and Hoyer sparsity, the weighted sum standardised once); ``saturation_weighted`` and ``per_reward`` may be named too.

Reported per aggregator (mean and std over seeds): every composite metric held-out before and after training
(for the task, GenEval's overall strict and partial, the mean over tags) and, from the training rows, each
term's saturation — the fraction of groups where it is constant and its mean within-group spread, first and
last quarter of training. JSON to ``--out`` and a PNG of the held-out curves beside it. Evaluation uses fixed
seeds, so the "before" numbers are shared by every run of a seed.
"""

from __future__ import annotations

import argparse
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
from bench_time_to_reward import RECIPES  # noqa: E402

from flowgrpo import jsonio  # noqa: E402

COMPOSITES = {
    "image": {
        "model": "sd3_shapes", "overrides": ["reward=multi"],
        "terms": ["geneval", "jpeg_compressibility"],  # reward.kwargs.components order
        "metrics": {"geneval": "eval/geneval/geneval",                  # GenEval overall (strict), mean over tags
                    "geneval_partial": "eval/geneval/geneval_partial",  # Flow-GRPO partial credit, mean over tags
                    "jpeg": "eval/jpeg_compressibility"},               # −kB at quality 95 (higher = more compressible)
    },
    "video": {
        # Flow-GRPO on its 3 noisiest steps (the shared recipe; = experiment=video_shapes algo=grpo)
        "model": "wan_shapes", "overrides": ["reward=video_composite", "data=motion_shapes", *RECIPES["flow_grpo"]],
        "terms": ["video_geneval", "video_consistency", "video_sharpness"],
        "metrics": {"geneval": "eval/video_geneval/geneval",                  # video GenEval overall (strict)
                    "geneval_partial": "eval/video_geneval/geneval_partial",  # partial credit, mean over tags
                    "still_strict": "eval/video_geneval/strict/static",      # the "standing still" tag (the shortcut)
                    "consistency": "eval/video_consistency",                  # pixel temporal consistency
                    "sharpness": "eval/video_sharpness"},                     # per-frame edge sharpness
        "optional": {"still_strict"},  # absent when the held-out subset (--eval-num-prompts) has no static prompt
    },
}


def run(job: tuple[str, int, dict]) -> dict:
    """One training run; returns its held-out curve (a worker process: sets its own thread count)."""
    aggregator, seed, opts = job
    import torch

    torch.set_num_threads(opts["threads"])
    from flowgrpo.trainer import Trainer

    composite = COMPOSITES[opts["composite"]]
    out_dir = Path(opts["root"]) / f"{aggregator}-{seed}"
    weights = [f"reward.kwargs.components.{composite['terms'].index(k)}.weight={w}" for k, w in opts["weights"].items()]
    overrides = [f"model={opts['model']}", *composite["overrides"], f"reward.aggregate.name={aggregator}", *weights,
                 "logger=none", f"trainer.seed={seed}", f"trainer.iterations={opts['iterations']}",
                 "trainer.eval_every=0", "trainer.gallery_every=0", "trainer.checkpoint_every=0",
                 f"trainer.output_dir={out_dir}",
                 *([f"trainer.eval_num_prompts={opts['eval_num_prompts']}"] if opts["eval_num_prompts"] else []),
                 *opts["set"]]
    trainer = Trainer(compose(overrides), out_dir)

    def point() -> dict:
        result = trainer.evaluate()
        optional = composite.get("optional", set())
        missing = [k for n, k in composite["metrics"].items() if k not in result and n not in optional]
        if missing:
            raise KeyError(f"held-out evaluation lacks {missing}: are the composite's terms named "
                           f"{composite['terms']}? got {sorted(result)}")
        values = {name: result.get(key) for name, key in composite["metrics"].items()}
        for name in optional:  # NaN or absent: the subset holds no sample of that tag
            if values[name] is None or values[name] != values[name]:
                values[name] = None
        return {"iteration": trainer.iteration, **values}

    curve, train, clock = [point()], [], 0.0
    while trainer.iteration < opts["iterations"]:
        t0 = time.perf_counter()
        scalars = trainer.step()
        clock += time.perf_counter() - t0
        row = {"iteration": trainer.iteration, "zero_std_group_fraction": scalars.get("adv/zero_std_group_fraction")}
        for term in composite["terms"]:
            row[term] = scalars.get(f"reward/{term}")
            for stat in ("zero_std_group_fraction", "group_std_mean"):
                row[f"{term}/{stat}"] = scalars.get(f"groups/{term}/{stat}")
        train.append(row)
        if trainer.iteration % opts["eval_every"] == 0 or trainer.iteration == opts["iterations"]:
            curve.append(point())
    return {"aggregator": aggregator, "seed": seed, "train_seconds": round(clock, 1), "curve": curve, "train": train}


def _stats(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4),
            "std": round(statistics.pstdev(values), 4) if len(values) > 1 else 0.0,
            "values": [round(v, 4) for v in values]}


def _quarter(rows: list[dict], key: str, last: bool) -> float:
    """Mean of ``key`` over the first (or last) quarter of the training rows (at least one row)."""
    n = max(1, len(rows) // 4)
    part = rows[-n:] if last else rows[:n]
    values = [r[key] for r in part if r.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def summarise(runs: list[dict], composite: dict) -> dict:
    out = {}
    for agg in dict.fromkeys(r["aggregator"] for r in runs):
        mine = [r for r in runs if r["aggregator"] == agg]
        row = {}
        for name in composite["metrics"]:
            before = [r["curve"][0][name] for r in mine]
            after = [r["curve"][-1][name] for r in mine]
            if None in before + after:  # an optional metric the evaluation did not cover
                row[name] = None
                continue
            row[name] = {"before": _stats(before), "after": _stats(after),
                         "change": _stats([a - b for a, b in zip(after, before)])}
        saturation = {}
        for term in composite["terms"]:
            for stat in ("zero_std_group_fraction", "group_std_mean"):
                key = f"{term}/{stat}"
                if all(r["train"] and r["train"][0].get(key) is not None for r in mine):
                    saturation[key] = {"first_quarter": _stats([_quarter(r["train"], key, False) for r in mine]),
                                       "last_quarter": _stats([_quarter(r["train"], key, True) for r in mine])}
        row["saturation"] = saturation
        row["train_seconds"] = _stats([r["train_seconds"] for r in mine])
        out[agg] = row
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(COMPOSITES[report["composite"]]["metrics"])
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 3.4))
    aggs = list(report["summary"])
    for ax, name in zip(axes, metrics):
        for i, agg in enumerate(aggs):
            for j, r in enumerate(x for x in report["runs"] if x["aggregator"] == agg):
                points = [p for p in r["curve"] if p[name] is not None]
                ax.plot([p["iteration"] for p in points], [p[name] for p in points], color=f"C{i}",
                        marker="o", ms=3, alpha=0.8, label=agg if j == 0 else None)
        ax.set(xlabel="iteration", ylabel=f"held-out {name}" + (" (−kB)" if name == "jpeg" else ""))
    axes[0].legend(fontsize=8)
    terms = " + ".join(f"{report['weights'][t]:g}·{t}" for t in COMPOSITES[report["composite"]]["terms"])
    fig.suptitle(f"{report['model']}: {terms}, {report['iterations']} iterations, seeds {report['seeds']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _weights(composite: str, given: list[str]) -> dict[str, float]:
    """The composite's weights as run: its config's, with ``--weight TERM=W`` applied."""
    from omegaconf import OmegaConf

    spec = COMPOSITES[composite]
    reward = next(o.split("=", 1)[1] for o in spec["overrides"] if o.startswith("reward="))
    conf = OmegaConf.load(REPO / "conf" / "reward" / f"{reward}.yaml")
    weights = {c["name"] if "prefix" not in c else c["prefix"]: float(c.get("weight", 1.0)) for c in conf.kwargs.components}
    if list(weights) != spec["terms"]:
        raise SystemExit(f"conf/reward/{reward}.yaml lists {list(weights)}, the benchmark expects {spec['terms']}")
    for item in given:
        term, _, value = item.partition("=")
        if term not in weights or not value:
            raise SystemExit(f"--weight {item!r}: expected TERM=W with TERM one of {spec['terms']}")
        weights[term] = float(value)
    return weights


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--composite", choices=sorted(COMPOSITES), default="image", help="which composite reward")
    parser.add_argument("--model", default=None, help="conf/model option (default: the composite's)")
    parser.add_argument("--aggregators", default="sum,taros", help="reward.aggregate.name values, comma-separated")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated trainer seeds (≥3 for the report)")
    parser.add_argument("--iterations", type=int, default=60, help="training iterations per run (same budget)")
    parser.add_argument("--eval-every", type=int, default=20, help="iterations between held-out evaluations")
    parser.add_argument("--eval-num-prompts", type=int, default=None, help="held-out prompts (default: all)")
    parser.add_argument("--weight", action="append", default=[], metavar="TERM=W",
                        help="a composite term's weight (repeatable; default: the reward config's)")
    parser.add_argument("--set", action="append", default=[], help="extra Hydra override for every run (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: cores / jobs)")
    parser.add_argument("--out", type=Path, default=Path("multireward.json"), help="JSON path (PNG beside it)")
    args = parser.parse_args(argv)
    composite = COMPOSITES[args.composite]
    model = args.model or composite["model"]
    weights = _weights(args.composite, args.weight)
    seeds = [int(s) for s in args.seeds.split(",")]
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="multireward-") as root:  # the runs' scratch output dirs
        opts = {"composite": args.composite, "model": model, "iterations": args.iterations,
                "eval_every": args.eval_every, "eval_num_prompts": args.eval_num_prompts, "weights": weights,
                "set": args.set, "threads": threads, "root": root}
        jobs = [(agg, seed, opts) for seed in seeds for agg in args.aggregators.split(",")]
        finished = {(r["aggregator"], r["seed"]): r for r in pool_results(run, jobs, args.jobs)}
    runs = [finished[agg, seed] for agg, seed, _ in jobs]
    report = {"composite": args.composite, "model": model, "iterations": args.iterations, "seeds": seeds,
              "weights": weights, "overrides": composite["overrides"] + args.set,
              "wall_seconds": round(time.time() - t0, 1), "summary": summarise(runs, composite), "runs": runs}
    args.out.write_text(jsonio.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    print(jsonio.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    return report


if __name__ == "__main__":
    main()
