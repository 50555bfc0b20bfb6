#!/usr/bin/env python
"""How far apart the members of a group score, per run, from the runs' ``metrics.jsonl`` (JSON).

    python train.py experiment=kvpo_shapes algo.branch_source=routed trainer.lr=1e-12 trainer.iterations=6 \\
        trainer.eval_every=0 trainer.eval_before=false trainer.output_dir=R     # and =noise into N
    python scripts/branch_spread.py routed=R noise=N --out spread.json

A group's members are what the advantages rank: for KVPO the branches of a fork and the group's reference run. With
learning off (a learning rate of 1e-12) every iteration rolls out the base model, so each iteration's groups are a
fresh sample of the spread. Per run: the mean over iterations of the mean within-group reward std
(``adv/reward_group_std_mean``) and of the share of groups whose members all tie (``adv/zero_std_group_fraction``),
each ± its standard error over iterations, and the same spread per reward component (``groups/<k>/group_std_mean``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowgrpo import jsonio  # noqa: E402  (strict JSON: NaN / inf as null)

KEYS = {"group_std": "adv/reward_group_std_mean", "tied_groups": "adv/zero_std_group_fraction"}


def mean_se(values: list[float]) -> dict:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"n": 0}
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return {"mean": statistics.fmean(values), "se": se, "n": len(values)}


def summarise(run: Path) -> dict:
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [r for r in map(json.loads, filter(None, lines)) if KEYS["group_std"] in r]
    if not rows:
        raise SystemExit(f"{run}: no training rows with {KEYS['group_std']} in metrics.jsonl")
    out = {name: mean_se([r[key] for r in rows]) for name, key in KEYS.items()}
    parts = sorted({k.split("/")[1] for r in rows for k in r
                    if k.startswith("groups/") and k.endswith("/group_std_mean")})
    out["components"] = {p: mean_se([r.get(f"groups/{p}/group_std_mean") for r in rows]) for p in parts}
    return {"run": str(run), "iterations": len(rows), **out}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("arms", nargs="+", help="LABEL=RUN_DIR")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    report = {"arms": {}}
    for arm in args.arms:
        label, sep, run = arm.partition("=")
        if not sep:
            raise SystemExit(f"{arm!r}: give LABEL=RUN_DIR")
        report["arms"][label] = summarise(Path(run))
    text = jsonio.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
