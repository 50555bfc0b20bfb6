"""The README's results block and the headline figure, written from the results JSON by ``scripts/reports.py``.

The block sits in ``README.md`` between ``<!-- results: ... -->`` and ``<!-- end results -->``: every number in it is
read here from a key of a file in ``docs/results/`` (edit the JSON, then run ``python scripts/reports.py``), and a
row whose file ``docs/results/provenance.json`` marks stale says so. The figure (``docs/reports/image-runs.png``) is
held-out GenEval of the three headline image presets over training, mean ± std over seeds as a band.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
PROVENANCE = RESULTS / "provenance.json"
FIELDS = ("command", "commit", "measured", "world", "tripwire", "stale")  # of each provenance record
WORLDS = ("image", "video", "stream")
README = REPO / "README.md"
START, END = "<!-- results:", "<!-- end results -->"
FIGURE = REPO / "docs" / "reports" / "image-runs.png"

IMAGE, VIDEO, STREAM = "headline_image_runs.json", "video_runs_evals.json", "stream_one_object.json"
IMAGE_ARMS = {"default": ("default (MixGRPO)", "python train.py"),
              "flash_grpo": ("Flash-GRPO", "python train.py algo=flash_grpo"),
              "flow_grpo": ("Flow-GRPO", "python train.py experiment=flow_grpo_shapes")}
VIDEO_SEEDS = ("preset", "preset_seed1", "preset_seed2")  # video_runs_evals.json: the video preset's three seeds
KERNELS = {"AVX512": "AVX-512", "DEFAULT": "no SIMD"}  # torch's names of CPU kernel sets, as people write them


def provenance() -> dict:
    return json.loads(PROVENANCE.read_text(encoding="utf-8"))


def load(name: str):
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def mean_std(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def stale(name: str, prov: dict) -> str:
    why = prov[name]["stale"]
    return f" **Stale:** {why}" if why else ""


def rows(prov: dict) -> list[list[str]]:
    """One row per headline claim: preset, command, held-out metric, before → after, seeds, report."""
    image = load(IMAGE)
    out = []
    for arm, (label, command) in IMAGE_ARMS.items():
        a = image["arms"][arm]
        before = f"{a['base']['eval/geneval']:.3f} / {a['base']['eval/geneval_partial']:.3f}"
        after = " / ".join(f"{a[m]['final']['mean']:.3f} ± {a[m]['final']['std']:.3f}"
                           for m in ("eval/geneval", "eval/geneval_partial"))
        out.append([label, f"`{command}`", f"GenEval strict / partial, {a['iterations']} iterations",
                    f"{before} → **{after}**", str(len(a["seeds"])), "[image runs](docs/reports/image-runs.md)"
                    + stale(IMAGE, prov)])
    video = load(VIDEO)["step10500"]
    first, last = video[VIDEO_SEEDS[0]]["evals"][0], [video[k]["evals"][-1] for k in VIDEO_SEEDS]
    out.append(["video (AWM)", "`python train.py experiment=video_shapes`",
                f"video GenEval partial, {last[0]['iteration']} iterations",
                f"{first['eval/geneval_partial']:.3f} → **{mean_std([e['eval/geneval_partial'] for e in last])}**",
                str(len(last)), "[video runs](docs/reports/video.md)" + stale(VIDEO, prov)])
    runs = load(STREAM)["arms"]["streaming AWM"]["runs"]
    changes = ", ".join(f"{r['metrics']['reward']['change']:+.3f} ± {r['metrics']['reward']['stderr']:.3f}"
                        for r in runs)
    out.append(["streaming video (streaming AWM)", "`python train.py experiment=stream_awm_shapes`",
                f"long-video reward, paired change ± SE per seed ({runs[0]['metrics']['reward']['n']} videos)",
                changes, str(len(runs)), "[streaming runs](docs/reports/streaming-runs.md)" + stale(STREAM, prov)])
    return out


def block(prov: dict | None = None) -> str:
    """The README's results block, markers included."""
    prov = provenance() if prov is None else prov
    kernels = sorted({KERNELS.get(r.get("cpu"), r.get("cpu")) for r in load(IMAGE)["runs"]})
    lines = [f"{START} written by python scripts/reports.py from docs/results/{IMAGE}, {VIDEO} and {STREAM} -->",
             "Held-out scores on the embedded worlds before → after training, mean ± std over seeds (2 CPU cores, "
             f"{', '.join(kernels)} kernels; on other CPU kernels a seed's run differs, the mean holds):", "",
             "| preset | command | held-out metric | before → after | seeds | report |", "|---|---|---|---|--:|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows(prov)]
    return "\n".join(lines + [END])


def readme(text: str, prov: dict | None = None) -> str:
    """``text`` (the README) with its results block rewritten."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no results block ('{START} ...' ... '{END}'): put one where it goes")
    return text[:start] + block(prov) + text[end + len(END):]


def figure(path: Path = FIGURE) -> None:
    """Held-out GenEval (strict and partial) of the headline image presets over iterations, mean ± std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = load(IMAGE)["arms"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharex=True)
    for ax, metric, title in zip(axes, ("eval/geneval", "eval/geneval_partial"), ("strict", "partial credit")):
        for arm, (label, _) in IMAGE_ARMS.items():
            curve = arms[arm]["curve"][metric]
            x = [p["iteration"] for p in curve]
            m, s = [p["mean"] for p in curve], [p["std"] for p in curve]
            ax.plot(x, m, marker="o", ms=3, label=f"{label}, {len(arms[arm]['seeds'])} seeds")
            ax.fill_between(x, [a - b for a, b in zip(m, s)], [a + b for a, b in zip(m, s)], alpha=0.2)
        ax.set(title=f"held-out GenEval, {title}", xlabel="training iteration")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean ± std over seeds")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def check() -> list[str]:
    """What differs from what :func:`write` would write: the README block, a missing figure."""
    text = README.read_text(encoding="utf-8")
    return ["README.md's results block differs from what python scripts/reports.py writes"] * (readme(text) != text) \
        + [f"{FIGURE.relative_to(REPO)} is missing: run python scripts/reports.py"] * (not FIGURE.is_file())


def write() -> str:
    """Rewrite the README block and draw the figure; say what was done."""
    text = README.read_text(encoding="utf-8")
    README.write_text(readme(text), encoding="utf-8")
    figure()
    return f"README results block {'rewritten' if readme(text) != text else 'unchanged'}; {FIGURE.relative_to(REPO)} drawn"
