#!/usr/bin/env python
r"""How far does one small random weight step move a model's samples, block by block? JSON.

    python scripts/probe_step_sensitivity.py                                  # the embedded streaming and clip models
    python scripts/probe_step_sensitivity.py --models assets/tiny-causal-wan-shapes-4step --lr 1e-3

RL updates are small steps, and a model whose samples move a lot under a small step pays for each step in reward it
did not ask for: its update's cost grows with the step, while the signal of a few dozen rewards does not. This probe
measures that cost without training: a fixed random step of the size of one Adam step on a LoRA adapter (rank
``--rank``, scale ``--alpha / --rank``, on the attention projections ``to_q``, ``to_k``, ``to_v``, ``to_out.0`` of
every block; LoRA's A initialised as peft does, uniform with bound ``1/√fan_in``; B, which starts at 0, after one
Adam step is ``±lr`` per entry, so ``ΔW = (α/r)·B·A`` with random signs) is added to the weights and the same prompts
are sampled from the same noise before and after.

Reported per latent frame (a streaming model: per block of its stream; a clip model: per latent frame of its clip):
the RMS change of the clean latents, and the RMS difference of an independent redraw (the same prompts, other noise),
the scale of "a different sample"; their ratio says what share of a new sample one step is. Streaming models sample
the held-out streams of ``assets/prompts/streams_val.jsonl`` with their own sampler (``stream_config.json``: steps,
guidance); clip models the held-out prompts of ``assets/prompts/motion_held_out.jsonl`` with the pipeline's own sampler
(``--clip-steps``, guidance ``--clip-guidance``, 13 frames).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flowgrpo import jsonio  # noqa: E402  (strict JSON: NaN / inf as null)

TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def lora_step(transformer: torch.nn.Module, *, lr: float, rank: int, alpha: float, seed: int) -> dict:
    """``{name: ΔW}`` for every targeted linear layer: one Adam step's LoRA update with random signs (module doc)."""
    gen = torch.Generator().manual_seed(seed)
    deltas = {}
    for name, module in transformer.named_modules():
        if not isinstance(module, torch.nn.Linear) or not any(name.endswith(t) for t in TARGETS):
            continue
        out_f, in_f = module.weight.shape
        a = (torch.rand(rank, in_f, generator=gen) * 2 - 1) / in_f ** 0.5
        b = lr * torch.randn(out_f, rank, generator=gen).sign()
        deltas[name] = (alpha / rank) * b @ a
    if not deltas:
        raise ValueError(f"no linear layer named like {TARGETS} in {type(transformer).__name__}")
    return deltas


def apply(transformer: torch.nn.Module, deltas: dict, sign: float) -> None:
    with torch.no_grad():
        for name, module in transformer.named_modules():
            if name in deltas:
                module.weight.add_(sign * deltas[name].to(module.weight))


def read_jsonl(path: Path, n: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:n]


def stream_latents(path: str, n: int, seed: int):
    """A sampler ``(draw) -> [B, K, C, F, h, w]`` clean blocks of the first ``n`` held-out streams, and the model."""
    from flowgrpo.models import StreamingWanPipeline
    from flowgrpo.models.stream_adapter import StreamAdapter

    stream = StreamingWanPipeline.from_pretrained(path)
    adapter = StreamAdapter(stream)
    c = stream.config
    metas = read_jsonl(ROOT / "assets" / "prompts" / "streams_val.jsonl", n)
    num_frames = int(metas[0]["num_frames"])
    model_kw = {"guidance": {"guidance_scale": c.guidance_scale}, "negative_prompt": c.negative_prompt,
                "max_sequence_length": c.max_sequence_length,
                "size": {"height": c.height or 64, "width": c.width or 64, "num_frames": num_frames}}

    @torch.no_grad()
    def sample(draw: int) -> torch.Tensor:                                      # [B, K, C, F, h, w]
        gens = [torch.Generator().manual_seed(seed * 1_000_003 + draw * 10_007 + i) for i in range(len(metas))]
        return adapter.generate([m["prompt"] for m in metas], metas, gens, sigmas=adapter.sigmas(c.num_steps),
                                model_kw=model_kw, decode=False)

    info = {"kind": "stream", "steps": c.num_steps, "guidance_scale": c.guidance_scale, "shift": c.shift,
            "forwards_per_step": 2 if c.guidance_scale > 1 else 1, "samples": len(metas)}
    return sample, stream.pipe.transformer, info


def clip_latents(path: str, n: int, seed: int, steps: int, guidance: float):
    """The same for a clip model (``WanPipeline``): ``[B, F, C, 1, h, w]`` (one latent frame per "block")."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    prompts = [r["prompt"] for r in read_jsonl(ROOT / "assets" / "prompts" / "motion_held_out.jsonl", n)]
    channels = pipe.transformer.config.in_channels
    frames, h, w = (13 - 1) // pipe.vae_scale_factor_temporal + 1, 64 // pipe.vae_scale_factor_spatial, \
        64 // pipe.vae_scale_factor_spatial

    @torch.no_grad()
    def sample(draw: int) -> torch.Tensor:
        gens = [torch.Generator().manual_seed(seed * 1_000_003 + draw * 10_007 + i) for i in range(len(prompts))]
        latents = torch.stack([torch.randn(channels, frames, h, w, generator=g) for g in gens])
        out = pipe(prompts, height=64, width=64, num_frames=13, num_inference_steps=steps, guidance_scale=guidance,
                   latents=latents, output_type="latent", max_sequence_length=16).frames
        return out.float().permute(0, 2, 1, 3, 4).unsqueeze(3)                     # [B, F, C, 1, h, w]

    info = {"kind": "clip", "steps": steps, "guidance_scale": guidance,
            "forwards_per_step": 2 if guidance > 1 else 1, "samples": len(prompts)}
    return sample, pipe.transformer, info


def rms_per_block(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return [round(v, 4) for v in (a - b).float().square().flatten(2).mean(2).mean(0).sqrt().tolist()]


def probe(path: str, args) -> dict:
    t0 = time.time()
    if Path(path, "stream_config.json").is_file():
        sample, transformer, info = stream_latents(path, args.samples, args.seed)
    else:
        sample, transformer, info = clip_latents(path, args.samples, args.seed, args.clip_steps, args.clip_guidance)
    base = sample(0)
    redraw = sample(1)
    deltas = lora_step(transformer, lr=args.lr, rank=args.rank, alpha=args.alpha, seed=args.seed)
    apply(transformer, deltas, +1.0)
    try:
        stepped = sample(0)
    finally:
        apply(transformer, deltas, -1.0)
    change, scale = rms_per_block(stepped, base), rms_per_block(redraw, base)
    return {"model": path, **info, "lr": args.lr, "rank": args.rank, "alpha": args.alpha,
            "step_rms": change, "redraw_rms": scale,
            "step_over_redraw": [round(c / s, 4) if s > 0 else None for c, s in zip(change, scale)],
            "mean_step_over_redraw": round(sum(c for c in change) / max(sum(scale), 1e-12), 4),
            "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=[str(ROOT / "assets" / m) for m in (
        "tiny-causal-wan-shapes", "tiny-causal-wan-shapes-4step", "tiny-wan-shapes") if (ROOT / "assets" / m).is_dir()])
    p.add_argument("--lr", type=float, default=3e-3, help="the Adam step's size per LoRA entry")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--samples", type=int, default=8, help="held-out prompts (streams) per model")
    p.add_argument("--clip-steps", type=int, default=10)
    p.add_argument("--clip-guidance", type=float, default=4.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the JSON here too")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = {"lr": args.lr, "rank": args.rank, "alpha": args.alpha, "seed": args.seed,
              "models": [probe(m, args) for m in args.models]}
    text = jsonio.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
