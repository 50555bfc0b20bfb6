#!/usr/bin/env python
r"""Held-out evaluation of a streaming model on the moving-shapes world's streams (prompt switches): JSON.

    python scripts/eval_streams.py                                         # the embedded streaming model
    python scripts/eval_streams.py --model outputs/pretrain_tiny_causal_wan/export --streams 48 --sheet /tmp/s.png

For every held-out stream of ``--prompts`` (default ``assets/prompts/streams_val.jsonl``, the first ``--streams``
of them), ``--samples`` videos, sample ``j`` of stream ``i`` from the noise of the generator seeded by
``(--seed, i, j)`` whatever the batching; streams that switch at the same frames are generated together (the
pipeline's rows share their switch frames), ``--batch`` at a time, with the model's own ``stream_config.json``.
Each video is scored by ``rewards.load("long_video")`` against its metadata.

Prints JSON: the reward's rules (``scored_by``, e.g. ``long_video v2 (score=mean)``), the mean of every component
(``adherence`` per segment after a grace period, ``direction``, ``speed``, ``identity``, ``teleport``,
``smoothness``, ``recovery``, ``anti_freeze``, the scalar ``reward``), the same per tag (``one_object_stream`` /
``two_object_stream``) and per segment index (``segment<k>/...``), the number of videos and the seconds.
``--sheet`` writes the first videos' segment rows as one labelled PNG.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from flowgrpo import jsonio

ROOT = Path(__file__).resolve().parents[1]


def noise_for(pipe, key: tuple[int, int, int], num_frames: int, height: int, width: int):
    """One stream's draws from the generator seeded by ``key`` (its own, whatever the batch)."""
    from samplers import stream_noise

    c = pipe.config
    channels, frames, h, w = pipe.adapter._latent_shape(1, height, width, num_frames)[1:]
    seed = int(np.random.SeedSequence(list(key)).generate_state(1)[0])
    return stream_noise(1, frames // c.block_frames, c.num_steps, (channels, c.block_frames, h, w),
                        generator=torch.Generator().manual_seed(seed))


def evaluate(args) -> dict:
    import rewards
    from flowgrpo.models import StreamingWanPipeline
    from flowgrpo.stream import segment_sheet

    if not Path(args.model, "stream_config.json").is_file():
        raise SystemExit(f"--model {args.model}: not a streaming model directory (no stream_config.json)")
    lines = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    streams = lines[: args.streams] if args.streams else lines
    pipe = StreamingWanPipeline.from_pretrained(args.model)
    pipe.pipe.to(args.device)
    height, width = pipe.config.height or 64, pipe.config.width or 64
    judge = rewards.load("long_video")
    jobs = [(i, j) for i in range(len(streams)) for j in range(args.samples)]
    groups = defaultdict(list)
    for i, j in jobs:
        meta = streams[i]
        layout = (int(meta["num_frames"]), tuple(int(s["start"]) for s in meta["segments"][1:]))
        groups[layout].append((i, j))
    results: dict[tuple[int, int], dict] = {}
    sheet_videos = []
    start = time.time()
    for (num_frames, switches), members in groups.items():
        for b in range(0, len(members), args.batch):
            part = members[b:b + args.batch]
            draws = [noise_for(pipe, (args.seed, i, j), num_frames, height, width) for i, j in part]
            noise, renoise = torch.cat([d[0] for d in draws]), torch.cat([d[1] for d in draws])
            out = pipe([[s["prompt"] for s in streams[i]["segments"]] for i, _ in part], switch_frames=list(switches),
                       num_frames=num_frames, height=height, width=width, noise=noise, renoise=renoise)
            metas = [streams[i] for i, _ in part]
            scored = judge(out.videos.cpu(), [m["prompt"] for m in metas], metas)
            for row, key in enumerate(part):
                results[key] = {"reward": float(scored.scores[row]),
                                **{k: float(v[row]) for k, v in scored.components.items()}}
                if len(sheet_videos) < args.sheet_streams and key[1] == 0:
                    sheet_videos.append((key[0], out.videos[row].cpu()))
    seconds = time.time() - start

    def means(keys) -> dict:
        names = sorted({n for k in keys for n in results[k]})
        out = {}
        for n in names:
            vals = [results[k][n] for k in keys if n in results[k] and np.isfinite(results[k][n])]
            if vals:
                out[n] = round(float(np.mean(vals)), 4)
        return out

    report = {"model": args.model, "prompts": args.prompts, "streams": len(streams), "videos": len(results),
              "scored_by": judge.describe(), "overall": means(list(results)), "seconds": round(seconds, 1)}
    by_tag = defaultdict(list)
    for (i, j) in results:
        by_tag[streams[i].get("tag", "stream")].append((i, j))
    report["per_tag"] = {tag: {"n": len(keys), **means(keys)} for tag, keys in sorted(by_tag.items())}
    if args.sheet and sheet_videos:
        from PIL import Image

        images = []
        for i, video in sheet_videos:
            segs = streams[i]["segments"]
            images.append(segment_sheet(video, [s["prompt"] for s in segs], [int(s["start"]) for s in segs]))
        width_px = max(im.width for im in images)
        canvas = Image.new("RGB", (width_px, sum(im.height for im in images)), "white")
        y = 0
        for im in images:
            canvas.paste(im, (0, y))
            y += im.height
        Path(args.sheet).parent.mkdir(parents=True, exist_ok=True)
        canvas.save(args.sheet)
        report["sheet"] = args.sheet
    return report


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "assets" / "tiny-causal-wan-shapes"), help="streaming model dir")
    p.add_argument("--prompts", default=str(ROOT / "assets" / "prompts" / "streams_val.jsonl"))
    p.add_argument("--streams", type=int, default=0, help="the first N streams of the file (0: all)")
    p.add_argument("--samples", type=int, default=1, help="videos per stream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--sheet", default=None, help="write a labelled PNG of the first streams")
    p.add_argument("--sheet-streams", type=int, default=6)
    p.add_argument("--json-out", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for path in (args.json_out, args.sheet):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    report = evaluate(args)
    text = jsonio.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
