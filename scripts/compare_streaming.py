#!/usr/bin/env python
r"""KVPO against streaming GRPO on the embedded streaming model, at the presets' wall-clock budget, over seeds: JSON
+ PNG + a markdown table (``scripts/compare_presets.py`` with the streaming presets and long-video metrics).

    python scripts/compare_streaming.py                                  # both presets, seeds 0,1,2
    python scripts/compare_streaming.py --seeds 0 --arms kvpo_shapes     # one run
    python scripts/compare_streaming.py --out docs/results/streaming_rl  # where the JSON / PNG / table go

The held-out long-video reward is evaluated at iterations 0, 10 and 20 on the first 48 held-out prompt sequences,
one fixed-seed video each, the same videos for every arm and seed. Reported per arm: the reward, its per-segment
adherence (before any switch, after one, two), switch recovery, direction and identity at the last evaluation, the
change from the base model (iteration 0, the same for every run), and the wall clock of a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import compare_presets  # noqa: E402

METRICS = ["eval/reward", "eval/adherence", "eval/segment0/adherence", "eval/segment1/adherence",
           "eval/segment2/adherence", "eval/recovery", "eval/direction", "eval/identity"]
DEFAULTS = {
    "arms": "stream_grpo_shapes,kvpo_shapes",
    "runs": str(REPO / "outputs" / "compare_streaming"),
    "out": str(REPO / "outputs" / "compare_streaming" / "compare_streaming"),
    "metrics": ",".join(METRICS),
    "columns": "eval/reward=reward;eval/segment0/adherence=adherence, 1st segment;"
               "eval/segment1/adherence=after 1st switch;eval/recovery=recovery",
    "plot": "eval/reward,eval/segment1/adherence",
}


def main(argv=None) -> dict:
    return compare_presets.main(argv, description=__doc__.split("\n\n")[0], defaults=DEFAULTS)


if __name__ == "__main__":
    main()
