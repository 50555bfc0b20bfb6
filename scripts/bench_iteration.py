"""Iteration cost of every algorithm on one model and batch, side by side, as JSON.

    python scripts/bench_iteration.py                                  # the embedded shapes pipeline, GenEval, CPU
    python scripts/bench_iteration.py --model tiny_sd3 --reward jpeg_compressibility --iterations 5 --out bench.json
    python scripts/bench_iteration.py --set trainer.group_size=16 --set model.torch_dtype=bfloat16   # any override

For each algorithm it runs warm-up + N iterations of the real trainer (``Trainer.step``) and reports the median
wall time per iteration, the time per phase, rollout NFE (sample-steps of the velocity field), transformer
forward calls (rollout) and forward+backward calls (update), the time in transformer forwards, backward passes,
VAE decodes and the reward, the share of the iteration outside transformer calls and rewards (with and without
the decode), and ``ratios`` of each algorithm's iteration time to Flow-GRPO's. It also times
a plain ``pipe(...)`` call at the same NFE and batch as a full-ODE rollout of ours (``rollout / pipeline``).
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
sys.path.insert(0, str(REPO))

from flowgrpo import jsonio  # noqa: E402  (strict JSON: NaN / inf as null)

ALGORITHMS = {
    # Flow-GRPO as the papers run it, every SDE step trained: the ratios' denominator (the embedded world's tuned
    # recipe, experiment=flow_grpo_shapes, trains the first 3 of 10)
    "flow_grpo": ["algo=grpo", "sampler=sde", "algo.timestep_fraction=1"],
    "dance_grpo": ["algo=grpo", "sampler=dance", "algo.timestep_fraction=0.6"],
    "mix_grpo": ["algo=mix_grpo", "sampler=mix_sde"],
    "mix_grpo_flash": ["algo=mix_grpo", "sampler=mix_sde_flash", "algo.compress_ratio=0.4"],
    "flash_grpo": ["algo=flash_grpo", "sampler=mix_sde"],
    # experiment=flash_grpo_fast's rollout: the ODE prefix before k_p once per group, a compressed DPM-Solver++ tail
    "flash_grpo_fast": ["algo=flash_grpo", "sampler=mix_sde", "sampler.solver=dpm++2m", "algo.shared_noise=true",
                        "algo.compress_ratio=0.4"],
    "diffusion_nft": ["algo=diffusion_nft"],  # ODE rollouts; 9 of 10 noise levels trained per sample
    # Flow-GRPO's rollout and trained steps with GRPO-Guard's update (every step trained, as the flow_grpo row)
    "grpo_guard": ["algo=grpo_guard", "sampler=sde", "algo.timestep_fraction=1"],
    "awm": ["algo=awm"],  # ODE rollouts; 6 stratified noise levels trained per sample
    # DanceGRPO's rollout and steps with pairwise win-rate advantages and the normalised ratio
    "pref_grpo": ["algo=pref_grpo", "sampler=dance"],
    "dgpo": ["algo=dgpo"],  # ODE rollouts; 4 of the first 5 noise levels, whole groups per micro-batch
    # the default run with SLAS's advantages (experiment=slas_shapes) and with CGPO's curriculum drawing its prompts
    # (experiment=cgpo_shapes): neither changes the rollout or the update, so both should cost MixGRPO's iteration
    "slas": ["algo=mix_grpo", "sampler=mix_sde", "algo.slas_gamma=0.5"],
    "cgpo": ["algo=mix_grpo", "sampler=mix_sde", "data.sampling=cgpo"],
    # Flow-OPD at its defaults (9 of 10 SDE steps trained): Flow-GRPO's update plus one teacher and one regulariser
    # forward per trained step. It distils teacher runs; for the timing the row makes two untrained ones (checkpoints
    # of the model at iteration 0), which cost what trained ones cost.
    "flow_opd": ["algo=flow_opd", "sampler=sde"],
    # MixGRPO with its window frozen at the last position (start = T − w, set in bench_algorithm): the shared-noise
    # ODE prefix is longest there, so this row shows what computing it once per prompt saves
    "mix_grpo_late": ["algo=mix_grpo", "sampler=mix_sde", "algo.window.schedule=frozen"],
}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class CallTimer:
    """Counts and times the forward calls of a module (wall time between pre- and post-hook, synchronised)."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        self.samples = 0
        self.seconds = 0.0
        self._t0 = 0.0
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, module, args, kwargs=None):
        _sync()
        self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        _sync()
        self.seconds += time.perf_counter() - self._t0
        self.calls += 1
        x = args[0] if args else None
        self.samples += int(x.shape[0]) if isinstance(x, torch.Tensor) else 0

    def reset(self):
        self.calls, self.samples, self.seconds = 0, 0, 0.0

    def close(self):
        for h in self._handles:
            h.remove()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def pool_results(fn, jobs: list, processes: int):
    """Yield ``fn(job)`` for every job as it finishes, in ``processes`` spawned workers (in this process when 1).

    Unlike a bare ``ProcessPoolExecutor``, the workers do not outlive an error, Ctrl-C or a SIGTERM of this process:
    they are terminated on the way out (orphaned workers would keep training and skew every timing taken after)."""
    if processes <= 1:
        for job in jobs:
            yield fn(job)
        return
    import multiprocessing
    import signal
    from concurrent.futures import ProcessPoolExecutor, as_completed

    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
    finished = False
    try:
        for future in as_completed([pool.submit(fn, job) for job in jobs]):
            yield future.result()
        finished = True
    finally:
        if finished:  # idle workers exit on their own (terminating them leaks their semaphores)
            pool.shutdown(wait=True)
        else:
            workers = list((pool._processes or {}).values())  # private, but the executor has no terminate()
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in workers:
                if worker.is_alive():
                    worker.terminate()
        signal.signal(signal.SIGTERM, previous)


def emit(report: dict, out: Path | None) -> dict:
    """Print ``report`` as indented strict JSON (NaN / inf as ``null``; and write it to ``out`` when given); returns it."""
    text = jsonio.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).write_text(text)
    return report


def scoped(overrides: list[str], recipe: list[str]) -> list[str]:
    """The overrides that apply to a row whose own overrides are ``recipe`` (e.g. ``ALGORITHMS[name]``):
    ``key=value`` applies to every row, ``NAME:key=value`` only to rows with ``algo=NAME`` in their recipe
    (``mix_grpo:algo.window.size=2``: keys of one algorithm's schema do not exist in another's)."""
    algo = next((o.split("=", 1)[1] for o in recipe if o.startswith("algo=")), None)
    out = []
    for o in overrides:
        head, sep, rest = o.partition(":")
        if sep and "=" not in head:
            if head == algo:
                out.append(rest)
        else:
            out.append(o)
    return out


#: on an embedded model every row samples the model's own grid, whatever its sampler option states (sampler=mix_sde:
#: 25): the CPU rows compare the algorithms at the step count of that world, as its experiment presets do
MODEL_GRID = {"sampler.num_steps": "${model.num_steps}", "sampler.eval_num_steps": "${model.eval_num_steps}"}


def compose(overrides: list[str]):
    """``python train.py``'s config with ``overrides``; on an embedded model (``model.pretrained`` under assets/) with
    :data:`MODEL_GRID` too, unless the overrides set the steps themselves (composed once: which model it is is only
    known after composing, and the grid is then set as those overrides would set it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    import flowgrpo.config  # noqa: F401

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = hydra_compose("train", overrides=overrides)
    steps = any(o.startswith(tuple(f"{key}=" for key in MODEL_GRID)) for o in overrides)
    if str(cfg.model.pretrained).startswith("assets/") and not steps:
        for key, value in MODEL_GRID.items():
            OmegaConf.update(cfg, key, value)
    return cfg


def scratch_trainer(overrides: list[str], prefix: str):
    """A ``Trainer`` of ``python train.py``'s config with ``overrides`` (no logger, no evaluation before training) in a
    temporary run directory; returns it with that directory's handle, which deletes the directory when collected, so
    keep it as long as the trainer. Nothing the trainer writes is kept."""
    from flowgrpo.trainer import Trainer

    scratch = tempfile.TemporaryDirectory(prefix=prefix)
    out_dir = Path(scratch.name)
    cfg = compose(["logger=none", f"trainer.output_dir={out_dir}", "trainer.eval_before=false", *overrides])
    return Trainer(cfg, out_dir), scratch


#: a timed run logs, evaluates and draws nothing
QUIET = ["logger=none", "trainer.eval_before=false", "trainer.eval_every=0", "trainer.gallery_every=0"]


def untrained_teachers(overrides: list[str], out_dir: Path, names=("a", "b")) -> list[str]:
    """``+algo.teachers.NAME=DIR`` for Flow-OPD's row: every name points at one checkpoint of the model at iteration 0
    (the same model set-up as the row, so the student loads it), for timing a distillation without training teachers
    first. Each name is still its own teacher to the algorithm (its own copy of the weights, its own forwards)."""
    from flowgrpo.trainer import Trainer

    recipe = ["algo=grpo", "sampler=sde"]
    run = out_dir / "teacher"
    Trainer(compose([*scoped(overrides, recipe), *recipe, f"trainer.output_dir={run}", *QUIET]), run).save_checkpoint()
    return [f"+algo.teachers.{name}={run}" for name in names]


def bench_algorithm(name: str, overrides: list[str], iterations: int, warmup: int, out_dir: Path) -> dict:
    from flowgrpo.trainer import Trainer

    teachers = untrained_teachers(overrides, out_dir / name) if "algo=flow_opd" in ALGORITHMS[name] else []
    cfg = compose([*scoped(overrides, ALGORITHMS[name]), *ALGORITHMS[name], *teachers,
                   f"trainer.output_dir={out_dir / name}", *QUIET])
    if name == "mix_grpo_late":
        from flowgrpo.algorithms.mix_grpo import default_window_size

        size = cfg.algo.window.size or default_window_size(cfg.sampler.num_steps)
        cfg.algo.window.start = cfg.sampler.num_steps - size
    trainer = Trainer(cfg, out_dir / name)
    timer = CallTimer(trainer.unwrapped)
    reward_time = [0.0]
    reward = trainer.reward

    def timed_reward(*a, **k):
        t0 = time.perf_counter()
        try:
            return reward(*a, **k)
        finally:
            reward_time[0] += time.perf_counter() - t0

    trainer.reward = timed_reward
    # backward passes of the update (the transformer's, almost entirely) and VAE decodes, timed separately
    extra = {"backward": 0.0, "decode": 0.0}

    def timing(fn, key):
        def wrapped(*a, **k):
            _sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                _sync()
                extra[key] += time.perf_counter() - t0
        return wrapped

    trainer.acc.backward = timing(trainer.acc.backward, "backward")
    trainer.adapter.decode = timing(trainer.adapter.decode, "decode")
    rows = []
    for i in range(warmup + iterations):
        timer.reset()
        reward_time[0] = 0.0
        extra.update(backward=0.0, decode=0.0)
        _sync()
        scalars = trainer.step()
        if i < warmup:
            continue
        rows.append({
            "iteration": scalars["time/iteration"],
            **{k.split("/", 1)[1]: v for k, v in scalars.items() if k.startswith("time/") and k != "time/iteration"},
            "nfe": scalars["nfe/rollout"],
            "transformer_calls": timer.calls,
            "transformer_seconds": timer.seconds,
            "reward_seconds": reward_time[0],
            "backward_seconds": extra["backward"],
            "decode_seconds": extra["decode"],
        })
        counted = timer.seconds + extra["backward"] + reward_time[0]
        rows[-1]["outside"] = 1 - counted / scalars["time/iteration"]
        rows[-1]["overhead"] = 1 - (counted + extra["decode"]) / scalars["time/iteration"]
    timer.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    trained = trainer.batch.rollouts_per_process * trainer.batch.trained_steps * cfg.trainer.inner_epochs
    return {
        "seconds_per_iteration": med["iteration"],
        "phases": {k: med[k] for k in ("plan", "rollout", "score", "advantage", "update")},
        "rollout_nfe": med["nfe"],
        "trained_transitions": trained,
        "transformer_calls": med["transformer_calls"],
        "transformer_seconds": med["transformer_seconds"],
        "reward_seconds": med["reward_seconds"],
        "backward_seconds": med["backward_seconds"],
        "decode_seconds": med["decode_seconds"],
        # share of the iteration outside transformer forwards, backward passes and the reward (VAE decode counts
        # as outside); and the same without the decode: our own code's overhead. Median of the per-iteration
        # shares, not a ratio of medians taken from different iterations.
        "outside_transformer_and_reward": med["outside"],
        "overhead_excluding_decode": med["overhead"],
        "algorithm": trainer.algorithm.describe(),
        # NFE saved by computing the shared-noise prefix once per prompt instead of once per sample
        "prefix_reuse_nfe_saving": 1 - med["nfe"] / (trainer.batch.rollouts_per_process * cfg.sampler.num_steps),
    }


def bench_pipeline(overrides: list[str], repeats: int, out_dir: Path) -> dict:
    """Plain ``pipe(...)`` vs our full-ODE rollout through the adapter at the same NFE and batch."""
    from flowgrpo.trainer import Trainer

    cfg = compose([*scoped(overrides, ["algo=grpo"]), "algo=grpo", "sampler=sde", "logger=none",
                   f"trainer.output_dir={out_dir / 'pipeline'}"])
    trainer = Trainer(cfg, cfg.trainer.output_dir)
    pipe, size = trainer.adapter.pipe, trainer.model_kw["size"]
    batch = trainer.batch.rollout_batch_per_process
    prompts = [trainer.train_set.prompts[i % len(trainer.train_set)] for i in range(batch)]
    steps = cfg.sampler.num_steps
    guidance = cfg.model.guidance_scale
    call_kwargs = {k: v for k, v in size.items() if v is not None}
    # the same text sequence as our rollout (e.g. the embedded model runs with 1 zero T5 token, not the 256 default)
    import inspect

    msl = trainer.model_kw["max_sequence_length"]
    if msl is not None and "max_sequence_length" in inspect.signature(pipe.__call__).parameters:
        call_kwargs["max_sequence_length"] = msl

    def run_pipe():
        with torch.no_grad():
            pipe(prompts, num_inference_steps=steps, guidance_scale=guidance, output_type="latent",
                 generator=torch.Generator(trainer.device).manual_seed(0), **call_kwargs)

    def run_ours():  # the trainer's rollout engine (samplers.ragged_rollout), every row on the pipeline's grid
        from samplers import ragged_rollout

        with torch.no_grad():
            cond = trainer._encode(prompts)
            noise = trainer.adapter.prepare_noise(batch, generator=torch.Generator(trainer.device).manual_seed(0), **size)
            sigmas, velocity = trainer.sampler.sigmas, trainer.rollout_engine.model.velocity_fn(None)
            ragged_rollout(lambda x, sigma, rows: velocity(x, sigma, cond[rows.cpu()]), noise, [sigmas] * batch,
                           [torch.zeros(steps, dtype=torch.bool)] * batch)

    runs = {"pipeline": run_pipe, "rollout": run_ours}
    samples = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(repeats):  # alternate the two, so that drifts in machine speed hit both alike
        for name, fn in runs.items():
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            samples[name].append(time.perf_counter() - t0)
    times = {name: statistics.median(v) for name, v in samples.items()}
    return {"batch": batch, "nfe": steps, "pipeline_seconds": times["pipeline"], "rollout_seconds": times["rollout"],
            "rollout_over_pipeline": times["rollout"] / times["pipeline"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sd3_shapes", help="conf/model option (default: the embedded pipeline)")
    parser.add_argument("--reward", default="geneval", help="conf/reward option")
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations per algorithm (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated subset")
    parser.add_argument("--set", action="append", default=[],
                        help="extra Hydra override (repeatable); ALGO:key=value applies to rows of algo=ALGO only")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    overrides = [f"model={args.model}", f"reward={args.reward}", "trainer.iterations=1000", *args.set]
    with tempfile.TemporaryDirectory(prefix="bench-iteration-") as scratch:  # the runs' checkpoints are not kept
        out_dir = Path(scratch)
        results = {}
        for name in args.algorithms.split(","):
            results[name] = bench_algorithm(name, overrides, args.iterations, args.warmup, out_dir)
        pipeline = bench_pipeline(overrides, max(1, args.iterations), out_dir)
    report = {
        "model": args.model,
        "overrides": overrides,
        "device": str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu",
        "algorithms": results,
        "pipeline": pipeline,
    }
    if "flow_grpo" in results:
        base = results["flow_grpo"]["seconds_per_iteration"]
        report["ratios"] = {k: v["seconds_per_iteration"] / base for k, v in results.items()}
        report["nfe_ratios"] = {k: v["rollout_nfe"] / results["flow_grpo"]["rollout_nfe"] for k, v in results.items()}
    return emit(report, args.out)


if __name__ == "__main__":
    main()
