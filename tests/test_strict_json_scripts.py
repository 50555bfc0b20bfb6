"""The scripts write strict JSON (``flowgrpo.jsonio``): a NaN or ±inf in a result is written ``null``, never the bare
``NaN`` / ``Infinity`` that strict parsers refuse; and a script that reads such a file back takes a ``null`` for a
value that was not a number (NaN) instead of failing on it."""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

#: scripts that may call json.dump / json.dumps themselves: tripwire.py's reference keeps NaN on purpose (and hashes
#: its rows with json.dumps); publish_results.py and reports.py are rewritten apart from this change
EXCLUDED = {"tripwire.py", "publish_results.py", "reports.py"}
#: (script, source line) pairs that call json.dump(s) for something other than writing (none at present)
ALLOWED: set[tuple[str, str]] = set()


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def strict(text: str):
    """``text`` parsed as strict JSON: a bare NaN / Infinity / -Infinity raises."""
    return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"not strict JSON: {c}")))


def test_strict_parser_refuses_what_json_dumps_writes():
    with pytest.raises(ValueError, match="NaN"):
        strict(json.dumps({"x": float("nan")}))
    assert strict('{"x": null}') == {"x": None}


def test_no_script_writes_json_past_flowgrpo_jsonio():
    """Every JSON a script writes (a file, a JSONL line, a report printed to stdout) goes through ``jsonio.dumps``."""
    pattern = re.compile(r"(?<![\w.])json\s*\.\s*dumps?\s*\(|from\s+json\s+import\s+[^\n]*\bdumps?\b|import\s+json\s+as\b")
    found = []
    for path in sorted(SCRIPTS.glob("*.py")):
        if path.name in EXCLUDED:
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if pattern.search(line) and (path.name, line.strip()) not in ALLOWED:
                found.append(f"{path.name}: {line.strip()}")
    assert not found, "write JSON with flowgrpo.jsonio.dumps (NaN / inf as null):\n" + "\n".join(found)


def test_bench_iteration_emit_prints_and_writes_nan_as_null(tmp_path, capsys):
    """``emit`` (bench_iteration, gpu_check, probe_update): the printed report and the file are strict JSON."""
    bench = load_script("bench_iteration")
    out = tmp_path / "bench.json"
    report = {"rows": [{"algo": "grpo", "seconds": 1.5, "ratio": float("nan")}], "floor": float("inf"),
              "steps": (1, float("-inf"))}
    assert bench.emit(report, out) is report
    written = strict(out.read_text())
    assert written == {"rows": [{"algo": "grpo", "seconds": 1.5, "ratio": None}], "floor": None, "steps": [1, None]}
    assert strict(capsys.readouterr().out) == written


def _metric(change, stderr=0.01, n=200):
    return {"n": n, "base": 0.4, "trained": 0.4 + change, "change": change, "stderr": stderr, "improved": 0.5,
            "worse": 0.4}


def test_paired_report_writes_null_and_reads_its_null_back(tmp_path, capsys):
    """paired_eval's standard error of a single sample is NaN: paired_report reads it (``null``, as paired_eval now
    writes it, or a bare NaN of an older file), writes ``null`` and reads its own report back as an arm."""
    report = load_script("paired_report")
    run = tmp_path / "s0"
    run.mkdir()
    (run / "config.yaml").write_text("trainer:\n  seed: 0\n  iterations: 4\n")
    runs = [{"run": str(run), "iteration": 4,
             "metrics": {"reward": _metric(0.02, stderr=None, n=1), "direction": _metric(0.04, stderr=float("nan"), n=1),
                         "segment1/speed": _metric(0.01)}}]
    # the file as paired_eval writes it now (null), with one bare NaN as an older paired_eval wrote it
    (tmp_path / "arm.json").write_text(json.dumps({"prompts": 1, "samples": 1, "runs": runs}))
    assert "NaN" in (tmp_path / "arm.json").read_text() and "null" in (tmp_path / "arm.json").read_text()
    out = report.main(["--arm", f"A={tmp_path / 'arm.json'}", "--out", str(tmp_path / "report")])
    written = strict((tmp_path / "report.json").read_text())
    metrics = written["arms"]["A"]["runs"][0]["metrics"]
    assert metrics["reward"]["stderr"] is None and metrics["direction"]["stderr"] is None
    assert metrics["reward"]["change"] == 0.02 and written["arms"]["A"]["mean"]["reward"]["change"] == 0.02
    assert (tmp_path / "report.png").stat().st_size > 0 and "± nan" in capsys.readouterr().out
    assert out["arms"]["A"]["runs"][0]["metrics"]["segment1/speed"]["stderr"] == 0.01
    # the published report, nulls and all, is an arm of a new one
    again = report.main(["--arm", f"then={tmp_path / 'report.json'}#A", "--arm", f"new={tmp_path / 'arm.json'}",
                         "--out", str(tmp_path / "again")])
    assert again["arms"]["then"]["runs"][0]["metrics"]["reward"]["stderr"] is None
    assert strict((tmp_path / "again.json").read_text())["arms"]["then"]["mean"]["reward"]["change"] == 0.02


def test_bench_time_to_reward_merge_reads_a_null_value_as_nan(tmp_path, monkeypatch):
    """A held-out value that was NaN is written ``null``; ``--merge`` reads it back as NaN (compared with the target,
    not failing on None), and the rewritten report is strict JSON again."""
    bench = load_script("bench_time_to_reward")
    out = tmp_path / "ttr.json"
    settings = {"model": "tiny_sd3", "reward": "jpeg_compressibility", "metric": "eval/reward", "target": 0.5,
                "seeds": [0, 1], "max_iterations": 1, "eval_every": 1, "jobs": 1, "threads": 1}
    kept_run = {"seed": 0, "reached": False, "iterations": 1, "seconds": 2.0,
                "curve": [{"iteration": 0, "seconds": 0.0, "value": None}, {"iteration": 1, "seconds": 2.0, "value": None}]}
    out.write_text(json.dumps({**settings, "overrides": [], "recipes": {"mix_grpo": bench.RECIPES["mix_grpo"]},
                               "algorithms": {"mix_grpo": {"runs": [kept_run], "overrides": []}}, "ratios": {},
                               "starting_values": {"key": {"value": None, "algorithms": ["mix_grpo"]}}}))
    starts = []

    def run(name, seed, args, out_dir, start):
        starts.append((name, seed, start))
        return {"seed": seed, "reached": start >= args.target, "iterations": 1, "seconds": 1.0,
                "curve": [{"iteration": 0, "seconds": 0.0, "value": start},
                          {"iteration": 1, "seconds": 1.0, "value": float("inf")}]}

    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(bench, "starting_values", lambda names, seed, args, root, known: {n: "key" for n in names})
    report = bench.main(["--model", "tiny_sd3", "--reward", "jpeg_compressibility", "--metric", "eval/reward",
                         "--target", "0.5", "--seeds", "0,1", "--algorithms", "mix_grpo", "--max-iterations", "1",
                         "--eval-every", "1", "--threads", "1", "--out", str(out), "--merge"])
    (name, seed, start), = starts
    assert (name, seed) == ("mix_grpo", 1) and math.isnan(start)
    assert report["algorithms"]["mix_grpo"]["reached"] == "0/2" and out.with_suffix(".png").is_file()
    written = strict(out.read_text())
    assert written["starting_values"]["key"]["value"] is None
    assert [[p["value"] for p in r["curve"]] for r in written["algorithms"]["mix_grpo"]["runs"]] == [[None, None],
                                                                                                    [None, None]]


def test_compare_presets_reads_a_nan_of_an_older_metrics_file_as_the_null_of_a_newer_one(tmp_path):
    """The trainer writes a value that was not a number as ``null``; a run's metrics.jsonl from before it did holds a
    bare NaN instead. Both are a missing value to the comparison (not a NaN mean over seeds, nor a failing stdev),
    and its report is strict JSON."""
    compare = load_script("compare_presets")
    runs = tmp_path / "runs"
    for seed, (final, train) in enumerate(((float("nan"), float("nan")), (None, None), (0.4, 0.5))):
        d = runs / f"a_seed{seed}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"cpu_kernels": "AVX2"}))
        (d / "wall_clock.json").write_text(json.dumps({"seconds": 60.0}))
        rows = [{"iteration": 0, "eval/strict": 0.2}, {"iteration": 1, "reward/mean": train},
                {"iteration": 1, "eval/strict": final}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "NaN" in (runs / "a_seed0" / "metrics.jsonl").read_text()
    report = compare.main(["--arms", "a", "--seeds", "0,1,2", "--runs", str(runs), "--out", str(tmp_path / "cmp"),
                           "--metrics", "eval/strict", "--train-metrics", "reward/mean"])
    written = strict((tmp_path / "cmp.json").read_text())
    assert written["arms"] == report["arms"]
    a = written["arms"]["a"]
    assert a["eval/strict"]["final"] == {"mean": 0.4, "std": 0.0, "n": 1} and a["eval/strict"]["gain"]["n"] == 1
    assert a["reward/mean"]["last_quarter"] == {"mean": 0.5, "std": 0.0, "n": 1}
    assert [r["evals"][-1]["eval/strict"] for r in written["runs"]] == [None, None, 0.4]
    assert [r["train"]["reward/mean"]["series"] for r in written["runs"]] == [[], [], [[1, 0.5]]]
    assert "| a | 3 | 1 | 1.0 | 0.400 ± 0.000 (+0.200) |" in (tmp_path / "cmp.md").read_text()
    assert (tmp_path / "cmp.png").is_file()
