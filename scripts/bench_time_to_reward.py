"""Wall clock and iterations each algorithm needs to reach a held-out reward target, over seeds (JSON + PNG).

    python scripts/bench_time_to_reward.py                                   # embedded world, held-out GenEval ≥ 0.35
    python scripts/bench_time_to_reward.py --target 0.45 --seeds 0,1,2 --max-iterations 60 --jobs 2
    python scripts/bench_time_to_reward.py --model tiny_sd3 --reward jpeg_compressibility --metric eval/reward ...

Every run is the real trainer with held-out evaluation every ``--eval-every`` iterations (evaluation time is
excluded from the clock: it is the same for every algorithm and not part of training). The held-out value before
training is evaluated once per evaluation setting (``Trainer.held_out_key``: every algorithm and seed of one model
shares it) and kept in the JSON's ``starting_values``, so ``--merge`` does not evaluate it again. A run stops at the
first evaluation that reaches the target, or at ``--max-iterations``. The default target, held-out GenEval
(mean over tags, strict) ≥ 0.35, is the shipped pipeline's 0.233 plus about 0.12. ``ratios``: each algorithm's
median seconds to the target over Flow-GRPO's (when both reached it in every seed). The JSON is rewritten as
every run finishes, so an interrupted benchmark keeps what it measured (unfinished runs are counted as such).
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

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from bench_iteration import ALGORITHMS, compose, pool_results, scoped  # noqa: E402

from flowgrpo import jsonio  # noqa: E402  (strict JSON: NaN / inf as null)

# the algorithms at their embedded-world recipes (bench_iteration's "mix_grpo_late" is a timing layout, not a
# training recipe; its "flow_grpo" pins every step trained, the cost the papers pay, where Flow-GRPO's recipe on the
# embedded world, experiment=flow_grpo_shapes, trains the first 3 steps). The experiment presets cannot be used
# directly: they also pin the model and the reward, which would override --model / --reward.
RECIPES = {name: overrides for name, overrides in ALGORITHMS.items() if name != "mix_grpo_late"}
RECIPES["flow_grpo"] = ["algo=grpo", "sampler=sde", "algo.timestep_fraction=0.3", "algo.timestep_selection=first"]
RECIPES["dance_grpo"] = ["algo=dance_grpo", "sampler=dance"]  # = experiment=dance_grpo_shapes's algorithm and sampler
RECIPES["grpo_guard"] = ["algo=grpo_guard", "sampler=sde", *RECIPES["flow_grpo"][2:]]  # = experiment=grpo_guard_shapes
RECIPES["pref_grpo"] = [*RECIPES["pref_grpo"], "algo.judge=[strict,partial]"]  # = experiment=pref_grpo_shapes
# Flow-OPD distils teacher runs, which the benchmark does not train: it runs only when named in --algorithms and
# given its teachers, --set flow_opd:+algo.teachers.NAME=RUN_DIR (one per teacher, trained with the same model);
# its update as experiment=flow_opd_shapes's (Flow-GRPO's 3 noisiest steps), the teacher schedule by --set as well
RECIPES["flow_opd"] = ["algo=flow_opd", "sampler=sde", *RECIPES["flow_grpo"][2:]]
TRAINING = [name for name in RECIPES if name != "flow_opd"]


def _config(algorithm: str, seed: int, args, out_dir: Path):
    return compose([f"model={args.model}", f"reward={args.reward}", "logger=none", f"trainer.seed={seed}",
                    f"trainer.iterations={args.max_iterations}", "trainer.eval_every=0", "trainer.gallery_every=0",
                    "trainer.checkpoint_every=0", f"trainer.output_dir={out_dir}", *RECIPES[algorithm],
                    *scoped(args.set, RECIPES[algorithm])])


def run(algorithm: str, seed: int, args, out_dir: Path, start: float) -> dict:
    """One (algorithm, seed) run from the held-out value ``start`` (computed once by :func:`starting_values`)."""
    from flowgrpo.trainer import Trainer

    cfg = _config(algorithm, seed, args, out_dir)
    trainer = Trainer(cfg, out_dir)
    curve = [{"iteration": 0, "seconds": 0.0, "value": start}]
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
    return {"seed": seed, "reached": reached, "iterations": curve[-1]["iteration"], "seconds": clock, "curve": curve}


def starting_values(names: list[str], seed: int, args, root: Path, known: dict) -> dict[str, str]:
    """``{algorithm: evaluation key}`` (``Trainer.held_out_key``: not the algorithm or the seed, as every run starts
    from the same weights: a LoRA adapter starts as the identity, an EMA as a copy); ``known`` (``{key: {"value", "algorithms"}}``, the report's
    ``starting_values``, kept by ``--merge``) gains the held-out value of every key it lacks, evaluated here once
    before any run starts (with every core, as no run is training yet)."""
    import gc

    from flowgrpo.trainer import Trainer

    keys = {}
    for name in names:
        trainer = Trainer(_config(name, seed, args, root / f"start-{name}"), root / f"start-{name}")
        key = keys[name] = trainer.held_out_key(trainer.eval_jobs())
        if key not in known:
            print(f"held-out {args.metric} before training ({name} and every algorithm evaluated alike) ...", flush=True)
            known[key] = {"value": trainer.evaluate()[args.metric], "algorithms": []}
        known[key]["algorithms"] = sorted({*known[key]["algorithms"], name})
        del trainer
        gc.collect()
    return keys


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for i, (name, row) in enumerate(report["algorithms"].items()):
        for j, r in enumerate(row["runs"]):
            xs = [p["seconds"] for p in r["curve"]]
            its = [p["iteration"] for p in r["curve"]]
            ys = [jsonio.nan_to_float(p["value"]) for p in r["curve"]]  # null (not a number, as read back): NaN
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
    parser.add_argument("--metric", default="eval/geneval", help="held-out scalar compared with --target")
    parser.add_argument("--target", type=float, default=0.35, help="held-out value to reach")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated trainer seeds (≥3 for the report)")
    parser.add_argument("--algorithms", default=",".join(TRAINING), help="comma-separated subset")
    parser.add_argument("--max-iterations", type=int, default=40, help="give up after this many iterations")
    parser.add_argument("--eval-every", type=int, default=5, help="iterations between held-out evaluations")
    parser.add_argument("--set", action="append", default=[],
                        help="extra Hydra override (repeatable); ALGO:key=value applies to runs of algo=ALGO only")
    parser.add_argument("--out", type=Path, default=Path("time_to_reward.json"), help="JSON path (PNG beside it)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other algorithms' rows of an existing --out measured with the same settings, and the "
                             "finished seeds of the named ones (a stopped benchmark resumes)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads per run (default: cores / jobs)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.algorithms.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise SystemExit(f"--algorithms: unknown {unknown}; known: {', '.join(RECIPES)}")
    if "flow_opd" in names and not any(s.startswith("flow_opd:+algo.teachers.") for s in args.set):
        raise SystemExit("--algorithms flow_opd distils teacher runs: give each with --set "
                         "flow_opd:+algo.teachers.NAME=RUN_DIR (a run of the same model, one per reward)")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    report = {"model": args.model, "reward": args.reward, "metric": args.metric, "target": args.target,
              "seeds": seeds, "max_iterations": args.max_iterations, "eval_every": args.eval_every,
              "jobs": args.jobs, "threads": args.threads, "overrides": _unscoped(args.set),
              "recipes": {name: RECIPES[name] for name in names}, "algorithms": {}, "ratios": {}}
    if args.merge and args.out.is_file():
        kept = json.loads(args.out.read_text())
        same = ("model", "reward", "metric", "target", "seeds", "max_iterations", "eval_every", "jobs", "threads")
        differ = [k for k in same if kept.get(k) != report[k]]
        if differ:
            raise SystemExit(f"--merge: {args.out} was measured with other {', '.join(differ)}; rerun every algorithm "
                             "or write to another --out")
        kept_overrides = _unscoped(kept.get("overrides", []))
        if kept_overrides != report["overrides"]:
            raise SystemExit(f"--merge: {args.out} was measured with the overrides {kept_overrides} for every "
                             f"algorithm, this run with {report['overrides']}; scope an override to one algorithm "
                             "(--set NAME:key=value) or write to another --out")
        report["recipes"] = {**{n: r for n, r in kept["recipes"].items() if n not in names}, **report["recipes"]}
        report["algorithms"] = {n: row for n, row in kept["algorithms"].items() if n not in names}
    # the held-out value before training per evaluation setting (Trainer.held_out_key), shared by every algorithm and seed
    # (a value that was not a number is written null: NaN here, so that it compares with the target as NaN does)
    starts: dict[str, dict] = ({key: {**start, "value": jsonio.nan_to_float(start["value"])}
                                for key, start in kept.get("starting_values", {}).items()}
                               if args.merge and args.out.is_file() else {})
    results: dict[tuple[str, int], dict] = {}
    if args.merge and args.out.is_file():
        # a benchmark stopped part-way resumes: the finished seeds of a named algorithm measured with the same row
        # overrides are kept, and only the missing (algorithm, seed) runs are made
        for n in names:
            row = kept["algorithms"].get(n)
            if row and row.get("overrides") == [o for o in scoped(args.set, RECIPES[n]) if o not in args.set]:
                results.update({(n, r["seed"]): r for r in row["runs"] if r.get("seed") in seeds})

    def record(name: str, seed: int, result: dict) -> None:  # the JSON is rewritten as every run finishes
        results[name, seed] = result
        for n in names:
            runs = [results[n, s] for s in seeds if (n, s) in results]
            if runs:
                # an override scoped to an algorithm (--set NAME:key=value) is recorded with its rows
                report["algorithms"][n] = {**summarise(runs, len(seeds)), "overrides":
                                         [o for o in scoped(args.set, RECIPES[n]) if o not in args.set]}
        report["ratios"] = ratios(report["algorithms"], len(seeds))
        args.out.write_text(jsonio.dumps(report, indent=2))

    with tempfile.TemporaryDirectory(prefix="time-to-reward-") as root:
        todo = [(name, seed) for seed in seeds for name in names if (name, seed) not in results]
        keys = starting_values(list(dict.fromkeys(n for n, _ in todo)), seeds[0], args, Path(root), starts)
        report["starting_values"] = starts
        jobs = [(name, seed, args, Path(root) / f"{name}-{seed}", starts[keys[name]]["value"]) for name, seed in todo]
        if results:
            print(f"resuming: {len(results)} finished runs kept, {len(jobs)} to run", flush=True)
            record(*next(iter(results)), next(iter(results.values())))
        for result in pool_results(run_job, jobs, args.jobs):
            record(*result)
    plot(report, args.out.with_suffix(".png"))
    print(jsonio.dumps({**{k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in report["algorithms"].items()},
                        "ratios": report["ratios"]}, indent=2))
    return report


def _unscoped(overrides: list[str]) -> list[str]:
    """The overrides for every row (those ``scoped`` gives a row of no algorithm), sorted."""
    return sorted(scoped(overrides, []))


def run_job(job: tuple) -> tuple[str, int, dict]:
    """One (algorithm, seed) run; in a worker process it sets its own thread count first."""
    name, seed, args, out_dir, start = job
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return name, seed, run(name, seed, args, out_dir, start)
    finally:
        torch.set_num_threads(threads)


def summarise(runs: list[dict], planned: int) -> dict:
    done = [r for r in runs if r["reached"]]
    return {
        "reached": f"{len(done)}/{len(runs)}" + ("" if len(runs) == planned else f" ({planned - len(runs)} not finished)"),
        "median_seconds": statistics.median(r["seconds"] for r in done) if done else None,
        "median_iterations": statistics.median(r["iterations"] for r in done) if done else None,
        "runs": runs,
    }


def ratios(rows: dict, planned: int) -> dict:
    """Median seconds to the target over Flow-GRPO's, for algorithms that reached it in all ``planned`` seeds (as
    Flow-GRPO)."""
    def complete(row):
        return len(row["runs"]) == planned and all(r["reached"] for r in row["runs"])

    base = rows.get("flow_grpo")
    if not base or not complete(base):
        return {}
    return {name: round(row["median_seconds"] / base["median_seconds"], 3) for name, row in rows.items() if complete(row)}

if __name__ == "__main__":
    main()
