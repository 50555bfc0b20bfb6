#!/usr/bin/env python
r"""Does what a streaming model attends decide how it resumes? Resume streams with the first resumed blocks routed
three ways, on the same noise (JSON).

    python scripts/probe_resume_gate.py                                  # the embedded 4-step model, validation set
    python scripts/probe_resume_gate.py --model DIR --streams 100 --out gate.json

A resume stream (:mod:`flowgrpo.world.resume`) moves one way, then another (*last*), pauses, and is told only
"moving again": the right motion is *last*'s. Every stream is generated three times from the same noise (the draws of
``scripts/eval_streams.py``: stream ``i``, sample ``j`` from the generator seeded by ``(--seed, i, j)``), identical up
to the first resumed block; in the ``--blocks`` blocks from there (and their cache writes) the model attends

* ``own window``: its unrouted context (sink + the newest frames: the pause and the end of *last*);
* ``keeps last``: sink + the last ``n`` latent frames of *last* + the frame just before the block;
* ``older motion``: sink + the last ``n`` latent frames of the first segment (the other direction) + the frame just
  before the block,

``n`` = window − block − 1, so every arm attends as many frames as the unrouted context: the two routed arms are the
branches of a KVPO routing plan (``flowgrpo.algorithms.kvpo.routing``) forked at the first resumed block.
Each video is scored by ``long_video``; per arm the mean of ``resume/direction``, ``resume/adherence`` and the
scalar, and the paired differences (mean ± standard error over streams) of ``keeps last`` against ``older motion``
and against ``own window``. The world is one where the frames attended decide when ``keeps last`` beats ``older
motion`` by several standard errors at the base weights: then branches that route differently score differently.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from branch_spread import mean_se  # noqa: E402
from eval_streams import noise_for  # noqa: E402

from flowgrpo import jsonio  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("own window", "keeps last", "older motion")
BRANCH = {"own window": None, "keeps last": 0, "older motion": 1}  # the arms' branches of each stream's plan
METRICS = ("resume/direction", "resume/adherence", "reward")


def plan(meta: dict, wan, blocks: int):
    """KVPO's routing plan (:class:`~flowgrpo.algorithms.kvpo.routing.RoutingPlan`) of a resume stream with two
    branches: from its first resumed block, for ``blocks`` blocks, branch 0 attends the last latent frames of *last*,
    branch 1 those of the first segment (each with the sink and the frame just before the block)."""
    from flowgrpo.algorithms.kvpo.routing import RoutingPlan
    from flowgrpo.world import latent_segments

    seg = latent_segments(meta)
    bf, sink, window = wan.block_frames, wan.sink_frames, wan.window_frames
    if bf != 1:
        raise SystemExit(f"blocks of {bf} latent frames: the probe routes blocks of one latent frame")
    resumed = [k for k, s in enumerate(meta["segments"]) if s.get("resume")]
    if len(resumed) != 1 or resumed[0] != 3:
        raise SystemExit("the probe needs resume streams (flowgrpo.world.resume): four segments, the last resumed")
    start = seg.index(3)  # the first resumed latent frame
    n = window - bf - 1
    last = [f for f in range(sink, start) if seg[f] == 1][-n:]
    older = [f for f in range(sink, start) if seg[f] == 0][-n:]
    if len(last) < n or len(older) < n:
        raise SystemExit(f"a stream whose segments hold fewer than {n} latent frames: {meta['prompt']!r}")
    return RoutingPlan(fork_frame=start, blocks=blocks, block_frames=bf, sink_frames=sink, window_frames=window,
                       nearest_m=1, positions_per_branch=[last, older], pool_start=sink, pool_end=start - 1)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "assets" / "tiny-causal-wan-shapes-4step"), help="streaming model dir")
    p.add_argument("--prompts", default=str(ROOT / "assets" / "prompts" / "resume_val.jsonl"))
    p.add_argument("--streams", type=int, default=100, help="the first N streams of the file")
    p.add_argument("--samples", type=int, default=1, help="videos per stream and arm")
    p.add_argument("--blocks", type=int, default=2, help="blocks routed from the first resumed one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import rewards
    from flowgrpo.algorithms.kvpo.routing import stacked_route_fn
    from flowgrpo.models import StreamingWanPipeline

    t0 = time.perf_counter()
    streams = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][:args.streams]
    pipe = StreamingWanPipeline.from_pretrained(args.model)
    height, width = pipe.config.height or 64, pipe.config.width or 64
    judge = rewards.load("long_video")
    jobs = defaultdict(list)  # streams that switch at the same frames are generated together
    for i, meta in enumerate(streams):
        for j in range(args.samples):
            jobs[tuple(s["start"] for s in meta["segments"][1:])].append((i, j))
    scores: dict[str, dict[tuple[int, int], dict]] = {arm: {} for arm in ARMS}
    for switches, keys in jobs.items():
        for b in range(0, len(keys), args.batch):
            chunk = keys[b:b + args.batch]
            metas = [streams[i] for i, _ in chunk]
            T = int(metas[0]["num_frames"])
            draws = [noise_for(pipe, (args.seed, i, j), T, height, width) for i, j in chunk]
            noise, renoise = torch.cat([d[0] for d in draws]), torch.cat([d[1] for d in draws])
            plans = [plan(m, pipe.wan, args.blocks) for m in metas]
            for arm in ARMS:
                branch = BRANCH[arm]
                route = None if branch is None else stacked_route_fn(plans, [branch] * len(plans))
                with torch.no_grad(), pipe.wan.routed(route):
                    out = pipe([[s["prompt"] for s in m["segments"]] for m in metas], switch_frames=list(switches),
                               num_frames=T, height=height, width=width, noise=noise, renoise=renoise)
                result = judge(out.videos, metadata=metas)
                for r, key in enumerate(chunk):
                    scores[arm][key] = {"reward": float(result.scores[r])} | {
                        m: float(result.components[m][r]) for m in METRICS if m != "reward"}
            print(f"[gate] {sum(len(s) for s in scores.values()) // len(ARMS)}/{sum(map(len, jobs.values()))} "
                  f"videos per arm, {time.perf_counter() - t0:.0f} s", flush=True)
    keys = sorted(scores[ARMS[0]])
    report = {
        "model": args.model, "prompts": args.prompts, "streams": len(streams), "samples": args.samples,
        "blocks": args.blocks, "scored_by": judge.describe(),
        "arms": {arm: {m: mean_se([scores[arm][k][m] for k in keys]) for m in METRICS} for arm in ARMS},
        "keeps_last_minus_older_motion": {m: mean_se([scores["keeps last"][k][m] - scores["older motion"][k][m]
                                                      for k in keys]) for m in METRICS},
        "keeps_last_minus_own_window": {m: mean_se([scores["keeps last"][k][m] - scores["own window"][k][m]
                                                    for k in keys]) for m in METRICS},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    text = jsonio.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
