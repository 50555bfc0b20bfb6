#!/usr/bin/env python
r"""Pretrain the moving-shapes world's streaming (causal) Wan: ``assets/tiny-causal-wan-shapes``.

    python scripts/pretrain_tiny_causal_wan.py --threads 2            # the shipped asset (CPU; see pretrain_summary.json)
    python scripts/pretrain_tiny_causal_wan.py --resume               # continue from <ckpt-dir>/last.pt
    python scripts/pretrain_tiny_causal_wan.py --init toy --steps 2 --batch 2 --out /tmp/x   # smoke run

What it builds: the text-to-video asset (``assets/tiny-wan-shapes``: VAE, UMT5 text encoder, world tokenizer,
``WanTransformer3DModel``) with its transformer trained to stream: blocks of ``--block-frames`` latent frames, each
attending to itself, the ``--sink-frames`` first frames and the newest ``--window-frames`` frames
(:class:`flowgrpo.models.CausalWan`), over 49-frame streams of the world whose prompt switches 1-3 times
(:mod:`flowgrpo.world.streams`). It starts from the bidirectional weights, as Self-Forcing (arXiv 2506.08009)
starts from a bidirectional Wan; the VAE and the text encoder stay frozen. The export is a plain ``WanPipeline``
directory plus ``stream_config.json`` (:class:`flowgrpo.models.StreamingWanPipeline`).

**Teacher forcing, exactly what streaming samples.** One forward per stream over ``[clean; noisy]`` (26 latent
frames): the clean frames at timestep 0 stand for the cache the write passes fill, each noisy block has its own
noise level (logit-normal, shifted by ``--shift``; diffusion forcing) and attends to its own frames and to the
clean frames streaming would have cached before it (:func:`flowgrpo.models.causal_wan.teacher_forcing_mask`).
Every frame reads the prompt of its own segment (``CausalWan.full``'s ``text_frames``), so a block after a switch
sees context written under the earlier prompt and must follow the new one: streaming samples this with
``recache: false`` (the cache is kept as written at a switch), which the exported ``stream_config.json`` says.
By the exactness tests (tests/test_causal_wan.py) the loss is the streaming sampler's, block by block.

**The caption flaw.** As for the clip world: with probability ``--opposite-prob`` a segment's object moves the
opposite way to its caption and with ``--still-prob`` it does not move (:func:`flowgrpo.world.corrupt_stream`),
so the model follows each segment's prompt often but not always: room for RL with the stream rewards.

Data: fresh streams (:func:`flowgrpo.world.sample_stream_metadata`, every held-out prompt sequence of
:func:`flowgrpo.world.split_stream_prompts` left out), encoded by the frozen VAE into a bank refreshed every step as in
``pretrain_tiny_wan.py`` (``--bank-size`` / ``--bank-refresh``); prompts are encoded once each (frozen encoder).

Resume: ``<ckpt-dir>/last.pt`` is replaced atomically every ``--ckpt-every`` steps with the transformer, optimizer,
EMA, bank, every RNG state and the log; a resumed run ends bit-identical to an uninterrupted one (same threads).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import WanPipeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain_tiny import bank_batch, ema_pipeline, lr_at, sample_sigmas, save_pipeline, save_state  # noqa: E402
from pretrain_tiny_wan import build_pipeline  # noqa: E402

from flowgrpo import jsonio  # noqa: E402
from flowgrpo.models import CausalWan, StreamConfig  # noqa: E402
from flowgrpo.models.causal_wan import teacher_forcing_mask  # noqa: E402
from flowgrpo.models.stream_pipeline import STREAM_CONFIG_NAME  # noqa: E402
from flowgrpo.world.resume import resume_held_out_sequences, sample_training_stream  # noqa: E402
from flowgrpo.world.streams import (  # noqa: E402
    STREAM_NUM_FRAMES,
    corrupt_stream,
    latent_segments,
    render_stream,
    held_out_sequences,
    sequence_key,
    stream_fits,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_INIT = ROOT / "assets" / "tiny-wan-shapes"
DEFAULT_OUT = ROOT / "assets" / "tiny-causal-wan-shapes"
DEFAULT_CKPT = ROOT / "outputs" / "pretrain_tiny_causal_wan"  # git-ignored
MAX_SEGMENTS = 4  # 1-3 switches


def load_init(init: str) -> WanPipeline:
    """The starting pipeline: a directory (the text-to-video asset), or ``toy`` (random, for smoke runs)."""
    if init == "toy":
        return build_pipeline("toy")
    if not Path(init).is_dir():
        raise FileNotFoundError(f"--init {init}: not a pipeline directory (the default is {DEFAULT_INIT})")
    return WanPipeline.from_pretrained(init)


def render_streams(rng: np.random.Generator, n: int, exclude: set, num_frames: int, opposite: float, still: float,
                   resume_share: float = 0.0):
    """``n`` fresh streams in [-1, 1] ``[n, 3, T, 64, 64]`` and their (caption) metadata; a corrupted stream shows
    the caption flaw (redrawn when its path no longer fits the frame; a stream the renderer cannot lay out is
    replaced by another). With ``resume_share`` > 0 that share of the streams are resume streams
    (:mod:`flowgrpo.world.resume`)."""
    clips, metas = [], []
    while len(metas) < n:
        meta = sample_training_stream(rng, num_frames, resume_share)  # at 0: the shipped asset's draws
        if sequence_key(meta) in exclude:
            continue
        shown = meta
        if opposite or still:
            for _ in range(20):
                candidate = corrupt_stream(meta, rng, opposite, still)
                if stream_fits(candidate):
                    shown = candidate
                    break
        try:
            clips.append(render_stream(shown, rng=rng))
        except RuntimeError:  # a layout the renderer could not find (two objects, long paths): draw another stream
            continue
        metas.append(meta)
    x = torch.from_numpy(np.stack(clips)).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
    return x, metas


class Trainer:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.pipe = load_init(args.init).to(self.device)
        for module in (self.pipe.vae, self.pipe.text_encoder):
            module.requires_grad_(False).eval()
        self.transformer = self.pipe.transformer
        self.wan = CausalWan(self.transformer, block_frames=args.block_frames, sink_frames=args.sink_frames,
                             window_frames=args.window_frames)
        self.params = list(self.transformer.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=args.lr, weight_decay=0.01)
        self.ema = [p.detach().clone() for p in self.params]
        self.step = 0
        self.log: list[dict] = []
        self.data_rng = np.random.default_rng(args.seed)
        self.bank: tuple[torch.Tensor, list[dict]] | None = None
        self.exclude = held_out_sequences() | resume_held_out_sequences()  # the held-out splits, once per process
        self.text_cache: dict[str, torch.Tensor] = {}
        frames = (args.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        self.latent_frames = frames
        self.mask = teacher_forcing_mask(frames, args.block_frames, sink_frames=args.sink_frames,
                                         window_frames=args.window_frames)
        torch.manual_seed(args.seed)
        random.seed(args.seed)

    # -- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step, "args": vars(self.args), "transformer": self.transformer.state_dict(),
            "opt": self.opt.state_dict(), "ema": self.ema, "log": self.log, "bank": self.bank,
            "rng": {"numpy": self.data_rng.bit_generator.state, "torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.transformer.load_state_dict(state["transformer"])
        self.opt.load_state_dict(state["opt"])
        self.ema = [e.to(self.device) for e in state["ema"]]
        self.log = state["log"]
        self.bank = state.get("bank")
        self.data_rng.bit_generator.state = state["rng"]["numpy"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])

    # -- data ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_video(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised latents as the pipeline uses them (posterior mean)."""
        vae = self.pipe.vae
        z = vae.encode(x.to(self.device)).latent_dist.mean
        mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
        return (z - mean) / std

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """``[n, L, D]`` embeddings as the pipeline makes them (padded to ``--max-sequence-length``), cached."""
        missing = sorted({p for p in prompts if p not in self.text_cache})
        if missing:
            embeds, _ = self.pipe.encode_prompt(missing, do_classifier_free_guidance=False,
                                                max_sequence_length=self.args.max_sequence_length,
                                                device=self.device)
            self.text_cache.update({p: e for p, e in zip(missing, embeds)})
        return torch.stack([self.text_cache[p] for p in prompts])

    def fresh(self, n: int) -> tuple[torch.Tensor, list[dict]]:
        args = self.args
        x, metas = render_streams(self.data_rng, n, self.exclude, args.num_frames, args.opposite_prob, args.still_prob,
                                  args.resume_streams)
        return torch.cat([self.encode_video(x[i:i + 8]) for i in range(0, n, 8)]), metas

    def batch(self) -> tuple[torch.Tensor, list[dict]]:
        """Fresh streams (``--bank-size 0``), or a draw from a bank of encoded streams refreshed every step."""
        args = self.args
        if args.bank_size <= 0:
            return self.fresh(args.batch)
        self.bank, latents, metas = bank_batch(self.bank, self.fresh, bank_size=args.bank_size,
                                               refresh=args.bank_refresh, batch=args.batch, device=self.device)
        return latents, metas

    # -- training ------------------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        args = self.args
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, args.steps, args.lr, args.warmup)
        x0, metas = self.batch()
        n, frames = len(metas), self.latent_frames
        drop = (torch.rand(n) < args.cfg_dropout).tolist()
        # per row: each segment's prompt in a slot ("" everywhere for a caption-dropout row), each frame's slot
        slots, frame_slot = [], []
        for meta, dropped in zip(metas, drop):
            prompts = [("" if dropped else s["prompt"]) for s in meta["segments"]]
            slots += prompts + [""] * (MAX_SEGMENTS - len(prompts))
            frame_slot.append(latent_segments(meta, self.pipe.vae_scale_factor_temporal))
        text = self.encode_prompts(slots)                                                   # [n·P, L, D]
        text = text.view(n, MAX_SEGMENTS * text.shape[1], text.shape[2])
        frame_slot = torch.tensor(frame_slot)
        blocks = frames // args.block_frames
        sigma = sample_sigmas(n * blocks, args.shift, self.device).view(n, blocks)
        sigma = sigma.repeat_interleave(args.block_frames, 1)                             # [n, F] per frame
        noise = torch.randn_like(x0)
        s = sigma[:, None, :, None, None]
        xt = (1 - s) * x0 + s * noise
        timestep = torch.cat([torch.zeros_like(sigma), 1000.0 * sigma], 1)
        v = self.wan.full(torch.cat([x0, xt], 2), timestep, text, mask=self.mask,
                          frame_positions=list(range(frames)) * 2, text_frames=torch.cat([frame_slot, frame_slot], 1),
                          prompt_tokens=args.max_sequence_length)
        loss = F.mse_loss(v[:, :, frames:].float(), noise - x0)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, [p.detach() for p in self.params],
                                 1.0 - min(args.ema, (1 + self.step) / (10 + self.step)))
        return {"loss": loss.item(), "grad": grad.item()}

    def run(self) -> None:
        args = self.args
        window, t0, s0 = [], time.time(), self.step
        self.transformer.train()
        while self.step < args.steps:
            metrics = self.train_step()
            self.step += 1
            window.append(metrics["loss"])
            if self.step % args.log_every == 0 or self.step == args.steps:
                rate = (self.step - s0) / (time.time() - t0)
                entry = {"step": self.step, "loss": float(np.mean(window)), "grad": round(metrics["grad"], 5)}
                self.log.append(entry)
                print(f"[pretrain] step {self.step}/{args.steps} loss {entry['loss']:.4f} grad {entry['grad']} "
                      f"{rate:.3f} it/s eta {(args.steps - self.step) / max(rate, 1e-9) / 60:.1f} min", flush=True)
                window = []
            if self.step % args.ckpt_every == 0 or self.step in (args.steps, args.stop_at):
                save_state(self.state_dict(), Path(args.ckpt_dir))
            if args.export_every and self.step % args.export_every == 0:
                self.export()
            if self.step == args.stop_at:
                print(f"[pretrain] stopped at step {self.step} (--stop-at); continue with --resume", flush=True)
                return
        self.export()

    def stream_config(self) -> StreamConfig:
        a = self.args
        return StreamConfig(block_frames=a.block_frames, num_steps=a.stream_steps, shift=a.shift,
                            sink_frames=a.sink_frames, window_frames=a.window_frames, context_sigma=0.0, recache=False,
                            guidance_scale=a.guidance_scale, max_sequence_length=a.max_sequence_length,
                            height=64, width=64)

    def export(self) -> None:
        pipe = ema_pipeline(self.pipe, ("transformer",), self.ema)
        pipe.register_to_config(_name_or_path=Path(self.args.out).name)  # no local path in the export
        summary = {"script": "scripts/pretrain_tiny_causal_wan.py", "step": self.step, "args": vars(self.args),
                   "last_log": self.log[-5:]}
        save_pipeline(pipe, Path(self.args.out), summary)
        (Path(self.args.out) / STREAM_CONFIG_NAME).write_text(jsonio.dumps(vars(self.stream_config()), indent=2) + "\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--init", default=str(DEFAULT_INIT), help="starting pipeline dir, or 'toy' (random, smoke runs)")
    p.add_argument("--num-frames", type=int, default=STREAM_NUM_FRAMES, help="pixel frames per training stream (4k+1)")
    p.add_argument("--block-frames", type=int, default=1, help="latent frames per block")
    p.add_argument("--sink-frames", type=int, default=1, help="latent frames of the attention sink")
    p.add_argument("--window-frames", type=int, default=4, help="newest latent frames a block attends, itself included")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4, help="peak lr (warmup, cosine to 10%%)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--shift", type=float, default=3.0, help="training noise-level shift = the sampler's")
    p.add_argument("--stream-steps", type=int, default=10, help="sampling steps per block (stream_config.json)")
    p.add_argument("--guidance-scale", type=float, default=4.5, help="CFG of the exported stream config")
    p.add_argument("--max-sequence-length", type=int, default=16, help="text tokens (every world prompt fits)")
    p.add_argument("--bank-size", type=int, default=512)
    p.add_argument("--bank-refresh", type=int, default=4)
    p.add_argument("--opposite-prob", type=float, default=0.25)
    p.add_argument("--still-prob", type=float, default=0.15)
    p.add_argument("--resume-streams", type=float, default=0.0,
                   help="share of resume streams (flowgrpo.world.resume: told only to move 'again' after a pause)")
    p.add_argument("--cfg-dropout", type=float, default=0.1)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--ckpt-dir", default=str(DEFAULT_CKPT))
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--export-every", type=int, default=250)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--stop-at", type=int, default=None, help="stop (checkpointed) at this step; --resume continues")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def main(argv=None) -> Trainer:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    trainer = Trainer(args)
    ckpt = Path(args.ckpt_dir) / "last.pt"
    if args.resume and ckpt.exists():
        trainer.load_state_dict(torch.load(ckpt, weights_only=False))
        print(f"[pretrain] resumed at step {trainer.step}", flush=True)
    print(f"[pretrain] {args.steps} steps x {args.batch} streams of {args.num_frames} frames "
          f"({trainer.latent_frames} latent), blocks of {args.block_frames}, sink {args.sink_frames}, "
          f"window {args.window_frames}", flush=True)
    trainer.run()
    return trainer


if __name__ == "__main__":
    main()
