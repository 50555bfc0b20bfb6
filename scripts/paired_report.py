#!/usr/bin/env python
r"""Paired held-out results of several methods over seeds, side by side: a compact JSON and a PNG from the JSONs of
``scripts/paired_eval.py``.

    python scripts/paired_eval.py RUN_S0 RUN_S1 RUN_S2 --prompts 100 --samples 2 --out awm_paired.json
    python scripts/paired_eval.py RUN_G0 RUN_G1 RUN_G2 --prompts 100 --samples 2 --out grpo_paired.json
    python scripts/paired_report.py --arm "streaming AWM=awm_paired.json" --arm "streaming GRPO=grpo_paired.json" \
        --out docs/results/stream_one_object

Per arm and run: the seed and wall clock of the run (read from the run directory's ``config.yaml`` and ``train.log``
while it exists), and the paired change of the reward and of every reward component, overall and per segment
(``segment<k>/<name>``), with its standard error; per arm the mean change over its runs. ``--arm LABEL=REPORT.json#ARM``
takes an arm of a report this script wrote before, as it was published (its runs need not exist any more).
``--train-metrics KEYS`` adds, per run, the mean of each logged training metric over the first and the last quarter
of its iterations (read from the run directory's ``metrics.jsonl``). ``--apart LABEL=JSON``
adds other paired evaluations of an arm's runs (e.g. on another held-out file, per tag), reported per tag.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowgrpo import jsonio  # noqa: E402  (strict JSON: NaN / inf as null; null read back as NaN)

COMPONENTS = ["adherence", "direction", "speed", "identity", "teleport", "smoothness", "recovery", "anti_freeze"]
KEEP = ("n", "base", "trained", "change", "stderr", "improved", "worse")


def _labelled(spec: str) -> tuple[str, Path]:
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise SystemExit(f"expected LABEL=PATH, got {spec!r}")
    return label, Path(path)


def run_facts(run: str) -> dict:
    """Seed and wall clock (first to last line of ``train.log``, seconds) of a run directory, while it exists."""
    out: dict = {"run": Path(run).name}
    config, log = Path(run) / "config.yaml", Path(run) / "train.log"
    if config.is_file():
        from omegaconf import OmegaConf
        cfg = OmegaConf.load(config)
        out["seed"] = int(cfg.trainer.seed)
        out["iterations"] = int(cfg.trainer.iterations)
    if log.is_file():
        stamps = [line[:23] for line in log.read_text().splitlines() if line[:4].isdigit() and line[4:5] == "-"]
        if len(stamps) >= 2:
            first, last = (datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f") for s in (stamps[0], stamps[-1]))
            out["seconds"] = round((last - first).total_seconds(), 1)
    return out


def training_quarters(run: str, keys: list[str]) -> dict:
    """Per key of ``keys`` logged in the run's ``metrics.jsonl`` (while it exists): its mean over the first and over
    the last quarter of the iterations that logged it (NaN entries left out)."""
    path = Path(run) / "metrics.jsonl"
    if not keys or not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = {}
    for key in keys:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
        if values:
            q = max(1, len(values) // 4)
            out[key] = {"first_quarter": statistics.fmean(values[:q]), "last_quarter": statistics.fmean(values[-q:]),
                        "iterations": len(values)}
    return out


def summarise(paired: dict, train_keys: list[str] = ()) -> list[dict]:
    runs = []
    for r in paired["runs"]:
        metrics = {k: {kk: v[kk] for kk in KEEP if kk in v} for k, v in r["metrics"].items() if v.get("n")}
        train = training_quarters(r["run"], list(train_keys))
        runs.append(run_facts(r["run"]) | {"evaluated_iteration": r["iteration"], "metrics": metrics}
                    | ({"training": train} if train else {}))
    return runs


def published_arm(spec: Path) -> dict:
    """``REPORT.json#ARM``: the arm ``ARM`` of a report written by this script (the run directories and paired_eval
    JSONs behind it need not exist any more), its source recorded as that report and arm."""
    report_path, _, name = str(spec).partition("#")
    report = json.loads(Path(report_path).read_text())
    if name not in report.get("arms", {}):
        raise SystemExit(f"--arm ...={spec}: {report_path} has no arm {name!r}; its arms: "
                         f"{', '.join(report.get('arms', {})) or 'none (not a report of paired_report.py)'}")
    return {**report["arms"][name], "source": f"{Path(report_path).name}#{name}"}


def mean_over_runs(runs: list[dict]) -> dict:
    """Per metric every run has: the mean change and base over the runs (a ``null`` read back, a value that was not
    a number, counts as NaN)."""
    keys = set.intersection(*(set(r["metrics"]) for r in runs))
    return {k: {"change": statistics.fmean(jsonio.nan_to_float(r["metrics"][k]["change"]) for r in runs),
                "base": statistics.fmean(jsonio.nan_to_float(r["metrics"][k]["base"]) for r in runs)}
            for k in sorted(keys)}


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["reward"] + COMPONENTS
    segments = sorted({k for arm in report["arms"].values() for r in arm["runs"] for k in r["metrics"]
                       if k.startswith("segment") and "/" in k and k.split("/")[1] in ("adherence", "direction", "speed")})
    fig, axes = plt.subplots(2, 1, figsize=(13, 7.5))
    bars = [(label, r) for label, arm in report["arms"].items() for r in arm["runs"]]
    width = 0.8 / max(1, len(bars))
    colours = plt.get_cmap("tab20")
    for ax, keys, title in ((axes[0], names, "reward and components"), (axes[1], segments, "per segment")):
        for j, (label, r) in enumerate(bars):
            xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(keys))]
            # a null (a value that was not a number, e.g. the standard error of one sample) is drawn as NaN
            ys = [jsonio.nan_to_float(r["metrics"].get(k, {}).get("change")) for k in keys]
            es = [jsonio.nan_to_float(r["metrics"].get(k, {}).get("stderr", 0.0)) for k in keys]
            ax.bar(xs, ys, width, yerr=es, capsize=2, color=colours(j), label=f"{label}, seed {r.get('seed', '?')}")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(keys)), keys, rotation=20 if len(keys) > 9 else 0, fontsize=8)
        ax.set_ylabel("paired change (± s.e.)")
        ax.set_title(f"held-out change against the base model, same noise: {title}", fontsize=10)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _split(paired: dict) -> dict:
    """What a paired evaluation scored: its prompt and sample counts, its split (``val``: the validation set; older
    reports scored it and say nothing) and the prompts file given instead of the split's."""
    return {"prompts": paired["prompts"], "samples": paired["samples"], "split": paired.get("split", "val"),
            "prompts_file": paired.get("prompts_file")}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", action="append", required=True,
                   help="LABEL=paired_eval JSON, or LABEL=REPORT.json#ARM: an arm of an earlier report (repeatable)")
    p.add_argument("--apart", action="append", default=[], help="LABEL=paired_eval JSON reported per tag")
    p.add_argument("--train-metrics", default="",
                   help="comma-separated keys of the runs' metrics.jsonl: per run their mean over the first and the "
                        "last quarter of training (e.g. taros/anti_freeze/saturation)")
    p.add_argument("--out", type=Path, required=True, help="output stem: STEM.json and STEM.png")
    args = p.parse_args(argv)
    train_keys = [k for k in args.train_metrics.split(",") if k]
    report: dict = {"arms": {}, "apart": {}}
    for label, path in map(_labelled, args.arm):
        if "#" in path.name:  # an arm of a report this script wrote: its runs as published, kept as they are
            report["arms"][label] = published_arm(path)
            continue
        paired = json.loads(path.read_text())
        runs = summarise(paired, train_keys)
        report["arms"][label] = {"source": path.name, **_split(paired), "runs": runs, "mean": mean_over_runs(runs)}
    for label, path in map(_labelled, args.apart):
        paired = json.loads(path.read_text())
        runs = [{**{k: v for k, v in r.items() if k != "metrics"},
                 "by_tag": {k: v for k, v in r["metrics"].items() if k.startswith("by_tag/")}}
                for r in summarise(paired)]
        report["apart"][label] = {"source": path.name, **_split(paired), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(jsonio.dumps(report, indent=1) + "\n")
    plot(report, args.out.with_suffix(".png"))
    for label, arm in report["arms"].items():
        for r in arm["runs"]:
            m = {k: jsonio.nan_to_float(v) for k, v in r["metrics"]["reward"].items()}  # null (not a number): NaN
            print(f"{label} seed {r.get('seed')}: {m['change']:+.4f} ± {m['stderr']:.4f} "
                  f"({m['base']:.3f} -> {m['trained']:.3f}), {jsonio.nan_to_float(r.get('seconds')) / 60:.1f} min")
    return report


if __name__ == "__main__":
    sys.exit(main() and 0)
