#!/usr/bin/env python
r"""Short runs of the published presets against recorded references: a change that alters what a preset computes
is seen by the test suite, not by the next person who reruns a published number.

    python scripts/tripwire.py                       # run every preset, compare with tests/data/tripwire.json
    python scripts/tripwire.py --only image          # one preset
    python scripts/tripwire.py --kernels avx2        # as an AVX2-only CPU computes (on a CPU that has more)
    python scripts/tripwire.py --inject lr_x2        # a deliberate mistake: the comparison must fail
    python scripts/tripwire.py --update --only image --reason "the GenEval detector drops image-sized blobs"

Each preset is the published command (``python train.py``, ``experiment=video_shapes``,
``experiment=stream_grpo_shapes``) cut to one iteration, with a smaller held-out evaluation before and after and no
gallery; those overrides change how much is run, not what an iteration computes. Compared with the reference: every
logged number that is not a time (rewards, advantages, losses, ratios, gradient norms, evaluations) and, from the
final checkpoint, the weights the updates made (:func:`trained_weights`). A changed learning rate, reward rule,
sampler coefficient, loss term or random stream layout shows as a mismatch naming the key and the row.

**The same check on any x86 CPU.** torch, MKL and oneDNN pick kernels by instruction set (AVX-512, AVX2, none), and
each rounds a little differently. What the instruction sets do to each recorded number was measured: a number that
depends continuously on the computation moves in its last digits (a gradient norm by ~1e-6, a loss that is a
difference of nearly equal terms by more, relative to itself); a held-out score after an update can move by a
sample's verdict (a detector decision that the rounding tipped). So one iteration is run: every rollout comes from
the shipped weights, and the update is seen in continuous quantities (losses, gradient norm, the trained weights).
``--update`` records the reference on this CPU's kernels and runs the presets again on each lower set it can force
(``KERNELS``), and each number's tolerance is ``SPREAD_FACTOR`` times the largest difference between them, at least
``RTOL`` relative or ``ATOL`` absolute; a held-out score after an update is allowed ``EVAL_ATOL`` (a few samples'
verdicts). The reference records the kernels it ran on and those it was compared with.

A change that is meant to alter a preset reruns it with ``--update`` and a ``--reason``; the reference records the
commit it was measured on, the reason and a ``fingerprint`` (a hash of the recorded numbers). Published results
measured on a world record the fingerprint of its preset at the time (``docs/results/provenance.json``), so when
a reference moves, every result of that world that was not measured again must be marked stale in the same commit
(``tests/test_reports.py`` checks it). ``--update --unchanged`` re-records a reference whose preset
computes what it did (the tripwire itself changed: another cut, another recorded number): it refuses unless every
row the new run shares with the old reference matches it, and keeps the old fingerprint as ``computes_as`` so the
results measured under it stay current.

The runs use ``THREADS`` CPU threads: ``OMP_NUM_THREADS`` when set, else 2 (one kind of kernels gives the same
numbers with 1 and 2 threads).
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
#: a number's tolerance: this many times the largest difference the instruction sets made to it when recorded
SPREAD_FACTOR = 10.0
#: a held-out score after an update (a mean of per-sample verdicts in [0, 1]): a few samples' verdicts
EVAL_ATOL = 0.02
THREADS = int(os.environ.get("OMP_NUM_THREADS") or 2)  # the test suite's workers set 1
#: keys that vary from run to run of the same computation (wall times), or that only count work
SKIP_PREFIXES = ("time/", "memory/", "throughput/")

# How much is run; nothing here changes what an iteration computes (evaluations only read the weights).
_SHORT = ["trainer.iterations=1", "trainer.eval_every=1", "trainer.gallery_every=0", "trainer.checkpoint_every=0",
          "trainer.eval_before=true"]
PRESETS: dict[str, dict] = {
    "image": {  # python train.py: MixGRPO on the embedded shapes world, GenEval
        "command": "python train.py",
        "overrides": ["trainer.eval_samples_per_tag=8", *_SHORT],
    },
    "video": {  # the text-to-video preset: AWM on the moving-shapes world, video GenEval
        "command": "python train.py experiment=video_shapes",
        "overrides": ["experiment=video_shapes", "trainer.eval_num_prompts=12", "trainer.eval_samples_per_tag=null",
                      *_SHORT],
    },
    "stream": {  # the streaming preset: streaming GRPO on the embedded causal Wan, the long-video reward
        "command": "python train.py experiment=stream_grpo_shapes",
        "overrides": ["experiment=stream_grpo_shapes", "trainer.eval_num_prompts=2", *_SHORT],
    },
}


#: CPU kernels a run can be held to, below what the CPU has: torch's own (``ATEN_CPU_CAPABILITY``), MKL's
#: (``MKL_ENABLE_INSTRUCTIONS``) and oneDNN's (``ONEDNN_MAX_CPU_ISA``) together, so that an AVX-512 machine computes
#: as an AVX2-only one would; ``native``: what the CPU has.
KERNELS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}


def environment(kernels: str = "native") -> dict:
    """The subprocess environment: pinned threads, offline, the CPU kernels ``kernels`` (a key of ``KERNELS``)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), HF_HUB_OFFLINE="1",
               WANDB_MODE="disabled", **KERNELS[kernels])
    return env


# Deliberate mistakes, each applied to the trainer's process before it starts (``--inject NAME``), to show that the
# comparison sees a real change of what a preset computes. Each hides from the logged value it would most plainly
# show in, so only its effect on the computation can give it away.
INJECTIONS = {
    "lr_x2": "every optimizer step takes twice the learning rate (the logged train/lr unchanged)",
    "sampler_1e-3": "the velocity coefficient of every sampler step (SDE and Euler) scaled by 1 + 1e-3",
    "kl_dropped": "the KL / trust-region terms keep their logged value but no longer reach the gradient",
}


def _inject(name: str) -> None:
    """Apply injection ``name`` in this process (the trainer's, before it imports the trainer)."""
    import torch

    if name == "lr_x2":
        plain = torch.optim.AdamW.step

        def step(self, *args, **kwargs):
            saved = [group["lr"] for group in self.param_groups]
            for group in self.param_groups:
                group["lr"] = 2 * group["lr"]
            try:
                return plain(self, *args, **kwargs)
            finally:
                for group, lr in zip(self.param_groups, saved):
                    group["lr"] = lr

        torch.optim.AdamW.step = step
    elif name == "sampler_1e-3":
        import samplers.steps as steps

        coefficients, ode = steps._coefficients, steps.ode_step

        def perturbed_coefficients(*args):
            std, a, b = coefficients(*args)
            return std, a, b * (1 + 1e-3)

        def perturbed_ode(velocity, sample, sigma, sigma_next):
            return ode(velocity * (1 + 1e-3), sample, sigma, sigma_next)

        steps._coefficients = perturbed_coefficients
        _replace_everywhere(ode, perturbed_ode)
    elif name == "kl_dropped":
        import samplers
        import flowgrpo.algorithms.losses as losses

        velocity_kl, sde_kl = losses.add_velocity_kl, samplers.sde_kl

        def detached_velocity_kl(loss, info, v, v_ref, beta, key="kl"):
            return loss + (velocity_kl(loss, info, v, v_ref, beta, key) - loss).detach()

        _replace_everywhere(velocity_kl, detached_velocity_kl)
        _replace_everywhere(sde_kl, lambda *args, **kwargs: sde_kl(*args, **kwargs).detach())
    else:
        raise SystemExit(f"unknown injection {name!r}; choose one of {sorted(INJECTIONS)}")


def _replace_everywhere(original, replacement) -> None:
    """Rebind ``original`` to ``replacement`` in every module that holds it (``from x import f`` copies the name), the
    algorithms' modules imported first so that their names are bound already."""
    import importlib
    import pkgutil

    import flowgrpo.algorithms

    for info in pkgutil.walk_packages(flowgrpo.algorithms.__path__, "flowgrpo.algorithms."):
        importlib.import_module(info.name)
    for module in list(sys.modules.values()):
        for key, value in list(vars(module).items()) if module is not None else []:
            if value is original:
                setattr(module, key, replacement)


def _child(inject: str, overrides: list[str]) -> None:
    """The trainer's process under an injection: patch, then run ``train.py`` as its command line would."""
    import runpy

    _inject(inject)
    sys.argv = [str(REPO / "train.py"), *overrides]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


def run(name: str, workdir: Path, inject: str | None = None, kernels: str = "native") -> list[dict]:
    """Run preset ``name`` in ``workdir`` on the CPU kernels ``kernels`` (under injection ``inject``, if given): its
    metrics rows (iteration and evaluation rows, times left out), then :func:`trained_weights`' row."""
    out = workdir / name
    overrides = [*PRESETS[name]["overrides"], f"hydra.run.dir={out}"]
    cmd = [sys.executable, str(REPO / "train.py"), *overrides]
    if inject:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", inject, *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=environment(kernels), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tripwire preset {name!r} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)  # a value that was not a number is written null: NaN here, as the reference has it
        rows.append({k: math.nan if v is None else v for k, v in row.items()
                     if (v is None or isinstance(v, (int, float))) and not k.startswith(SKIP_PREFIXES)})
    return [*rows, trained_weights(out)]


def trained_weights(run_dir: Path) -> dict:
    """The row that shows what the updates did to the weights, read from the run's final checkpoint: for the LoRA
    factors that start at zero (``lora_B``, all of whose value the updates made) their norm and three fixed ±1
    projections; for a full fine-tune the same of every trained tensor. Unlike a held-out score these move
    continuously with the weights (rounding on another instruction set moves them in their last digits), and a
    changed step size, gradient or rollout moves them at once."""
    import torch
    from safetensors.torch import load_file

    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    tensors = {}
    for path in sorted(checkpoint.rglob("*.safetensors")):
        tensors.update({f"{path.relative_to(checkpoint)}:{k}": v for k, v in load_file(path).items()})
    if not tensors:
        raise RuntimeError(f"no trained weights (*.safetensors) in {checkpoint}")
    grown = {k: v for k, v in tensors.items() if "lora_B" in k} or tensors
    flat = torch.cat([grown[k].double().flatten() for k in sorted(grown)])
    signs = torch.randint(0, 2, (3, flat.numel()), generator=torch.Generator().manual_seed(0)).double() * 2 - 1
    row = {"weights/norm": float(flat.norm())}
    row.update({f"weights/projection{k}": float(signs[k] @ flat) for k in range(3)})
    return row


def fingerprint(rows: list[dict]) -> str:
    """A short hash of the recorded numbers (6 significant digits, so it names the reference, not float noise)."""
    canon = [{k: (None if isinstance(v, float) and math.isnan(v) else float(f"{v:.6g}")) for k, v in sorted(r.items())}
             for r in rows]
    return hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()[:12]


def _label(row: dict) -> str:
    if "iteration" not in row:
        return "the trained weights"
    return f"{'evaluation' if _is_eval(row) else 'iteration'} {row['iteration']}"


def _is_eval(row: dict) -> bool:
    return any(k.startswith("eval/") for k in row)


def tolerances(rows: list[dict], others: list[list[dict]]) -> list[dict]:
    """Per row and key, the absolute tolerance of a comparison with ``rows``: ``SPREAD_FACTOR`` times the largest
    difference from it in ``others`` (the same preset on other CPU kernels), at least ``RTOL`` of the value or
    ``ATOL``; ``EVAL_ATOL`` at least for a held-out score after an update."""
    out = []
    for i, row in enumerate(rows):
        after_update = _is_eval(row) and row.get("iteration", 0) > 0
        tol = {}
        for key, value in row.items():
            if key == "iteration":
                continue
            spread = max([abs(float(o[i][key]) - float(value)) for o in others
                          if i < len(o) and key in o[i] and math.isfinite(float(o[i][key]))
                          and math.isfinite(float(value))] or [0.0])
            floor = EVAL_ATOL if after_update and key.startswith("eval/") else 0.0
            tol[key] = max(SPREAD_FACTOR * spread, RTOL * abs(float(value)) if math.isfinite(float(value)) else 0.0,
                           ATOL, floor)
        out.append(tol)
    return out


def compare(reference: list[dict], got: list[dict], tolerance: list[dict] | None = None) -> list[str]:
    """Human-readable mismatches between two runs' rows (empty: the same computation). ``tolerance``: per row and
    key the absolute difference allowed (:func:`tolerances`); without it ``RTOL`` / ``ATOL``."""
    problems = []
    if len(reference) != len(got):
        problems.append(f"{len(got)} metric rows, the reference has {len(reference)}")
    for i, (ref, new) in enumerate(zip(reference, got)):
        where = f"row {i} ({_label(ref)})"
        for key in sorted(set(ref) | set(new)):
            if key not in new or key not in ref:
                problems.append(f"{where}: {key} only in the {'reference' if key in ref else 'new run'}")
                continue
            a, b = float(ref[key]), float(new[key])
            if math.isnan(a) and math.isnan(b):
                continue
            if key == "iteration" or tolerance is None:
                allowed = max(RTOL * abs(a), ATOL) if math.isfinite(a) else 0.0
            else:
                allowed = tolerance[i].get(key, 0.0)
            if not abs(a - b) <= allowed:
                problems.append(f"{where}: {key} = {b!r}, reference {a!r} (allowed ±{allowed:.3g})")
    return problems


def _row_key(row: dict) -> tuple:
    """What a row records: its iteration and kind (training, evaluation, the trained weights)."""
    return row.get("iteration"), _is_eval(row), "iteration" in row


def shared_rows(old: list[dict], new: list[dict]) -> tuple[list[dict], list[dict]]:
    """The rows of two runs of one preset that record the same thing, in ``old``'s order."""
    mine = {_row_key(r): r for r in new}
    pairs = [(r, mine[_row_key(r)]) for r in old if _row_key(r) in mine]
    return [a for a, _ in pairs], [b for _, b in pairs]


def cpu_capability(kernels: str = "native") -> str:
    """The kernels torch runs on with ``KERNELS[kernels]`` (``AVX512``, ``AVX2``, ``DEFAULT``), asked of a child."""
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", probe], env=environment(kernels), capture_output=True, text=True,
                          check=True).stdout.strip()


def load_reference() -> dict:
    return json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:  # the trainer's process under an injection
        _child(sys.argv[2], sys.argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(PRESETS), help="preset(s) to run (default: all)")
    parser.add_argument("--kernels", choices=sorted(KERNELS), default="native",
                        help="the CPU kernels to run on: this CPU's (native), or a lower set forced")
    parser.add_argument("--inject", choices=sorted(INJECTIONS),
                        help="run with a deliberate mistake (" + "; ".join(f"{k}: {v}" for k, v in INJECTIONS.items())
                        + "): the comparison must fail")
    parser.add_argument("--update", action="store_true", help="record the runs as the new reference")
    parser.add_argument("--reason", default=None, help="why the reference moves (required with --update)")
    parser.add_argument("--unchanged", action="store_true",
                        help="with --update: the preset computes what it did (the tripwire changed); refused unless "
                             "the rows shared with the old reference match it")
    parser.add_argument("--save", type=Path, default=None, help="write each run's rows to DIR/<preset>.json")
    args = parser.parse_args(argv)
    if args.update and not args.reason:
        parser.error("--update needs --reason: what changed the preset's numbers, and that it was meant to")
    if args.update and (args.inject or args.kernels != "native"):
        parser.error("--update records this CPU's own kernels, with no injection")
    names = args.only or sorted(PRESETS)
    reference = load_reference()
    failed = False
    with tempfile.TemporaryDirectory(prefix="tripwire-") as tmp:
        for name in names:
            rows = run(name, Path(tmp) / args.kernels, inject=args.inject, kernels=args.kernels)
            if args.save:
                args.save.mkdir(parents=True, exist_ok=True)
                (args.save / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
            if args.update:
                failed |= not record(name, rows, reference, args.reason, Path(tmp), unchanged=args.unchanged)
                continue
            if name not in reference:
                print(f"{name}: no reference in {REFERENCE}; record one with --update --only {name} --reason ...")
                failed = True
                continue
            problems = compare(reference[name]["rows"], rows, reference[name].get("tolerance"))
            failed |= bool(problems)
            print(f"{name}: {'differs from its reference' if problems else 'matches its reference'}"
                  + "".join(f"\n  {p}" for p in problems[:40]))
    return 1 if failed else 0


def record(name: str, rows: list[dict], reference: dict, reason: str, workdir: Path, *, unchanged: bool) -> bool:
    """Make ``rows`` (this CPU's own kernels) preset ``name``'s reference, with tolerances from runs on every lower
    kernel set this CPU can force; with ``unchanged``, only if the rows shared with the old reference match it."""
    native = cpu_capability()
    others = {k: run(name, workdir / k, kernels=k) for k in lower_kernels(native)}
    spread_from = {k: cpu_capability(k) for k in others}
    old = reference.get(name)
    computes_as = []
    if unchanged:
        if old is None:
            print(f"{name}: --unchanged, but there is no reference to be unchanged from")
            return False
        old_rows, new_rows = shared_rows(old["rows"], rows)
        lower = [shared_rows(old["rows"], o)[1] for o in others.values()]  # tolerances measured without the old rows
        # a key one side logs and the other does not (a metric added or dropped) is no change of what is computed
        keys = [set(a) & set(b) for a, b in zip(old_rows, new_rows)]
        added = sorted({k for a, b in zip(old_rows, new_rows) for k in set(b) ^ set(a)})
        old_rows, new_rows = ([{k: r[k] for k in ks} for r, ks in zip(side, keys)] for side in (old_rows, new_rows))
        problems = compare(new_rows, old_rows, tolerances(new_rows, lower))
        if added:
            print(f"{name}: keys logged by one of the two only, not compared: {', '.join(added)}")
        if problems:
            print(f"{name}: not unchanged: the rows shared with the reference of {old['commit']} differ:\n  "
                  + "\n  ".join(problems[:40]))
            return False
        # the old reference's own kernels are one more set the new tolerances must cover
        others[f"reference {old['commit']}"] = _aligned(old["rows"], rows)
        spread_from[f"reference {old['commit']}"] = old.get("cpu")
        computes_as = [old["fingerprint"], *old.get("computes_as", [])]
    reference[name] = {"command": PRESETS[name]["command"], "overrides": PRESETS[name]["overrides"],
                       "commit": code_label(code_version(REPO)), "reason": reason, "cpu": native,
                       "spread_from": spread_from, "fingerprint": fingerprint(rows),
                       **({"computes_as": computes_as} if computes_as else {}),
                       "tolerance": tolerances(rows, list(others.values())), "rows": rows}
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)  # after every preset: a later one may fail
    REFERENCE.write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")
    print(f"{name}: recorded ({len(rows)} rows on {native}, tolerances from {sorted(spread_from.values(), key=str)}, "
          f"fingerprint {reference[name]['fingerprint']})")
    return True


def _aligned(old: list[dict], rows: list[dict]) -> list[dict]:
    """``old``'s rows at the positions of ``rows`` that record the same thing (an empty row where it has none)."""
    theirs = {_row_key(r): r for r in old}
    return [theirs.get(_row_key(r), {}) for r in rows]


def lower_kernels(native: str) -> list[str]:
    """The ``KERNELS`` sets below ``native`` (a capability such as ``AVX512``) that this CPU can be held to."""
    order = ["default", "avx2"]
    return order[:1] if native.upper().startswith("AVX2") else order if native.upper().startswith("AVX512") else []


if __name__ == "__main__":
    sys.exit(main())
