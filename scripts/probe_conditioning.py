#!/usr/bin/env python
r"""Which words of the prompt a moving-shapes video pipeline actually uses.

    python scripts/probe_conditioning.py                                   # assets/tiny-wan-shapes
    python scripts/probe_conditioning.py --pretrained DIR --json out.json  # a pretraining export

Two measurements, printed as JSON:

- ``loss_gap``: the flow-matching loss of the pipeline on ``--clips`` rendered clips (single-object ``motion``
  prompts, correct captions, mean latents) at fixed noise levels σ, with the true caption and with a caption whose
  words of one kind are swapped, same noise: ``direction`` (left <-> right, up <-> down) and ``appearance``
  (every colour and shape word replaced by another). ``increase`` is the mean loss increase over clips (± its
  standard error): how much of the loss the model explains with those words. A word the model ignores costs
  nothing to swap. The row ``first_frame_clean`` noises the first latent frame at σ 0.1 and the others at 0.95 and
  scores the noisy frames only: the start is visible, so only the words say where the object goes next (this is
  what a pipeline pretrained with ``--frame-noise-prob`` sees in training).
- ``direction``: the clips the pipeline makes (``--steps`` Euler steps, CFG ``--guidance-scale``) for each
  direction of four (colour, shape) pairs, ``--samples`` clips each from the same seeds, judged by the
  ``video_geneval`` tracker: the fitted velocity of the longest track projected on the named direction
  (``along``, px/frame; about 0 when the direction comes from the noise, not the prompt), its speed, and the
  share of clips passing the reward's motion check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from diffusers import WanPipeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pretrain_tiny_wan as pw  # noqa: E402

from flowgrpo import jsonio  # noqa: E402
from flowgrpo.world import CLASSES, DIRECTIONS, PALETTE, motion_metadata_for  # noqa: E402
from flowgrpo.world.motion import OPPOSITE, UNIT  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIGMAS = (0.95, 0.85, 0.7, 0.5, 0.3)
FIRST_FRAME_LEVELS = (0.1, 0.95)  # the first latent frame's noise level, the others'


def swap_words(prompt: str, kind: str) -> str:
    """``prompt`` with its direction words reversed (``direction``), its colour and shape words each replaced by the
    next one of their list (``appearance``), or unchanged (``none``)."""
    colors, classes = list(PALETTE), list(CLASSES)
    table = {"none": {}, "direction": OPPOSITE,
             "appearance": {**{c: colors[(i + 1) % len(colors)] for i, c in enumerate(colors)},
                            **{c: classes[(i + 1) % len(classes)] for i, c in enumerate(classes)}}}[kind]  # fmt: skip
    return " ".join(table.get(w, w) for w in prompt.split())


@torch.no_grad()
def loss_gap(pipe: WanPipeline, clips: int = 64, sigmas=SIGMAS, kinds=("direction", "appearance"), seed: int = 7,
             num_frames: int = 13, max_sequence_length: int = 16) -> dict:  # fmt: skip
    """Per σ: the loss with the true captions and, per word kind, the loss increase when those words are swapped
    (text padded to ``max_sequence_length`` tokens as ``model=wan_shapes`` runs the pipeline)."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    only_motion = np.eye(len(pw.MOTION_TAGS))[pw.MOTION_TAGS.index("motion")]
    x, prompts = pw.render_batch(rng, clips, set(), num_frames, tag_probs=only_motion)
    x0 = pw.normalised_latents(pipe.vae, x.to(pipe.vae.dtype), sample=False)

    n, _, frames, height, width = x0.shape
    patch = pipe.transformer.config.patch_size
    first_clean = torch.tensor([FIRST_FRAME_LEVELS[0]] + [FIRST_FRAME_LEVELS[1]] * (frames - 1))

    def per_clip_loss(captions, xt, noise, timestep, scored):
        embeds, lengths = pw.encode_text(pipe, captions)
        v = pw.collapsed_velocity(pipe.transformer, xt, timestep, embeds, lengths,
                                  (max_sequence_length - lengths).clamp(min=0))  # fmt: skip
        return (v.float() - (noise - x0))[:, :, scored].pow(2).mean(dim=(1, 2, 3, 4))

    out = {}
    for sigma in (*sigmas, "first_frame_clean"):
        noise = torch.randn(x0.shape, generator=generator)
        if sigma == "first_frame_clean":  # one timestep per token, the noisy frames scored
            levels = first_clean.view(1, 1, frames, 1, 1)
            timestep = pw.token_timesteps(first_clean.expand(n, -1), height, width, patch)
            scored = slice(1, None)
        else:
            levels, timestep, scored = sigma, torch.full((n,), sigma * 1000.0), slice(None)
        xt = (1.0 - levels) * x0 + levels * noise
        base = per_clip_loss(prompts, xt, noise, timestep, scored)
        row = {"loss": round(float(base.mean()), 5)}
        for kind in kinds:
            d = per_clip_loss([swap_words(p, kind) for p in prompts], xt, noise, timestep, scored) - base
            row[kind] = {"increase": round(float(d.mean()), 5), "se": round(float(d.std() / len(d) ** 0.5), 5) if len(d) > 1 else None}
        out[str(sigma)] = row
    return out


@torch.no_grad()
def direction_probe(pipe: WanPipeline, samples: int = 8, steps: int = 10, guidance_scale: float = 4.5, seed: int = 0,
                    num_frames: int = 13) -> dict:  # fmt: skip
    """Same-seed clips for every direction of four (colour, shape) pairs: velocity along the named direction."""
    import rewards

    judge = rewards.load("video_geneval", score="strict")
    pairs = [(CLASSES[i % len(CLASSES)], list(PALETTE)[i]) for i in range(4)]
    along, speed, passed = [], [], []
    for cls, color in pairs:
        for direction in DIRECTIONS:
            meta = motion_metadata_for("motion", cls, color, direction)
            frames = pipe(prompt=[meta["prompt"]] * samples, num_inference_steps=steps, guidance_scale=guidance_scale,
                          num_frames=num_frames, height=64, width=64, max_sequence_length=16,
                          generator=torch.Generator().manual_seed(seed), output_type="np").frames  # fmt: skip
            videos = (np.asarray(frames) * 255).round().astype(np.uint8)
            for verdict in judge.judge(videos, [meta] * samples):
                passed.append(float(verdict.checks.get("motion", 0.0)))
                tracks = sorted((t for ts in verdict.tracks.values() for t in ts), key=lambda t: -len(t.frames))
                if tracks:
                    vx, vy = tracks[0].velocity
                    ux, uy = UNIT[direction]
                    along.append(vx * ux + vy * uy)
                    speed.append(float(np.hypot(vx, vy)))
    n = len(along)
    return {"clips": len(passed), "tracked": n,
            "along": round(float(np.mean(along)), 3) if n else None,
            "along_se": round(float(np.std(along) / n**0.5), 3) if n > 1 else None,
            "speed": round(float(np.mean(speed)), 3) if n else None,
            "motion_check": round(float(np.mean(passed)), 3) if passed else None}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrained", default=str(ROOT / "assets" / "tiny-wan-shapes"), help="a WanPipeline directory")
    p.add_argument("--clips", type=int, default=64, help="rendered clips of the loss measurement")
    p.add_argument("--samples", type=int, default=8, help="generated clips per (pair, direction)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--guidance-scale", type=float, default=4.5)
    p.add_argument("--skip-generation", action="store_true", help="the loss measurement only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not (Path(args.pretrained) / "model_index.json").exists():
        raise SystemExit(f"--pretrained {args.pretrained}: no model_index.json (a WanPipeline.save_pretrained directory)")
    pipe = WanPipeline.from_pretrained(args.pretrained)
    pipe.set_progress_bar_config(disable=True)
    report = {"pretrained": args.pretrained, "loss_gap": loss_gap(pipe, args.clips)}
    if not args.skip_generation:
        report["direction"] = direction_probe(pipe, args.samples, args.steps, args.guidance_scale)
    text = jsonio.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
