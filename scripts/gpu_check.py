"""Iteration time of every algorithm at realistic size against its floor, on a GPU (JSON out).

    python scripts/gpu_check.py             # SD3.5-Medium 512 px, Wan2.1-1.3B 480p×33, Self-Forcing 480p×81
    python scripts/gpu_check.py --models sd35_medium --algorithms flow_grpo,flash_grpo --iterations 2
    python scripts/gpu_check.py --models self_forcing_wan --algorithms stream_grpo,kvpo
    python scripts/gpu_check.py --tiny      # the same measurement on the tiny twins (CPU; tested)

Weights do not change the cost, so the published architectures run at random initialisation
(``model.pretrained=random-init:<arch>``, ``flowgrpo.models.random_init``). For each model and algorithm the
script runs the real trainer (``Trainer.step``), records every ``adapter.velocity`` call it makes (batch size;
with or without grad), and then replays exactly those calls alone — the same number of transformer forwards
(rollout, no grad) and forward+backwards (update) on the same shapes. ``iteration / floor`` is the overhead of
everything else: samplers, log-probs, VAE decode, rewards, optimizer, bookkeeping. Peak GPU memory per
algorithm comes from ``torch.cuda.max_memory_allocated``.

Each model has its own algorithms: the image and clip models (``sd35_medium``, ``wan21_1_3b``) those of
``scripts/bench_iteration.py``, the streaming model (``self_forcing_wan``: Self-Forcing's causal Wan2.1-1.3B, block
by block; ``--tiny``: the embedded ``causal_wan_shapes_4step``) the streaming ones, :data:`STREAM_ALGORITHMS`. A
streaming row has no floor (``floor_seconds`` null, ``floor_note`` says why): its transformer calls each attend a KV
cache whose length grows block by block, write finished blocks into it (``adapter.commit``) and train whole streams
in teacher-forced forwards, which replaying batch sizes alone would not reproduce. It reports the iteration time, the
peak memory, the plan and how many calls of each kind the iteration made.

Beside each measurement it prints the plan of the same configuration (``flowgrpo.planner``, fake tensors on the CPU:
``scripts/plan.py``): the planned peak against the measured one, and the planned FLOPs against the measured time (the
achieved TFLOP/s, the share of the card's peak that the plans' projected times assume). One run on the first GPU at
hand calibrates the planner. A row that runs out of GPU memory reports it (``error``, the peak reached, the plan)
and the next rows still run; the report is written and the script then exits non-zero, naming those rows.
"""

from __future__ import annotations

import argparse
import gc
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

#: the streaming algorithms (a streaming model trains with these alone), each with the algorithm and sampler of its
#: real settings (conf/experiment/stream_grpo_self_forcing.yaml, stream_awm_self_forcing.yaml, kvpo_longlive.yaml)
STREAM_ALGORITHMS = {
    "stream_grpo": ["algo=stream_grpo", "sampler=stream"],  # PPO-clip on 0.1 of a stream's re-noise transitions
    "stream_awm": ["algo=stream_awm", "sampler=stream"],  # one teacher-forced forward per stream, plus its KL forward
    # routed branches and the reference run of each group; local and global advantages from the segments reward's
    # per-segment and whole-stream scores, as experiment=kvpo_longlive's
    "kvpo": ["algo=kvpo", "sampler=stream", "algo.local_components=[score]", "algo.global_components=[score]"],
}
MODELS = {
    # name: (conf/model option, overrides at realistic size)
    "sd35_medium": ("sd35_medium", ["model.pretrained=random-init:sd35_medium", "trainer.prompts_per_iteration=2",
                                    "trainer.group_size=8", "trainer.train_batch_size=4", "trainer.gradient_accumulation_steps=4",
                                    "sampler.num_steps=10", "trainer.mixed_precision=bf16"]),
    "wan21_1_3b": ("wan21_1_3b", ["model.pretrained=random-init:wan21_1_3b", "trainer.prompts_per_iteration=1",
                                  "trainer.group_size=4", "trainer.train_batch_size=1", "trainer.gradient_accumulation_steps=4",
                                  "sampler.num_steps=10", "trainer.mixed_precision=bf16"]),
    # Self-Forcing's geometry (81 frames: 7 blocks of 3 latent frames, 4 steps each, every earlier frame attended) and
    # one GPU's share of its presets' batch, groups of 4: LoRA rank 256, gradient checkpointing, 2 streams per
    # micro-batch; experiment=stream_grpo_self_forcing rolls 2 streams out at a time and keeps the trained blocks'
    # caches in host memory, experiment=stream_awm_self_forcing rolls 2 out at a time and trains one per micro-batch.
    # Planned peaks (plan_of, on an H100): stream_grpo 27.8 GiB (rollout), kvpo 32.6 GiB (update), stream_awm 46.4 GiB
    # (update; with 2 streams per micro-batch and the whole group rolled out at once it planned at 74.7)
    "self_forcing_wan": ("self_forcing_wan", [
        "model.pretrained=random-init:wan21_1_3b", "model.stream.checkpoint=null", "model.stream.lora_checkpoint=null",
        "model.gradient_checkpointing=true", "model.lora.rank=256", "model.lora.alpha=256.0",
        "trainer.prompts_per_iteration=1", "trainer.group_size=4", "trainer.train_batch_size=2",
        "trainer.gradient_accumulation_steps=2", "trainer.mixed_precision=bf16",
        "stream_grpo:trainer.rollout_batch_size=2", "stream_grpo:trainer.offload_kept_context=true",
        # streaming AWM's teacher-forced forward (per stream 42 frames of 1,560 tokens, 21 clean and 21 noisy, under
        # a frame mask) of 2 streams leaves less than the planner's tenth of an 80 GB card: one stream per micro-batch
        # and 2 rolled out at a time, as its preset
        "stream_awm:trainer.train_batch_size=1", "stream_awm:trainer.gradient_accumulation_steps=4",
        "stream_awm:trainer.rollout_batch_size=2",
        # KVPO routes a block to older frames outside its attention window, and Self-Forcing attends every earlier
        # frame: this row streams with LongLive's window (conf/model/longlive_wan.yaml: sink 3 + window 9) and, as
        # experiment=kvpo_longlive, keeps older frames cached for the routes (its 33-frame buffer holds all 21 here:
        # the preset's null); it streams 2 branches at a time (the preset, at 585 frames: 1)
        "kvpo:model.stream.sink_frames=3", "kvpo:model.stream.window_frames=9", "kvpo:algo.branch_batch=2"]),
}
TINY = {
    "sd35_medium": ("tiny_sd3", ["trainer.prompts_per_iteration=2", "trainer.group_size=2", "trainer.train_batch_size=4",
                                 "trainer.gradient_accumulation_steps=1", "sampler.num_steps=4", "mix_grpo:algo.window.size=2"]),
    "wan21_1_3b": ("tiny_wan", ["trainer.prompts_per_iteration=1", "trainer.group_size=2", "trainer.train_batch_size=2",
                                "trainer.gradient_accumulation_steps=1", "sampler.num_steps=4", "mix_grpo:algo.window.size=2"]),
    # the embedded guidance-free streaming model (blocks of 1 latent frame, sink 1 + window 4, 4 steps) on streams of
    # 9 blocks instead of its 13 (the plan's time is most of a tiny row's): room for KVPO's routes after the sink and
    # window, inside the second segment. KVPO needs 2 routed branches and the reference run per group
    "self_forcing_wan": ("causal_wan_shapes_4step", [
        "model.num_frames=33", "trainer.prompts_per_iteration=1", "trainer.group_size=2", "trainer.train_batch_size=2",
        "trainer.gradient_accumulation_steps=1", "kvpo:trainer.group_size=3", "kvpo:trainer.train_batch_size=3"]),
}
#: each model's algorithms (``--algorithms`` defaults to its own list and takes no other name)
ALGORITHMS_OF = {"sd35_medium": ALGORITHMS, "wan21_1_3b": ALGORITHMS, "self_forcing_wan": STREAM_ALGORITHMS}
#: each model's reward, weight-free and cheap; a streaming model's scores each segment of a stream (what KVPO's local
#: advantage reads) with the same flicker score as the clip model's
REWARDS = {"sd35_medium": ["reward=jpeg_compressibility"], "wan21_1_3b": ["reward=video_flicker"],
           "self_forcing_wan": ["reward=segments", "reward.kwargs.reward=video_flicker"]}
#: why a streaming row reports no floor
STREAM_FLOOR_NOTE = ("no floor: a streaming model's transformer calls attend KV caches that grow block by block, "
                     "write each finished block into them (commit_calls) and train whole streams in teacher-forced "
                     "forwards, which a replay of batch sizes alone does not reproduce")


def streaming(model: str) -> bool:
    """Whether ``model`` (a key of :data:`MODELS`) is a streaming model, trained with :data:`STREAM_ALGORITHMS`."""
    return ALGORITHMS_OF[model] is STREAM_ALGORITHMS


def write_streams(path: Path, num_frames: int, count: int = 8) -> None:
    """``count`` prompt streams of ``num_frames`` frames in the format of ``assets/prompts/streams_*.jsonl``, each with
    one prompt switch half-way: what a streaming row trains on (``data.train_file``; the planner reads it too)."""
    from flowgrpo import jsonio

    switch = (num_frames - 1) // 2 + 1
    colours = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
    with open(path, "w") as f:
        for i in range(count):
            first, then = f"a {colours[i % 8]} kite rising", f"a {colours[i % 8]} kite diving"
            row = {"prompt": f"{first}; then {then}", "num_frames": num_frames,
                   "segments": [{"start": 0, "prompt": first}, {"start": switch, "prompt": then}]}
            f.write(jsonio.dumps(row) + "\n")


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

    def clear(self):
        self.calls.clear()

    def close(self):
        self.adapter.velocity = self.inner


class StreamCallCounter:
    """Counts a streaming adapter's transformer calls by kind: block velocities (``velocity``, with or without grad),
    cache writes (``commit``) and teacher-forced forwards over whole streams (``teacher_forced_velocity``)."""

    NAMES = ("velocity", "commit", "teacher_forced_velocity")

    def __init__(self, adapter):
        self.adapter = adapter
        self.inner = {name: getattr(adapter, name) for name in self.NAMES}
        self.calls: dict[str, list[bool]] = {name: [] for name in self.NAMES}
        for name in self.NAMES:
            setattr(adapter, name, self._counted(name))

    def _counted(self, name):
        inner, calls = self.inner[name], self.calls[name]

        def call(*args, **kwargs):
            calls.append(torch.is_grad_enabled())
            return inner(*args, **kwargs)

        return call

    def counts(self) -> dict[str, int]:
        v, t = self.calls["velocity"], self.calls["teacher_forced_velocity"]
        return {"velocity_calls_forward": v.count(False), "velocity_calls_forward_backward": v.count(True),
                "commit_calls": len(self.calls["commit"]),  # under no_grad whatever the caller's mode
                "teacher_forced_calls_forward": t.count(False), "teacher_forced_calls_forward_backward": t.count(True)}

    def clear(self):
        for calls in self.calls.values():
            calls.clear()

    def close(self):
        for name, inner in self.inner.items():
            setattr(self.adapter, name, inner)


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


def compose_row(model: str, algorithm: str, tiny: bool, extra: list[str], out_dir: Path):
    """The config of one row: the model at its size, its reward (and for a streaming model its prompt streams, written
    to ``out_dir``), the algorithm's recipe and ``extra``, each override scoped to the row's algorithm."""
    option, overrides = (TINY if tiny else MODELS)[model]
    recipe = ALGORITHMS_OF[model][algorithm]
    streams = out_dir / "streams.jsonl"
    data = ["data=text_prompts", "data.format=jsonl", f"data.train_file={streams}", "data.val_file=null"]
    cfg = compose([f"model={option}", *REWARDS[model], *(data if streaming(model) else []), "logger=none",
                   "trainer.iterations=1000", "trainer.eval_before=false", "trainer.eval_every=0",
                   "trainer.gallery_every=0", f"trainer.output_dir={out_dir}", *scoped(overrides, recipe), *recipe,
                   *scoped(extra, recipe)])
    if streaming(model) and cfg.data.train_file == str(streams):  # not replaced by --set data.train_file=...
        write_streams(streams, int(cfg.model.num_frames), count=max(8, int(cfg.trainer.prompts_per_iteration)))
    return cfg


def measure(cfg, out_dir: Path, stream: bool, iterations: int, warmup: int) -> tuple[float, dict, str]:
    """Build the trainer of ``cfg`` and time ``warmup + iterations`` iterations: the median time, the floor (or for a
    streaming model the calls by kind) and the algorithm's description."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(cfg, out_dir)
    rec = StreamCallCounter(trainer.adapter) if stream else VelocityRecorder(trainer.adapter)
    times, floors = [], []
    for i in range(warmup + iterations):
        rec.clear()
        _sync()
        t0 = time.perf_counter()
        trainer.step()
        _sync()
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
            if stream:
                counts = rec.counts()
                continue
            calls = list(rec.calls)
            guidance = trainer.model_kw["guidance"]
            rec.close()
            floors.append(replay_floor(trainer, calls, guidance))
            rec = VelocityRecorder(trainer.adapter)
    rec.close()
    it = statistics.median(times)
    if stream:
        floor = {"floor_seconds": None, "iteration_over_floor": None, "floor_note": STREAM_FLOOR_NOTE, **counts}
    else:
        forward = sum(1 for _, g in calls if not g)
        median_floor = statistics.median(floors)
        floor = {"floor_seconds": median_floor, "iteration_over_floor": it / median_floor,
                 "velocity_calls_forward": forward, "velocity_calls_forward_backward": len(calls) - forward}
    return it, floor, trainer.algorithm.describe()


def check(model: str, algorithm: str, iterations: int, warmup: int, tiny: bool, extra: list[str],
          with_plan: bool = True) -> dict:
    """One row: the plan of the configuration, then its measured iterations. A row that runs out of GPU memory is
    a result too (the configuration does not fit the card): it reports ``error``, the peak reached and the plan, and
    the rows after it still run."""
    scratch = tempfile.TemporaryDirectory(prefix="gpu-check-")  # deleted with this object: nothing here is kept
    out_dir = Path(scratch.name)
    cfg = compose_row(model, algorithm, tiny, extra, out_dir)
    planned = plan_of(cfg) if with_plan else {}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        it, floor, described = measure(cfg, out_dir, streaming(model), iterations, warmup)
    except torch.OutOfMemoryError as err:
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        lines = str(err).strip().splitlines()
        message = lines[0] if lines else type(err).__name__
        print(f"{model} {algorithm}: out of memory ({message}); planned "
              f"{planned.get('plan_peak_gib', float('nan')):.2f} GiB", file=sys.stderr)
        return {"error": f"out of memory: {message}", "seconds_per_iteration": None, "peak_memory_gib": peak,
                **planned}
    row = {
        "seconds_per_iteration": it,
        **floor,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "algorithm": described,
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


def chosen(models: str, algorithms: str | None) -> dict[str, list[str]]:
    """``{model: [algorithm, ...]}`` of ``--models`` and ``--algorithms`` (default: each model's own list), every
    name checked before anything runs."""
    names = models.split(",")
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    rows = {}
    for model in names:
        own = list(ALGORITHMS_OF[model])
        asked = own if algorithms is None else algorithms.split(",")
        wrong = [a for a in asked if a not in own]
        if wrong:
            kind = "streaming model" if streaming(model) else "model"
            raise SystemExit(f"--algorithms: {', '.join(wrong)} cannot train {model} (a {kind}); its algorithms are "
                             f"{', '.join(own)}")
        rows[model] = asked
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--algorithms", default=None,
                        help="comma-separated subset of every chosen model's own algorithms (default: all of them; "
                             f"image and clip models: {', '.join(ALGORITHMS)}; streaming: "
                             f"{', '.join(STREAM_ALGORITHMS)})")
    parser.add_argument("--iterations", type=int, default=2, help="timed iterations (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first (kernels, allocator)")
    parser.add_argument("--tiny", action="store_true", help="the tiny twins instead (CPU-sized)")
    parser.add_argument("--set", action="append", default=[], help="extra Hydra override (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--no-plan", action="store_true", help="skip the planner's prediction beside each measurement")
    args = parser.parse_args(argv)
    rows_of = chosen(args.models, args.algorithms)
    if not torch.cuda.is_available() and not args.tiny:
        print("no GPU: measuring the tiny twins instead (--tiny)", file=sys.stderr)
        args.tiny = True
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "tiny": args.tiny,
              "models": {}}
    for model, algorithms in rows_of.items():
        rows = {a: check(model, a, args.iterations, args.warmup, args.tiny, args.set, not args.no_plan)
                for a in algorithms}
        # each family's plain GRPO, when it ran
        base = next((a for a in ("flow_grpo", "stream_grpo") if a in rows and "error" not in rows[a]), None)
        if base is not None:
            for row in rows.values():
                if "error" not in row:
                    row[f"ratio_to_{base}"] = row["seconds_per_iteration"] / rows[base]["seconds_per_iteration"]
        report["models"][model] = rows
    failed = [f"{m} {a}" for m, rows in report["models"].items() for a, row in rows.items() if "error" in row]
    report = emit(report, args.out)
    if failed:  # the report is written; the run still says it did not measure everything
        raise SystemExit(f"out of GPU memory: {', '.join(failed)} (their rows say how far they got, beside the plan)")
    return report


if __name__ == "__main__":
    main()
