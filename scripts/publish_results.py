#!/usr/bin/env python
r"""The published numbers, written from the JSON that measured them: the README's results and the results page's
headline tables are generated blocks, and every file in ``docs/results/`` has a provenance record.

    python scripts/publish_results.py            # rewrite the generated blocks from docs/results/
    python scripts/publish_results.py --check    # exit 1 naming every block that is not what the JSON says

A generated block sits between ``<!-- generated: NAME (...) -->`` and ``<!-- end: NAME -->`` in a markdown file; its
text is :data:`BLOCKS`\ ``[NAME]``'s rendering of the results JSON, so a number edited by hand there fails
``tests/test_published_results.py`` and a rerun that rewrites a JSON moves the prose with it.

``docs/results/provenance.json`` records, per file of ``docs/results/``: the ``command`` that produced it, the
``commit`` that published it (its code, or its parent's, is the code that ran), the day it was ``measured``, the
``world`` it measured (``image``, ``video``, ``stream``; null for timings), the ``tripwire`` fingerprint of that
world's preset when it was measured (``scripts/tripwire.py``) and ``stale``: null, or why its numbers no longer
hold (a change since, named by its commit). A result is current only while its world's preset computes what it
computed then: when a preset's tripwire reference is re-recorded, the results of that world that were not measured
again are marked stale in the same commit. A headline rendered from a stale file says so.
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


def load(name: str):
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
        f"On the embedded worlds, 2 CPU cores, held-out GenEval strict / partial, mean ± std over {seeds} seeds "
        "([Results](docs/results.md)):",
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
        last = [(r["seed"], r["evals"][-1]) for r in image["runs"] if r["arm"] == arm]
        finals = [f"seed {seed} {e['eval/geneval']:.3f} / {e['eval/geneval_partial']:.3f}" for seed, e in last]
        per_seed.append(f"{label.split(' (')[0]}: " + ", ".join(finals))
    return "\n".join([*lines, "", "Per seed at the last evaluation, strict / partial: " + "; ".join(per_seed) + "."])


# ---------------------------------------------------------------- provenance, as a table a reader can check

def provenance_table() -> str:
    lines = ["| file | command | commit | measured | status |", "|---|---|---|---|---|"]
    for name, rec in sorted(provenance().items()):
        status = f"stale: {rec['stale']}" if rec["stale"] else "current"
        command = rec["command"].replace("|", "\\|")
        lines.append(f"| `{name}` | `{command}` | {rec['commit']} | {rec['measured']} | {status} |")
    return "\n".join(lines)


def index_results() -> str:
    """The documentation home page's headline: the README's, with links relative to ``docs/``."""
    return readme_results().replace("](docs/", "](")


BLOCKS = {
    "readme-results": (REPO / "README.md", readme_results),
    "index-results": (REPO / "docs" / "index.md", index_results),
    "image-runs": (REPO / "docs" / "results.md", image_runs_table),
    "provenance": (REPO / "docs" / "results.md", provenance_table),
}
_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) [^\n]*-->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)", re.S)


def blocks_in(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in _BLOCK.finditer(text)}


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


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
        return m.group(1) + BLOCKS[m["name"]][1]() + "\n" + m.group(4)

    return _BLOCK.sub(sub, text)


def check() -> list[str]:
    """Names of the blocks whose text is not what their JSON renders to (empty: all current)."""
    stale = []
    for path in sorted({p for p, _ in BLOCKS.values()}):
        now, want = blocks_in(path.read_text()), blocks_in(render(path))
        stale += [f"{_shown(path)}: {name}" for name in want if now.get(name) != want[name]]
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is not current")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(f"not what its JSON says (run python scripts/publish_results.py): {p}")
        return 1 if problems else 0
    for path in sorted({p for p, _ in BLOCKS.values()}):
        path.write_text(render(path))
        print(f"wrote {_shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
