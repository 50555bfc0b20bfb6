"""Plan a run's per-GPU memory, FLOPs and time before paying for it: the real preset, every model at its real
architecture under fake tensors (no weights, no GPU), one rollout, one update micro-batch and one held-out batch
through the trainer's own code (:mod:`flowgrpo.planner` says what is modelled and how).

    python scripts/plan.py experiment=flow_grpo_wan21_1_3b                 # the same overrides as train.py
    python scripts/plan.py experiment=flow_grpo_wan22_5b --gpus 8 --gpu h100 --mfu 0.4 --out plan.json
    python scripts/plan.py experiment=flow_grpo_sd35m_geneval model=sd35_large --launcher fsdp
    python scripts/plan.py experiment=kvpo_longlive --switch-frames 153,297,441   # streams switching prompt there
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowgrpo import jsonio  # noqa: E402  (strict JSON: NaN / inf as null)


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def main(argv: list[str] | None = None) -> dict:
    from flowgrpo.planner import GPUS, plan_run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    parser.add_argument("--gpus", type=int, default=8, help="processes (GPUs) the batch is split over (the presets: 8)")
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="the card checked against")
    parser.add_argument("--launcher", default=None, choices=["ddp", "fsdp", "single"],
                        help="ddp (default with several GPUs), or fsdp (sharding applied arithmetically)")
    parser.add_argument("--mfu", type=float, default=0.4, help="share of the card's peak FLOP/s the time assumes")
    parser.add_argument("--phases", default="rollout,update,eval", help="comma-separated phases to run")
    parser.add_argument("--switch-frames", default=None,
                        help="a streaming model's prompt switches (pixel frames, comma-separated) in the streams it "
                             "plans; default: the first streams of data.train_file, else one segment")
    parser.add_argument("--out", default=None, help="write the plan as JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = compose(["logger=none", *args.overrides])
    label = " ".join(args.overrides) or "(defaults)"
    switches = None if args.switch_frames is None else tuple(int(f) for f in args.switch_frames.split(",") if f)
    plan = plan_run(cfg, num_processes=args.gpus, gpu=args.gpu, launcher=args.launcher, mfu=args.mfu,
                    phases=tuple(args.phases.split(",")), label=label, switch_frames=switches)
    print(plan.table())
    result = plan.to_dict()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(jsonio.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
