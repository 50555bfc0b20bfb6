"""Iteration time of every algorithm at realistic size against its floor, on a GPU (JSON out).

    python scripts/gpu_check.py                         # SD3.5-Medium 512 px and Wan2.1-1.3B 480p×33, random init
    python scripts/gpu_check.py --models sd35_medium --algorithms flow_grpo,flash_grpo --iterations 2
    python scripts/gpu_check.py --tiny                  # the same measurement on the tiny twins (CPU; tested)

Weights do not change the cost, so the published architectures run at random initialisation
(``model.pretrained=random-init:<arch>``, ``flowgrpo.models.random_init``). For each model and algorithm the
script runs the real trainer (``Trainer.step``), records every ``adapter.velocity`` call it makes (batch size;
with or without grad), and then replays exactly those calls alone — the same number of transformer forwards
(rollout, no grad) and forward+backwards (update) on the same shapes. ``iteration / floor`` is the overhead of
everything else: samplers, log-probs, VAE decode, rewards, optimizer, bookkeeping. Peak GPU memory per
algorithm comes from ``torch.cuda.max_memory_allocated``.

Beside each measurement it prints the plan of the same configuration (``flowgrpo.planner``, fake tensors on the CPU:
``scripts/plan.py``): the planned peak against the measured one, and the planned FLOPs against the measured time (the
achieved TFLOP/s, the share of the card's peak that the plans' projected times assume). One run on the first GPU at
hand calibrates the planner.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from bench_iteration import ALGORITHMS, compose, emit, scoped  # noqa: E402  (same algorithm presets, same composition)

MODELS = {
    # name: (conf/model option, overrides at realistic size)
    "sd35_medium": ("sd35_medium", ["model.pretrained=random-init:sd35_medium", "trainer.prompts_per_iteration=2",
                                    "trainer.group_size=8", "trainer.train_batch_size=4", "trainer.gradient_accumulation_steps=4",
                                    "sampler.num_steps=10", "trainer.mixed_precision=bf16"]),
    "wan21_1_3b": ("wan21_1_3b", ["model.pretrained=random-init:wan21_1_3b", "trainer.prompts_per_iteration=1",
                                  "trainer.group_size=4", "trainer.train_batch_size=1", "trainer.gradient_accumulation_steps=4",
                                  "sampler.num_steps=10", "trainer.mixed_precision=bf16"]),
}
TINY = {
    "sd35_medium": ("tiny_sd3", ["trainer.prompts_per_iteration=2", "trainer.group_size=2", "trainer.train_batch_size=4",
                                 "trainer.gradient_accumulation_steps=1", "sampler.num_steps=4", "mix_grpo:algo.window.size=2"]),
    "wan21_1_3b": ("tiny_wan", ["trainer.prompts_per_iteration=1", "trainer.group_size=2", "trainer.train_batch_size=2",
                                "trainer.gradient_accumulation_steps=1", "sampler.num_steps=4", "mix_grpo:algo.window.size=2"]),
}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class VelocityRecorder:
    """Wraps ``adapter.velocity`` to record each call's batch size, sigma kind and whether grad was on."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.inner = adapter.velocity
        self.calls: list[tuple[int, bool]] = []
        adapter.velocity = self

    def __call__(self, x, sigma, cond, **kw):
        self.calls.append((int(x.shape[0]), torch.is_grad_enabled()))
        self.kwargs = kw
        return self.inner(x, sigma, cond, **kw)

    def close(self):
        self.adapter.velocity = self.inner


def replay_floor(trainer, calls: list[tuple[int, bool]], guidance: dict) -> float:
    """Time the recorded velocity calls alone: same batch sizes, same grad mode, same conditioning shapes."""
    adapter = trainer.adapter
    size = trainer.model_kw["size"]
    prompts = trainer.train_set.prompts[:1]
    cond1 = trainer._encode(prompts)
    cache = {}
    _sync()
    t0 = time.perf_counter()
    for batch, grad in calls:
        if batch not in cache:
            cache[batch] = (adapter.prepare_noise(batch, generator=torch.Generator(trainer.device).manual_seed(0), **size),
                            cond1.repeat_interleave(batch))
        x, cond = cache[batch]
        sigma = torch.full((batch,), 0.5, device=x.device)
        if grad:
            with trainer.acc.autocast():
                v = adapter.velocity(x, sigma, cond, **guidance)
            v.float().square().mean().backward()
        else:
            with torch.no_grad(), trainer.acc.autocast():
                adapter.velocity(x, sigma, cond, **guidance)
    _sync()
    elapsed = time.perf_counter() - t0
    trainer.optimizer.zero_grad(set_to_none=True)
    return elapsed


def plan_of(cfg) -> dict:
    """The planner's rollout and update phases of ``cfg`` on one process (CPU, fake tensors), as measured here."""
    from flowgrpo.planner import GPUS, plan_run

    name = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else ""
    gpu = next((k for k in GPUS if k in name), "h100")
    plan = plan_run(cfg, num_processes=1, gpu=gpu, phases=("rollout", "update"))
    return {"plan_peak_gib": plan.peak_bytes / 2**30, "plan_peak_phase": plan.peak_phase,
            "plan_phases_gib": {p.name: round(p.peak_bytes / 2**30, 3) for p in plan.phases},
            "plan_tflop_per_iteration": plan.flops_per_iteration / 1e12, "plan_card_tflops": plan.peak_flops / 1e12}


def check(model: str, algorithm: str, iterations: int, warmup: int, tiny: bool, extra: list[str],
          with_plan: bool = True) -> dict:
    from flowgrpo.trainer import Trainer

    option, overrides = (TINY if tiny else MODELS)[model]
    scratch = tempfile.TemporaryDirectory(prefix="gpu-check-")  # deleted with this object: nothing here is kept
    out_dir = Path(scratch.name)
    reward = "video_flicker" if model.startswith("wan") else "jpeg_compressibility"  # weight-free, cheap
    cfg = compose([f"model={option}", f"reward={reward}", "logger=none", "trainer.iterations=1000",
                   "trainer.eval_before=false", "trainer.eval_every=0", "trainer.gallery_every=0",
                   f"trainer.output_dir={out_dir}", *scoped(overrides, ALGORITHMS[algorithm]), *ALGORITHMS[algorithm],
                   *scoped(extra, ALGORITHMS[algorithm])])
    planned = plan_of(cfg) if with_plan else {}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg, out_dir)
    rec = VelocityRecorder(trainer.adapter)
    times, floors = [], []
    for i in range(warmup + iterations):
        rec.calls.clear()
        _sync()
        t0 = time.perf_counter()
        trainer.step()
        _sync()
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            calls = list(rec.calls)
            times.append(elapsed)
            guidance = trainer.model_kw["guidance"]
            rec.close()
            floors.append(replay_floor(trainer, calls, guidance))
            rec = VelocityRecorder(trainer.adapter)
    rec.close()
    it, floor = statistics.median(times), statistics.median(floors)
    forward = sum(1 for _, g in calls if not g)
    row = {
        "seconds_per_iteration": it,
        "floor_seconds": floor,
        "iteration_over_floor": it / floor,
        "velocity_calls_forward": forward,
        "velocity_calls_forward_backward": len(calls) - forward,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "algorithm": trainer.algorithm.describe(),
        **planned,
    }
    if planned:
        # the planner counts one update micro-batch step per trained step of every micro-batch: the same iteration
        achieved = planned["plan_tflop_per_iteration"] / it
        row["achieved_tflops"] = achieved
        row["achieved_share_of_peak"] = achieved / planned["plan_card_tflops"]
        if row["peak_memory_gib"] is not None:
            row["measured_over_plan"] = row["peak_memory_gib"] / planned["plan_peak_gib"]
        print(f"{model} {algorithm}: peak {row['peak_memory_gib'] if row['peak_memory_gib'] is not None else float('nan'):.2f} "
              f"GiB measured, {planned['plan_peak_gib']:.2f} GiB planned ({planned['plan_peak_phase']}); "
              f"{it:.2f} s per iteration, {planned['plan_tflop_per_iteration']:.1f} TFLOP planned: "
              f"{achieved:.1f} TFLOP/s achieved ({row['achieved_share_of_peak']:.1%} of the card's peak)", file=sys.stderr)
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated subset")
    parser.add_argument("--iterations", type=int, default=2, help="timed iterations (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first (kernels, allocator)")
    parser.add_argument("--tiny", action="store_true", help="the tiny twins instead (CPU-sized)")
    parser.add_argument("--set", action="append", default=[], help="extra Hydra override (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--no-plan", action="store_true", help="skip the planner's prediction beside each measurement")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.tiny:
        print("no GPU: measuring the tiny twins instead (--tiny)", file=sys.stderr)
        args.tiny = True
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "tiny": args.tiny,
              "models": {}}
    for model in args.models.split(","):
        rows = {a: check(model, a, args.iterations, args.warmup, args.tiny, args.set, not args.no_plan)
                for a in args.algorithms.split(",")}
        if "flow_grpo" in rows:
            base = rows["flow_grpo"]["seconds_per_iteration"]
            for row in rows.values():
                row["ratio_to_flow_grpo"] = row["seconds_per_iteration"] / base
        report["models"][model] = rows
    return emit(report, args.out)


if __name__ == "__main__":
    main()
