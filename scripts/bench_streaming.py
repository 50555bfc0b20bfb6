#!/usr/bin/env python
r"""Streaming cost per generated frame: KV-cached vs recomputing the context every block (JSON + PNG).

    python scripts/bench_streaming.py                                  # asset size, CPU, 32 rows, 16..128 latent frames
    python scripts/bench_streaming.py --size wan21_1_3b --device cuda --dtype bfloat16 --frames 21,42,84 \
        --out docs/results/bench_streaming_gpu.json                    # Wan2.1-1.3B size (random weights), a GPU

Both ways generate the same stream (the bench checks the outputs agree) with the few-step streaming sampler:
blocks of ``--block-frames`` latent frames, ``--steps`` denoising steps each, a sink and a window of context.

* **cached** (:class:`flowgrpo.models.CausalWan`): each step runs the transformer on the block's tokens only,
  attending to the cached keys and values of the sink and window; one no-grad write pass per block stores it.
* **recompute** (no cache; what sliding-window video generators without a cache do, e.g. re-running the
  history each step): each step runs one forward over ``[clean context frames; noisy block]`` under the
  teacher-forcing mask, so the context's keys and values are computed again at every step of every block.

Per stream length: seconds per generated latent frame of each, their ratio, and the flatness of the cached cost
(per-frame seconds at the longest over the shortest). ``--size`` picks the transformer: ``asset`` (the embedded
moving-shapes models: 4 layers, 4 x 32 heads, 64 tokens per latent frame), ``wan21_1_3b`` (Wan2.1-T2V-1.3B:
30 layers, 12 x 128 heads, 480x832 → 1560 tokens per latent frame; random weights, speed only). With a
``--reference-fps`` the JSON also gives pixel frames per second (4 per latent frame) against it, e.g. the 17 FPS
Self-Forcing reports for Wan2.1-1.3B on one H100.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from flowgrpo import jsonio
from flowgrpo.models import CausalWan
from flowgrpo.models.causal_wan import teacher_forcing_mask
from samplers import stream_noise, stream_sigmas

SIZES = {
    # the embedded moving-shapes Wan (assets/tiny-wan-shapes, assets/tiny-causal-wan-shapes): 64x64 frames
    "asset": dict(config=dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16,
                              out_channels=16, text_dim=64, freq_dim=64, ffn_dim=512, num_layers=4,
                              rope_max_seq_len=64, cross_attn_norm=True),
                  latent_hw=(16, 16), text=(16, 64), block=1, sink=1, window=4),
    # Wan2.1-T2V-1.3B at 480x832 (Self-Forcing / LongLive: blocks of 3, LongLive's sink 3 + window 9)
    "wan21_1_3b": dict(config=dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                                   in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                                   num_layers=30, rope_max_seq_len=1024, cross_attn_norm=True),
                       latent_hw=(60, 104), text=(512, 4096), block=3, sink=3, window=9),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(size: str, device, dtype) -> tuple[WanTransformer3DModel, dict]:
    spec = SIZES[size]
    torch.manual_seed(0)
    model = WanTransformer3DModel(**spec["config"]).to(device=device, dtype=dtype).eval()
    return model, spec


@torch.no_grad()
def stream_cached(wan: CausalWan, noise, renoise, sigmas, text, block: int) -> torch.Tensor:
    wan.reset()
    blocks, out = noise.shape[1], []
    for k in range(blocks):
        x = noise[:, k]
        for j, sigma in enumerate(sigmas.tolist()):
            t = torch.full((x.shape[0],), 1000.0 * sigma, device=x.device, dtype=x.dtype)
            x0 = x - sigma * wan(x, t, text, frame_offset=k * block)
            if j + 1 < len(sigmas):
                nxt = float(sigmas[j + 1])
                x = (1 - nxt) * x0 + nxt * renoise[:, k, j]
        out.append(x0)
        wan.write(x0, text, frame_offset=k * block)
    return torch.cat(out, 2)


@torch.no_grad()
def stream_recompute(wan: CausalWan, noise, renoise, sigmas, text, block: int) -> torch.Tensor:
    """The same stream with no cache: every step re-encodes the context frames the block attends to."""
    blocks, out = noise.shape[1], []
    for k in range(blocks):
        start = k * block
        context = wan.context_positions(start, block, cached=range(start))
        clean = torch.cat([out[p // block][:, :, p % block:p % block + 1] for p in context], 2) if context else None
        mask = teacher_forcing_mask(context or [], block, sink_frames=wan.sink_frames, window_frames=wan.window_frames,
                                    noisy=list(range(start, start + block)))
        positions = list(context) + list(range(start, start + block))
        x = noise[:, k]
        for j, sigma in enumerate(sigmas.tolist()):
            seq = x if clean is None else torch.cat([clean, x], 2)
            t = torch.cat([torch.zeros(x.shape[0], len(context), device=x.device, dtype=x.dtype),
                           torch.full((x.shape[0], block), 1000.0 * sigma, device=x.device, dtype=x.dtype)], 1)
            v = wan.full(seq, t, text, mask=mask, frame_positions=positions)[:, :, len(context):]
            x0 = x - sigma * v
            if j + 1 < len(sigmas):
                nxt = float(sigmas[j + 1])
                x = (1 - nxt) * x0 + nxt * renoise[:, k, j]
        out.append(x0)
    return torch.cat(out, 2)


def measure(fn, device, repeats: int) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["lengths"]
    frames = [r["latent_frames"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for key, label in (("cached_s_per_frame", "KV cache"), ("recompute_s_per_frame", "recompute context")):
        ax.plot(frames, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("stream length (latent frames)")
    ax.set_ylabel("seconds per generated latent frame")
    ax.set_title(f"streaming cost, {report['size']} ({report['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="asset")
    p.add_argument("--frames", default="16,32,64,128", help="stream lengths in latent frames (multiples of the block)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per block")
    p.add_argument("--batch", type=int, default=32,
                   help="streams (rows) generated together; 32 is what the streaming presets roll out (16 with CFG)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reference-fps", type=float, default=None, help="pixel frames per second to compare with")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (and the PNG beside it)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    block = SIZES[args.size]["block"]
    lengths = [int(f) for f in args.frames.split(",")]
    for frames in lengths:  # before the model is built (Wan2.1-1.3B size takes a while)
        if frames % block:
            raise SystemExit(f"--frames {frames} is not a multiple of the block ({block})")
    model, spec = build(args.size, device, dtype)
    h_w = spec["latent_hw"]
    wan = CausalWan(model, block_frames=block, sink_frames=spec["sink"], window_frames=spec["window"],
                    cache_frames=spec["sink"] + spec["window"])
    g = torch.Generator().manual_seed(0)
    text = torch.randn(args.batch, *spec["text"], generator=g).to(device=device, dtype=dtype)
    sigmas = stream_sigmas(args.steps, 5.0)
    rows = []
    for frames in lengths:
        noise, renoise = stream_noise(args.batch, frames // block, args.steps, (16, block, *h_w), generator=g)
        noise, renoise = noise.to(device, dtype), renoise.to(device, dtype)
        cached_s, a = measure(lambda: stream_cached(wan, noise, renoise, sigmas, text, block), device, args.repeats)
        recompute_s, b = measure(lambda: stream_recompute(wan, noise, renoise, sigmas, text, block), device,
                                 args.repeats)
        agree = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))
        row = {"latent_frames": frames, "pixel_frames": 4 * (frames - 1) + 1,
               "cached_s_per_frame": cached_s / frames, "recompute_s_per_frame": recompute_s / frames,
               "recompute_over_cached": recompute_s / cached_s, "max_relative_difference": agree,
               "cache_mb": wan.cache.nbytes() / 2**20}
        if args.reference_fps:
            row["pixel_fps_cached"] = 4 * frames / cached_s
        rows.append(row)
        print(jsonio.dumps(row), flush=True)
    report = {
        "size": args.size, "device": str(device), "dtype": args.dtype, "batch": args.batch, "steps": args.steps,
        "block_frames": block, "sink_frames": spec["sink"], "window_frames": spec["window"],
        "tokens_per_frame": h_w[0] * h_w[1] // 4, "threads": args.threads, "repeats": args.repeats,
        "lengths": rows,
        "cached_flatness_longest_over_shortest": rows[-1]["cached_s_per_frame"] / rows[0]["cached_s_per_frame"],
        "recompute_over_cached_at_longest": rows[-1]["recompute_over_cached"],
    }
    if args.reference_fps:
        report["reference_fps"] = args.reference_fps
        report["fps_over_reference_at_longest"] = rows[-1]["pixel_fps_cached"] / args.reference_fps
    text_out = jsonio.dumps(report, indent=2)
    print(text_out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text_out + "\n")
        plot(report, args.out.with_suffix(".png"))
    return report


if __name__ == "__main__":
    main()
