#!/usr/bin/env python
r"""Experiment presets side by side over seeds, at each preset's own budget: JSON + PNG + a markdown table.

    python scripts/compare_presets.py --arms flash_grpo_shapes,flash_grpo_fast --seeds 0,1,2 \
        --metrics eval/strict,eval/partial --runs outputs/flash --out docs/results/flash_grpo_tail
    python scripts/compare_presets.py --arms sum=video_shapes,taros=video_shapes --set reward=video_composite \
        --arm-set sum reward.aggregate.name=sum --arm-set taros reward.aggregate.name=taros \
        --train-metrics groups/video_consistency/zero_std_group_fraction --runs outputs/taros --out outputs/taros/cmp
    python scripts/compare_streaming.py                # the streaming presets (this script with their metrics)

Each run is ``python train.py experiment=<preset> trainer.seed=<seed> [--set ...] [--arm-set ...]``, one after the
other so that their clocks do not share the CPU. An arm is a preset, or ``name=preset`` with overrides of its own
(``--arm-set name key=value ...``): two arms may share a preset and differ in one knob; ``name=`` (no preset) runs
the defaults, ``python train.py`` with the arm's overrides. Every arm runs every ``--seeds`` seed, unless
``--arm-seeds name 0`` gives it fewer (an ablation on one seed). The JSON records each arm's command and the commit of
the runs' code (the one each run's ``summary.json`` names, else the one this script started at). Every run's
directory is kept under ``--runs`` as ``<arm>_seed<seed>``; a run already finished there is read back instead of
run again, so an interrupted comparison resumes where it stopped, and the JSON is rewritten after every run. A run
stopped part-way (SIGTERM: its ``summary.json`` says ``stopped``; or killed after a checkpoint) continues from its
newest checkpoint when the command is run again. SIGTERM or Ctrl-C to this script is passed on to the running
``train.py``, which checkpoints and stops; the script waits for it.

Each run records the CPU kernels it ran on (``cpu``: ``AVX512``, ``AVX2``, ...): the trainer computes the same numbers
on one kind of kernels whatever the thread count, but another instruction set rounds differently, and after the first
updates a run's trajectory parts from the other's (a seed's number is then a different draw, not a reproduction).

Reported per arm: mean ± std over seeds of each ``--metrics`` held-out value at the last evaluation, its change
from iteration 0, the value at every evaluation, and the wall clock of a run (evaluations included); for each
``--train-metrics`` key (a training log value, e.g. a reward term's share of constant groups), its mean over the
first and over the last quarter of the iterations, and its value at every iteration (mean ± std over seeds; each
run's own series is kept too).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowgrpo import jsonio  # noqa: E402  (strict JSON: NaN / inf as null)
from flowgrpo.runlog import code_label, code_version  # noqa: E402  (light: no torch)


def run(arm: str, seed: int, runs: Path, extra: list[str], metrics: list[str], *, preset: str | None = None,
        train_metrics: list[str] = ()) -> dict:
    out = runs / f"{arm}_seed{seed}"
    summary, clock = out / "summary.json", out / "wall_clock.json"
    if not _finished(summary):
        # a run stopped part-way (SIGTERM, a crash) continues from its newest checkpoint, its clock from where it was
        resume = (out / "checkpoints" / "latest").is_file()
        spent = json.loads(clock.read_text())["seconds"] if resume and clock.is_file() else 0.0
        start = time.time()
        # with no checkpoint to continue from, the run starts over in its dir (a fresh run refuses a dir holding one)
        cmd = [sys.executable, str(REPO / "train.py"), *command_overrides(arm, preset, extra), f"trainer.seed={seed}",
               f"hydra.run.dir={out}", f"trainer.resume={out}" if resume else "trainer.overwrite=true"]
        try:
            with open(runs / f"{arm}_seed{seed}.log", "a" if resume else "w") as log:
                returncode = _run_forwarding_signals(cmd, log)
        finally:  # a signal that stops the run still leaves its clock, so a resumed run adds to it
            out.mkdir(parents=True, exist_ok=True)
            clock.write_text(jsonio.dumps({"seconds": spent + time.time() - start}))
        if returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed (exit {returncode}); see {runs / f'{arm}_seed{seed}.log'}")
        if not _finished(summary):
            raise SystemExit(f"{out} stopped before its last iteration ({json.loads(summary.read_text())['stopped']}); "
                             "run the same command again to continue it from its checkpoint")
    # the trainer writes a value that was not a number as null (strict JSON); a bare NaN / Infinity of a run from before
    # it did reads the same, as a missing value (else one NaN would make every mean over seeds NaN, and stdev fail)
    rows = [json.loads(line, parse_constant=lambda constant: None)
            for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    seconds = json.loads((out / "wall_clock.json").read_text())["seconds"]
    record = json.loads(summary.read_text())
    code = record.get("code")  # the run's own record of its code, where it has one
    result = {"arm": arm, "seed": seed, "seconds": round(seconds, 1), "dir": str(out),
              "commit": code_label(code), "cpu": record.get("cpu_kernels") or cpu_kernels(),
              "evals": [{"iteration": e["iteration"], **{m: e.get(m) for m in metrics}} for e in evals]}
    if train_metrics:
        train = [r for r in rows if not any(k.startswith("eval/") for k in r)]
        result["train"] = {m: {"first_quarter": _quarter(train, m, last=False), "last_quarter": _quarter(train, m, last=True),
                               "series": [[r["iteration"], r[m]] for r in train if r.get(m) is not None]}
                           for m in train_metrics}
    return result


def cpu_kernels() -> str:
    """The CPU kernels torch runs on in this environment, which the runs inherit (``AVX512``, ``AVX2``, ``DEFAULT``;
    ``ATEN_CPU_CAPABILITY`` lowers them): a run's numbers depend on them, not on the thread count. For runs whose
    ``summary.json`` predates its own record (``cpu_kernels``). torch is imported here only, when first needed."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def command_overrides(arm: str, preset: str | None, extra: list[str]) -> list[str]:
    """What an arm's runs add to ``python train.py`` besides the seed: ``experiment=<preset>`` (none for an arm
    whose preset is empty, ``name=``: the defaults) and the arm's overrides."""
    preset = arm if preset is None else preset
    return [*([f"experiment={preset}"] if preset else []), *extra]


#: the code the runs use: the commit when this script started (``+changes`` with uncommitted changes)
STARTED_AT = code_label(code_version(REPO))


def runs_commit(results: list[dict]) -> str | list[str]:
    """The commit of the runs' code: each run's own record (``summary.json``'s ``code``), else the commit this script
    started at; a list when the runs differ."""
    commits = sorted({r.get("commit") or STARTED_AT for r in results})
    return commits[0] if len(commits) == 1 else commits


def _run_forwarding_signals(cmd: list[str], log) -> int:
    """Run ``cmd``; a SIGTERM or SIGINT to this process goes to it (it checkpoints and stops), and we wait for it."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    received = []

    def forward(signum, frame):
        received.append(signum)
        proc.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        returncode = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        raise SystemExit(f"stopped by signal {received[0]}: the run checkpointed (exit {returncode}); "
                         "run the same command again to continue it")
    return returncode


def _quarter(rows: list[dict], key: str, last: bool) -> float | None:
    """Mean of ``key`` over the first (or last) quarter of the training rows that log it (at least one row)."""
    rows = [r[key] for r in rows if r.get(key) is not None]
    if not rows:
        return None
    n = max(1, len(rows) // 4)
    return statistics.fmean(rows[-n:] if last else rows[:n])


def _finished(summary: Path) -> bool:
    """A run is done when its ``summary.json`` exists and does not say it stopped early."""
    return summary.is_file() and json.loads(summary.read_text()).get("stopped") is None


def summarise(results: list[dict], metrics: list[str]) -> dict:
    arms = {}
    for arm in sorted({r["arm"] for r in results}):
        mine = [r for r in results if r["arm"] == arm]
        row = {"seeds": [r["seed"] for r in mine], "iterations": mine[0]["evals"][-1]["iteration"],
               "seconds": _stats([r["seconds"] for r in mine])}
        for m in metrics:
            last = [r["evals"][-1][m] for r in mine if r["evals"][-1].get(m) is not None]
            gain = [r["evals"][-1][m] - r["evals"][0][m] for r in mine
                    if r["evals"][-1].get(m) is not None and r["evals"][0].get(m) is not None]
            row[m] = {"final": _stats(last), "gain": _stats(gain)}
        row["base"] = {m: mine[0]["evals"][0].get(m) for m in metrics}
        for m in mine[0].get("train", {}):
            row[m] = {part: _stats([r["train"][m][part] for r in mine if r["train"][m][part] is not None])
                      for part in ("first_quarter", "last_quarter")}
            by_iteration: dict[int, list[float]] = {}
            for r in mine:
                for it, value in r["train"][m].get("series", []):
                    by_iteration.setdefault(it, []).append(value)
            row[m]["curve"] = [{"iteration": it, **_stats(v)} for it, v in sorted(by_iteration.items())]
        row["curve"] = {m: [{"iteration": e["iteration"], **_stats([r["evals"][i][m] for r in mine
                                                                  if i < len(r["evals"]) and r["evals"][i].get(m) is not None])}
                            for i, e in enumerate(mine[0]["evals"])] for m in metrics}
        arms[arm] = row
    return arms


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": round(statistics.fmean(values), 4),
            "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0, "n": len(values)}


def table(arms: dict, cols: list[tuple[str, str]]) -> str:
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


def plot(results: list[dict], path: Path, metrics: list[str], train: list[str] = ()) -> None:
    """Held-out ``metrics`` over iterations, one panel each (every run thin, each arm's mean over seeds bold), and
    below them the training keys ``train`` (each arm's mean over seeds at every iteration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if train else 1
    cols = max(len(metrics), len(train))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for k, arm in enumerate(sorted({r["arm"] for r in results})):
        color = plt.get_cmap("tab10")(k % 10)  # every arm its colour (10 before they repeat)
        mine = [x for x in results if x["arm"] == arm]
        for ax, metric in zip(axes[0], metrics):
            for r in mine:
                ax.plot([e["iteration"] for e in r["evals"]], [e[metric] for e in r["evals"]], "-", color=color,
                        alpha=0.35 if len(mine) > 1 else 0.8, lw=1)
            mean = _mean_curve([[(e["iteration"], e[metric]) for e in r["evals"]] for r in mine])
            ax.plot(*zip(*mean), "o-", color=color, lw=2, label=f"{arm} ({len(mine)} seeds)" if len(mine) > 1 else arm)
            ax.set_xlabel("iteration")
            ax.set_title(f"held-out {metric.removeprefix('eval/')}")
        for ax, key in zip(axes[1] if train else (), train):
            series = [r.get("train", {}).get(key, {}).get("series", []) for r in mine]
            if any(series):
                ax.plot(*zip(*_mean_curve(series)), "-", color=color, lw=1.5, label=arm)
            ax.set_xlabel("iteration")
            ax.set_title(f"training {key} (mean over seeds)", fontsize=9)
    axes[0][0].legend(fontsize=8)
    for ax in list(axes[0][len(metrics):]) + (list(axes[1][len(train):]) if train else []):
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _mean_curve(runs: list[list]) -> list[tuple[int, float]]:
    """``[(iteration, value), ...]`` per run → the mean over the runs that have a value at each iteration."""
    values: dict[int, list[float]] = {}
    for run_ in runs:
        for it, v in run_:
            if v is not None:
                values.setdefault(it, []).append(v)
    return [(it, statistics.fmean(v)) for it, v in sorted(values.items())]


def main(argv=None, *, description: str | None = None, defaults: dict | None = None) -> dict:
    """``defaults``: other defaults for the options (``compare_streaming.py`` sets arms, runs, out and metrics)."""
    defaults = {"arms": None, "runs": None, "out": None, "metrics": "eval/reward", "columns": None, "plot": None,
                **(defaults or {})}
    p = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    p.add_argument("--arms", default=defaults["arms"], required=defaults["arms"] is None,
                   help="experiment presets (or name=preset; name= for the defaults, no preset), comma-separated")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--runs", default=defaults["runs"], required=defaults["runs"] is None, help="run directories")
    p.add_argument("--out", default=defaults["out"], required=defaults["out"] is None,
                   help="path stem of the JSON / PNG / markdown written")
    p.add_argument("--metrics", default=defaults["metrics"], help="held-out metrics reported, comma-separated")
    p.add_argument("--columns", default=defaults["columns"],
                   help="metric=label pairs of the markdown table, separated by ';' (default: every metric)")
    p.add_argument("--plot", default=defaults["plot"], help="metrics plotted, comma-separated (default: the first two)")
    p.add_argument("--set", nargs="*", default=[], help="extra overrides for every run (key=value)")
    p.add_argument("--arm-set", nargs="+", action="append", default=[], metavar=("ARM", "KEY=VALUE"),
                   help="overrides for one arm's runs only (repeatable)")
    p.add_argument("--arm-seeds", nargs=2, action="append", default=[], metavar=("ARM", "SEEDS"),
                   help="the seeds of one arm, comma-separated, a subset of --seeds (an ablation run on fewer seeds); "
                        "repeatable")
    p.add_argument("--plot-train", default="", help="training keys plotted below the held-out panels (of "
                   "--train-metrics), comma-separated")
    p.add_argument("--train-metrics", default="",
                   help="training log keys reported as first- and last-quarter means, comma-separated")
    args = p.parse_args(argv)
    arms = {}
    for spec in args.arms.split(","):
        name, _, preset = spec.rpartition("=")
        if not (name or preset):
            raise SystemExit(f"--arms {args.arms!r}: an empty arm (give a preset, name=preset or name=)")
        arms[name or preset] = preset
    arm_set = {}
    for name, *overrides in args.arm_set:
        if name not in arms:
            raise SystemExit(f"--arm-set names the arm {name!r}, which --arms does not have ({', '.join(arms)})")
        arm_set.setdefault(name, []).extend(overrides)
    seeds = [int(x) for x in args.seeds.split(",")]
    arm_seeds = {}
    for name, own in args.arm_seeds:
        if name not in arms:
            raise SystemExit(f"--arm-seeds names the arm {name!r}, which --arms does not have ({', '.join(arms)})")
        arm_seeds[name] = [int(x) for x in own.split(",")]
        if sorted(set(arm_seeds[name]) - set(seeds)):
            raise SystemExit(f"--arm-seeds {name} {own}: seeds {sorted(set(arm_seeds[name]) - set(seeds))} are not "
                             f"among --seeds {args.seeds}")
    train_metrics = [m for m in args.train_metrics.split(",") if m]
    metrics = args.metrics.split(",")
    cols = ([tuple(c.split("=", 1)) for c in args.columns.split(";")] if args.columns
            else [(m, m.removeprefix("eval/")) for m in metrics])
    unknown = sorted({c for c, _ in cols} - set(metrics))
    if unknown:
        raise SystemExit(f"--columns names {unknown}, which --metrics does not report")
    shown = args.plot.split(",") if args.plot else metrics[:2]
    shown_train = [m for m in args.plot_train.split(",") if m]
    if sorted(set(shown_train) - set(train_metrics)):
        raise SystemExit(f"--plot-train names {sorted(set(shown_train) - set(train_metrics))}, which --train-metrics "
                         "does not report")
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in seeds:
        for arm, preset in arms.items():
            if seed not in arm_seeds.get(arm, seeds):
                continue
            results.append(run(arm, seed, runs, args.set + arm_set.get(arm, []), metrics, preset=preset,
                               train_metrics=train_metrics))
            report = {"arms": summarise(results, metrics), "runs": results, "overrides": args.set,
                      "arm_presets": arms, "arm_overrides": arm_set, "arm_seeds": arm_seeds,
                      "commit": runs_commit(results),
                      "command": " ".join(["python scripts/compare_presets.py", *(argv if argv is not None
                                                                                   else sys.argv[1:])]),
                      "arm_commands": {a: " ".join(["python train.py", *command_overrides(a, arms[a], args.set
                                                                                            + arm_set.get(a, []))])
                                       for a in arms}}
            out.with_suffix(".json").write_text(jsonio.dumps(report, indent=2))
            out.with_suffix(".md").write_text(table(report["arms"], cols) + "\n")
            plot(results, out.with_suffix(".png"), shown, shown_train)
    print(table(report["arms"], cols))
    return report


if __name__ == "__main__":
    main()
