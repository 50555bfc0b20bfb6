"""``python -m rewards <command>``: score images (or moving-shapes clips) with a reward, standalone.

Every command prints (or writes) strict JSON: NaN and inf are written as ``null``.

Commands (argparse subparsers):

``python -m rewards list``
    the reward names ``rewards.load`` accepts.

``python -m rewards geneval --images DIR --metadata FILE [--detector shapes|real] [--out FILE]``
    GenEval-score a folder of images against a JSONL file of GenEval metadata (one dict per line) and
    print JSON: ``{"summary": {...}, "images": [...]}`` (``--out`` writes it to a file instead).

    Images are the ``.png/.jpg/.jpeg/.webp/.bmp`` files directly in DIR, matched to metadata lines so:

    - if **every** file name starts with digits (``00012.png``, ``12_3.png``, ``0012-seed4.jpg``), those
      digits are the 0-based metadata line of the image, so several samples per prompt are fine;
    - otherwise the files, sorted by name, are matched to the lines in order (counts must agree).

    Without ``--metadata``, DIR is read in GenEval's own layout: ``DIR/<digits>/metadata.jsonl`` (one
    dict) and ``DIR/<digits>/samples/*.png``.

    The summary has, over all images and per tag, ``strict`` (GenEval's verdict, mean), ``exact`` and
    ``partial`` (Flow-GRPO's), and ``geneval`` = mean over tags of the per-tag strict accuracy (GenEval's
    "overall score").

``python -m rewards score --reward NAME --images DIR --prompts FILE [--kwargs JSON] [--out FILE]``
    Score a folder of images with any reward, ``rewards.load(NAME, **json.loads(JSON))``, and print JSON:
    ``{"summary": {...}, "images": [{"file", "index", "prompt", "score", <every component>}, ...]}``.

    FILE is a text file with one prompt per line (blank lines and lines starting with ``#`` skipped), or a
    ``.jsonl`` file of records holding ``"prompt"`` (the whole record is passed on as the image's metadata,
    e.g. GenEval's clauses or the OCR reward's ``"text"``). Images are matched to prompt lines as by the
    ``geneval`` command (a leading number in every file name is the 0-based line; otherwise sorted files
    pair with lines in order). The summary's ``stats`` has ``n``/``mean``/``std``/``min``/``max`` of the score
    and of every component over the images (NaN entries, e.g. a per-tag component on other tags' images,
    left out).
    Images only: video rewards take ``[B, T, 3, H, W]`` clips in code (``video_geneval`` has its own command).

``python -m rewards video_geneval --videos DIR --metadata FILE [--out FILE]``
    Judge a folder of clips against a JSONL file of video GenEval metadata (one dict per line, e.g.
    ``assets/prompts/motion_held_out.jsonl``) with ``rewards.load("video_geneval")`` and print JSON:
    ``{"summary": {...}, "videos": [...]}`` (``--out`` writes it to a file instead).

    A clip is one entry directly in DIR, any of:

    - a **directory of frames**: its ``.png/.jpg/.jpeg/.webp/.bmp`` files, in name order (``000.png``, ...);
    - a **.npy** array, ``[T, H, W, 3]`` or ``[T, 3, H, W]``, uint8 or float in [0, 1];
    - a **.mp4** (or ``.gif`` / ``.webm`` / ``.avi`` / ``.mov``) file, read with ``imageio`` (mp4 needs the
      ``imageio`` and ``imageio-ffmpeg`` packages; lossy codecs smear the world's small shapes, so frame
      directories or .npy are the faithful forms).

    Clips are matched to metadata lines as images are by ``geneval``: if every entry's name starts with digits
    (``00012.mp4``, ``12_3/``), those digits are the 0-based metadata line; otherwise the entries, sorted by
    name, are matched to the lines in order, one clip per line (counts must agree).

    The summary has ``n``, the means of ``strict`` and ``partial``, ``per_tag`` (``strict``, ``partial``, ``n``),
    ``geneval`` / ``geneval_partial`` = the mean over tags of the per-tag means (GenEval's overall score), and
    per check (object, color, count, motion, speed, still, identity) its pass rate over the clips it applies to.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ._json import dumps

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
VIDEO_SUFFIXES = {".mp4", ".gif", ".webm", ".avi", ".mov"}


def _section(command: str) -> str:
    """The module doc's section of one command, for its ``--help``."""
    text = __doc__.split(f"``python -m rewards {command} ")[1].split("\n", 1)[1]
    return text.split("``python -m rewards ")[0]


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise SystemExit(f"{path}:{n + 1}: not valid JSON ({err})") from err
    return rows


def _pair_images(images_dir: Path, metadata_file: Path | None) -> list[tuple[Path, int, dict]]:
    """(image path, metadata index, metadata) per image, by the rules in the module doc."""
    if not images_dir.is_dir():
        raise SystemExit(f"--images {images_dir}: not a directory")
    if metadata_file is None:  # GenEval layout
        pairs = []
        for sub in sorted(p for p in images_dir.iterdir() if p.is_dir() and p.name.isdigit()):
            meta_rows = _read_jsonl(sub / "metadata.jsonl")
            if len(meta_rows) != 1:
                raise SystemExit(f"{sub / 'metadata.jsonl'}: expected one metadata dict, found {len(meta_rows)}")
            for img in sorted((sub / "samples").glob("*")):
                if img.suffix.lower() in IMAGE_SUFFIXES:
                    pairs.append((img, int(sub.name), meta_rows[0]))
        if not pairs:
            raise SystemExit(
                f"--images {images_dir}: no --metadata given and no GenEval layout (<digits>/metadata.jsonl + samples/)"
            )
        return pairs
    return _pair_files(images_dir, _read_jsonl(metadata_file), metadata_file, "metadata")


def _emit(result: dict, out: str | None) -> int:
    """Print the result as JSON, or write it to ``out`` and print only its summary (NaN / inf as null: strict JSON)."""
    text = dumps(result, indent=1)
    if out:
        Path(out).write_text(text + "\n")
        print(dumps(result["summary"], indent=1))
    else:
        print(text)
    return 0


def _pair(entries: list[Path], folder: Path, rows: list, rows_file: Path, what: str, noun: str, example: str):
    """(path, row index, row) per entry of ``folder``: by a leading row index in every name, else one per line in
    sorted order (module doc). ``noun`` is the entries' singular ("image", "clip") in the errors."""
    indices = [re.match(r"^(\d+)", p.name) for p in entries]
    if all(indices):
        pairs = []
        for path, match in zip(entries, indices):
            index = int(match.group(1))
            if index >= len(rows):
                raise SystemExit(f"{path.name}: index {index} but {rows_file} has only {len(rows)} lines")
            pairs.append((path, index, rows[index]))
        return pairs
    if len(entries) != len(rows):
        raise SystemExit(
            f"{len(entries)} {noun}s in {folder} but {len(rows)} {what} lines in {rows_file}; name the {noun}s with a "
            f"leading {what} index (e.g. {example}) or give exactly one {noun} per line"
        )
    return [(path, i, row) for i, (path, row) in enumerate(zip(entries, rows))]


def _pair_files(images_dir: Path, rows: list, rows_file: Path, what: str) -> list[tuple[Path, int, object]]:
    """(image path, row index, row) per image file of ``images_dir``, by the rules in the module doc."""
    files = sorted(p for p in images_dir.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise SystemExit(f"--images {images_dir}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return _pair(files, images_dir, rows, rows_file, what, "image", "00012.png")


def _cmd_geneval(args: argparse.Namespace) -> int:
    from PIL import Image

    from .base import load

    pairs = _pair_images(Path(args.images), Path(args.metadata) if args.metadata else None)
    kwargs = {"detector": args.detector, "partial_credit": args.partial_credit}
    if args.detector == "real":
        kwargs.update(detector_path=args.detector_path, clip_path=args.clip_path)
        if args.device:
            kwargs["device"] = args.device
    reward = load("geneval", **kwargs)
    records = []
    for start in range(0, len(pairs), args.batch_size):
        batch = pairs[start : start + args.batch_size]
        images = [Image.open(path).convert("RGB") for path, _, _ in batch]
        verdicts = reward.judge(images, [meta for _, _, meta in batch])
        for (path, index, meta), v in zip(batch, verdicts):
            records.append(
                {
                    "file": str(path.relative_to(args.images)),
                    "index": index,
                    "tag": meta["tag"],
                    "prompt": meta.get("prompt"),
                    "strict": bool(v.strict),
                    "exact": bool(v.exact),
                    "partial": v.partial,
                    "reason": v.reason,
                    "detections": {cls: [d.to_json() for d in dets] for cls, dets in v.detections.items()},
                }
            )
    return _emit({"summary": summarise(records), "images": records}, args.out)


def summarise(records: list[dict]) -> dict:
    """Means over all images and per tag; ``geneval`` = mean over tags of per-tag strict accuracy."""

    def means(rows):
        n = len(rows)
        return {
            "n": n,
            "strict": sum(r["strict"] for r in rows) / n,
            "exact": sum(r["exact"] for r in rows) / n,
            "partial": sum(r["partial"] for r in rows) / n,
        }

    tags = list(dict.fromkeys(r["tag"] for r in records))
    per_tag = {t: means([r for r in records if r["tag"] == t]) for t in tags}
    summary = means(records)
    summary["geneval"] = sum(v["strict"] for v in per_tag.values()) / len(per_tag)
    summary["per_tag"] = per_tag
    return summary


def _read_prompts(path: Path) -> list[tuple[str, dict | None]]:
    """(prompt, metadata) per line of a text file (one prompt a line) or a JSONL file (records with "prompt")."""
    if not path.is_file():
        raise SystemExit(f"--prompts {path}: no such file")
    if path.suffix.lower() == ".jsonl":
        rows = []
        for n, record in enumerate(_read_jsonl(path)):
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise SystemExit(f"{path}: record {n} has no string 'prompt'")
            rows.append((record["prompt"], record))
        return rows
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [(line, None) for line in lines if line and not line.startswith("#")]


def _json_float(value: float) -> float | None:
    return None if value != value or value in (float("inf"), float("-inf")) else float(value)


def _cmd_score(args: argparse.Namespace) -> int:
    import torch
    from PIL import Image

    from .base import load

    try:
        kwargs = json.loads(args.kwargs) if args.kwargs else {}
    except json.JSONDecodeError as err:
        raise SystemExit(f"--kwargs: not valid JSON ({err})") from err
    if not isinstance(kwargs, dict):
        raise SystemExit(f"--kwargs: expected a JSON object, got {args.kwargs!r}")
    images_dir, prompts_file = Path(args.images), Path(args.prompts)
    if not images_dir.is_dir():
        raise SystemExit(f"--images {images_dir}: not a directory")
    pairs = _pair_files(images_dir, _read_prompts(prompts_file), prompts_file, "prompt")
    reward = load(args.reward, **kwargs)
    records, columns = [], {}
    for start in range(0, len(pairs), args.batch_size):
        batch = pairs[start : start + args.batch_size]
        images = [Image.open(path).convert("RGB") for path, _, _ in batch]
        prompts = [row[0] for _, _, row in batch]
        metadata = [row[1] for _, _, row in batch]
        out = reward(images, prompts, None if all(m is None for m in metadata) else metadata)
        clash = sorted(set(out.components) & {"file", "index", "prompt", "score"})
        if clash:
            raise ValueError(f"reward {args.reward!r} has components named {clash}, which clash with the record's fields")
        values = {"score": out.scores, **out.components}
        for i, (path, index, (prompt, _)) in enumerate(batch):
            record = {"file": str(path.relative_to(images_dir)), "index": index, "prompt": prompt}
            for name, value in values.items():
                record[name] = _json_float(float(value[i]))
                columns.setdefault(name, []).append(float(value[i]))
            records.append(record)
    summary = {"reward": args.reward, "kwargs": kwargs, "n": len(records), "stats": {}}
    for name, column in columns.items():
        t = torch.tensor(column, dtype=torch.float64)
        t = t[torch.isfinite(t)]
        summary["stats"][name] = {"n": int(t.numel()), "mean": _json_float(float(t.mean())) if t.numel() else None,
                         "std": _json_float(float(t.std(correction=0))) if t.numel() else None,
                         "min": _json_float(float(t.min())) if t.numel() else None,
                         "max": _json_float(float(t.max())) if t.numel() else None}
    return _emit({"summary": summary, "images": records}, args.out)


def _video_entries(videos_dir: Path) -> list[Path]:
    """The clips of DIR: frame directories, .npy arrays and video files (module doc)."""
    if not videos_dir.is_dir():
        raise SystemExit(f"--videos {videos_dir}: not a directory")
    entries = []
    for p in sorted(videos_dir.iterdir()):
        if p.is_dir() and any(f.suffix.lower() in IMAGE_SUFFIXES for f in p.iterdir() if f.is_file()):
            entries.append(p)
        elif p.is_file() and (p.suffix.lower() == ".npy" or p.suffix.lower() in VIDEO_SUFFIXES):
            entries.append(p)
    if not entries:
        raise SystemExit(f"--videos {videos_dir}: no clips (frame directories, .npy, {', '.join(sorted(VIDEO_SUFFIXES))})")
    return entries


def _pair_videos(videos_dir: Path, rows: list, rows_file: Path) -> list[tuple[Path, int, object]]:
    """(clip path, metadata index, metadata) per clip, matched as images are (module doc)."""
    return _pair(_video_entries(videos_dir), videos_dir, rows, rows_file, "metadata", "clip", "00012.mp4, 00012/")


def read_clip(path: Path):
    """One clip as uint8 ``[T, H, W, 3]`` from a frame directory, a .npy array or a video file (module doc)."""
    import numpy as np
    from PIL import Image

    from .images import check_pixels

    path = Path(path)
    if path.is_dir():
        frames = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
        clip = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in frames])
    elif path.suffix.lower() == ".npy":
        clip = np.load(path)
        if clip.ndim != 4 or 3 not in (clip.shape[1], clip.shape[-1]):
            raise ValueError(f"{path}: expected a [T, H, W, 3] or [T, 3, H, W] array, got shape {clip.shape}")
        if clip.shape[-1] != 3:
            clip = clip.transpose(0, 2, 3, 1)
        if clip.dtype != np.uint8:
            if not np.issubdtype(clip.dtype, np.floating):
                raise ValueError(f"{path}: expected uint8 or float frames in [0, 1], got {clip.dtype}")
            check_pixels([clip], reward=str(path), what="clip")  # NaN, or a range other than [0, 1]: refused
            clip = np.rint(np.clip(clip, 0.0, 1.0) * 255).astype(np.uint8)
    elif path.suffix.lower() == ".gif":
        with Image.open(path) as im:
            clip = []
            for i in range(getattr(im, "n_frames", 1)):
                im.seek(i)
                clip.append(np.asarray(im.convert("RGB")))
        clip = np.stack(clip)
    else:
        try:
            import imageio.v3 as iio
        except ImportError as err:
            raise ImportError(f"{path}: reading {path.suffix} needs imageio (and imageio-ffmpeg): pip install imageio "
                              "imageio-ffmpeg; or give frame directories / .npy arrays") from err
        clip = np.asarray(iio.imread(path, index=None))
        if clip.ndim == 4 and clip.shape[-1] == 4:
            clip = clip[..., :3]
    if clip.ndim != 4 or clip.shape[-1] != 3 or len(clip) == 0:
        raise ValueError(f"{path}: expected RGB frames [T, H, W, 3], got shape {clip.shape}")
    return np.ascontiguousarray(clip)


def _cmd_video_geneval(args: argparse.Namespace) -> int:
    import torch

    from .base import load
    from .geneval.summary import geneval_summary
    from .geneval.video import CHECKS

    metadata_file = Path(args.metadata)
    if not metadata_file.is_file():
        raise SystemExit(f"--metadata {metadata_file}: no such file")
    pairs = _pair_videos(Path(args.videos), _read_jsonl(metadata_file), metadata_file)
    reward = load("video_geneval")
    records = []
    for path, index, meta in pairs:
        verdict = reward.judge([read_clip(path)], [meta])[0]
        records.append(
            {
                "file": str(path.relative_to(args.videos)),
                "index": index,
                "tag": meta["tag"],
                "prompt": meta.get("prompt"),
                "strict": bool(verdict.strict),
                "partial": verdict.partial,
                "checks": verdict.checks,
                "reason": verdict.reason,
            }
        )
    comps = {"strict": torch.tensor([float(r["strict"]) for r in records]),
             "partial": torch.tensor([r["partial"] for r in records])}
    tags = geneval_summary(comps, [{"tag": r["tag"]} for r in records])
    checks = {}
    for name in CHECKS:
        seen = [r["checks"][name] for r in records if name in r["checks"]]
        if seen:
            checks[name] = {"n": len(seen), "pass": sum(seen) / len(seen)}
    summary = {
        "n": len(records),
        "strict": sum(r["strict"] for r in records) / len(records),
        "partial": sum(r["partial"] for r in records) / len(records),
        "geneval": tags["overall"],
        "geneval_partial": tags["overall_partial"],
        "per_tag": tags["per_tag"],
        "checks": checks,
    }
    return _emit({"summary": summary, "videos": records}, args.out)


def _cmd_list(args: argparse.Namespace) -> int:
    from .base import available

    print("\n".join(available()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rewards",
                                     description="Score images (or moving-shapes clips) with a reward, standalone.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    p = sub.add_parser("list", help="list the reward names rewards.load accepts")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser(
        "geneval",
        help="GenEval-score a folder of images against GenEval metadata",
        description=_section("geneval"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--images", required=True, help="folder of images (see matching rules above)")
    p.add_argument("--metadata", help="JSONL, one GenEval metadata dict per line (omit for GenEval's folder layout)")
    p.add_argument("--detector", choices=("shapes", "real"), default="shapes", help="shapes world or Mask2Former + CLIP")
    p.add_argument("--detector-path", default=None, help="'real': Mask2Former checkpoint (path or hub id)")
    p.add_argument("--clip-path", default=None, help="'real': CLIP checkpoint (path or hub id)")
    p.add_argument("--device", default=None, help="'real': torch device (default: cuda if available)")
    p.add_argument("--partial-credit", choices=("flowgrpo", "clipped"), default="flowgrpo")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", default=None, help="write the full JSON here (the summary still goes to stdout)")
    p.set_defaults(func=_cmd_geneval)

    p = sub.add_parser(
        "score",
        help="score a folder of images with any reward",
        description=_section("score"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--reward", required=True, help="reward name (python -m rewards list)")
    p.add_argument("--images", required=True, help="folder of images (matched to prompt lines as above)")
    p.add_argument("--prompts", required=True, help="prompts: .txt (one a line) or .jsonl (records with 'prompt')")
    p.add_argument("--kwargs", default=None, help='JSON object of reward constructor kwargs, e.g. \'{"quality": 90}\'')
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default=None, help="write the full JSON here (the summary still goes to stdout)")
    p.set_defaults(func=_cmd_score)

    p = sub.add_parser(
        "video_geneval",
        help="judge a folder of moving-shapes clips against video GenEval metadata",
        description=_section("video_geneval"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--videos", required=True,
                   help="folder of clips: frame directories, .npy arrays or .mp4 files (see matching rules above)")
    p.add_argument("--metadata", required=True, help="JSONL, one video GenEval metadata dict per line")
    p.add_argument("--out", default=None, help="write the full JSON here (the summary still goes to stdout)")
    p.set_defaults(func=_cmd_video_geneval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "geneval" and args.detector == "real":
        from .geneval.real import DEFAULT_CLIP, DEFAULT_DETECTOR

        args.detector_path = args.detector_path or DEFAULT_DETECTOR
        args.clip_path = args.clip_path or DEFAULT_CLIP
    try:
        return args.func(args)
    except (ValueError, OSError, KeyError, TypeError, ImportError, RuntimeError) as err:  # say what, no traceback
        print(f"python -m rewards {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
