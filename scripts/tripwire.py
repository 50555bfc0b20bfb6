#!/usr/bin/env python
r"""Short runs of the published presets against recorded references: a change that alters what a preset computes
is seen by the test suite, not by the next person who reruns a published number.

    python scripts/tripwire.py                       # run every preset, compare with tests/data/tripwire.json
    python scripts/tripwire.py --only image          # one preset
    python scripts/tripwire.py --update --only image --reason "the GenEval detector drops image-sized blobs"

Each preset is the published command (``python train.py``, ``experiment=video_shapes``,
``experiment=stream_grpo_shapes``) cut to a few iterations, with a smaller held-out evaluation before and after and
no gallery or checkpoint; those overrides change how much is run, not what any iteration computes. Every logged
number that is not a time (rewards, advantages, losses, ratios, gradient norms, evaluations) is compared with the
reference to ``RTOL`` / ``ATOL``: the learning rate, a reward rule, a sampler default or the random stream layout
moving shows as a mismatch naming the key and the iteration.

A change that is meant to alter a preset reruns it with ``--update`` and a ``--reason``; the reference records the
commit it was measured on, the reason and a ``fingerprint`` (a hash of the recorded numbers). Published results
measured on a world record the fingerprint of its preset at the time (``docs/results/provenance.json``), so when
a reference moves, every result of that world that was not measured again must be marked stale in the same commit
(``tests/test_published_results.py`` checks it).

The runs use ``THREADS`` CPU threads: ``OMP_NUM_THREADS`` when set, else 2 (the numbers were the same with 1 and 2). The reference records the CPU
kernels it ran (``torch.backends.cpu.get_cpu_capability()``): on another instruction set (AVX2 against AVX-512) the
losses, ratios and gradient norms of a short run move in their last digits, which ``RTOL`` / ``ATOL`` allow, while a
changed learning rate moves them by far more.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowgrpo.runlog import code_label, code_version  # noqa: E402  (light: no torch)

REFERENCE = REPO / "tests" / "data" / "tripwire.json"
RTOL, ATOL = 2e-4, 1e-7
THREADS = int(os.environ.get("OMP_NUM_THREADS") or 2)  # the test suite's workers set 1
#: keys that vary from run to run of the same computation (wall times), or that only count work
SKIP_PREFIXES = ("time/", "memory/", "throughput/")

# How much is run; nothing here changes what an iteration computes (evaluations only read the weights).
_SHORT = ["trainer.gallery_every=0", "trainer.checkpoint_every=0", "trainer.eval_before=true"]
PRESETS: dict[str, dict] = {
    "image": {  # python train.py: MixGRPO on the embedded shapes world, GenEval
        "command": "python train.py",
        "overrides": ["trainer.iterations=3", "trainer.eval_every=3", "trainer.eval_samples_per_tag=8", *_SHORT],
    },
    "video": {  # the text-to-video preset: AWM on the moving-shapes world, video GenEval
        "command": "python train.py experiment=video_shapes",
        "overrides": ["experiment=video_shapes", "trainer.iterations=1", "trainer.eval_every=1",
                      "trainer.eval_num_prompts=12", "trainer.eval_samples_per_tag=null", *_SHORT],
    },
    "stream": {  # the streaming preset: streaming GRPO on the embedded causal Wan, the long-video reward
        "command": "python train.py experiment=stream_grpo_shapes",
        "overrides": ["experiment=stream_grpo_shapes", "trainer.iterations=1", "trainer.eval_every=1",
                      "trainer.eval_num_prompts=2", *_SHORT],
    },
}


def environment() -> dict:
    """The subprocess environment: pinned threads, offline."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), HF_HUB_OFFLINE="1",
               WANDB_MODE="disabled")
    return env


def run(name: str, workdir: Path) -> list[dict]:
    """Run preset ``name`` in ``workdir``; its metrics rows (iteration and evaluation rows, times left out)."""
    out = workdir / name
    cmd = [sys.executable, str(REPO / "train.py"), *PRESETS[name]["overrides"], f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, env=environment(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tripwire preset {name!r} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.append({k: v for k, v in row.items() if isinstance(v, (int, float)) and not k.startswith(SKIP_PREFIXES)})
    return rows


def fingerprint(rows: list[dict]) -> str:
    """A short hash of the recorded numbers (6 significant digits, so it names the reference, not float noise)."""
    canon = [{k: (None if isinstance(v, float) and math.isnan(v) else float(f"{v:.6g}")) for k, v in sorted(r.items())}
             for r in rows]
    return hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()[:12]


def compare(reference: list[dict], got: list[dict], rtol: float = RTOL, atol: float = ATOL) -> list[str]:
    """Human-readable mismatches between two runs' rows (empty: the same run)."""
    problems = []
    if len(reference) != len(got):
        problems.append(f"{len(got)} metric rows, the reference has {len(reference)}")
    for i, (ref, new) in enumerate(zip(reference, got)):
        where = f"row {i} (iteration {ref.get('iteration')})"
        for key in sorted(set(ref) | set(new)):
            if key not in new or key not in ref:
                problems.append(f"{where}: {key} only in the {'reference' if key in ref else 'new run'}")
                continue
            a, b = float(ref[key]), float(new[key])
            if math.isnan(a) and math.isnan(b):
                continue
            if not math.isclose(a, b, rel_tol=rtol, abs_tol=atol):
                problems.append(f"{where}: {key} = {b!r}, reference {a!r}")
    return problems


def cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def load_reference() -> dict:
    return json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(PRESETS), help="preset(s) to run (default: all)")
    parser.add_argument("--update", action="store_true", help="record the runs as the new reference")
    parser.add_argument("--reason", default=None, help="why the reference moves (required with --update)")
    args = parser.parse_args(argv)
    if args.update and not args.reason:
        parser.error("--update needs --reason: what changed the preset's numbers, and that it was meant to")
    names = args.only or sorted(PRESETS)
    reference = load_reference()
    failed = False
    with tempfile.TemporaryDirectory(prefix="tripwire-") as tmp:
        for name in names:
            rows = run(name, Path(tmp))
            if args.update:
                reference[name] = {"command": PRESETS[name]["command"], "overrides": PRESETS[name]["overrides"],
                                   "commit": code_label(code_version(REPO)), "reason": args.reason,
                                   "cpu": cpu_capability(), "fingerprint": fingerprint(rows),
                                   "rows": rows}
                REFERENCE.parent.mkdir(parents=True, exist_ok=True)  # after every preset: a later one may fail
                REFERENCE.write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")
                print(f"{name}: recorded ({len(rows)} rows, fingerprint {reference[name]['fingerprint']})")
                continue
            if name not in reference:
                print(f"{name}: no reference in {REFERENCE}; record one with --update --only {name} --reason ...")
                failed = True
                continue
            problems = compare(reference[name]["rows"], rows)
            failed |= bool(problems)
            print(f"{name}: {'differs from its reference' if problems else 'matches its reference'}"
                  + "".join(f"\n  {p}" for p in problems[:40]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
