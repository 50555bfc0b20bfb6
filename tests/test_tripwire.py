"""The published presets, a few iterations each, compute what their recorded references say: a change to a default
(the learning rate, a reward rule, a sampler knob, the random stream layout) fails here, in the suite its author
runs, and is re-recorded on purpose with ``python scripts/tripwire.py --update --only NAME --reason "..."``."""

from __future__ import annotations

import importlib.util
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
