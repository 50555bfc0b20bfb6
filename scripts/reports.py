#!/usr/bin/env python
"""One report page per study, generated whole from the measured results in ``docs/results/``.

    python scripts/reports.py           # write docs/reports/*.md, the README's results block and the headline figure
    python scripts/reports.py --check   # write nothing; exit 1 naming every page (or the README block) that differs

A study is the JSON files of one measurement (``STUDIES``). Per file its page says what was run (command, commit, date:
``docs/results/provenance.json``; the CPU kernels of its runs), whether its numbers still hold (``stale``), the file's
own verdict, its figures and its tables, laid out by the shape of the data: the arms of ``compare_presets.py``, paired
evaluations (``paired_eval.py``, ``paired_report.py``), a table of records (benchmarks, time to reward, memory plans,
update probes) or of keys and values. Every number is read from a JSON: edit the JSON. The README's results block
and the headline figure come from ``scripts/headline.py``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, namedtuple
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import headline  # noqa: E402  (the README's results block and the headline figure)

RESULTS, REPORTS = REPO / "docs" / "results", REPO / "docs" / "reports"
GIB = 2 ** 30

Study = namedtuple("Study", "slug title what members")  # members: file stems in docs/results/, in page order
STUDIES = [Study(slug, title, what, members.split()) for slug, title, what, members in [
    ("image-runs", "Image runs", "The default, Flash-GRPO and Flow-GRPO image presets over seeds: held-out GenEval, "
     "and the same runs on another CPU's kernels", "headline_image_runs headline_image_runs_avx2"),
    ("awm", "AWM", "AWM on the image world: held-out GenEval over seeds", "awm"),
    ("cgpo", "CGPO curriculum", "CGPO's curriculum against MixGRPO and uniform sampling", "cgpo cgpo_uniform"),
    ("dgpo", "DGPO", "DGPO against Flow-GRPO: held-out GenEval over seeds", "dgpo"),
    ("flash-grpo-tail", "Flash-GRPO's tail", "Flash-GRPO, its fast variant and two ablations", "flash_grpo_tail"),
    ("flow-opd", "Flow-OPD", "Flow-OPD against GRPO on the sum and on `saturation_weighted` (arm `taros`)", "flow_opd"),
    ("grpo-guard", "GRPO-Guard", "GRPO-Guard against Flow-GRPO: held-out GenEval over seeds", "grpo_guard"),
    ("pref-grpo", "Pref-GRPO", "Pref-GRPO against DanceGRPO: held-out GenEval and training statistics", "pref_grpo"),
    ("slas", "SLAS advantage shaping", "SLAS against MixGRPO, and SLAS with gamma 1", "slas slas_gamma1"),
    ("multireward", "Two rewards", "GenEval and JPEG compressibility, summed or aggregated by `saturation_weighted` "
     "(the arm named `taros`: this project's aggregator, not the paper's TaRoS)", "multireward"),
    ("saturation-weighted", "Saturation-weighted aggregation", "This project's `saturation_weighted` aggregator (the "
     "arms named `taros` in these files; not the paper's TaRoS) on video, with its ablations and a sweep of a "
     "component's weight, and on streaming long video", "taros_shortcut taros_shortcut_sweep taros_long_video"),
    ("video", "Video runs", "Runs on the embedded Wan video model; `saturation_weighted` (arm `taros`) against the sum",
     "video_runs_evals video_taros"),
    ("streaming-runs", "Streaming video", "Streaming GRPO, streaming AWM and KVPO; streaming AWM on the test set",
     "stream_awm_test streaming_rl streaming_rl_paired streaming_rl_lr1e-4_paired stream_one_object "
     "stream_awm_reference stream_awm_batch_paired stream_awm_lr1e-5_paired stream_awm_tuning stream_awm_drift"),
    ("kvpo", "KVPO", "KVPO's forks, exploration, EMA and objective ablation, on paired held-out videos",
     "kvpo_branch_spread kvpo_branch_control resume_gate_base kvpo_forks kvpo_forks_more kvpo_paired kvpo_preset_400 kvpo_48 kvpo_exploration"),
    ("performance", "Performance", "Seconds per iteration and per phase of each algorithm (image and video), and "
     "streaming generation with and without the KV cache", "bench_iteration_cpu bench_iteration_cpu_vae_bf16 "
     "bench_iteration_cpu_flash_fast bench_iteration_cpu_flash_shared bench_iteration_cpu_step_synchronous "
     "bench_iteration_cpu_breadth bench_iteration_cpu_opd_slas_cgpo bench_iteration_video_cpu bench_streaming_cpu "
     "bench_streaming_cpu_batch8 bench_streaming_cpu_batch32"),
    ("time-to-reward", "Time to reward", "Wall-clock time for each algorithm to reach a held-out target, image and "
     "video", "time_to_reward_cpu video_time_to_reward_cpu"),
    ("memory-plans", "Memory plans", "Planned peak GPU memory per phase and time per iteration of the full-size "
     "presets", "plan_flow_grpo_sd35m_geneval plan_flow_grpo_sd35l_geneval plan_dance_grpo_flux_hps "
     "plan_flow_grpo_wan21_1_3b plan_flow_grpo_wan22_5b plan_stream_grpo_self_forcing plan_stream_awm_self_forcing "
     "plan_stream_awm_self_forcing_as_written plan_kvpo_longlive plan_kvpo_longlive_as_written"),
    ("probes", "Update probes", "How one update moves the reward with the advantages and against them, and how far "
     "one step moves each model's samples", "probe_update probe_update_components probe_update_streaming "
     "probe_update_stream_awm probe_update_stream_grpo_one_object probe_update_stream_grpo_updates probe_update_kvpo "
     "step_sensitivity"),
    ("assets", "Embedded models and first runs", "The embedded models' own held-out evaluations, and the first "
     "single-seed runs of the image presets", "tiny_causal_wan_shapes_eval tiny_causal_wan_shapes_4step_eval "
     "tiny_wan_shapes_samples default_run_evals flow_grpo_run_evals flash_grpo_run_evals diffusion_nft_run_evals"),
]]

VERDICT_KEYS = ("verdict", "summary", "note", "what")  # a file's own words about its result, shown under its command
LABEL_KEYS = ("name", "arm", "run", "model", "config", "iteration", "latent_frames")  # what names a record in a list
HEADLINE = ("eval/geneval", "eval/geneval_partial", "eval/strict", "eval/partial", "eval/reward", "reward")
LONG = 60  # a text longer than this leaves its table for a line under it
EMPTY = ("", [], {})


# ------------------------------------------------------------------------------------------ cells

def is_cell(v) -> bool:
    """A value one table cell shows: a scalar, a short list of them, mean ± spread, first → last quarter, a change."""
    if isinstance(v, dict):
        return "mean" in v or {"first_quarter", "last_quarter"} <= v.keys() or {"base", "change"} <= v.keys()
    if isinstance(v, list):
        return all(is_cell(x) and not isinstance(x, (dict, list)) for x in v)
    return not (isinstance(v, str) and len(v) > LONG)


def num(v) -> str:
    """3 decimals below 100 (2 significant digits where that would read 0.000), 1 decimal up to 1e5, then 3 digits."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "—" if v is None else "yes" if v is True else "no" if v is False else esc(str(v))
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 1e5 else str(v)
    a = abs(v)
    return f"{v:.3g}" if a >= 1e5 else f"{v:.1f}" if a >= 100 else f"{v:.2g}" if 0 < a < 0.0005 else f"{v:.3f}"


def signed(v) -> str:
    return ("+" if isinstance(v, (int, float)) and v > 0 else "") + num(v)


def fmt(v, key: str = "") -> str:
    """One cell: mean ± std (or ± standard error), first → last quarter, before → after (change), bytes in GiB."""
    if isinstance(v, dict):
        if {"base", "change"} <= v.keys():
            spread = f" ± {num(v['stderr'])}" if "stderr" in v else ""
            trained = f" → {num(v['trained'])}" if "trained" in v else ""
            return f"{num(v['base'])}{trained} ({signed(v['change'])}{spread})"
        if "mean" in v:
            spread = next((v[k] for k in ("std", "se", "stderr") if k in v), None)
            big = isinstance(v["mean"], (int, float)) and abs(v["mean"]) >= 100 and spread is not None
            return num(v["mean"]) + ("" if spread is None else f" ± {spread:.1f}" if big else f" ± {num(spread)}")
        return "—" if v["first_quarter"] is None else f"{fmt(v['first_quarter'])} → {fmt(v['last_quarter'])}"
    if isinstance(v, list):
        parts = [fmt(x, key) for x in v]
        return ", ".join(parts) if len(parts) <= 6 else f"{parts[0]}, {parts[1]} … {parts[-1]} ({len(parts)} values)"
    if key.endswith("bytes") and isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v / GIB:.2f} GiB"
    return code(v) if isinstance(v, str) and ("command" in key or key in ("overrides", "config")) else num(v)


def esc(s: str) -> str:
    return s.replace("<", "&lt;").replace("*", "\\*")


def code(s: str) -> str:
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def text(key: str, v: str) -> str:  # a command reads as code, any other text as text
    return code(v) if "command" in key or v.startswith("python ") else esc(v)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table; a column of numbers is right-aligned."""
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    right = [i and all(re.match(r"[-+]?[\d.]|—|$", str(r[i])) for r in rows) for i in range(len(header))]
    return ["| " + " | ".join(map(cell, header)) + " |", "|" + "".join("--:|" if r else "---|" for r in right)] + \
        ["| " + " | ".join(map(cell, row)) + " |" for row in rows] + [""]


def details(title: str, lines: list[str]) -> list[str]:
    title = title.replace('"', "'")
    return [f'??? note "{title}"', ""] + [("    " + line) if line else "" for line in lines] + [""]


def heading(label: str, depth: int) -> list[str]:
    return [f"{'#' * depth} {label}", ""] if depth <= 5 else [f"**{label}**", ""]


# ------------------------------------------------------------------------------------------ generic layouts

def history(v):
    """An evaluation history: a list of dicts with an ``iteration``, or a dict keyed by iteration numbers."""
    if isinstance(v, dict) and v and all(k.isdigit() and isinstance(x, dict) for k, x in v.items()):
        v = [{"iteration": int(k), **x} for k, x in v.items()]
    return v if isinstance(v, list) and v and all(isinstance(x, dict) and "iteration" in x for x in v) else None


def flat(rec: dict):
    """A record's (key, value) pairs: a dict of cells spreads over ``key/sub``; a history adds headline metrics."""
    for k, v in rec.items():
        h = history(v)
        for m in [m for m in HEADLINE if h and m in h[0] and m in h[-1]][:2]:
            yield f"{k}: {m}", " → ".join(f"{num(e[m])} (it {e['iteration']})" for e in (h[:1] + h[1:][-1:]))
        spread = isinstance(v, dict) and v and not is_cell(v) and all(map(is_cell, v.values()))
        yield from ((f"{k}/{s}", x) for s, x in v.items()) if spread else [(k, v)]


def records(items: list[tuple[str, dict]], depth: int, label: str = "") -> list[str]:
    """A row per record (a column, where narrower); long texts go under the table, nested data into collapsed blocks."""
    cols, notes, nested, rows = [], [], [], []
    for name, rec in items:
        row = {}
        for k, v in [(k, v) for k, v in flat(rec) if v not in EMPTY]:
            if isinstance(v, str) and len(v) > LONG:
                notes.append(f"- **{esc(name)}**, {k}: {text(k, v)}")
            elif is_cell(v):
                row[k] = fmt(v, k)
                cols += [] if k in cols else [k]
            else:
                nested.append((f"{name}: {k}", v))
        rows.append(row)
    names = [esc(n) for n, _ in items]
    if len(cols) > 8 and len(cols) > len(items):  # more columns than records: a column per record
        head, body = [label] + names, [[code(c)] + [r.get(c, "") for r in rows] for c in cols]
    else:
        head, body = [label] + [*map(code, cols)], [[n] + [r.get(c, "") for c in cols] for n, r in zip(names, rows)]
    out = table(head, body) + notes + [""] * bool(notes)
    return out + [line for title, v in nested for line in details(title, render(v, 9))]


def labelled(items: list[dict]) -> list[tuple[str, dict]]:
    """(label, the rest) per dict: named by its first LABEL_KEYS field, else its first short text; and its seed."""
    out = []
    for i, x in enumerate(items, 1):
        k = next((k for k in LABEL_KEYS if isinstance(x.get(k), (str, int, float))), None) or \
            next((k for k, v in x.items() if isinstance(v, str) and len(v) <= LONG), None)
        name = (x[k] if isinstance(x[k], str) else f"{k} {x[k]}") + (f", seed {x['seed']}" if "seed" in x else "") \
            if k else str(i)
        out.append((name, {a: b for a, b in x.items() if not k or a not in (k, "seed")}))
    return out


def recordish(v) -> bool:
    """A dict of mostly cells, texts, histories and dicts of cells: a row of a table of its siblings."""
    if not isinstance(v, dict) or not v or is_cell(v) or layout(v):
        return False
    return 2 * sum(is_cell(x) or isinstance(x, str) or history(x) is not None or
                   isinstance(x, dict) and all(map(is_cell, x.values())) for x in v.values()) >= len(v)


def generic(x, depth: int) -> list[str]:
    """Long texts as lines, a key/value table of the cells, then the children."""
    if isinstance(x, list):
        if all(isinstance(v, str) for v in x):
            return [f"- {text('', v)}" for v in x] + [""]
        if all(map(is_cell, x)):
            return [fmt(x), ""]
        if all(map(recordish, x)):
            return records(labelled(x), depth)
        return children(labelled(x) if all(isinstance(v, dict) for v in x) else
                        [(str(i), v) for i, v in enumerate(x, 1)], depth)
    texts = [(k, v) for k, v in x.items() if isinstance(v, str) and len(v) > LONG]
    kv = [(k, v) for k, v in x.items() if is_cell(v) and v not in EMPTY and (k, v) not in texts]
    rest = [(k, v) for k, v in x.items() if not is_cell(v) and not isinstance(v, str) and v not in EMPTY]
    small = [(k, v) for k, v in rest if isinstance(v, dict) and all(map(is_cell, v.values()))]
    if len(small) == 1 or len(small) > 1 and not set.intersection(*(set(v) for _, v in small)):
        kv += [(f"{k}/{s}", y) for k, v in small for s, y in v.items()]  # unlike dicts of cells join the table
        rest = [(k, v) for k, v in rest if (k, v) not in small]
    out = [line for k, v in texts for line in (f"**{k}:** {text(k, v)}", "")]
    return out + (table(["field", "value"], [[code(k), fmt(v, k)] for k, v in kv]) if kv else []) + \
        children(rest, depth)


def children(items: list[tuple[str, object]], depth: int) -> list[str]:
    """Siblings that are records with keys in common share one table; every other child gets a section."""
    recs = [(k, v) for k, v in items if recordish(v)]
    recs = recs if len(recs) > 1 and set.intersection(*(set(v) for _, v in recs)) else []
    out = records(recs, depth) if recs else []
    for k, v in items:
        out += [] if (k, v) in recs else heading(esc(str(k)), depth) + render(v, depth + 1)
    return out


# ------------------------------------------------------------------------------------------ measurement layouts

def presets(d: dict, depth: int) -> list[str]:
    """``scripts/compare_presets.py``: each arm's set-up, its held-out and its training metrics, each run collapsed."""
    arms = d["arms"]
    keyed = lambda part: list(dict.fromkeys(k for a in arms.values() for k, v in a.items()  # noqa: E731
                                            if isinstance(v, dict) and part in v))
    metrics, train = keyed("final"), keyed("first_quarter")
    setup = []
    for name, a in arms.items():
        how = {"command": d["arm_commands"][name]} if name in d.get("arm_commands", {}) else {
            "preset": d.get("arm_presets", {}).get(name),
            "overrides": " ".join(d.get("arm_overrides", {}).get(name, []))}
        facts = {k: v for k, v in a.items() if k not in metrics + train + ["base", "curve"] and is_cell(v)}
        setup.append((name, {**{k: v for k, v in how.items() if v}, **facts}))
    out = records(setup, depth, "arm") + ["Held-out metrics at the last evaluation, mean ± std over seeds; in "
                                          "brackets the gain over the model before training (`base`).", ""]
    bases = {m: sorted({num(a.get("base", {}).get(m)) for a in arms.values()}) for m in metrics}
    out += table(["metric", "base"] + [esc(a) for a in arms], [
        [code(m), bases[m][0] if len(bases[m]) == 1 else "(per arm)"] +
        [f"{fmt(a[m]['final'])} ({signed(a[m]['gain']['mean'])})" if m in a else "" for a in arms.values()]
        for m in metrics])
    if train:
        out += ["Training metrics, the mean over the first quarter of the iterations → over the last quarter "
                "(mean ± std over seeds).", ""]
        out += table(["training metric"] + [esc(a) for a in arms],
                     [[code(m)] + [fmt(a[m]) if m in a else "" for a in arms.values()] for m in train])
    runs = []
    for r in d.get("runs", []):
        last = (r.get("evals") or [{}])[-1]
        runs.append((f"{r['arm']}, seed {r['seed']}", {**{k: r[k] for k in ("seconds", "cpu", "commit") if k in r},
                                                      "evaluated at": last.get("iteration"),
                                                      **{m: last[m] for m in metrics if m in last}}))
    out += details(f"Each run ({len(runs)}): its last evaluation", records(runs, 9, "run")) if runs else []
    return out + generic(rest(d, "arms", "runs", "arm_presets", "arm_overrides", "arm_commands"), depth)


def paired_columns(cols: list[tuple[str, dict]]) -> list[str]:
    """Rows are metrics, columns runs or arms; the whole-video metrics first, per segment and per tag collapsed."""
    metrics = sorted(dict.fromkeys(m for _, c in cols for m in c), key=lambda m: m != "reward")

    def row(m):
        bases = sorted({num(c[m]["base"]) for _, c in cols if "change" in c.get(m, {})})
        change = lambda v: signed(v["change"]) + (f" ± {num(v['stderr'])}" if "stderr" in v else "")  # noqa: E731
        cell = lambda v: "—" if "change" not in v else change(v) if len(bases) == 1 else fmt(v)  # noqa: E731
        return [code(m), bases[0] if len(bases) == 1 else "(per column)"] + [cell(c.get(m, {})) for _, c in cols]
    header = ["metric", "before"] + [esc(n) for n, _ in cols]
    main = [m for m in metrics if "/" not in m] or metrics
    out = ["Paired held-out evaluation on the same prompts and noise: the score before training, and per run the "
           "change ± its standard error (per arm: the mean change over its runs).", ""]
    out += table(header, [*map(row, main)])
    parts = [m for m in metrics if m not in main]
    return out + (details("Per segment and per tag", table(header, [*map(row, parts)])) if parts else [])


def paired(d: dict, depth: int) -> list[str]:
    """``scripts/paired_eval.py`` (runs) and ``scripts/paired_report.py`` (arms of runs, and evaluations apart)."""
    if "arms" not in d:
        runs = d["runs"] if isinstance(d["runs"], list) else [{"run": k, **v} for k, v in d["runs"].items()]
        named = [(r.get("run", str(i)), r) for i, r in enumerate(runs, 1)]
        facts = [(n, {k: v for k, v in r.items() if k != "run" and is_cell(v)}) for n, r in named]
        return paired_columns([(n, r["metrics"]) for n, r in named]) + records(facts, depth, "run") + \
            generic(rest(d, "runs"), depth)
    arms = d["arms"]
    out = records([(n, {k: v for k, v in a.items() if is_cell(v)}) for n, a in arms.items()], depth, "arm")
    out += paired_columns([(n, a["mean"]) for n, a in arms.items()])
    runs = [(f"{n}: {r.get('run')}", {**{k: v for k, v in r.items() if k != "run" and is_cell(v)},
                                      "reward": r.get("metrics", {}).get("reward")}) for n, a in arms.items()
            for r in a["runs"]]
    out += details(f"Each run ({len(runs)}): its paired change of the reward", records(runs, 9, "run"))
    trained = [(f"{n}: {r.get('run')}", r["training"]) for n, a in arms.items() for r in a["runs"] if r.get("training")]
    out += details("Training metrics of each run, first quarter → last quarter", records(trained, 9)) * bool(trained)
    for n, a in d.get("apart", {}).items():
        out += heading(f"{esc(n)}: {a.get('prompts_file') or a.get('source')}", depth)
        out += paired_columns([(r.get("run"), r.get("by_tag") or r.get("metrics", {})) for r in a["runs"]])
    return out + generic(rest(d, "arms", "apart"), depth)


def algorithms(d: dict, depth: int) -> list[str]:
    """``scripts/bench_iteration.py`` (seconds per iteration and phase) and ``scripts/bench_time_to_reward.py`` (runs
    that reached the target, and their medians): a row per algorithm, with the ratios the file gives."""
    rows = []
    for n, a in d["algorithms"].items():
        ratio = {"time ratio": d.get("ratios", {}).get(n)}
        if "seconds_per_iteration" in a:
            rows.append((n, {"seconds/iteration": a["seconds_per_iteration"], **ratio,
                             "rollout NFE": a.get("rollout_nfe"), "NFE ratio": d.get("nfe_ratios", {}).get(n),
                             "trained transitions": a.get("trained_transitions"),
                             **{f"{p} s": s for p, s in a.get("phases", {}).items()}, "algorithm": a.get("algorithm")}))
        else:
            m, runs = a["median_iterations"], a.get("runs", [])
            rows.append((n, {"reached": a["reached"], "median seconds": a["median_seconds"],
                             "median iterations": m if m is None or m % 1 else int(m), **ratio,
                             "seconds per run": [r["seconds"] for r in runs],
                             "iterations per run": [r["iterations"] for r in runs]}))
    target = [f"Target: `{d['metric']}` ≥ {num(d['target'])}.", ""] if "target" in d else []
    return target + records(rows, depth, "algorithm") + \
        generic(rest(d, "algorithms", "ratios", "nfe_ratios", "metric", "target"), depth)


def plan(d: dict, depth: int) -> list[str]:
    """``scripts/plan.py``: the verdict, then the peak memory of each phase split by what holds it, and the modules."""
    head = {k: d[k] for k in ("config", "gpu", "num_processes", "launcher", "fits", "peak_gib", "peak_phase",
                              "headroom_gib", "projected_seconds_per_iteration") if k in d}
    phases = [(p["name"], {"peak GiB": p["peak_bytes"] / GIB, **{f"{k} GiB": v / GIB for k, v in p["split"].items()},
                           "host GiB": p.get("host_bytes", 0) / GIB, "FLOPs": p.get("flops"),
                           "largest at": p.get("where"), "note": p.get("note")}) for p in d["phases"]]
    modules = [(m["name"], {"parameters": m.get("params"), "GiB": m["bytes"] / GIB}) for m in d.get("modules", [])]
    return generic(head, depth) + records(phases, depth, "phase") + records(modules, depth, "module") + \
        generic(rest(d, "phases", "modules", "peak_bytes", *head), depth)


def probe(d: dict, depth: int) -> list[str]:
    """``scripts/probe_update.py``: per lr the change with the advantages, negated, their difference and their mean."""
    main, parts = [], []
    for lr, groups in d["summary"].items():
        if "with_advantages" in groups:
            groups = {"all": rest(groups, "components_signal"),
                      **{f"component:{c}": {"signal": s} for c, s in groups.get("components_signal", {}).items()}}
        for g, stats in groups.items():
            (parts if "component:" in g else main).append((f"lr {lr}, {g}", stats))
    out = ["Change of the reward after the update, mean ± standard error over prompt groups.", ""]
    out += records(main, depth, "probe") + details("Per reward component", records(parts, 9, "probe")) * bool(parts)
    return out + generic(rest(d, "summary", "probes"), depth)  # each single probe stays in the file


def rest(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def layout(x):
    """The measurement layout for data of this shape, if any."""
    if not isinstance(x, dict):
        return None
    first = lambda k: next(iter(x[k].values() if isinstance(x[k], dict) else x[k]), None) \
        if isinstance(x.get(k), (dict, list)) else None  # noqa: E731
    arm, run, algo = first("arms"), first("runs"), first("algorithms")
    summary = x["summary"] if isinstance(x.get("summary"), dict) else {}
    return presets if isinstance(arm, dict) and any(isinstance(v, dict) and "final" in v for v in arm.values()) else \
        paired if isinstance(arm, dict) and "mean" in arm or isinstance(run, dict) and "metrics" in run else \
        algorithms if isinstance(algo, dict) and {"seconds_per_iteration", "reached"} & algo.keys() else \
        plan if isinstance(x.get("phases"), list) and "gpu" in x else \
        probe if any(isinstance(v, dict) and {"with_advantages", "same/all"} & v.keys() for v in summary.values()) \
        else None


def render(x, depth: int) -> list[str]:
    return (layout(x) or generic)(x, depth)


# ------------------------------------------------------------------------------------------ pages

def cpu_line(runs) -> list[str]:
    """The CPU kernels its runs record (``cpu``), counted, where any run records them."""
    runs = [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []
    counts = Counter(r.get("cpu") or "not recorded" for r in runs) if any("cpu" in r for r in runs) else {}
    line = "CPU kernels of its runs: " + ", ".join(f"{k} ({n} runs)" for k, n in counts.items()) + "."
    return [line, ""] * bool(counts)


def figures(stem: str, prov: dict) -> list[str]:
    """PNGs of this stem, and those of no JSON that its command made (the same command and commit)."""
    rec = prov.get(f"{stem}.json") or {}
    same = lambda p: bool(rec) and not (RESULTS / f"{p.stem}.json").exists() and all(  # noqa: E731
        (prov.get(p.name) or {}).get(k) == rec.get(k) for k in ("command", "commit"))
    return [p.name for p in sorted(RESULTS.glob("*.png")) if p.stem == stem or same(p)]


def member(stem: str, prov: dict) -> tuple[list[str], bool | None]:
    """A file's section on its study's page, and whether it is stale (None: absent)."""
    path, pngs = RESULTS / f"{stem}.json", figures(stem, prov)
    name = path.name if path.exists() or not pngs else pngs[0]
    out = heading(name, 2)
    if not path.exists() and not pngs:
        return out + [f"Not in `docs/results/`: `{path.name}` has not been measured yet.", ""], None
    rec = prov.get(name) or {}
    world = f" (world: {rec['world']})" if rec.get("world") else ""
    out += [f"Measured {rec['measured']} at commit `{rec['commit']}`{world}." if rec else
            "No record in `docs/results/provenance.json`: where this came from is not written down.", ""]
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    top = data if isinstance(data, dict) else {}
    out += cpu_line(top.get("runs"))
    if rec.get("stale"):
        out += ['!!! warning "Stale: these numbers no longer hold"', "", f"    {esc(rec['stale'])}", ""]
    commands = [rec.get("command")]
    if isinstance(top.get("command"), str) and top["command"] not in str(commands[0]):
        commands.append(top["command"])  # the file's own, where it says more
    for c in filter(None, commands):
        out += ["```", *c.split(" ; "), "```", ""]
    out += [f"**{k.capitalize()}** (from the file): {esc(v)}\n" for k, v in top.items()
            if k in VERDICT_KEYS and isinstance(v, str)]
    out += [f"![{Path(p).stem}](../results/{p})\n" for p in pngs]
    if data is not None:
        body = {k: v for k, v in top.items() if k != "commit" and not (isinstance(v, str) and k in VERDICT_KEYS +
                                                                         ("command",))} if top else data
        out += render(body, 3) + [f"Data: [{path.name}](../results/{path.name}).", ""]
    return out, bool(rec.get("stale"))


def status(flags: list) -> str:
    present = [f for f in flags if f is not None]
    n, absent = sum(present), len(flags) - len(present)
    return ("current" if not n else "stale" if n == len(present) else f"partly stale ({n} of {len(present)} files)") \
        + (f" ({absent} listed file absent)" if absent else "")


def render_all(prov: dict | None = None) -> dict[str, str]:
    """Every page: ``{its file name in docs/reports/: its text}``."""
    prov = headline.provenance() if prov is None else prov
    note = "<!-- generated by python scripts/reports.py from docs/results/: edit the JSON, not this page -->"
    pages, index = {}, []
    for s in STUDIES:
        sections = [member(stem, prov) for stem in s.members]
        flags = [flag for _, flag in sections]
        head = [note, "", f"# {s.title}", "", f"{s.what}.", "", f"Status: **{status(flags)}**.", ""] + \
            [f"![{s.title}]({s.slug}.png)", ""] * (REPORTS / f"{s.slug}.png").is_file()  # a study's own figure
        pages[f"{s.slug}.md"] = "\n".join(head + [line for lines, _ in sections for line in lines]).rstrip() + "\n"
        index.append([f"[{s.title}]({s.slug}.md)", s.what, str(sum(f is not None for f in flags)), status(flags)])
    intro = ("Every measured result in `docs/results/` belongs to one study. Each study's page is generated from its "
             "JSON files: the command that produced each, its commit and date, its tables and figure, and whether its "
             "numbers still hold.")
    pages["index.md"] = "\n".join([note, "", "# Reports", "", intro, ""] +
                                  table(["study", "what it measured", "files", "status"], index)).rstrip() + "\n"
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming whatever differs")
    args = parser.parse_args(argv)
    pages = render_all()
    differ = sorted(n for n in pages if not (REPORTS / n).is_file() or (REPORTS / n).read_text("utf-8") != pages[n])
    extra = sorted({p.name for p in REPORTS.glob("*.md")} - set(pages))
    if args.check:
        problems = [f"docs/reports/{n} differs from what python scripts/reports.py writes" for n in differ] + \
            [f"docs/reports/{n} is no page python scripts/reports.py writes" for n in extra] + headline.check()
        print("".join(f"{p}\n" for p in problems), end="")
        return 1 if problems else 0
    REPORTS.mkdir(parents=True, exist_ok=True)
    for n in differ:
        (REPORTS / n).write_text(pages[n], encoding="utf-8")
    for n in extra:
        (REPORTS / n).unlink()
    print(f"docs/reports: {len(pages)} pages, {len(differ)} written, {len(extra)} removed; {headline.write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
