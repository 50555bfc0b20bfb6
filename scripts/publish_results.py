#!/usr/bin/env python
r"""The published numbers, written from or pinned to the JSON that measured them: tables of run results in the README
and the docs are generated blocks, every other number written in a section about measured results is pinned to the
JSON number it is rounded from, and every file in ``docs/results/`` has a provenance record.

    python scripts/publish_results.py            # rewrite the generated blocks and the pins from docs/results/
    python scripts/publish_results.py --check    # exit 1 naming every block or number that is not what the JSON says

A generated block sits between ``<!-- generated: NAME (...) -->`` and ``<!-- end: NAME -->`` in a markdown file; its
text is :data:`BLOCKS`\ ``[NAME]``'s rendering of the results JSON and its opening comment names the files it read,
so a number edited by hand there fails ``tests/test_published_results.py`` and a rerun that rewrites a JSON moves the
text with it. A block read from a file marked stale says so.

A number written by hand in a measured section (:func:`prose_numbers`; the rule is spelled out in
``tests/test_published_results.py::test_every_number_in_a_measured_section_is_pinned_to_the_json_it_cites``) is
pinned in ``tests/data/cited_numbers.json`` to a place in a results JSON its paragraph or section links whose number
rounds to it. Writing keeps each pin while page and JSON agree and pins new numbers to the closest recorded number;
it names every number no cited JSON records: link the JSON it comes from, or say in the docs that it is not a recorded
measurement.

``docs/results/provenance.json`` records, per file of ``docs/results/``: the ``command`` that produced it, the
``commit`` that published it (its code, or its parent's, is the code that ran), the day it was ``measured``, the
``world`` it measured (``image``, ``video``, ``stream``; null for timings), the ``tripwire`` fingerprint of that
world's preset when it was measured (``scripts/tripwire.py``) and ``stale``: null, or why its numbers no longer
hold (a change since, named by its commit). A result is current only while its world's preset computes what it
computed then: when a preset's tripwire reference is re-recorded, the results of that world that were not measured
again are marked stale in the same commit.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
PROVENANCE = RESULTS / "provenance.json"
WORLDS = ("image", "video", "stream")
FIELDS = ("command", "commit", "measured", "world", "tripwire", "stale")


_READING: list[set[str]] = []  # the results files each block being rendered has read


def load(name: str):
    for sources in _READING:
        sources.add(name)
    return json.loads((RESULTS / name).read_text())


def provenance() -> dict:
    return json.loads(PROVENANCE.read_text())


def pm(stats: dict, digits: int = 3) -> str:
    """``mean ± std`` of a ``{"mean", "std"}`` summary."""
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def stale_note(name: str) -> str:
    """`` (stale: …)`` when ``name``'s provenance marks it stale, else empty."""
    why = provenance()[name]["stale"]
    return f" (**stale**: {why})" if why else ""


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min"


# ---------------------------------------------------------------- the image world's headline runs (3 seeds each)

IMAGE_RUNS = "headline_image_runs.json"
IMAGE_LABELS = {"default": "`python train.py` (MixGRPO)", "flash_grpo": "`python train.py algo=flash_grpo`",
                "flow_grpo": "`python train.py experiment=flow_grpo_shapes` (Flow-GRPO, its 3 noisiest steps)"}


def _strict_partial(row: dict, part: str) -> str:
    return f"{pm(row['eval/geneval'][part])} / {pm(row['eval/geneval_partial'][part])}"


def readme_results() -> str:
    image = load(IMAGE_RUNS)
    d, f, g = (image["arms"][a] for a in ("default", "flash_grpo", "flow_grpo"))
    base = f"{d['base']['eval/geneval']:.3f} / {d['base']['eval/geneval_partial']:.3f}"
    seeds = len(d["seeds"])
    video = load("video_runs_evals.json")["step10500"]
    runs = [video[k] for k in ("preset", "preset_seed1", "preset_seed2")]
    first, last = runs[0]["evals"][0], [r["evals"][-1] for r in runs]
    partial = [e["eval/geneval_partial"] for e in last]
    strict = [e["eval/geneval"] for e in last]
    vflow = video["flow_grpo"]["evals"]
    vflow_25 = next(e for e in vflow if e["iteration"] == 25)["eval/geneval_partial"]
    taros = load("multireward.json")["summary"]
    cost = load("bench_iteration_cpu.json")["ratios"]
    return "\n".join([
        f"On the embedded worlds, 2 CPU cores ({_kernels(_one_cpu(image['runs']))} kernels), held-out GenEval strict "
        f"/ partial, mean ± std over {seeds} seeds ([Results](docs/results.md); on other CPU kernels a seed's number "
        "differs, the mean holds):",
        "",
        f"* `python train.py` (MixGRPO, {d['iterations']} iterations): {base} → **{_strict_partial(d, 'final')}**; "
        f"Flash-GRPO {_strict_partial(f, 'final')}; Flow-GRPO on its 3 noisiest steps "
        f"{_strict_partial(g, 'final')}{stale_note(IMAGE_RUNS)}.",
        f"* Video, `python train.py experiment=video_shapes` (AWM, {last[0]['iteration']} iterations of 8 prompts × 8 "
        f"clips, {_minutes(runs[0]['wall_seconds'])} on 2 cores with three evaluations), held-out video GenEval "
        f"partial {first['eval/geneval_partial']:.3f} → **{_mean_std(partial)}** ({len(runs)} seeds: "
        + ", ".join(f"{p - first['eval/geneval_partial']:+.3f}" for p in partial)
        + f"; strict {first['eval/geneval']:.3f} → {_mean_std(strict)}); Flow-GRPO {vflow_25:.3f} at 25 iterations "
        f"of 4 × 8{stale_note('video_runs_evals.json')}.",
        f"* GenEval + JPEG multi-reward, {len(load('multireward.json')['seeds'])} seeds: TaRoS "
        f"{_signed(taros['taros']['geneval']['change'])} strict against the weighted sum's "
        f"{_signed(taros['sum']['geneval']['change'])}{stale_note('multireward.json')}.",
        f"* Iteration cost against Flow-GRPO with every step trained: MixGRPO {cost['mix_grpo']:.2f}×, Flash-GRPO "
        f"{cost['flash_grpo']:.2f}× ([Performance](docs/performance.md)){stale_note('bench_iteration_cpu.json')}.",
    ])


def _mean_std(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def _signed(stats: dict) -> str:
    return f"{stats['mean']:+.3f} ± {stats['std']:.3f}"


def image_runs_table() -> str:
    """The results page's table of the headline image runs: held-out GenEval at every evaluation, mean ± std."""
    image = load(IMAGE_RUNS)
    arms = image["arms"]
    iterations = [p["iteration"] for p in arms["default"]["curve"]["eval/geneval"]]
    lines = ["| run | " + " | ".join(str(i) for i in iterations) + " | change | minutes per run |",
             "|---|" + "---|" * (len(iterations) + 2)]
    for arm, label in IMAGE_LABELS.items():
        row = arms[arm]
        cells = [f"{s['mean']:.3f} / {p['mean']:.3f}" for s, p in zip(row["curve"]["eval/geneval"],
                                                                       row["curve"]["eval/geneval_partial"])]
        cells[0] = f"{row['base']['eval/geneval']:.3f} / {row['base']['eval/geneval_partial']:.3f}"  # shared by seeds
        cells[-1] = f"**{_strict_partial(row, 'final')}**"
        change = f"{_signed(row['eval/geneval']['gain'])} / {_signed(row['eval/geneval_partial']['gain'])}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {change} | {row['seconds']['mean'] / 60:.1f} |")
    per_seed = []
    for arm, label in IMAGE_LABELS.items():
        last = [(r["seed"], r["cpu"], r["evals"][-1]) for r in image["runs"] if r["arm"] == arm]
        finals = [f"seed {seed} ({_kernels(cpu)}) {e['eval/geneval']:.3f} / {e['eval/geneval_partial']:.3f}"
                  for seed, cpu, e in last]
        per_seed.append(f"{label.split(' (')[0]}: " + ", ".join(finals))
    return "\n".join([*lines, "", "Per seed at the last evaluation, strict / partial, with the CPU kernels it ran on: "
                      + "; ".join(per_seed) + "."])


IMAGE_RUNS_AVX2 = "headline_image_runs_avx2.json"


def _kernels(cpu: str) -> str:
    """``AVX512`` → ``AVX-512``: torch's name of the CPU kernels a run used, as people write it."""
    return {"AVX512": "AVX-512", "DEFAULT": "no SIMD"}.get(cpu, cpu)


def image_runs_kernels_table() -> str:
    """The default run's seeds on two instruction sets: mean ± std per set at every evaluation, and per seed the
    final score on each (a seed is the same draw only on the same kernels)."""
    sets = [load(IMAGE_RUNS), load(IMAGE_RUNS_AVX2)]
    arms = [s["arms"]["default"] for s in sets]
    kernels = [_kernels(_one_cpu([r for r in s["runs"] if r["arm"] == "default"])) for s in sets]
    iterations = [p["iteration"] for p in arms[0]["curve"]["eval/geneval"]]
    lines = ["| CPU kernels | seeds | " + " | ".join(str(i) for i in iterations) + " |",
             "|---|---|" + "---|" * len(iterations)]
    for name, arm in zip(kernels, arms):
        cells = [f"{_mean_pm(s)} / {_mean_pm(p)}" for s, p in zip(arm["curve"]["eval/geneval"],
                                                                 arm["curve"]["eval/geneval_partial"])]
        cells[0] = f"{arm['base']['eval/geneval']:.3f} / {arm['base']['eval/geneval_partial']:.3f}"
        lines.append(f"| {name} | {len(arm['seeds'])} | " + " | ".join(cells) + " |")
    seeds = []
    for seed in arms[0]["seeds"]:
        finals = [next(r for r in s["runs"] if r["arm"] == "default" and r["seed"] == seed)["evals"][-1] for s in sets]
        seeds.append(f"seed {seed} " + " against ".join(
            f"{e['eval/geneval']:.3f} / {e['eval/geneval_partial']:.3f} ({k})" for e, k in zip(finals, kernels)))
    return "\n".join([*lines, "", f"At iteration {iterations[-1]}, strict / partial: " + "; ".join(seeds) + "."])


def _one_cpu(runs: list[dict]) -> str:
    kinds = {r["cpu"] for r in runs}
    if len(kinds) != 1:
        raise ValueError(f"runs on several kinds of CPU kernels in one arm: {sorted(kinds)}")
    return kinds.pop()


# ---------------------------------------------------------------- the per-page tables of compare_presets.py runs

STRICT_PARTIAL = ("eval/strict", "eval/partial")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def _point(arm: dict, metric: str, iteration: int) -> dict:
    """``{"mean", "std"}`` of ``metric`` over an arm's seeds at ``iteration``."""
    return next(p for p in arm["curve"][metric] if p["iteration"] == iteration)


def _at(arm: dict, iteration: int, metrics=STRICT_PARTIAL) -> str:
    """``strict ± std / partial ± std`` of an arm at ``iteration`` (no ± for one seed)."""
    return " / ".join(_mean_pm(_point(arm, m, iteration)) for m in metrics)


def _mean_pm(stats: dict, digits: int = 3) -> str:
    return pm(stats, digits) if stats.get("n", 2) > 1 else f"{stats['mean']:.{digits}f}"


def _final(arm: dict, metric: str, gain: bool = False) -> str:
    """``final ± std``, with `` (+gain)`` when asked."""
    text = _mean_pm(arm[metric]["final"])
    return text + f" ({arm[metric]['gain']['mean']:+.3f})" if gain else text


def runs_table(rows: list[tuple[str, str, str]], iterations: list[int], metrics=STRICT_PARTIAL) -> str:
    """One row per ``(label, file, arm)`` of compare_presets.py results: held-out mean ± std over the arm's seeds at
    each of ``iterations``."""
    header = ["run", f"{iterations[0]} iterations", *(str(i) for i in iterations[1:])]
    body = []
    for label, name, arm in rows:
        data = load(name)["arms"][arm]
        body.append([label, *(_at(data, i, metrics) for i in iterations)])
    return _table(header, body)


FLOW_GRPO_BESIDE_GUARD = ("Flow-GRPO (`experiment=flow_grpo_shapes`, the runs beside "
                          "[GRPO-Guard](grpo_guard.md#measured-here))", "grpo_guard.json", "flow_grpo_shapes")


def awm_runs() -> str:
    return runs_table([("AWM (`experiment=awm_shapes`)", "awm.json", "awm_shapes"), FLOW_GRPO_BESIDE_GUARD],
                      [25, 50, 100])


def dgpo_runs() -> str:
    return runs_table([("DGPO (`experiment=dgpo_shapes`)", "dgpo.json", "dgpo_shapes"),
                       ("Flow-GRPO (`experiment=flow_grpo_shapes`)", "dgpo.json", "flow_grpo_shapes")],
                      [25, 50, 75, 100])


def pref_grpo_runs() -> str:
    return runs_table([("Pref-GRPO (`experiment=pref_grpo_shapes`)", "pref_grpo.json", "pref_grpo_shapes"),
                       ("DanceGRPO (`experiment=dance_grpo_shapes`)", "pref_grpo.json", "dance_grpo_shapes")],
                      [25, 50, 75, 100])


def slas_runs() -> str:
    rows = []
    for label, name, arm in [("`experiment=mix_grpo_shapes` (group std)", "slas.json", "mix_grpo_shapes"),
                             ("`experiment=slas_shapes` (γ = 0.5)", "slas.json", "slas_shapes"),
                             ("`experiment=slas_shapes algo.slas_gamma=1.0`", "slas_gamma1.json", "slas_shapes")]:
        data = load(name)["arms"][arm]
        rows.append([label, _final(data, "eval/strict"), _final(data, "eval/partial"),
                     pm(data["train_reward_iterations_81_100"]), pm(data["train_minus_heldout_partial"])])
    table = _table(["run", "held-out strict", "partial", "training reward, iterations 81–100",
                    "training − held-out partial"], rows)
    arms = load("slas.json")["arms"]
    gaps = ", ".join(f"{name} {_difference(arms['slas_shapes'], arms['mix_grpo_shapes'], m)}"
                     for name, m in (("strict", "eval/strict"), ("partial", "eval/partial")))
    return table + f"\n\nSLAS (γ = 0.5) − group std at 100 iterations (standard error of the difference): {gaps}."


CGPO_TAGS = ("color_attr", "position", "counting", "two_object")


def cgpo_runs() -> str:
    cgpo = load("cgpo.json")["arms"]
    base = cgpo["cgpo_shapes"]["base"]
    rows = [["base", f"{base['eval/strict']:.3f} / {base['eval/partial']:.3f}",
             *(f"{base['eval/strict/' + t]:.3f}" for t in CGPO_TAGS)]]
    for label, arm in [("CGPO's curriculum", "cgpo_shapes"), ("tag-balanced draw", "mix_grpo_shapes")]:
        data = cgpo[arm]
        rows.append([label, f"{_final(data, 'eval/strict')} / {_final(data, 'eval/partial')}",
                     *(_final(data, "eval/strict/" + t) for t in CGPO_TAGS)])
    return _table(["run", "overall strict / partial", *CGPO_TAGS], rows)


def cgpo_uniform_runs() -> str:
    rows = []
    for label, name, arm in [("uniform draw (the file's mix)", "cgpo_uniform.json", "uniform"),
                             ("CGPO's curriculum (the table above)", "cgpo.json", "cgpo_shapes")]:
        data = load(name)["arms"][arm]
        curve = [f"{_point(data, 'eval/strict', i)['mean']:.3f}" for i in (25, 50, 75)]
        rows.append([label, *curve, _final(data, "eval/strict"), _final(data, "eval/partial"),
                     *(f"{data['eval/strict/' + t]['final']['mean']:.3f}" for t in CGPO_TAGS)])
    table = _table(["run", "25", "50", "75", "100 (± std)", "partial at 100", *CGPO_TAGS], rows)
    cgpo, uniform = load("cgpo.json")["arms"]["cgpo_shapes"], load("cgpo_uniform.json")["arms"]["uniform"]
    gaps = "; ".join(name + " " + ", ".join(f"{_point(cgpo, m, i)['mean'] - _point(uniform, m, i)['mean']:+.3f}"
                                            for i in (50, 75, 100))
                     for name, m in (("strict", "eval/strict"), ("partial", "eval/partial")))
    return table + f"\n\nThe curriculum − the uniform draw at 50, 75 and 100 iterations: {gaps}."


OPD_METRICS = ("eval/geneval/geneval", "eval/geneval/geneval_partial", "eval/jpeg_compressibility", "eval/reward")
JPEG_WEIGHT = 0.1  # reward=multi: GenEval partial credit + 0.1 × JPEG compressibility


def flow_opd_runs() -> str:
    opd = load("flow_opd.json")
    arms = opd["arms"]
    base = arms["opd"]["base"]
    rows = [["base model", *(f"{base[m]:.3f}" for m in OPD_METRICS), ""]]
    for label, arm in [("weighted sum", "sum"), ("TaRoS", "taros"),
                       ("Flow-OPD (`kl_reward=sampled`, the default)", "opd"),
                       ("Flow-OPD, `kl_reward=exact` (detached, as the paper prescribes)", "exact"),
                       ("Flow-OPD, `kl_reward=exact detach_kl=false` (the authors' code)", "direct")]:
        data = arms[arm]
        seeds = ("seeds " if len(data["seeds"]) > 1 else "seed ") + ", ".join(str(s) for s in data["seeds"])
        cells = [_final(data, m, gain=m != "eval/jpeg_compressibility") for m in OPD_METRICS]
        rows.append([f"{label}; {seeds}", *cells, f"{data['seconds']['mean'] / 60:.1f}"])
    teachers = opd["teachers"]
    each = str(teachers["minutes_each"])
    for label, key, minutes in [("the teachers and the cold start, same evaluation:* *GenEval teacher",
                                 "geneval_teacher", each), ("JPEG teacher", "jpeg_teacher", each),
                                ("the teachers' average (the student's first weights)", "cold_start_average", "")]:
        held = teachers["held_out"][key]
        composite = held["eval/geneval/geneval_partial"] + JPEG_WEIGHT * held["eval/jpeg_compressibility"]
        rows.append([f"*{label}*", *(f"{held[m]:.3f}" for m in OPD_METRICS[:3]), f"{composite:.3f}", minutes])
    return _table(["run", "GenEval strict", "GenEval partial", "JPEG term (−kB)", "composite", "minutes"], rows)


def flash_grpo_tail_runs() -> str:
    tail = load("flash_grpo_tail.json")["arms"]
    bench = load("bench_iteration_cpu_flash_fast.json")
    rows = []
    for label, arm, row in [("full (`algo=flash_grpo`)", "flash_grpo_shapes", "flash_grpo"),
                            ("shared prefix + tail 0.4 (`experiment=flash_grpo_fast`)", "flash_grpo_fast",
                             "flash_grpo_fast"),
                            ("tail 0.4 only", "flash_grpo_tail_only", None),
                            ("shared prefix only", "flash_grpo_shared_only", None)]:
        data = tail[arm]
        cost = (f"{bench['algorithms'][row]['seconds_per_iteration']:.2f} ({bench['ratios'][row]:.2f}× Flow-GRPO)"
                if row else "")
        rows.append([label, _final(data, "eval/strict"), _final(data, "eval/partial"), cost])
    table = _table(["rollout (100 iterations, 3 seeds)", "held-out strict", "partial", "s / iteration, bench"], rows)
    pairs = (("flash_grpo_fast", "the preset"), ("flash_grpo_tail_only", "the tail alone"))
    gaps = ["; ".join(f"{name} " + ", ".join(f"{label} {_difference(tail[arm], tail['flash_grpo_shapes'], metric)}"
                                              for arm, label in pairs)
                      for name, metric in (("strict", "eval/strict"), ("partial", "eval/partial")))]
    return table + "\n\nAgainst the full rollout, mean difference (standard error of the difference): " + gaps[0] + "."


def _difference(arm: dict, against: dict, metric: str) -> str:
    """Difference of two arms' final means and its standard error, from their stds over seeds."""
    a, b = arm[metric]["final"], against[metric]["final"]
    error = (a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"]) ** 0.5
    return f"{a['mean'] - b['mean']:+.3f} ({error:.3f})"


# ---------------------------------------------------------------- results.md: single-seed runs, detector before 20fb8be

SINGLE_SEED_RUNS = [("`python train.py` (MixGRPO)", "default_run_evals.json"),
                    ("`python train.py algo=flash_grpo`", "flash_grpo_run_evals.json"),
                    ("`python train.py experiment=flow_grpo_shapes` (Flow-GRPO, its 3 noisiest steps)",
                     "flow_grpo_run_evals.json"),
                    ("`python train.py algo=diffusion_nft` (the authors' defaults)", "diffusion_nft_run_evals.json")]
GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


def single_seed_runs() -> str:
    """The four single-seed runs measured before GenEval's shapes detector changed: every evaluation, then per tag."""
    runs = [(label, load(name)) for label, name in SINGLE_SEED_RUNS]
    iterations = [e["iteration"] for e in runs[0][1]]
    curve = []
    for label, evals in runs:
        cells = [f"{e['eval/geneval']:.3f} / {e['eval/geneval_partial']:.3f}" for e in evals]
        change = " / ".join(f"{evals[-1][m] - evals[0][m]:+.3f}" for m in ("eval/geneval", "eval/geneval_partial"))
        curve.append([label, *cells, change])
    tags = [["baseline (iteration 0)", *(f"{runs[0][1][0]['eval/strict/' + t]:.2f} / "
                                         f"{runs[0][1][0]['eval/partial/' + t]:.2f}" for t in GENEVAL_TAGS)]]
    for label, evals in runs:
        last = evals[-1]
        tags.append([label.split(" (")[0], *(f"{last['eval/strict/' + t]:.2f} / {last['eval/partial/' + t]:.2f}"
                                             for t in GENEVAL_TAGS)])
    return "\n".join([_table(["run", *(str(i) for i in iterations), "change"], curve), "",
                      f"Per tag after {iterations[-1]} iterations, strict / partial:", "",
                      _table(["run", *GENEVAL_TAGS], tags)])


# ---------------------------------------------------------------- results.md: multi-reward, video TaRoS, streaming

def multireward_table() -> str:
    summary = load("multireward.json")["summary"]
    keys = ("geneval", "geneval_partial", "jpeg")
    rows = [["baseline", *(f"{summary['sum'][k]['before']['mean']:.3f}" for k in keys)]]
    for label, arm in [("weighted sum", "sum"), ("TaRoS", "taros")]:
        rows.append([label, *(f"{summary[arm][k]['after']['mean']:.3f} ({_signed(summary[arm][k]['change'])})"
                              for k in keys)])
    return _table(["aggregator", "GenEval strict", "GenEval partial", "JPEG term (−kB)"], rows)


VIDEO_TAROS_METRICS = ("eval/video_geneval/geneval", "eval/video_geneval/geneval_partial",
                       "eval/video_geneval/partial/motion", "eval/video_geneval/partial/static",
                       "eval/video_consistency", "eval/video_sharpness")


def video_taros_table() -> str:
    arms = load("video_taros.json")["arms"]
    rows = [[label, *(_final(arms[arm], m, gain=True) for m in VIDEO_TAROS_METRICS),
             f"{arms[arm]['seconds']['mean'] / 60:.1f}"]
            for label, arm in [("weighted sum", "sum"), ("TaRoS", "taros")]]
    return _table(["aggregator", "video GenEval strict", "partial", "motion (partial)", "standing still (partial)",
                   "consistency", "sharpness", "minutes"], rows)


STREAM_PRESETS = [("streaming GRPO (`experiment=stream_grpo_shapes`)", "stream_grpo_shapes"),
                  ("KVPO (`experiment=kvpo_shapes` as it was: the guided model)", "kvpo_shapes")]


def streaming_table() -> str:
    arms = load("streaming_rl.json")["arms"]
    rows = [[label, pm(_point(arms[arm], "eval/reward", 10)),
             *(_final(arms[arm], m, gain=True) for m in ("eval/reward", "eval/segment0/adherence",
                                                          "eval/segment1/adherence", "eval/recovery"))]
            for label, arm in STREAM_PRESETS]
    return _table(["preset, 20 iterations, seeds 0, 1, 2", "reward at 10", "reward at 20", "adherence, 1st segment",
                   "after the 1st switch", "recovery"], rows)


def streaming_summary() -> str:
    data = load("streaming_rl.json")
    rows = []
    for label, arm in STREAM_PRESETS:
        minutes = [r["seconds"] / 60 for r in data["runs"] if r["arm"] == arm]
        rows.append([label.split(" (")[1].rstrip(")"), pm(_point(data["arms"][arm], "eval/reward", 10)),
                     _final(data["arms"][arm], "eval/reward", gain=True),
                     f"{min(minutes):.1f}–{max(minutes):.1f} min"])
    return _table(["preset", "reward at 10 iterations", "reward at 20", "run (evaluations included)"], rows)


def streaming_runs_table() -> str:
    """Every recorded 20-iteration run on the streaming model: held-out reward at 0, 10 and 20 iterations."""
    data = load("streaming_rl.json")
    names = dict((arm, label.split(" (")[0]) for label, arm in STREAM_PRESETS)
    rows = []
    for run in sorted(data["runs"], key=lambda r: (r["seed"], r["arm"] != "stream_grpo_shapes")):
        cells = {e["iteration"]: f"{e['eval/reward']:.3f}" for e in run["evals"]}
        rows.append([f"{names[run['arm']]}, lr 3e-5 (the preset), seed {run['seed']}",
                     *(cells.get(i, "") for i in (0, 10, 20)), f"{run['seconds'] / 60:.1f} min"])
    for label, evals in load("kvpo_exploration.json")["learning"].items():
        cells = {e["iteration"]: f"{e['eval/reward']:.3f}" for e in evals["eval"]}
        rows.append([f"KVPO, `{label.split(',')[0]}`, lr 3e-5, seed 0", *(cells.get(i, "") for i in (0, 10, 20)),
                     "the CPU was shared"])
    for key, label in (("sg_lr3e-4_kl0.04", "`algo.kl_beta=0.04`"), ("sg_lr3e-4_kl0.4", "`algo.kl_beta=0.4`")):
        held = load("probe_update.json")["training_runs"]["runs"][key]["held_out"]
        rows.append([f"streaming GRPO, lr 3e-4, {label} (no evaluation at 0)", "",
                     *(f"{held[str(i)]:.3f}" for i in (10, 20)), "two runs shared the cores"])
    return _table(["run", "0", "10", "20", "wall (evaluations included)"], rows)


STREAM_ONE_OBJECT = "stream_one_object.json"


def _change(metric: dict) -> str:
    """``+0.031 ± 0.009`` of a paired metric (scripts/paired_eval.py), the change and its standard error."""
    return f"{metric['change']:+.3f} ± {metric['stderr']:.3f}"


def stream_one_object_table() -> str:
    """The streaming page's table: per method and seed, the paired held-out change of the long-video reward and its
    motion and identity components on one-object streams, and the wall clock of the run."""
    data = load(STREAM_ONE_OBJECT)
    rows = []
    for label, arm in data["arms"].items():
        for run in arm["runs"]:
            m = run["metrics"]
            rows.append([f"{label}, seed {run['seed']}", f"{m['reward']['base']:.3f} → {m['reward']['trained']:.3f}",
                         f"**{_change(m['reward'])}**",
                         *(_change(m[c]) for c in ("direction", "speed", "adherence", "identity", "anti_freeze")),
                         f"{run['seconds'] / 60:.1f} min"])
    return _table(["method, seed", "reward", "change", "direction", "speed", "adherence", "identity", "anti-freeze",
                   "run"], rows)


KVPO_PAIRED = "kvpo_paired.json"
#: the preset's runs at 48 iterations with an EMA (decay 0.9), read through the EMA and through the trained weights,
#: each on 400 held-out videos (100 sequences x 4)
KVPO_48 = "kvpo_48.json"
#: the preset (36 iterations) run again at a later commit, each on 400 held-out videos (100 sequences x 4)
KVPO_PRESET_400 = "kvpo_preset_400.json"
#: once forks with one selection were left out: the preset, with no nearest frame (algo.nearest_m=0) and with 8 routed
#: branches a group, each on 400 held-out videos (100 sequences x 4)
KVPO_FORKS = "kvpo_forks.json"
#: with forks that differ, later: the objective ablation (algo=kvpo_awm) and three more seeds of 8 routed branches a
#: group, each on 400 held-out videos
KVPO_FORKS_MORE = "kvpo_forks_more.json"
#: the streaming page's comparison: the independent-stream methods' runs of KVPO's 36 iterations (its wall-clock
#: budget: one thread each, two runs at a time on the two cores, as KVPO's) beside KVPO's
STREAM_BASELINES = [("streaming AWM, 36 iterations", "streaming AWM, 36 iterations"),
                    ("streaming GRPO, lr 2e-5, 36 iterations", "streaming GRPO, lr 2e-5, 36 iterations")]
COMPONENTS = ("direction", "speed", "adherence", "identity", "anti_freeze")


def kvpo_comparison_table() -> str:
    """KVPO's runs and its objective ablation beside streaming AWM and streaming GRPO on one-object streams: per
    run the paired held-out change of the long-video reward and its components; per method with several seeds,
    the mean ± std of those changes over seeds."""
    baselines = load(STREAM_ONE_OBJECT)["arms"]
    arms = [(label, baselines[key]) for label, key in STREAM_BASELINES] + list(load(KVPO_PAIRED)["arms"].items()) \
        + list(load(KVPO_48)["arms"].items()) + list(load(KVPO_PRESET_400)["arms"].items()) \
        + list(load(KVPO_FORKS)["arms"].items()) + list(load(KVPO_FORKS_MORE)["arms"].items())
    return _paired_runs_table(arms)


def _paired_runs_table(arms: list[tuple[str, dict]]) -> str:
    """Per run of each ``(label, arm)`` (scripts/paired_report.py's arms) the paired held-out change of the
    long-video reward and its components and the run's wall clock; per arm of several runs their mean ± std."""
    rows = []
    for label, arm in arms:
        runs = arm["runs"]
        for run in runs:
            m = run["metrics"]
            rows.append([f"{label}, seed {run['seed']}", f"**{_change(m['reward'])}**",
                         *(_change(m[c]) for c in COMPONENTS), f"{run['seconds'] / 60:.1f} min"])
        if len(runs) > 1:
            spread = [[r["metrics"][c]["change"] for r in runs] for c in ("reward", *COMPONENTS)]
            rows.append([f"{label}: mean ± std over {len(runs)} seeds",
                         *(f"{statistics.fmean(v):+.3f} ± {statistics.stdev(v):.3f}" for v in spread), ""])
    return _table(["method, seed", "reward", *(c.replace("_", "-") for c in COMPONENTS), "run"], rows)


#: TaRoS on the long-video aspects through streaming AWM, beside streaming AWM's one-thread runs with the weighted mean
TAROS_LONG_VIDEO = "taros_long_video.json"
#: the long-video reward's eight aspects, TaRoS's components there
TAROS_LONG_VIDEO_ASPECTS = ("adherence", "direction", "speed", "identity", "teleport", "smoothness", "recovery",
                            "anti_freeze")


def taros_long_video_table() -> str:
    """The rewards page's TaRoS-on-long-video comparison: per run the paired held-out change (as the streaming page's
    comparison), then TaRoS's per-aspect diagnostics over training, mean over its seeds (first → last quarter)."""
    arms = load(TAROS_LONG_VIDEO)["arms"]
    paired = _paired_runs_table(list(arms.items()))

    def aggregated(run):  # a run trained with TaRoS records its diagnostics (every run may record the groups')
        return f"taros/{TAROS_LONG_VIDEO_ASPECTS[0]}/saturation" in run.get("training", {})

    label = next(lbl for lbl, arm in arms.items() if any(aggregated(r) for r in arm["runs"]))
    runs = [r for r in arms[label]["runs"] if aggregated(r)]
    rows = []
    for aspect in TAROS_LONG_VIDEO_ASPECTS:
        cells = []
        for key in (f"taros/{aspect}/saturation", f"taros/{aspect}/zeroed", f"groups/{aspect}/zero_std_group_fraction",
                    f"groups/{aspect}/group_std_mean"):
            first = statistics.fmean(r["training"][key]["first_quarter"] for r in runs)
            last = statistics.fmean(r["training"][key]["last_quarter"] for r in runs)
            cells.append(f"{first:.3f} → {last:.3f}")
        rows.append([aspect.replace("_", "-"), *cells])
    diagnostics = _table([f"aspect ({label}, mean over {len(runs)} seeds; first → last quarter of training)",
                          "σ/σ̄ in groups", "entries zeroed", "groups with no spread", "spread in groups (std)"], rows)
    return paired + "\n\n" + diagnostics


def stream_apart_table() -> str:
    """The same runs on the streams held-out file, per tag (one- and two-object streams apart)."""
    data = load(STREAM_ONE_OBJECT)
    rows = []
    for label, arm in data["apart"].items():
        for run in arm["runs"]:
            tags = run["by_tag"]
            rows.append([f"{label}, seed {run['seed']}",
                         *(_change(tags[f"by_tag/{t}/reward"]) for t in ("one_object_stream", "two_object_stream"))])
    return _table(["method, seed", "one-object streams", "two-object streams"], rows)


# ---------------------------------------------------------------- performance.md: time to reward, iteration cost

TIME_TO_REWARD_LABELS = {
    "flow_grpo": "Flow-GRPO (`experiment=flow_grpo_shapes`'s knobs: first 3 of 10 steps trained, β 0.04)",
    "dance_grpo": "DanceGRPO (`sampler=dance`, 60% of the steps at random, shared noise, β 0)",
    "mix_grpo": "MixGRPO (the default)",
    "mix_grpo_flash": "MixGRPO-Flash (`experiment=mix_grpo_flash_shapes`'s knobs)",
    "flash_grpo": "Flash-GRPO (`algo=flash_grpo`)",
    "diffusion_nft": "DiffusionNFT (`algo=diffusion_nft`, the authors' defaults)",
    "slas": "SLAS (the default run with `algo.slas_gamma=0.5`, `experiment=slas_shapes`'s knob)",
    "cgpo": "CGPO (the default run drawing from the curriculum, `data.sampling=cgpo`)",
    "grpo_guard": "GRPO-Guard (`experiment=grpo_guard_shapes`'s knobs: Flow-GRPO's first 3 steps)",
    "awm": "AWM (`algo=awm`, the authors' defaults)",
    "pref_grpo": "Pref-GRPO (`experiment=pref_grpo_shapes`'s knobs: DanceGRPO's steps, strict then partial judge)",
    "dgpo": "DGPO (`algo=dgpo`, the authors' defaults)",
    "flow_opd": "Flow-OPD (`experiment=flow_opd_shapes`'s student: the GenEval and JPEG teachers, 3:1; the student's "
                "clock only)",
}
VIDEO_TIME_TO_REWARD_LABELS = {
    "awm": "AWM (`algo=awm`, the preset's algorithm)", "flow_grpo": "Flow-GRPO (first 3 of 10 steps trained)",
    "mix_grpo": "MixGRPO (the default)", "flash_grpo": "Flash-GRPO (`algo=flash_grpo`)",
    "dance_grpo": "DanceGRPO (`sampler=dance`)", "diffusion_nft": "DiffusionNFT (the authors' defaults)",
}


def _time_to_reward(name: str, labels: dict[str, str], digits: int) -> str:
    data = load(name)
    target, most = data["target"], data["max_iterations"]
    rows = []
    for algo, label in labels.items():
        runs = data["algorithms"][algo]["runs"]
        reached = [r["reached"] for r in runs]
        count = f"{sum(reached)} of {len(runs)}"
        missed = [f"{r['curve'][-1]['value']:.3f}" for r in runs if not r["reached"]]
        missed = f" ({', '.join(missed)} at {most})" if missed else ""
        if any(reached):
            iterations = ", ".join(str(r["iterations"]) if r["reached"] else "—" for r in runs) + missed
            seconds = ", ".join(f"{r['seconds']:.0f}" if r["reached"] else "—" for r in runs)
        else:
            iterations, seconds = "—" + missed, "—"
        per_iteration = statistics.fmean(r["curve"][-1]["seconds"] / r["curve"][-1]["iteration"] for r in runs)
        rows.append([label, f"**{count}**" if all(reached) else count, iterations, seconds,
                     f"{per_iteration:.{digits}f}"])
    return _table(["algorithm (config)", f"seeds that reached {target} in ≤ {most} iterations",
                   "iterations (per seed)", "training seconds (per seed)",
                   "s / iteration (1 thread, 2 runs at a time)"], rows)


def time_to_reward_table() -> str:
    return _time_to_reward("time_to_reward_cpu.json", TIME_TO_REWARD_LABELS, 1)


def video_time_to_reward_table() -> str:
    return _time_to_reward("video_time_to_reward_cpu.json", VIDEO_TIME_TO_REWARD_LABELS, 0)


BENCH_LABELS = {
    "flow_grpo": "Flow-GRPO (all 10 steps trained, KL)", "dance_grpo": "DanceGRPO (60% of steps)",
    "mix_grpo": "MixGRPO (window 2)", "mix_grpo_flash": "MixGRPO-Flash (DPM-Solver++ tail)",
    "flash_grpo": "Flash-GRPO (one step)", "flash_grpo_fast": "Flash-GRPO, `experiment=flash_grpo_fast`'s rollout",
    "diffusion_nft": "DiffusionNFT", "grpo_guard": "GRPO-Guard (all 10 steps trained)",
    "awm": "AWM (the authors' defaults: 6 levels, KL 0.001)", "pref_grpo": "Pref-GRPO", "dgpo": "DGPO",
    "slas": "MixGRPO + SLAS", "cgpo": "MixGRPO + CGPO", "flow_opd": "Flow-OPD (two untrained teachers)",
    "mix_grpo_late": "MixGRPO, window at the last position",
}


def _bench_row(bench: dict, algo: str) -> tuple[dict, float]:
    return bench["algorithms"][algo], bench["ratios"][algo]


def iteration_cost_table() -> str:
    f32, bf16 = load("bench_iteration_cpu.json"), load("bench_iteration_cpu_vae_bf16.json")
    rows = []
    for algo in f32["algorithms"]:
        (a, ratio), (b, b_ratio) = _bench_row(f32, algo), _bench_row(bf16, algo)
        rows.append([BENCH_LABELS[algo], f"{a['seconds_per_iteration']:.2f}", f"{ratio:.2f}", f"{a['rollout_nfe']:.0f}",
                     f"{a['outside_transformer_and_reward']:.1%} ({a['overhead_excluding_decode']:.1%})",
                     f"{b['seconds_per_iteration']:.2f} / {b_ratio:.2f} / {b['outside_transformer_and_reward']:.1%}"])
    return _table(["algorithm", "s / iteration", "ratio to Flow-GRPO", "rollout NFE",
                   "outside transformer + reward (our code alone)", "bf16 decoder: s / ratio / outside"], rows)


PLANS = ("flow_grpo_sd35m_geneval", "flow_grpo_sd35l_geneval", "flow_grpo_wan21_1_3b", "flow_grpo_wan22_5b",
         "dance_grpo_flux_hps", "stream_grpo_self_forcing", "stream_awm_self_forcing", "kvpo_longlive")


def run_plans_table() -> str:
    """The real presets' plans (``scripts/plan.py``, fake tensors): per-GPU peak, headroom, FLOPs, projected time."""
    rows = []
    for name in PLANS:
        plan = load(f"plan_{name}.json")
        phases = {p["name"]: p["peak_bytes"] / 2**30 for p in plan["phases"]}
        split = next(p for p in plan["phases"] if p["name"] == plan["peak_phase"])["split"]
        parts = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in split.items() if v >= 0.05 * 2**30)
        rows.append([f"`{plan['config']}`", f"{plan['num_processes']} × {plan['gpu']} ({plan['launcher'].upper()})",
                     f"**{plan['peak_gib']:.1f}** in {plan['peak_phase']} ({parts})",
                     " / ".join(f"{phases[k]:.1f}" for k in ("rollout", "update", "eval") if k in phases),
                     f"{plan['headroom_gib']:.1f}{'' if plan['fits'] else ' (does not fit)'}",
                     _host_gib(plan),
                     f"{plan['flops_per_iteration'] / 1e15:.1f}",
                     f"{plan['projected_seconds_per_iteration']:.0f} at {plan['mfu']:.0%}"])
    return _table(["preset", "GPUs", "per-GPU peak, GiB (plan)", "rollout / update / eval peaks, GiB",
                   "headroom, GiB", "host memory per GPU, GiB", "PFLOP per iteration per GPU",
                   "projected s / iteration (share of peak FLOP/s)"], rows)


def _host_gib(plan: dict) -> str:
    """The most a plan keeps in host memory per GPU (``trainer.offload_kept_context``), or ``–``."""
    host = max(p.get("host_bytes", 0) for p in plan["phases"])
    return f"{host / 2**30:.1f}" if host else "–"


def video_iteration_cost_table() -> str:
    bench = load("bench_iteration_video_cpu.json")
    rows = []
    for algo in bench["algorithms"]:
        a, ratio = _bench_row(bench, algo)
        phases = " / ".join(f"{a['phases'][p]:.1f}" for p in ("rollout", "score", "update"))
        rows.append([BENCH_LABELS[algo], f"{a['seconds_per_iteration']:.1f}", f"{ratio:.2f}", phases])
    return _table(["algorithm", "s / iteration", "ratio to Flow-GRPO", "rollout / score / update (s)"], rows)


BREADTH_LABELS = {
    "flow_grpo": "Flow-GRPO (all 10 steps trained, KL)", "dance_grpo": "DanceGRPO row (60% of steps, KL)",
    "grpo_guard": "GRPO-Guard (all 10 steps trained, KL)", "awm": "AWM (ODE rollouts, 6 noise levels)",
    "pref_grpo": "Pref-GRPO (DanceGRPO's steps, no KL)",
    "dgpo": "DGPO (ODE rollouts, 4 noise levels, no CFG in training)",
    "mix_grpo": "MixGRPO (the default run)", "slas": "SLAS (the default run with SLAS's advantages, "
    "`experiment=slas_shapes`)", "cgpo": "CGPO (the default run drawing from the curriculum, `experiment=cgpo_shapes`)",
    "flow_opd": "Flow-OPD (9 of 10 steps trained; a teacher and a regulariser forward per trained step, no reference "
                "KL)",
}


def _calls_table(name: str) -> str:
    bench = load(name)
    rows = []
    for algo in bench["algorithms"]:
        a, ratio = _bench_row(bench, algo)
        rows.append([BREADTH_LABELS[algo], f"{a['seconds_per_iteration']:.2f}", f"{ratio:.2f}",
                     f"{a['transformer_calls']:.0f}", str(a["trained_transitions"])])
    return _table(["algorithm (bench row)", "s / iteration", "ratio to Flow-GRPO", "transformer calls",
                   "trained transitions per iteration"], rows)


def breadth_cost_table() -> str:
    return _calls_table("bench_iteration_cpu_breadth.json")


def opd_slas_cgpo_cost_table() -> str:
    return _calls_table("bench_iteration_cpu_opd_slas_cgpo.json")


def _seed_differences(name: str, arm: str, against: str, metric: str, iteration: int) -> str:
    """``arm`` − ``against`` at ``iteration``, seed by seed (runs of one compare_presets.py file)."""
    runs = load(name)["runs"]

    def value(which: str, seed: int) -> float:
        run = next(r for r in runs if r["arm"] == which and r["seed"] == seed)
        return next(e[metric] for e in run["evals"] if e["iteration"] == iteration)

    seeds = sorted({r["seed"] for r in runs if r["arm"] == arm})
    return ", ".join(f"{value(arm, s) - value(against, s):+.3f}" for s in seeds)


def grpo_guard_runs() -> str:
    table = runs_table([("Flow-GRPO (`experiment=flow_grpo_shapes`)", "grpo_guard.json", "flow_grpo_shapes"),
                        ("GRPO-Guard (`experiment=grpo_guard_shapes`)", "grpo_guard.json", "grpo_guard_shapes")],
                       [25, 50, 100])
    diff = [f"{label} {_seed_differences('grpo_guard.json', 'grpo_guard_shapes', 'flow_grpo_shapes', m, 100)}"
            for label, m in (("strict", "eval/strict"), ("partial", "eval/partial"))]
    return table + "\n\nGRPO-Guard − Flow-GRPO at 100 iterations, seeds 0, 1, 2: " + "; ".join(diff) + "."


# ---------------------------------------------------------------- methods.md: every algorithm on one line

def _cost(name: str, algo: str) -> str:
    return f"{load(name)['ratios'][algo]:.2f}× Flow-GRPO's"


def _reached(algo: str) -> str:
    """Seeds of ``algo`` that reached the time-to-reward target; where all did, when, and the median time."""
    data = load("time_to_reward_cpu.json")
    runs, ratio = data["algorithms"][algo]["runs"], data["ratios"].get(algo)
    text = f"{sum(r['reached'] for r in runs)} of {len(runs)} seeds"
    if not all(r["reached"] for r in runs):
        return text
    against = f", {ratio:.2f}× Flow-GRPO's" if ratio and algo != "flow_grpo" else ""
    return (f"{text} (at {', '.join(str(r['iterations']) for r in runs)}; median "
            f"{statistics.median(r['seconds'] for r in runs):.0f} s{against})")


def _final_of(name: str, arm: str, iteration: int | None = None) -> str:
    data = load(name)["arms"][arm]
    seeds = len(data["seeds"])
    if iteration is None:
        cells = [f"{data[m]['final']['mean']:.3f}" for m in STRICT_PARTIAL]
    else:
        cells = [f"{_point(data, m, iteration)['mean']:.3f}" for m in STRICT_PARTIAL]
    base = data["base"]
    return f"{' / '.join(cells)} ({seeds} seeds, from {base['eval/strict']:.3f} / {base['eval/partial']:.3f})"


def methods_table() -> str:
    image = load(IMAGE_RUNS)["arms"]

    def headline(arm: str) -> str:
        row = image[arm]
        return (f"{row['eval/geneval']['final']['mean']:.3f} / {row['eval/geneval_partial']['final']['mean']:.3f} "
                f"({len(row['seeds'])} seeds, from {row['base']['eval/geneval']:.3f} / "
                f"{row['base']['eval/geneval_partial']:.3f})")

    nft = load("diffusion_nft_run_evals.json")
    nft_cell = (f"{nft[-1]['eval/geneval']:.3f} / {nft[-1]['eval/geneval_partial']:.3f} (one seed, from "
                f"{nft[0]['eval/geneval']:.3f} / {nft[0]['eval/geneval_partial']:.3f}; "
                f"{nft[-2]['eval/geneval']:.3f} / {nft[-2]['eval/geneval_partial']:.3f} at {nft[-2]['iteration']})")
    flow_beside = _final_of("grpo_guard.json", "flow_grpo_shapes").split(" (")[0]
    mix_beside = _final_of("slas.json", "mix_grpo_shapes").split(" (")[0]
    cpu = "bench_iteration_cpu.json"
    rows = [
        ["MixGRPO (`python train.py`)", headline("default"), _reached("mix_grpo"), _cost(cpu, "mix_grpo")],
        ["Flash-GRPO (`algo=flash_grpo`)", headline("flash_grpo"), _reached("flash_grpo"), _cost(cpu, "flash_grpo")],
        ["Flow-GRPO (`experiment=flow_grpo_shapes`, first 3 of 10 steps)", headline("flow_grpo"),
         _reached("flow_grpo"), "1.00 with every step trained (the reference)"],
        ["DiffusionNFT (`algo=diffusion_nft`)", nft_cell, _reached("diffusion_nft"),
         _cost("bench_iteration_cpu_step_synchronous.json", "diffusion_nft")],
        ["DanceGRPO (`experiment=dance_grpo_shapes`)", _final_of("pref_grpo.json", "dance_grpo_shapes"),
         _reached("dance_grpo"), _cost(cpu, "dance_grpo")],
        ["MixGRPO-Flash (`experiment=mix_grpo_flash_shapes`)", "not run to 100", _reached("mix_grpo_flash"),
         _cost(cpu, "mix_grpo_flash")],
        ["GRPO-Guard (`experiment=grpo_guard_shapes`)",
         _final_of("grpo_guard.json", "grpo_guard_shapes") + f"; Flow-GRPO beside it {flow_beside}",
         _reached("grpo_guard"), _cost("bench_iteration_cpu_breadth.json", "grpo_guard")],
        ["AWM (`experiment=awm_shapes`)", _final_of("awm.json", "awm_shapes"), _reached("awm"),
         _cost("bench_iteration_cpu_breadth.json", "awm")],
        ["Pref-GRPO (`experiment=pref_grpo_shapes`)", _final_of("pref_grpo.json", "pref_grpo_shapes"),
         _reached("pref_grpo"), _cost("bench_iteration_cpu_breadth.json", "pref_grpo")],
        ["DGPO (`experiment=dgpo_shapes`)", _final_of("dgpo.json", "dgpo_shapes") + f"; Flow-GRPO beside it "
         f"{_final_of('dgpo.json', 'flow_grpo_shapes').split(' (')[0]}", _reached("dgpo"),
         _cost("bench_iteration_cpu_breadth.json", "dgpo")],
        ["CGPO's curriculum (`experiment=cgpo_shapes`: MixGRPO)", _final_of("cgpo.json", "cgpo_shapes") +
         f"; the tag-balanced draw beside it {_final_of('cgpo.json', 'mix_grpo_shapes').split(' (')[0]}, the file's "
         f"tag mix {_final_of('cgpo_uniform.json', 'uniform').split(' (')[0]}", _reached("cgpo"),
         _cost("bench_iteration_cpu_opd_slas_cgpo.json", "cgpo")],
        ["SLAS (`experiment=slas_shapes`: MixGRPO, γ 0.5)", _final_of("slas.json", "slas_shapes") +
         f"; MixGRPO beside it {mix_beside}", _reached("slas"),
         _cost("bench_iteration_cpu_opd_slas_cgpo.json", "slas")],
        ["Flow-OPD (`experiment=flow_opd_shapes`, on GenEval + 0.1 × JPEG)", _opd_cell(), _reached("flow_opd"),
         _cost("bench_iteration_cpu_opd_slas_cgpo.json", "flow_opd")],
    ]
    target = load("time_to_reward_cpu.json")
    return _table(["algorithm (config)", "held-out strict / partial after 100 iterations",
                   f"reached {target['target']} within {target['max_iterations']} iterations",
                   "s / iteration against Flow-GRPO with every step trained"], rows)


def _opd_cell() -> str:
    arms = load("flow_opd.json")["arms"]
    cells = {a: " / ".join(f"{arms[a][m]['final']['mean']:.3f}" for m in OPD_METRICS[:2])
             for a in ("opd", "sum", "taros")}
    return (f"{cells['opd']} after {arms['opd']['iterations']} student iterations ({len(arms['opd']['seeds'])} seeds; "
            f"the weighted sum beside it {cells['sum']}, TaRoS {cells['taros']}), after two 100-iteration teachers")


# ---------------------------------------------------------------- results.md: the video world's runs

VIDEO_RUNS = "video_runs_evals.json"
VIDEO_LABELS = {
    "step10500": {
        "preset": "`python train.py experiment=video_shapes` (**the preset**: AWM, 8 prompts × 8 clips; seed 0, alone "
                  "on 2 cores)",
        "preset_seed1": "the same, `trainer.seed=1` (two runs sharing the cores, one thread each)",
        "preset_seed2": "the same, `trainer.seed=2` (beside seed 1)",
        "preset_rollout_batch_32": "the same, seed 0, with `trainer.rollout_batch_size=32` (alone)",
        "awm": "the earlier preset (**AWM** at its defaults, 4 prompts × 8 clips, 24 iterations)",
        "awm_seed1": "the same, `trainer.seed=1`",
        "awm_seed2": "the same, `trainer.seed=2` (the whole command, evaluation at 0 included)",
        "awm_lr1e-3": "the same with `trainer.lr=1e-3` (seed 0)",
        "awm_8x4": "the same with `trainer.prompts_per_iteration=8 trainer.group_size=4` (seed 0; the same 32 clips)",
        "awm_lora16_ffn": "the same with `model.lora.rank=16` and the feed-forward layers adapted too "
                          "(`model.lora.target_modules=[to_q,to_k,to_v,to_out.0,net.0.proj,net.2]`, 3.3× the "
                          "adapter; seed 0)",
        "awm_8_levels": "the same with `algo.train_timesteps=8` (every noise level of the 8-step stratum range, not 6; "
                        "seed 0)",
        "awm_3_levels": "the same with `algo.train_timesteps=3` (seed 0; stopped at 12)",
        "awm_lora16_ffn_8_levels": "both of the last two changes together (seed 0; stopped at 12)",
        "awm_this_machine": "the earlier preset again (seed 0) on a machine about twice as fast (the rows below ran "
                            "there)",
        "awm_ema_kl_0.3": "the same with `algo.ema_kl_beta=0.3` (the EMA trust region at 0.3 of AWM's 1.0; seed 0)",
        "awm_ema_kl_0.3_seed1": "the same, `trainer.seed=1`",
        "awm_ema_kl_0.3_seed2": "the same, `trainer.seed=2`",
        "awm_ema_kl_0.1": "the same with `algo.ema_kl_beta=0.1` (seed 0; stopped at 18)",
        "awm_lr5e-4": "the same with `trainer.lr=5e-4` (seed 0)",
        "awm_cgpo": "the same with `data.sampling=cgpo` (CGPO's prompt curriculum instead of tag-balanced prompts; "
                    "seed 0; stopped at 19)",
        "awm_cgpo_seed1": "the same, `trainer.seed=1`",
        "awm_36_iterations": "the same with `trainer.iterations=36` (seed 0, one thread: its first 24 iterations are "
                             "the earlier preset's one-thread run's, bit for bit)",
        "awm_8x8": "the earlier preset with `trainer.prompts_per_iteration=8` (8 prompts × 8 clips, four updates of "
                   "16 per iteration; seed 0), alone on a third machine, slower and perhaps shared",
        "flow_grpo": "`experiment=video_shapes algo=grpo trainer.iterations=50 trainer.eval_every=25` (Flow-GRPO, its "
                     "3 noisiest steps, the preset before AWM replaced it)",
        "flow_grpo_seed1": "the same, `trainer.seed=1 trainer.iterations=25`",
        "grpo_guard": "the same with `algo=grpo_guard algo.timestep_fraction=0.3 algo.timestep_selection=first "
                      "trainer.prompts_per_iteration=4` (GRPO-Guard on the same 3 steps and batch)",
        "grpo_guard_seed1": "the same GRPO-Guard with `trainer.seed=1 trainer.iterations=25`",
        "flow_grpo_lr1e-3": "Flow-GRPO with `trainer.lr=1e-3 trainer.iterations=25` (3.3× the learning rate)",
        "flow_grpo_full_finetune": "Flow-GRPO with `model.finetune=full trainer.lr=1e-4 trainer.iterations=25` "
                                   "(every transformer weight trained)",
        "dance_grpo": "the same batch with `algo=dance_grpo sampler=dance sampler.num_steps=10 trainer.iterations=45 "
                      "trainer.eval_every=15` (DanceGRPO: a random 6 of 10 steps trained)",
    },
    "step6000": {
        "flow_grpo": "*on the step-6000 export:* Flow-GRPO as above, 50 iterations",
        "mix_grpo": "*on the step-6000 export:* `algo=mix_grpo algo.timestep_fraction=1 trainer.prompts_per_iteration=4 "
                    "trainer.iterations=60 trainer.eval_every=20` (MixGRPO, window 2, both window steps trained)",
    },
}


def _clock(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def video_runs_table() -> str:
    data = load(VIDEO_RUNS)
    rows = []
    for step, labels in VIDEO_LABELS.items():
        for key, label in labels.items():
            run = data[step][key]
            evals = ", ".join(f"{e['eval/geneval']:.3f} / {e['eval/geneval_partial']:.3f} ({e['iteration']})"
                              for e in run["evals"])
            time = []
            if "training_seconds" in run:
                time.append(f"{run['training_seconds']} s of training")
            if "seconds_per_iteration" in run:
                time.append(f"{run['seconds_per_iteration']:.1f} s per iteration")
            if "wall_seconds" in run:
                time.append(f"{_clock(run['wall_seconds'])} " + ("in all" if run["evals"][0]["iteration"] == 0 else
                                                                  "without the evaluation at 0"))
            rows.append([label, evals, "; ".join(time)])
    return _table(["run", "held-out strict / partial (iteration)", "time"], rows)


VIDEO_SEEDS = [
    ("the preset (AWM, 8 prompts × 8 clips)", ["preset", "preset_seed1", "preset_seed2"]),
    ("the earlier preset (AWM, 4 prompts × 8 clips)", ["awm", "awm_seed1", "awm_seed2"]),
    ("the earlier preset with `algo.ema_kl_beta=0.3`", ["awm_ema_kl_0.3", "awm_ema_kl_0.3_seed1",
                                                        "awm_ema_kl_0.3_seed2"]),
    ("the earlier preset with `data.sampling=cgpo`", ["awm_cgpo", "awm_cgpo_seed1"]),
    ("Flow-GRPO (4 prompts × 8 clips)", ["flow_grpo", "flow_grpo_seed1"]),
    ("GRPO-Guard (4 prompts × 8 clips)", ["grpo_guard", "grpo_guard_seed1"]),
]


def video_seeds_table(configurations: list[tuple[str, list[str]]] = VIDEO_SEEDS) -> str:
    """Held-out change from the shipped pipeline, per seed and mean ± std, at each configuration's last common
    evaluation (a run without an evaluation at 0 is measured from the one every run shares)."""
    runs = load(VIDEO_RUNS)["step10500"]
    base = runs["flow_grpo"]["evals"][0]
    rows = []
    for label, keys in configurations:
        last = min(runs[k]["evals"][-1]["iteration"] for k in keys)
        at = [next(e for e in runs[k]["evals"] if e["iteration"] == last) for k in keys]
        cells = []
        for metric in ("eval/geneval_partial", "eval/geneval"):
            change = [e[metric] - base[metric] for e in at]
            cells.append(", ".join(f"{c:+.3f}" for c in change) + f" ({statistics.fmean(change):+.3f} ± "
                         f"{statistics.stdev(change):.3f})")
        rows.append([label, str(last), *cells])
    return _table(["configuration", "iteration", "change in partial, per seed (mean ± std)",
                   "change in strict, per seed (mean ± std)"], rows)


def awm_video_seeds() -> str:
    """AWM's page: the video preset, the earlier preset and Flow-GRPO on the earlier preset's batch."""
    return video_seeds_table([VIDEO_SEEDS[0], VIDEO_SEEDS[1], VIDEO_SEEDS[4]])


# ---------------------------------------------------------------- provenance, as a table a reader can check

def provenance_table() -> str:
    lines = ["| file | command | commit | measured | status |", "|---|---|---|---|---|"]
    for name, rec in sorted(load(PROVENANCE.name).items()):
        status = f"stale: {rec['stale']}" if rec["stale"] else "current"
        command = rec["command"].replace("|", "\\|")
        lines.append(f"| `{name}` | `{command}` | {rec['commit']} | {rec['measured']} | {status} |")
    return "\n".join(lines)


TAROS_SHORTCUT_METRICS = ("eval/video_geneval/partial/motion", "eval/video_geneval/geneval_partial",
                          "eval/video_geneval/frozen", "eval/video_consistency", "eval/video_sharpness")
TAROS_SHORTCUT_HEADER = ["motion prompts (partial)", "video GenEval partial", "frozen share", "consistency",
                         "sharpness"]


def taros_shortcut_sweep_table() -> str:
    data = load("taros_shortcut_sweep.json")
    arms = data["arms"]
    base = next(iter(arms.values()))["base"]
    rows = [["base model", "", *(f"{base[m]:.3f}" for m in TAROS_SHORTCUT_METRICS)]]
    for label, arm in [("video GenEval alone (consistency 0, sharpness 0)", "c0"),
                       ("video_composite as shipped (consistency 0.5, sharpness 0.5)", "c05"),
                       ("consistency 8, sharpness 0.5", "c8")]:
        at12 = _point(arms[arm], "eval/video_geneval/frozen", 12)["mean"]
        rows.append([label, f"{at12:.3f}", *(_final(arms[arm], m, gain=True) for m in TAROS_SHORTCUT_METRICS)])
    return _table(["weighted sum of", "frozen share at 12", *(f"{h} at 24" for h in TAROS_SHORTCUT_HEADER)], rows)


TAROS_ARMS = [("weighted sum", "sum"), ("per-reward group-normalised", "per_reward"), ("TaRoS", "taros"),
              ("TaRoS, sparsity weighting alone (τ = 0)", "no_saturation"),
              ("TaRoS, saturation floor alone (κ = 0)", "no_sparsity")]


def _quarters(arm: dict, key: str) -> str:
    """``first → last`` quarter means of a training key over an arm's seeds (empty where the arm does not log it)."""
    stats = arm.get(key)
    if not stats or stats["first_quarter"] is None or stats["first_quarter"].get("mean") is None:
        return ""
    return f"{stats['first_quarter']['mean']:.3f} → {stats['last_quarter']['mean']:.3f}"


def taros_shortcut_table() -> str:
    """The aggregators on the composite with a shortcut: held-out task metrics and hack indicator at the end (mean ±
    std over seeds, change from the base model), and inside the groups over training: how often the task term is
    constant, consistency's spread against its running mean, and the entries TaRoS zeroes per term."""
    arms = load("taros_shortcut.json")["arms"]
    base = next(iter(arms.values()))["base"]
    rows = [["base model", *(f"{base[m]:.3f}" for m in TAROS_SHORTCUT_METRICS), "", "", ""]]
    for label, arm in TAROS_ARMS:
        a = arms[arm]
        zeroed = [a.get(f"taros/{k}/zeroed") for k in ("video_geneval", "video_consistency")]
        rows.append([f"{label} ({len(a['seeds'])} seed{'s' if len(a['seeds']) > 1 else ''})",
                     *(_final(a, m, gain=True) for m in TAROS_SHORTCUT_METRICS),
                     _quarters(a, "groups/video_geneval/zero_std_group_fraction"),
                     _quarters(a, "taros/video_consistency/saturation"),
                     " / ".join(f"{z['last_quarter']['mean']:.3f}" for z in zeroed) if all(zeroed) and all(
                         z["last_quarter"].get("mean") is not None for z in zeroed) else ""])
    return _table(["aggregator", *(f"{h} at 24" for h in TAROS_SHORTCUT_HEADER),
                   "video GenEval constant in a group (first → last quarter)",
                   "consistency σ/σ̄ in groups (first → last quarter)",
                   "entries zeroed, video GenEval / consistency (last quarter)"], rows)


def index_results() -> str:
    """The documentation home page's headline: the README's, with links relative to ``docs/``."""
    return readme_results().replace("](docs/", "](")


DOCS = REPO / "docs"
BLOCKS = {
    "readme-results": (REPO / "README.md", readme_results),
    "index-results": (DOCS / "index.md", index_results),
    "image-runs": (DOCS / "results.md", image_runs_table),
    "image-runs-kernels": (DOCS / "results.md", image_runs_kernels_table),
    "single-seed-runs": (DOCS / "results.md", single_seed_runs),
    "multireward": (DOCS / "results.md", multireward_table),
    "video-runs": (DOCS / "results.md", video_runs_table),
    "video-seeds": (DOCS / "results.md", video_seeds_table),
    "video-taros": (DOCS / "results.md", video_taros_table),
    "taros-shortcut-sweep": (DOCS / "rewards.md", taros_shortcut_sweep_table),
    "taros-shortcut": (DOCS / "rewards.md", taros_shortcut_table),
    "taros-long-video": (DOCS / "rewards.md", taros_long_video_table),
    "streaming-runs": (DOCS / "results.md", streaming_runs_table),
    "streaming-presets": (DOCS / "results.md", streaming_table),
    "provenance": (DOCS / "results.md", provenance_table),
    "awm-runs": (DOCS / "awm.md", awm_runs),
    "awm-video-seeds": (DOCS / "awm.md", awm_video_seeds),
    "cgpo-runs": (DOCS / "cgpo.md", cgpo_runs),
    "cgpo-uniform-runs": (DOCS / "cgpo.md", cgpo_uniform_runs),
    "dgpo-runs": (DOCS / "dgpo.md", dgpo_runs),
    "flash-grpo-tail": (DOCS / "flash_grpo.md", flash_grpo_tail_runs),
    "flow-opd-runs": (DOCS / "flow_opd.md", flow_opd_runs),
    "grpo-guard-runs": (DOCS / "grpo_guard.md", grpo_guard_runs),
    "methods": (DOCS / "methods.md", methods_table),
    "pref-grpo-runs": (DOCS / "pref_grpo.md", pref_grpo_runs),
    "slas-runs": (DOCS / "slas.md", slas_runs),
    "streaming-summary": (DOCS / "streaming-video.md", streaming_summary),
    "stream-one-object": (DOCS / "streaming-video.md", stream_one_object_table),
    "stream-apart": (DOCS / "streaming-video.md", stream_apart_table),
    "kvpo-comparison": (DOCS / "streaming-video.md", kvpo_comparison_table),
    "time-to-reward": (DOCS / "performance.md", time_to_reward_table),
    "video-time-to-reward": (DOCS / "performance.md", video_time_to_reward_table),
    "iteration-cost": (DOCS / "performance.md", iteration_cost_table),
    "run-plans": (DOCS / "performance.md", run_plans_table),
    "video-iteration-cost": (DOCS / "performance.md", video_iteration_cost_table),
    "breadth-cost": (DOCS / "performance.md", breadth_cost_table),
    "opd-slas-cgpo-cost": (DOCS / "performance.md", opd_slas_cgpo_cost_table),
}
_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) [^\n]*-->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)", re.S)


def blocks_in(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in _BLOCK.finditer(text)}


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def rendered(name: str) -> tuple[str, set[str]]:
    """Block ``name``'s text and the results files it was rendered from. A block rendered from a file its provenance
    marks stale says "stale" (the renderer's words, or a line naming the file and why)."""
    sources: set[str] = set()
    _READING.append(sources)
    try:
        text = BLOCKS[name][1]()
    finally:
        _READING.pop()
    records = provenance()
    text = re.sub(r"(?<=[\s(|/*])-(?=\d)", "\u2212", text)  # a minus sign, as the prose writes it (bold too)
    stale = [s for s in sorted(sources) if records.get(s, {}).get("stale")]
    if stale and "stale" not in text.lower():
        reasons: dict[str, list[str]] = {}
        for s in stale:
            reasons.setdefault(records[s]["stale"], []).append(f"`{s}`")
        text += "\n\n" + " ".join(f"**Stale:** {', '.join(names)}: {why}." for why, names in reasons.items())
    return text, sources


def render(path: Path) -> str:
    """``path``'s text with each of its generated blocks rewritten."""
    text = path.read_text()
    found = blocks_in(text)
    for name, (where, renderer) in BLOCKS.items():
        if where == path and name not in found:
            raise SystemExit(f"{_shown(path)} has no generated block {name!r} "
                             f"(<!-- generated: {name} ... --> ... <!-- end: {name} -->)")

    def sub(m: re.Match) -> str:
        if m["name"] not in BLOCKS:
            raise SystemExit(f"{_shown(path)}: unknown generated block {m['name']!r} (known: {sorted(BLOCKS)})")
        body, sources = rendered(m["name"])
        return header(m["name"], sources, path) + body + "\n" + m.group(4)

    return _BLOCK.sub(sub, text)


def header(name: str, sources: set[str], path: Path) -> str:
    """A block's opening comment, naming the results files it is written from (relative to ``path``), so that the
    section holding it cites them."""
    where = "docs/results/" if path.parent == REPO else "results/"
    files = ", ".join(where + s for s in sorted(sources))
    return f"<!-- generated: {name} (python scripts/publish_results.py writes this from {files}; edit the JSON, not " \
           f"the text) -->\n"


def _whole_blocks(text: str) -> dict[str, str]:
    return {m["name"]: m.group(0) for m in _BLOCK.finditer(text)}


def check() -> list[str]:
    """Names of the blocks whose text (or opening comment) is not what their JSON renders to (empty: all current)."""
    stale = []
    for path in sorted({p for p, _ in BLOCKS.values()}):
        now, want = _whole_blocks(path.read_text()), _whole_blocks(render(path))
        stale += [f"{_shown(path)}: {name}" for name in want if now.get(name) != want[name]]
    return stale


# ---------------------------------------------------------------- numbers in prose, pinned to the JSON they cite

MEASURED_PAGES = ("results.md", "performance.md")  # pages about measurements: every section of them is measured
UNRECORDED = re.compile(r"not\s+(?:a\s+)?recorded\s+measurements?", re.I)
# A setting, not a result: the number right after a Greek-letter hyperparameter, ``a``, ``lr``, ``ratio``, ``CFG`` or
# ``guidance`` (with or without ``=``), or after ``×`` (a batch shape), ``≥`` or ``≤`` (a threshold).
SETTING = re.compile(r"(?:(?<!\w)(?:[βγσκτε]|a|CFG|guidance|lr|ratio)\s*=?|[×≥≤])\s*$")
# Numbers in measured sections that are not run results (sizes, versions, clip ranges), as written in the page.
NOT_RESULTS = {
    "streaming-video.md": ["[0.9, 1.2]", "287.5 MB", "±2.5"],
    "performance.md": ["Wan 2.1 / 2.2"],
    "rewards.md": ["0.3 pixels a frame"],  # video GenEval's frozen threshold
    "results.md": ["gains +0.10 partial", "pass +0.10", "clears +0.10", "passed +0.10", "clear +0.10",
                   "cleared +0.10", "the +0.10"],  # the video world's target, a gain of a tenth
}
CITATIONS = REPO / "tests" / "data" / "cited_numbers.json"
_NUMBER = re.compile(r"(?<![\w.^·/])([+−-]?)(\d+\.\d+)(%?)(?![\w]|\.\d)")
_HEADING = re.compile(r"^(#{1,6}) (.*)$", re.M)
_STRIP = [re.compile(r"<!--.*?-->", re.S), re.compile(r"`[^`]+`"), re.compile(r"\]\([^)\s]*\)"),
          re.compile(r"arXiv \d+\.\d+")]
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_GENERATED = re.compile(r"(<!-- generated: ([\w-]+) [^\n]*-->)\n.*?<!-- end: \2 -->", re.S)


def recorded_numbers(name: str) -> list[tuple[float, list]]:
    """What a docs number may be rounded from when it cites results file ``name``, each with where it is:

    * ``["at", path]``: a numeric value (not in lists of more than 16 entries: per-sample scores, per-iteration logs);
    * ``["in", path, k]``: the k-th number written in a note (a string under a key ``note…`` or ``what``);
    * ``["minutes", path]``: a value in seconds, in minutes;
    * ``["change", path, first]``: an evaluated metric (``eval/…``, or a curve's ``mean``) of a later evaluation of a
      run minus its first evaluation's (records with an ``iteration`` in one list)."""
    out: list[tuple[float, list]] = []

    def walk(node, path: list) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, [*path, k])
        elif isinstance(node, list):
            if len(node) > 16:  # per-sample scores, per-iteration logs: no docs number is read off them
                return
            records = [i for i, v in enumerate(node) if isinstance(v, dict) and "iteration" in v]
            for i in records[1:]:
                first = node[records[0]]
                out.extend((v - first[k], ["change", [*path, i, k], [*path, records[0], k]])
                           for k, v in node[i].items()
                           if (k == "mean" or k.startswith("eval/")) and _is_number(v) and _is_number(first.get(k)))
            for i, v in enumerate(node):
                walk(v, [*path, i])
        elif _is_number(node):
            out.append((float(node), ["at", path]))
            if "second" in str(path[-1]):
                out.append((node / 60, ["minutes", path]))
        elif isinstance(node, str) and ("note" in str(path[-1]) or path[-1] == "what"):
            out.extend((float(x), ["in", path, k]) for k, x in enumerate(re.findall(r"\d+\.\d+", node)))

    walk(load(name), [])
    return out


def value_of(name: str, where: list) -> float:
    """The number ``where`` (a ``recorded_numbers`` location) points at in results file ``name``, as it is now."""
    data = load(name)

    def at(path: list):
        node = data
        for key in path:
            node = node[key]
        return node

    kind = where[0]
    if kind == "at":
        return float(at(where[1]))
    if kind == "minutes":
        return at(where[1]) / 60
    if kind == "in":
        return float(re.findall(r"\d+\.\d+", at(where[1]))[where[2]])
    return at(where[1]) - at(where[2])


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def rounds_to(written: str, value: float) -> bool:
    """Whether ``value`` (its sign aside) written to ``written``'s digits reads ``written`` (``"7.5%"``: 0.075)."""
    percent = written.endswith("%")
    digits = written.rstrip("%").lstrip("+−-")
    places = len(digits.split(".")[1]) + (2 if percent else 0)
    return abs(abs(value) - float(digits) / (100 if percent else 1)) <= 0.5 * 10 ** -places + 1e-12


def measured_sections(path: Path):
    """``(heading, text, cited)`` of each measured section of a docs page: its heading, its text (fenced code left
    out) and the results JSON files it links (generated blocks' opening comments included)."""
    text = _FENCE.sub("", path.read_text())
    marks = list(_HEADING.finditer(text))
    bounds = [0, *(m.start() for m in marks), len(text)]
    measured_level = None  # a subsection of a "Measured here" section is measured too
    for start, end in zip(bounds, bounds[1:]):
        section = text[start:end]
        head = _HEADING.match(section)
        level = len(head.group(1)) if head else 0
        title = head.group(2) if head else ""
        if measured_level is not None and level <= measured_level:
            measured_level = None
        if title.startswith("Measured here"):
            measured_level = level
        cited = _cited(section)
        if cited or measured_level is not None or path.name in MEASURED_PAGES:
            yield title, section, cited


def prose_numbers(paths: list[Path] | None = None) -> list[dict]:
    """Every number the citation rule covers, in page order: ``page``, ``section``, ``context`` (the 48 characters
    before it in its paragraph, numbers written ``#``), ``number`` as written, the results files it is ``checked``
    against and ``where`` (its surroundings, for messages)."""
    found = []
    for path in paths or docs_pages():
        exempt = NOT_RESULTS.get(path.name, [])
        seen: dict[tuple, int] = {}
        for title, section, cited in measured_sections(path):
            section = _GENERATED.sub(lambda m: m.group(1), section)  # a block's opening comment still cites
            units = _units(section.split("\n", 1)[1] if section.startswith("#") else section)
            if not cited and units and UNRECORDED.search(_stripped(units[0], exempt)):
                continue  # a section that cites no results file and opens by saying its numbers are not recorded
            before = ""
            for unit in units:
                own = _cited(unit) or (_cited(before) if unit.startswith("|") else [])
                paragraph = _stripped(unit, exempt)
                unrecorded = UNRECORDED.search(paragraph) or (unit.startswith("|") and UNRECORDED.search(before))
                before = unit
                if unrecorded:
                    continue
                for m in _NUMBER.finditer(paragraph):
                    if SETTING.search(paragraph[:m.start()]):
                        continue
                    context = _NUMBER.sub("#", " ".join(paragraph[:m.start()].split()))[-48:]
                    key = (title, context)
                    seen[key] = seen.get(key, -1) + 1
                    found.append({"page": _shown(path), "section": title, "context": context, "nth": seen[key],
                                  "number": m.group(0), "checked": own or cited,
                                  "where": " ".join(paragraph[max(0, m.start() - 50):m.end() + 20].split())})
    return found


def _key(entry: dict) -> tuple:
    return entry["page"], entry["section"], entry["context"], entry["nth"]


def _backing(number: dict, recorded) -> dict | None:
    """The recorded number, of the files ``number`` is checked against, that it rounds from: a value the file holds
    before a change, minutes or a note's number; then the closest; then the last recorded (a run's last evaluation
    before its first)."""
    written = float(number["number"].rstrip("%").lstrip("+−-")) / (100 if number["number"].endswith("%") else 1)
    found = [(_KINDS.index(where[0]), abs(abs(value) - written), -i, {"file": name, "value": where})
             for name in number["checked"] for i, (value, where) in enumerate(recorded(name))
             if rounds_to(number["number"], value)]
    return min(found, key=lambda f: f[:3])[3] if found else None


_KINDS = ("at", "change", "minutes", "in")  # a value the file holds first, a number in a note last


def _recorder():
    """``recorded_numbers`` read once per file."""
    cache: dict[str, list] = {}
    return lambda name: cache.setdefault(name, recorded_numbers(name))


def _holds(pin: dict, number: dict, recorded) -> bool:
    """Whether ``pin`` still backs ``number``: the same number, a file it is checked against, a place that file
    records, and the value there rounds to it."""
    return (pin["number"] == number["number"] and pin["file"] in number["checked"]
            and any(where == pin["value"] for _, where in recorded(pin["file"]))
            and rounds_to(number["number"], value_of(pin["file"], pin["value"])))


def load_citations() -> list[dict]:
    return json.loads(CITATIONS.read_text()) if CITATIONS.is_file() else []


def citation_problems(paths: list[Path] | None = None, citations: list[dict] | None = None) -> list[str]:
    """Every covered number that is not pinned in ``tests/data/cited_numbers.json`` to a number its results JSON
    records, or whose pinned JSON number no longer rounds to it; and every pin whose number left the page."""
    numbers, recorded = prose_numbers(paths), _recorder()
    pins = {_key(c): c for c in (load_citations() if citations is None else citations)}
    pages = {n["page"] for n in numbers} | {_shown(p) for p in (paths or [])}
    problems = []
    for n in numbers:
        pin = pins.pop(_key(n), None)
        said = f"{n['page']} / {n['section'] or '(top)'}: {n['number']} in \u2026{n['where']}\u2026"
        if pin is None:
            found = _backing(n, recorded)
            problems.append(f"{said} is not pinned: " + (
                f"{found['file']} records it; run python scripts/publish_results.py to pin it" if found else
                f"no results JSON it is checked against records it ({', '.join(n['checked']) or 'none cited'})"))
        elif pin["number"] != n["number"]:
            problems.append(f"{said}: the page says {n['number']} where {_shown(CITATIONS)} pins {pin['number']} "
                            f"({pin['file']} {pin['value']})")
        elif not _holds(pin, n, recorded):
            now = value_of(pin["file"], pin["value"]) if pin["file"] in n["checked"] else None
            problems.append(f"{said}: pinned to {pin['file']} {pin['value']}, which "
                            + (f"is now {now:.6g}" if now is not None else "the paragraph no longer cites"))
    problems += [f"{c['page']} / {c['section'] or '(top)'}: {_shown(CITATIONS)} pins {c['number']} (after "
                 f"\u2026{c['context']}), which the page no longer has" for c in pins.values() if c["page"] in pages]
    return problems


def pin_citations() -> list[str]:
    """Rewrite ``tests/data/cited_numbers.json``: each covered number keeps its pin while the page and the JSON still
    agree on it, else it is pinned to the first recorded number it rounds from. Returns the numbers nothing backs."""
    old, recorded = {_key(c): c for c in load_citations()}, _recorder()
    pins, unbacked = [], []
    for n in prose_numbers():
        pin = old.get(_key(n))
        if not (pin and _holds(pin, n, recorded)):
            pin = _backing(n, recorded)
            if pin is None:
                unbacked.append(f"{n['page']} / {n['section'] or '(top)'}: {n['number']} in \u2026{n['where']}\u2026 "
                                f"(checked against: {', '.join(n['checked']) or 'no results JSON'})")
                continue
        pins.append({**{k: n[k] for k in ("page", "section", "context", "nth", "number")},
                     "file": pin["file"], "value": pin["value"]})
    CITATIONS.write_text("[\n" + ",\n".join(json.dumps(p, ensure_ascii=False) for p in pins) + "\n]\n")
    return unbacked


def _cited(text: str) -> list[str]:
    """The results JSON files ``text`` links (or names in a generated block's opening comment)."""
    return sorted({n for n in re.findall(r"results/([\w.\-]+\.json)", text)
                   if (RESULTS / n).is_file() and n != PROVENANCE.name})


def _stripped(text: str, exempt: list[str]) -> str:
    """``text`` without what holds no hand-written number: comments, code, link targets, arXiv ids and the page's
    listed non-results."""
    for pattern in _STRIP:
        text = pattern.sub(lambda m: " " * len(m.group(0)), text)
    for literal in exempt:
        pattern = r"\s+".join(re.escape(word) for word in literal.split()) + r"(?!\d)"  # across a line break too
        text = re.sub(pattern, lambda m: re.sub(r"\S", " ", m.group(0)), text)
    return text


def _units(body: str) -> list[str]:
    """A section's paragraphs, each list item on its own and each table whole."""
    units = []
    for block in re.split(r"\n\s*\n", body.strip("\n")):
        units += [u for u in re.split(r"\n(?=\s*(?:[*-]|\d+\.) )", block.strip("\n")) if u.strip()]
    return units


def docs_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a block is not current or a number in prose is not pinned")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(f"not what its JSON says (run python scripts/publish_results.py): {p}")
        cited = citation_problems()
        for p in cited:
            print(f"number in prose: {p}")
        return 1 if problems or cited else 0
    for path in sorted({p for p, _ in BLOCKS.values()}):
        path.write_text(render(path))
        print(f"wrote {_shown(path)}")
    unbacked = pin_citations()
    print(f"wrote {_shown(CITATIONS)}")
    for p in unbacked:
        print(f"no results JSON records this number (link the JSON it comes from, or say it is not a recorded "
              f"measurement): {p}")
    return 1 if unbacked else 0


if __name__ == "__main__":
    sys.exit(main())
