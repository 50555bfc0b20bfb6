"""The published presets, a few iterations each, compute what their recorded references say: a change to a default
(the learning rate, a reward rule, a sampler knob, the random stream layout) fails here, in the suite its author
runs, and is re-recorded on purpose with ``python scripts/tripwire.py --update --only NAME --reason "..."``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tripwire", REPO / "scripts" / "tripwire.py")
tripwire = importlib.util.module_from_spec(_spec)
sys.modules["tripwire"] = tripwire
_spec.loader.exec_module(tripwire)


@pytest.mark.parametrize("name", sorted(tripwire.PRESETS))
def test_preset_computes_what_its_reference_records(name, tmp_path):
    reference = tripwire.load_reference()
    assert name in reference, f"no reference for {name}: python scripts/tripwire.py --update --only {name} --reason ..."
    recorded = reference[name]
    assert recorded["overrides"] == tripwire.PRESETS[name]["overrides"], (
        f"the {name} tripwire's overrides changed since its reference was recorded: re-record it")
    assert tripwire.fingerprint(recorded["rows"]) == recorded["fingerprint"], "the reference was edited by hand"
    assert len(recorded["tolerance"]) == len(recorded["rows"]) and recorded["spread_from"], (
        f"the {name} reference has no tolerances measured across CPU kernels: re-record it with --update")
    problems = tripwire.compare(recorded["rows"], tripwire.run(name, tmp_path), recorded["tolerance"])
    assert not problems, (
        f"`{recorded['command']}` no longer computes what it did at {recorded['commit']} "
        f"(recorded on {recorded['cpu']} kernels, tolerances from {sorted(map(str, recorded['spread_from'].values()))}; "
        f"this run on {tripwire.cpu_capability()}):\n  " + "\n  ".join(problems[:30])
        + f"\nIf the change is meant: python scripts/tripwire.py --update --only {name} --reason '...', and mark the "
        f"{name} world's results in docs/results/provenance.json stale (or measure them again).")


@pytest.mark.parametrize("bad", [{"a": 1.0}, {"a": 1.0, "b": 2.0}])
def test_tripwire_compare_names_what_moved(bad):
    ref = [{"iteration": 1, "a": 1.0, "b": float("nan")}]
    assert tripwire.compare(ref, [{"iteration": 1, "a": 1.0, "b": float("nan")}]) == []
    assert tripwire.compare(ref, [{"iteration": 1, "a": 1.0 + 1e-9, "b": float("nan")}]) == []
    problems = tripwire.compare(ref, [{"iteration": 1, **bad}])
    assert problems and all("iteration 1" in p for p in problems)
    assert tripwire.fingerprint(ref) == tripwire.fingerprint([{"iteration": 1, "a": 1.0 + 1e-12, "b": float("nan")}])
    assert tripwire.fingerprint(ref) != tripwire.fingerprint([{"iteration": 1, "a": 1.001, "b": float("nan")}])
    weights = [{"weights/norm": 2.0}]
    assert tripwire.compare(weights, [{"weights/norm": 2.0 * (1 + 1e-3)}]) == [
        "row 0 (the trained weights): weights/norm = 2.002, reference 2.0 (allowed ±0.0004)"]


def test_tripwire_tolerances_come_from_the_spread_across_cpu_kernels():
    """Each number's tolerance is SPREAD_FACTOR times what other CPU kernels moved it, at least RTOL or ATOL; a
    held-out score after an update is allowed a few samples' verdicts (EVAL_ATOL), one before an update is not."""
    rows = [{"iteration": 0, "eval/reward": 0.5}, {"iteration": 1, "train/loss": 1e-6, "train/grad_norm": 2.0},
            {"iteration": 1, "eval/reward": 0.5}, {"weights/norm": 3.0}]
    other = [{"iteration": 0, "eval/reward": 0.5}, {"iteration": 1, "train/loss": 1.2e-6, "train/grad_norm": 2.0 + 4e-5},
             {"iteration": 1, "eval/reward": 0.5}, {"weights/norm": 3.0}]
    tol = tripwire.tolerances(rows, [other])
    assert tol[0]["eval/reward"] == tripwire.RTOL * 0.5
    assert tol[1]["train/loss"] == pytest.approx(tripwire.SPREAD_FACTOR * 2e-7)  # a difference of near-equal terms
    assert tol[1]["train/grad_norm"] == pytest.approx(tripwire.SPREAD_FACTOR * 4e-5)
    assert tol[2]["eval/reward"] == tripwire.EVAL_ATOL
    assert tol[3]["weights/norm"] == tripwire.RTOL * 3.0
    assert tripwire.compare(rows, other, tol) == []
    moved = json.loads(json.dumps(other))
    moved[1]["train/grad_norm"] = 2.0 * (1 + 1e-3)  # 2e-3 away: five times what the kernels moved it
    assert [p.split(":")[1].split("=")[0].strip() for p in tripwire.compare(rows, moved, tol)] == ["train/grad_norm"]

