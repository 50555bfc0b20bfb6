#!/usr/bin/env python
r"""Distil the guided 10-step streaming model into a guidance-free 4-step one: ``assets/tiny-causal-wan-shapes-4step``.

    python scripts/distill_tiny_causal_wan.py                             # the shipped asset (pretrain_summary.json)
    python scripts/distill_tiny_causal_wan.py --resume                    # continue (teacher shards and student)
    python scripts/distill_tiny_causal_wan.py --probe 16                  # teacher samplers side by side, no training
    python scripts/distill_tiny_causal_wan.py --teacher toy --streams 4 --shard 2 --steps 2 --out /tmp/x   # smoke run

**What the student is for.** Streaming RL is published on distilled generators (Self-Forcing, LongLive): a few
steps per block, no classifier-free guidance, one forward per step. The teacher here
(``assets/tiny-causal-wan-shapes``) samples 10 steps per block with guidance 4.5, two forwards a step. The student
samples ``--student-steps`` (4) steps per block with the same sampler as the teacher (Self-Forcing's: predict the
clean block, re-noise it with fresh noise to the next level; :func:`samplers.chunked_rollout` with the ``cps``
kernel at noise level 1) and guidance 1.

**Targets: the teacher's flow map at the student's levels.** Regressing a guided multi-step sampler's outputs onto
a few-step student works when each student input determines its target (CausVid's ODE-pair regression, arXiv
2412.07772; rectified flow's reflow, arXiv 2209.03003): the teacher's probability-flow ODE (Euler over its own
``--teacher-steps``-step grid, guidance ``--teacher-guidance``) maps a noisy block to one clean block. For every
block and student level ``σ_j`` the teacher data hold

* the input the student's sampler would feed there if its previous predictions were the teacher's: the block's
  initial noise at ``σ_0 = 1``, and ``(1 − σ_j)·target_{j−1} + σ_j·ε_j`` (fresh ``ε_j``) after;
* the target: the teacher's ODE solve from that input down to 0 (the grid from ``σ_j``; the student's levels are
  points of the teacher's grid, so ``--teacher-steps`` must be a multiple of ``--student-steps``).

The last level's target is the block, written to the cache as the next block's context (the teacher's own stream).
So the data are the student's sampler run with the teacher's flow map for its denoiser, and the student learns that
map with one velocity per level (``v = (x − target) / σ_j``). The caption flaw of the teacher (a segment sometimes
moves the other way or not at all) is inherited: room for RL.

**Student training** is the teacher's pretraining forward (``scripts/pretrain_tiny_causal_wan.py``): one teacher-forced
forward per stream over ``[clean blocks; noisy blocks]`` whose context is the teacher's clean blocks, each block at
its own level (levels stratified over the blocks of a stream: every level equally often), every frame reading its
segment's prompt. No prompt dropout: the student never uses an unconditional branch. It starts from the teacher's
weights (``--init-student DIR``: from an earlier student's, to teach it more streams, e.g. ``--resume-streams``); EMA
of the weights ships.

Resume: teacher streams are written in shards (``<ckpt-dir>/teacher/shard-NNNN.pt``, each seeded by ``(--seed,
shard)``, written atomically), so a restart regenerates only missing shards and the data do not depend on restarts;
the student's state (weights, optimizer, EMA, RNG, log) is replaced atomically in ``<ckpt-dir>/last.pt`` every
``--ckpt-every`` steps and a resumed run ends bit-identical to an uninterrupted one (same thread count).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain_tiny import ema_pipeline, lr_at, save_pipeline  # noqa: E402
from pretrain_tiny_causal_wan import Trainer as StreamPretrainer  # noqa: E402

from flowgrpo import jsonio  # noqa: E402
from flowgrpo.models import CausalWan, StreamConfig, StreamingWanPipeline  # noqa: E402
from flowgrpo.models.causal_wan import teacher_forcing_mask  # noqa: E402
from flowgrpo.models.stream_adapter import StreamAdapter  # noqa: E402
from flowgrpo.models.stream_pipeline import STREAM_CONFIG_NAME  # noqa: E402
from flowgrpo.world.resume import resume_held_out_sequences, sample_training_stream  # noqa: E402
from flowgrpo.world.streams import STREAM_NUM_FRAMES, held_out_sequences, latent_segments, \
    sequence_key  # noqa: E402
from samplers import chunked_rollout, stream_sde_mask, stream_sigmas  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEACHER = ROOT / "assets" / "tiny-causal-wan-shapes"
DEFAULT_OUT = ROOT / "assets" / "tiny-causal-wan-shapes-4step"
DEFAULT_CKPT = ROOT / "outputs" / "distill_tiny_causal_wan"  # git-ignored
MAX_SEGMENTS = 4  # 1-3 switches


def _repo_relative(value):
    """A path inside the repository as a repository-relative string; anything else unchanged."""
    if isinstance(value, str) and value.startswith(str(ROOT) + "/"):
        return value[len(str(ROOT)) + 1:]
    return value


# ---------------------------------------------------------------------------------------------- teacher
def load_teacher(path: str) -> StreamingWanPipeline:
    if path == "toy":  # a random causal Wan with the asset's layout (smoke runs)
        from pretrain_tiny_wan import build_pipeline

        return StreamingWanPipeline(build_pipeline("toy"), StreamConfig(num_steps=10, shift=3.0, window_frames=4,
                                                                        recache=False, guidance_scale=4.5,
                                                                        max_sequence_length=16, height=64, width=64))
    if not Path(path, STREAM_CONFIG_NAME).is_file():
        raise FileNotFoundError(f"--teacher {path}: not a streaming model directory (no {STREAM_CONFIG_NAME})")
    return StreamingWanPipeline.from_pretrained(path)


def level_indices(teacher_steps: int, student_steps: int) -> list[int]:
    """Where the student's levels sit on the teacher's grid (both are ``1000·(1 − j/S)`` warped by one shift)."""
    if student_steps < 1 or teacher_steps % student_steps:
        raise ValueError(f"--teacher-steps {teacher_steps} must be a multiple of --student-steps {student_steps}: "
                         "the student's noise levels must be points of the teacher's grid")
    ratio = teacher_steps // student_steps
    return [j * ratio for j in range(student_steps)]


@torch.no_grad()
def teacher_chain(adapter: StreamAdapter, metas: list[dict], noise: torch.Tensor, renoise: torch.Tensor, *,
                  grid: torch.Tensor, starts: list[int], guidance: float, num_frames: int,
                  max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's sampler with the teacher's ODE solve for its denoiser (module doc).

    ``noise`` ``[B, K, C, F, h, w]``, ``renoise`` ``[B, K, S−1, C, F, h, w]``; ``grid`` the teacher's levels then 0;
    ``starts`` the grid index of each student level. Returns ``(inputs, targets)``, ``[B, K, S, C, F, h, w]``."""
    cond = adapter.encode_prompts([m["prompt"] for m in metas], "", guidance_scale=guidance,
                                  max_sequence_length=max_sequence_length, metadata=metas, num_frames=num_frames)
    levels = [float(grid[i]) for i in starts]
    inputs, targets = [], []
    for k in range(noise.shape[1]):
        x = noise[:, k].float()
        block_in, block_out = [], []
        for j, first in enumerate(starts):
            block_in.append(x)
            y = x
            for i in range(first, grid.shape[0] - 1):
                v = adapter.velocity(y, float(grid[i]), cond, guidance_scale=guidance)
                y = y + (float(grid[i + 1]) - float(grid[i])) * v
            block_out.append(y)
            if j + 1 < len(starts):
                x = (1 - levels[j + 1]) * y + levels[j + 1] * renoise[:, k, j].float()
        cond = adapter.commit(block_out[-1], cond)
        inputs.append(torch.stack(block_in, 1))
        targets.append(torch.stack(block_out, 1))
    return torch.stack(inputs, 1), torch.stack(targets, 1)


@torch.no_grad()
def reference_chain(adapter: StreamAdapter, metas: list[dict], noise: torch.Tensor, renoise: torch.Tensor, *,
                    levels: torch.Tensor, guidance: float, num_frames: int, max_sequence_length: int) -> torch.Tensor:
    """A model's own sampler (:func:`samplers.chunked_rollout` on the adapter's blocks, Self-Forcing's: ``cps`` at
    noise level 1 over ``levels`` and 0): the clean blocks ``[B, K, C, F, h, w]``."""
    cond = adapter.encode_prompts([m["prompt"] for m in metas], "", guidance_scale=guidance,
                                  max_sequence_length=max_sequence_length, metadata=metas, num_frames=num_frames)

    def velocity(x, sigma, cond):
        return adapter.velocity(x, sigma, cond, guidance_scale=guidance)

    return chunked_rollout(velocity, adapter.commit, noise, torch.cat([levels, torch.zeros(1)]),
                           stream_sde_mask(levels.shape[0]), cond=cond, kernel="cps", noise_level=1.0,
                           step_noise=renoise, keep_cond=False).final


def training_metas(rng: np.random.Generator, n: int, num_frames: int, resume_share: float = 0.0) -> list[dict]:
    """``n`` fresh stream captions, every held-out prompt sequence left out; ``resume_share`` of them resume
    streams (:mod:`flowgrpo.world.resume`)."""
    held_out, metas = held_out_sequences() | resume_held_out_sequences(), []
    while len(metas) < n:
        meta = sample_training_stream(rng, num_frames, resume_share)  # at 0: the shipped asset's draws
        if sequence_key(meta) not in held_out:
            metas.append(meta)
    return metas


class TeacherData:
    """Teacher streams in shards of ``--shard`` streams (module doc, "Resume")."""

    def __init__(self, args, teacher: StreamingWanPipeline):
        self.args = args
        self.dir = Path(args.ckpt_dir) / "teacher"
        self.teacher = teacher
        self.adapter = StreamAdapter(teacher)
        c = teacher.config
        self.block_frames = c.block_frames
        self.grid = torch.cat([stream_sigmas(args.teacher_steps, args.shift), torch.zeros(1)])
        self.starts = level_indices(args.teacher_steps, args.student_steps)
        shape = teacher.adapter._latent_shape(1, 64, 64, args.num_frames)[1:]
        channels, frames, h, w = shape
        self.blocks = frames // self.block_frames
        self.block_shape = (channels, self.block_frames, h, w)

    @property
    def shards(self) -> int:
        return -(-self.args.streams // self.args.shard)

    def path(self, i: int) -> Path:
        return self.dir / f"shard-{i:04d}.pt"

    def make(self, i: int) -> None:
        args = self.args
        count = min(args.shard, args.streams - i * args.shard)
        seed = int(np.random.SeedSequence([args.seed, i]).generate_state(1)[0])
        rng = np.random.default_rng(seed)
        gen = torch.Generator().manual_seed(seed)
        metas = training_metas(rng, count, args.num_frames, args.resume_streams)
        S = args.student_steps
        noise = torch.randn((count, self.blocks, *self.block_shape), generator=gen)
        renoise = torch.randn((count, self.blocks, max(S - 1, 0), *self.block_shape), generator=gen)
        inputs, targets = teacher_chain(self.adapter, metas, noise, renoise, grid=self.grid, starts=self.starts,
                                        guidance=args.teacher_guidance, num_frames=args.num_frames,
                                        max_sequence_length=args.max_sequence_length)
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path(i).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            torch.save({"metas": metas, "inputs": inputs.half(), "targets": targets.half(), "seed": seed}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path(i))

    def ensure(self) -> None:
        missing = [i for i in range(self.shards) if not self.path(i).is_file()]
        t0 = time.time()
        for n, i in enumerate(missing):
            self.make(i)
            rate = (time.time() - t0) / (n + 1)
            print(f"[distill] teacher shard {i + 1}/{self.shards} ({self.args.shard} streams), "
                  f"{rate:.0f} s/shard, eta {rate * (len(missing) - n - 1) / 60:.1f} min", flush=True)

    def load(self) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
        parts = [torch.load(self.path(i), weights_only=False) for i in range(self.shards)]
        return (torch.cat([p["inputs"] for p in parts]), torch.cat([p["targets"] for p in parts]),
                [m for p in parts for m in p["metas"]])


# ---------------------------------------------------------------------------------------------- student
class Student(StreamPretrainer):
    """The streaming pretraining's trainer (its loop, checkpoints and prompt cache) on the teacher's data."""

    def __init__(self, args, teacher: StreamingWanPipeline, data: TeacherData):  # not the parent's: no bank
        self.args = args
        self.device = torch.device(args.device)
        self.pipe = teacher.pipe.to(self.device)  # trained in place: the teacher's data are already made
        for module in (self.pipe.vae, self.pipe.text_encoder):
            module.requires_grad_(False).eval()
        self.config = teacher.config
        c = self.config
        self.transformer = self.pipe.transformer
        if args.init_student:  # a student trained before (the same transformer), instead of the teacher's weights
            if not Path(args.init_student, STREAM_CONFIG_NAME).is_file():
                raise SystemExit(f"--init-student {args.init_student}: not a streaming model directory (no "
                                 f"{STREAM_CONFIG_NAME})")
            start = StreamingWanPipeline.from_pretrained(args.init_student).pipe.transformer.state_dict()
            self.transformer.load_state_dict({k: v.to(self.device) for k, v in start.items()})
        self.wan = CausalWan(self.transformer, block_frames=c.block_frames, sink_frames=c.sink_frames,
                             window_frames=c.window_frames)
        self.params = list(self.transformer.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=args.lr, weight_decay=0.01)
        self.ema = [p.detach().clone() for p in self.params]
        self.step = 0
        self.log: list[dict] = []
        self.inputs, self.targets, self.metas = data.load()
        self.levels = torch.tensor([float(data.grid[i]) for i in data.starts])
        self.block_frames = c.block_frames
        self.frames = data.blocks * c.block_frames
        self.mask = teacher_forcing_mask(self.frames, c.block_frames, sink_frames=c.sink_frames,
                                         window_frames=c.window_frames)
        self.text_cache: dict[str, torch.Tensor] = {}
        torch.manual_seed(args.seed)
        random.seed(args.seed)

    def state_dict(self) -> dict:
        return {"step": self.step, "args": vars(self.args), "transformer": self.transformer.state_dict(),
                "opt": self.opt.state_dict(), "ema": self.ema, "log": self.log,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.transformer.load_state_dict(state["transformer"])
        self.opt.load_state_dict(state["opt"])
        self.ema = [e.to(self.device) for e in state["ema"]]
        self.log = state["log"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])

    def train_step(self) -> dict:
        args = self.args
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, args.steps, args.lr, args.warmup)
        pick = torch.randint(len(self.metas), (args.batch,))
        n, S = args.batch, self.levels.shape[0]
        K = self.inputs.shape[1]
        # stratified levels: every level equally often over a stream's blocks, in a random order
        level = torch.stack([torch.randperm(K) % S for _ in range(n)])                     # [n, K]
        rows = pick[:, None].expand(n, K)
        blocks = torch.arange(K)[None].expand(n, K)
        x_in = self.inputs[rows, blocks, level].float()                                      # [n, K, C, F, h, w]
        target = self.targets[rows, blocks, level].float()
        clean = self.targets[pick][:, :, -1].float()                                         # the teacher's stream
        sigma = self.levels[level]                                                           # [n, K]

        def video(b):  # [n, K, C, F, h, w] -> [n, C, K·F, h, w]
            return torch.cat(b.unbind(1), dim=2)

        metas = [self.metas[i] for i in pick.tolist()]
        slots, frame_slot = [], []
        for meta in metas:
            prompts = [s["prompt"] for s in meta["segments"]]
            slots += prompts + [""] * (MAX_SEGMENTS - len(prompts))
            frame_slot.append(latent_segments(meta, self.pipe.vae_scale_factor_temporal))
        text = self.encode_prompts(slots)
        text = text.view(n, MAX_SEGMENTS * text.shape[1], text.shape[2]).to(self.device)
        frame_slot = torch.tensor(frame_slot)
        frame_sigma = sigma.repeat_interleave(self.block_frames, 1)                         # [n, frames]
        timestep = torch.cat([torch.zeros_like(frame_sigma), 1000.0 * frame_sigma], 1).to(self.device)
        noisy = video(x_in).to(self.device)
        v = self.wan.full(torch.cat([video(clean).to(self.device), noisy], 2), timestep, text, mask=self.mask,
                          frame_positions=list(range(self.frames)) * 2,
                          text_frames=torch.cat([frame_slot, frame_slot], 1),
                          prompt_tokens=args.max_sequence_length)
        s = frame_sigma[:, None, :, None, None].to(self.device)
        v_target = (noisy - video(target).to(self.device)) / s
        loss = F.mse_loss(v[:, :, self.frames:].float(), v_target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, [p.detach() for p in self.params],
                                 1.0 - min(args.ema, (1 + self.step) / (10 + self.step)))
        return {"loss": loss.item(), "grad": grad.item()}

    def stream_config(self) -> StreamConfig:
        c, a = self.config, self.args
        return StreamConfig(block_frames=c.block_frames, num_steps=a.student_steps, shift=a.shift,
                            sink_frames=c.sink_frames, window_frames=c.window_frames, context_sigma=0.0,
                            recache=False, guidance_scale=1.0, max_sequence_length=a.max_sequence_length,
                            height=64, width=64)

    def export(self) -> None:
        pipe = ema_pipeline(self.pipe, ("transformer",), self.ema)
        name = Path(self.args.out).name
        pipe.register_to_config(_name_or_path=name)  # no local path in the export
        for component in ("transformer", "vae"):
            getattr(pipe, component).register_to_config(_name_or_path=f"{name}/{component}")
        args = {k: _repo_relative(v) for k, v in vars(self.args).items()}  # no local paths in the export
        summary = {"script": "scripts/distill_tiny_causal_wan.py", "step": self.step, "args": args,
                   "teacher_streams": len(self.metas), "last_log": self.log[-5:]}
        save_pipeline(pipe, Path(self.args.out), summary)
        (Path(self.args.out) / STREAM_CONFIG_NAME).write_text(jsonio.dumps(vars(self.stream_config()), indent=2) + "\n")


# ---------------------------------------------------------------------------------------------- probe
def probe(args, teacher: StreamingWanPipeline) -> dict:
    """The teacher's own sampler, its flow-map chain at the student's levels and (``--student``) a student's own
    sampler, on the same ``--probe`` training captions and draws, scored by the long-video reward."""
    import rewards

    data = TeacherData(args, teacher)
    rng = np.random.default_rng(args.seed + 12345)
    metas = training_metas(rng, args.probe, args.num_frames)
    gen = torch.Generator().manual_seed(args.seed + 12345)
    S, T = args.student_steps, teacher.config.num_steps
    noise = torch.randn((len(metas), data.blocks, *data.block_shape), generator=gen)
    renoise = torch.randn((len(metas), data.blocks, max(S, T) - 1, *data.block_shape), generator=gen)
    judge = rewards.load("long_video")
    report = {}

    def score(name, blocks, seconds):
        videos = data.adapter.decode(data.adapter.join_chunks(blocks)).float().clamp(0, 1)
        out = judge(videos, [m["prompt"] for m in metas], metas)
        tags = np.array([m.get("tag", "") for m in metas])
        entry = {"reward": round(float(out.scores.mean()), 4), "seconds": round(seconds, 1)}
        for tag in sorted(set(tags)):
            entry[tag] = round(float(out.scores[torch.from_numpy(tags == tag)].mean()), 4)
        entry |= {k: round(float(v.nanmean()), 4) for k, v in out.components.items()}
        report[name] = entry
        print(f"[probe] {name}: {jsonio.dumps(entry)}", flush=True)

    t0 = time.time()
    own = reference_chain(data.adapter, metas, noise, renoise[:, :, :T - 1],
                          levels=stream_sigmas(T, teacher.config.shift), guidance=teacher.config.guidance_scale,
                          num_frames=args.num_frames, max_sequence_length=args.max_sequence_length)
    score(f"teacher sampler ({T} steps, guidance {teacher.config.guidance_scale})", own, time.time() - t0)
    t0 = time.time()
    _, targets = teacher_chain(data.adapter, metas, noise, renoise[:, :, :S - 1], grid=data.grid, starts=data.starts,
                               guidance=args.teacher_guidance, num_frames=args.num_frames,
                               max_sequence_length=args.max_sequence_length)
    score(f"teacher flow map at {S} levels ({args.teacher_steps}-step grid, guidance {args.teacher_guidance})",
          targets[:, :, -1], time.time() - t0)
    if args.student:
        student = StreamingWanPipeline.from_pretrained(args.student)
        adapter = StreamAdapter(student)
        c = student.config
        t0 = time.time()
        blocks = reference_chain(adapter, metas, noise, renoise[:, :, :c.num_steps - 1],
                                 levels=stream_sigmas(c.num_steps, c.shift), guidance=c.guidance_scale,
                                 num_frames=args.num_frames, max_sequence_length=args.max_sequence_length)
        score(f"student {args.student} ({c.num_steps} steps, guidance {c.guidance_scale})", blocks, time.time() - t0)
    return report


# ---------------------------------------------------------------------------------------------- cli
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", default=str(DEFAULT_TEACHER), help="streaming model dir, or 'toy' (smoke runs)")
    p.add_argument("--num-frames", type=int, default=STREAM_NUM_FRAMES, help="pixel frames per stream (4k+1)")
    p.add_argument("--student-steps", type=int, default=4, help="the student's steps per block")
    p.add_argument("--teacher-steps", type=int, default=12, help="the teacher's ODE grid (a multiple of the above)")
    p.add_argument("--teacher-guidance", type=float, default=4.5, help="the teacher's classifier-free guidance")
    p.add_argument("--shift", type=float, default=3.0, help="shift of both noise-level lists")
    p.add_argument("--streams", type=int, default=512, help="teacher streams")
    p.add_argument("--resume-streams", type=float, default=0.0,
                   help="share of resume streams among them (flowgrpo.world.resume)")
    p.add_argument("--shard", type=int, default=32, help="teacher streams per shard (and per teacher batch)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4, help="peak lr (warmup, cosine to 10%%)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--max-sequence-length", type=int, default=16)
    p.add_argument("--ema", type=float, default=0.99)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--ckpt-dir", default=str(DEFAULT_CKPT))
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--export-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--stop-at", type=int, default=None, help="stop (checkpointed) at this step; --resume continues")
    p.add_argument("--teacher-only", action="store_true", help="make the teacher shards and stop")
    p.add_argument("--probe", type=int, default=0, help="compare samplers on N captions and exit")
    p.add_argument("--student", default=None, help="with --probe: a student directory to score beside the teacher")
    p.add_argument("--init-student", default=None,
                   help="start the student from this streaming model (an earlier student) instead of the teacher")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    level_indices(args.teacher_steps, args.student_steps)  # fail before any compute
    teacher = load_teacher(args.teacher)
    teacher.pipe.to(args.device)
    if args.probe:
        return probe(args, teacher)
    data = TeacherData(args, teacher)
    data.ensure()
    if args.teacher_only:
        return data
    student = Student(args, teacher, data)
    ckpt = Path(args.ckpt_dir) / "last.pt"
    if args.resume and ckpt.exists():
        student.load_state_dict(torch.load(ckpt, weights_only=False))
        print(f"[distill] resumed at step {student.step}", flush=True)
    print(f"[distill] {args.steps} steps x {args.batch} of {len(student.metas)} teacher streams, "
          f"{args.student_steps} levels {student.levels.tolist()}", flush=True)
    student.run()
    return student


if __name__ == "__main__":
    main()
