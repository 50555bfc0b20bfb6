"""``python -m rewards <command>``: score images with a reward, standalone.

Commands (argparse subparsers; other rewards add theirs next to ``geneval``):

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
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


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
    metadata = _read_jsonl(metadata_file)
    files = sorted(p for p in images_dir.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise SystemExit(f"--images {images_dir}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))})")
    indices = [re.match(r"^(\d+)", p.name) for p in files]
    if all(indices):
        pairs = []
        for path, match in zip(files, indices):
            index = int(match.group(1))
            if index >= len(metadata):
                raise SystemExit(f"{path.name}: index {index} but {metadata_file} has only {len(metadata)} lines")
            pairs.append((path, index, metadata[index]))
        return pairs
    if len(files) != len(metadata):
        raise SystemExit(
            f"{len(files)} images in {images_dir} but {len(metadata)} metadata lines in {metadata_file}; name the images "
            "with a leading metadata index (e.g. 00012.png) or give exactly one image per line"
        )
    return [(path, i, meta) for i, (path, meta) in enumerate(zip(files, metadata))]


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
    result = {"summary": summarise(records), "images": records}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(json.dumps(result["summary"], indent=1))
    else:
        print(text)
    return 0


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


def _cmd_list(args: argparse.Namespace) -> int:
    from .base import available

    print("\n".join(available()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rewards", description="Score images with a reward, standalone.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")

    p = sub.add_parser("list", help="list the reward names rewards.load accepts")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser(
        "geneval",
        help="GenEval-score a folder of images against GenEval metadata",
        description=__doc__.split("``python -m rewards geneval")[1].split("\n", 1)[1],
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "geneval" and args.detector == "real":
        from .geneval.real import DEFAULT_CLIP, DEFAULT_DETECTOR

        args.detector_path = args.detector_path or DEFAULT_DETECTOR
        args.clip_path = args.clip_path or DEFAULT_CLIP
    try:
        return args.func(args)
    except (ValueError, OSError) as err:  # bad metadata, missing weights: say what, no traceback
        print(f"python -m rewards {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
