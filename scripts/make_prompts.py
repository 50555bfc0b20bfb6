"""Write the worlds' fixed prompt sets: assets/prompts/{shapes,motion}_{train,held_out}.jsonl, streams_*.jsonl.

    python scripts/make_prompts.py            # seed 0, a third of each tag held out
    python scripts/make_prompts.py --check    # verify the committed files match (exit 1 if not)

Every distinct GenEval prompt of the shapes world (240: 3 single_object, 6 two_object, 9 counting,
18 colors, 24 position, 180 color_attr) is split per tag into disjoint train / held-out sets
(flowgrpo.world.split_prompts: a seeded permutation whose train part still contains every class,
colour, count and relation of the tag). One GenEval metadata dict per line, GenEval's key order. The world has no
other prompts, so its validation and test sets are the held-out prompts under two noise streams.

The moving-shapes (video) prompts, 426 (72 motion, 120 two_object_motion, 54 counting, 18 colors, 144 speed,
18 static), are split the same way (flowgrpo.world.split_motion_prompts) into motion_{train,held_out}.jsonl.

The streams (long clips whose prompt switches 1-3 times) are 400 distinct prompt sequences of 49 frames drawn by
flowgrpo.world.split_stream_prompts, 300 train and 100 validation (no sequence in both), in streams_{train,val}.jsonl:
one stream metadata dict per line (num_frames, tag, segments with their start frames, the joined prompt).
streams_one_object_val.jsonl holds 100 more held-out one-object streams (flowgrpo.world.one_object_held_out, seed 1),
none of whose prompt sequences is in either file: the validation set of data=one_object_streams. The test sets,
streams_test.jsonl (seed 2, any objects) and streams_one_object_test.jsonl (seed 3, one object), hold 100 streams
each whose prompt sequences are in no file written before them.

The resume streams (one object moves, turns, pauses, and is told only to move "again":
flowgrpo.world.split_resume_prompts) are 500 distinct prompt sequences, 300 train, 100 validation and 100 test, in
resume_{train,val,test}.jsonl.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

from flowgrpo import jsonio
from flowgrpo.world import (MOTION_TAGS, TAGS, more_held_out_streams, one_object_held_out, split_motion_prompts,
                            split_prompts, split_resume_prompts, split_stream_prompts)

ROOT = Path(__file__).resolve().parents[1]


def _lines(rows: list[dict]) -> str:
    return "".join(jsonio.dumps(r) + "\n" for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-fraction", type=float, default=1 / 3)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "assets" / "prompts")
    parser.add_argument("--check", action="store_true", help="compare with the files on disk instead of writing")
    args = parser.parse_args()

    files = {}
    for world, tags, split in (("shapes", TAGS, split_prompts), ("motion", MOTION_TAGS, split_motion_prompts)):
        train, test = split(seed=args.seed, test_fraction=args.test_fraction)
        files |= {f"{world}_train.jsonl": _lines(train), f"{world}_held_out.jsonl": _lines(test)}
        counts = {name: collections.Counter(r["tag"] for r in rows) for name, rows in (("train", train), ("held_out", test))}
        print(world, jsonio.dumps({s: {t: c[t] for t in tags} | {"total": sum(c.values())} for s, c in counts.items()}))
    train, test = split_stream_prompts(seed=args.seed)
    files |= {"streams_train.jsonl": _lines(train), "streams_val.jsonl": _lines(test)}
    one_object = one_object_held_out(100, seed=args.seed + 1, exclude=train + test)
    files["streams_one_object_val.jsonl"] = _lines(one_object)
    final = more_held_out_streams(100, args.seed + 2, train + test + one_object)
    one_object_final = more_held_out_streams(100, args.seed + 3, train + test + one_object + final, objects=1)
    files |= {"streams_test.jsonl": _lines(final), "streams_one_object_test.jsonl": _lines(one_object_final)}
    counts = {name: collections.Counter(f"{r['tag']}/{len(r['segments']) - 1}_switches" for r in rows)
              for name, rows in (("train", train), ("val", test), ("one_object_val", one_object), ("test", final),
                                 ("one_object_test", one_object_final))}
    print("streams", jsonio.dumps({s: dict(sorted(c.items())) | {"total": sum(c.values())} for s, c in counts.items()}))
    resume = split_resume_prompts(seed=args.seed)
    files |= {f"resume_{part}.jsonl": _lines(rows) for part, rows in zip(("train", "val", "test"), resume)}
    print("resume", jsonio.dumps({part: len(rows) for part, rows in zip(("train", "val", "test"), resume)}))
    if args.check:
        stale = [n for n, text in files.items() if not (args.out_dir / n).exists() or (args.out_dir / n).read_text() != text]
        if stale:
            print(f"out of date: {', '.join(stale)}; run python scripts/make_prompts.py", file=sys.stderr)
            return 1
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out_dir / name).write_text(text)
        print(f"wrote {args.out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
