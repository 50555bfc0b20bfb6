#!/usr/bin/env python
r"""KVPO against streaming GRPO on the embedded streaming model, at the presets' wall-clock budget, over seeds: JSON
+ PNG + a markdown table.

    python scripts/compare_streaming.py                                  # both presets, seeds 0,1,2
    python scripts/compare_streaming.py --seeds 0 --arms kvpo_shapes     # one run
    python scripts/compare_streaming.py --out docs/results/streaming_rl  # where the JSON / PNG / table go

Each run is ``python train.py experiment=<arm> trainer.seed=<seed>`` (the presets' own budget: held-out evaluation
of the long-video reward at iterations 0, 10 and 20 on the first 48 held-out prompt sequences, one fixed-seed video
each, the same videos for every arm and seed), run one after the other so that their clocks do not share the CPU.
Every run's directory is kept under ``--runs``; a run already finished there is read back instead of run again, so
an interrupted comparison resumes where it stopped, and the JSON is rewritten after every run.

Reported per arm: mean ± std over seeds of the held-out reward and of its per-segment adherence (before any switch,
after one), switch recovery and direction at the last evaluation, the change from the base model (iteration 0, the
same for every run), and the wall clock of a run (evaluations included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METRICS = ["eval/reward", "eval/adherence", "eval/segment0/adherence", "eval/segment1/adherence",
           "eval/segment2/adherence", "eval/recovery", "eval/direction", "eval/identity"]


def run(arm: str, seed: int, runs: Path, extra: list[str]) -> dict:
    out = runs / f"{arm}_seed{seed}"
    summary = out / "summary.json"
    if not summary.is_file():
        start = time.time()
        cmd = [sys.executable, str(REPO / "train.py"), f"experiment={arm}", f"trainer.seed={seed}",
               f"hydra.run.dir={out}", *extra]
        with open(runs / f"{arm}_seed{seed}.log", "w") as log:
            proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {runs / f'{arm}_seed{seed}.log'}")
        (out / "wall_clock.json").write_text(json.dumps({"seconds": time.time() - start}))
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if line.strip() and any(k.startswith("eval/") for k in json.loads(line))]
    seconds = json.loads((out / "wall_clock.json").read_text())["seconds"]
    return {"arm": arm, "seed": seed, "seconds": round(seconds, 1), "dir": str(out),
            "evals": [{"iteration": e["iteration"], **{m: e.get(m) for m in METRICS}} for e in evals]}


def summarise(results: list[dict]) -> dict:
    arms = {}
    for arm in sorted({r["arm"] for r in results}):
        mine = [r for r in results if r["arm"] == arm]
        row = {"seeds": [r["seed"] for r in mine], "iterations": mine[0]["evals"][-1]["iteration"],
               "seconds": _stats([r["seconds"] for r in mine])}
        for m in METRICS:
            last = [r["evals"][-1][m] for r in mine if r["evals"][-1].get(m) is not None]
            gain = [r["evals"][-1][m] - r["evals"][0][m] for r in mine
                    if r["evals"][-1].get(m) is not None and r["evals"][0].get(m) is not None]
            row[m] = {"final": _stats(last), "gain": _stats(gain)}
        row["base"] = {m: mine[0]["evals"][0].get(m) for m in METRICS}
        arms[arm] = row
    return arms


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": round(statistics.fmean(values), 4),
            "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0, "n": len(values)}


def table(arms: dict) -> str:
    cols = [("eval/reward", "reward"), ("eval/segment0/adherence", "adherence, 1st segment"),
            ("eval/segment1/adherence", "after 1st switch"), ("eval/recovery", "recovery")]
    head = "| arm | seeds | iterations | minutes | " + " | ".join(f"{name} (Δ)" for _, name in cols) + " |"
    lines = [head, "|" + "---|" * (4 + len(cols))]
    for arm, row in arms.items():
        cells = []
        for key, _ in cols:
            f, g = row[key]["final"], row[key]["gain"]
            cells.append("n/a" if f["mean"] is None else
                         f"{f['mean']:.3f} ± {f['std']:.3f} ({g['mean']:+.3f})")
        lines.append(f"| {arm} | {len(row['seeds'])} | {row['iterations']} | {row['seconds']['mean'] / 60:.1f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm, color in zip(sorted({r["arm"] for r in results}), ["tab:blue", "tab:orange", "tab:green"]):
        for ax, metric in zip(axes, ["eval/reward", "eval/segment1/adherence"]):
            for i, r in enumerate(x for x in results if x["arm"] == arm):
                its = [e["iteration"] for e in r["evals"]]
                ax.plot(its, [e[metric] for e in r["evals"]], "o-", color=color, alpha=0.8,
                        label=arm if i == 0 else None)
            ax.set_xlabel("iteration")
            ax.set_title(f"held-out {metric.removeprefix('eval/')}")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="stream_grpo_shapes,kvpo_shapes", help="experiment presets, comma-separated")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--runs", default=str(REPO / "outputs" / "compare_streaming"), help="run directories")
    p.add_argument("--out", default=str(REPO / "outputs" / "compare_streaming" / "compare_streaming"),
                   help="path stem of the JSON / PNG / markdown written")
    p.add_argument("--set", nargs="*", default=[], help="extra overrides for every run (key=value)")
    args = p.parse_args(argv)
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in args.arms.split(","):
            results.append(run(arm, seed, runs, args.set))
            report = {"arms": summarise(results), "runs": results, "overrides": args.set}
            out.with_suffix(".json").write_text(json.dumps(report, indent=2))
            out.with_suffix(".md").write_text(table(report["arms"]) + "\n")
            plot(results, out.with_suffix(".png"))
    print(table(report["arms"]))
    return report


if __name__ == "__main__":
    main()
