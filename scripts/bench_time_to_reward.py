"""Wall clock and iterations each algorithm needs to reach a held-out reward target, over seeds (JSON + PNG).

    python scripts/bench_time_to_reward.py                                   # embedded world, GenEval strict ≥ target
    python scripts/bench_time_to_reward.py --target 0.6 --seeds 0,1,2 --max-iterations 60
    python scripts/bench_time_to_reward.py --model tiny_sd3 --reward jpeg_compressibility --metric eval/reward ...

Every run is the real trainer with held-out evaluation every ``--eval-every`` iterations (evaluation time is
excluded from the clock: it is the same for every algorithm and not part of training). A run stops at the
first evaluation that reaches the target, or at ``--max-iterations``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from bench_iteration import ALGORITHMS, compose  # noqa: E402


def run(algorithm: str, seed: int, args, out_dir: Path) -> dict:
    from flowgrpo.trainer import Trainer

    cfg = compose([f"model={args.model}", f"reward={args.reward}", "logger=none", f"trainer.seed={seed}",
                   f"trainer.iterations={args.max_iterations}", "trainer.eval_every=0", "trainer.gallery_every=0",
                   f"trainer.output_dir={out_dir}", *ALGORITHMS[algorithm], *args.set])
    trainer = Trainer(cfg, out_dir)
    curve = [{"iteration": 0, "seconds": 0.0, "value": trainer.evaluate()[args.metric]}]
    clock = 0.0
    reached = curve[0]["value"] >= args.target
    while not reached and trainer.iteration < args.max_iterations:
        t0 = time.perf_counter()
        trainer.step()
        clock += time.perf_counter() - t0
        if trainer.iteration % args.eval_every == 0 or trainer.iteration == args.max_iterations:
            value = trainer.evaluate()[args.metric]
            curve.append({"iteration": trainer.iteration, "seconds": clock, "value": value})
            reached = value >= args.target
    return {"reached": reached, "iterations": curve[-1]["iteration"], "seconds": clock, "curve": curve}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for i, (name, row) in enumerate(report["algorithms"].items()):
        for j, r in enumerate(row["runs"]):
            xs = [p["seconds"] for p in r["curve"]]
            its = [p["iteration"] for p in r["curve"]]
            ys = [p["value"] for p in r["curve"]]
            label = name if j == 0 else None
            axes[0].plot(xs, ys, color=f"C{i}", alpha=0.8, label=label)
            axes[1].plot(its, ys, color=f"C{i}", alpha=0.8, label=label)
    for ax, xlabel in zip(axes, ("training wall clock (s)", "iteration")):
        ax.axhline(report["target"], color="k", ls="--", lw=0.8)
        ax.set(xlabel=xlabel, ylabel=report["metric"])
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sd3_shapes", help="conf/model option")
    parser.add_argument("--reward", default="geneval", help="conf/reward option")
    parser.add_argument("--metric", default="eval/strict", help="held-out scalar compared with --target")
    parser.add_argument("--target", type=float, default=0.5, help="held-out value to reach")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated trainer seeds (≥3 for the report)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated subset")
    parser.add_argument("--max-iterations", type=int, default=50, help="give up after this many iterations")
    parser.add_argument("--eval-every", type=int, default=5, help="iterations between held-out evaluations")
    parser.add_argument("--set", action="append", default=[], help="extra Hydra override (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("time_to_reward.json"), help="JSON path (PNG beside it)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    root = Path(tempfile.mkdtemp(prefix="time-to-reward-"))
    report = {"model": args.model, "reward": args.reward, "metric": args.metric, "target": args.target,
              "seeds": seeds, "max_iterations": args.max_iterations, "algorithms": {}}
    for name in args.algorithms.split(","):
        runs = [run(name, seed, args, root / f"{name}-{seed}") for seed in seeds]
        done = [r for r in runs if r["reached"]]
        report["algorithms"][name] = {
            "reached": f"{len(done)}/{len(runs)}",
            "median_seconds": statistics.median(r["seconds"] for r in done) if done else None,
            "median_iterations": statistics.median(r["iterations"] for r in done) if done else None,
            "runs": runs,
        }
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in report["algorithms"].items()},
                     indent=2))
    return report


if __name__ == "__main__":
    main()
