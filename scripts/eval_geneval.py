#!/usr/bin/env python
r"""GenEval of a pipeline on the shapes world's held-out prompts (issue 3, "Show it").

    python scripts/eval_geneval.py                                    # the shipped asset, 4 samples per prompt
    python scripts/eval_geneval.py --pretrained outputs/pretrain_tiny/export --grid /tmp/grid.png
    python scripts/eval_geneval.py --lora outputs/DATE/TIME/checkpoints/checkpoint-000100 --tags counting \
        --samples 48 --per-prompt --grid ''                           # a trained run's LoRA, prompt by prompt

Per prompt of ``--prompts`` (``assets/prompts/shapes_test.jsonl``: GenEval metadata JSONL), ``--samples``
images from fixed seeds (sample j of prompt i uses noise seed ``seed + 1000 * i + j``, whatever the batching),
sampled with the deterministic Euler ODE (``samplers.rollout`` with no SDE step) over the pipeline's own
``--steps``-step schedule with classifier-free guidance ``--guidance-scale`` (negative prompt ""), batched.
Scored with ``rewards.load("geneval", detector="shapes")``. Prints JSON: per tag the GenEval (``strict``,
GenEval's benchmark verdict) and Flow-GRPO's partial credit (``partial``), and ``overall`` = the mean over the
six tags (GenEval's convention: tags weigh equally, whatever their number of prompts). Writes a PNG grid:
``--grid-prompts-per-row`` prompts per row in file order (grouped by tag), each prompt's samples side by side.
``--lora`` loads a trainer checkpoint's LoRA (``checkpoint-N`` or its ``lora/`` folder) with ``pipe.load_lora_weights``;
``--tags`` keeps the prompts of some tags; ``--per-prompt`` adds each prompt's mean strict / partial to the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import rewards
import samplers
from flowgrpo.build import tag_rows
from flowgrpo.models import load_adapter

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = ROOT / "assets" / "prompts" / "shapes_test.jsonl"


def load_metadata(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@torch.no_grad()
def generate(adapter, prompts: list[str], seeds: list[int], *, steps: int, guidance_scale: float, height: int,
             width: int, max_sequence_length: int | None) -> torch.Tensor:  # fmt: skip
    """Images ``[B, 3, H, W]`` in [0, 1]: Euler ODE from per-sample seeded noise, CFG in one batched forward."""
    cond = adapter.encode_prompts(prompts, guidance_scale=guidance_scale, max_sequence_length=max_sequence_length)
    generators = [torch.Generator().manual_seed(s) for s in seeds]  # CPU draws: the same noise on any device
    noise = adapter.prepare_noise(len(prompts), height=height, width=width, generator=generators)
    sigmas = adapter.sigmas(steps, height=height, width=width)
    trajectory = samplers.rollout(
        lambda x, sigma: adapter.velocity(x, sigma, cond, guidance_scale=guidance_scale),
        noise,
        sigmas,
        sde_mask=torch.zeros(steps, dtype=torch.bool),
    )
    return adapter.decode(trajectory.latents[:, -1]).clamp(0, 1).cpu()


def grid_image(images: torch.Tensor, columns: int, pad: int = 2) -> Image.Image:
    """Images ``[N, 3, H, W]`` in row-major order on a light grey canvas."""
    n, _, h, w = images.shape
    rows = (n + columns - 1) // columns
    canvas = np.full((rows * (h + pad) + pad, columns * (w + pad) + pad, 3), 200, dtype=np.uint8)
    arrays = (images.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    for k, a in enumerate(arrays):
        r, c = divmod(k, columns)
        canvas[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = a
    return Image.fromarray(canvas)


def evaluate(args) -> dict:
    torch.set_num_threads(args.threads)
    metadata = load_metadata(args.prompts)
    if args.tags is not None:
        rows = tag_rows(metadata, [t.strip() for t in args.tags.split(",") if t.strip()], "--tags", str(args.prompts))
    else:
        rows = list(range(len(metadata)))
    adapter = load_adapter("sd3", str(args.pretrained), device=args.device)
    if args.lora:
        lora = Path(args.lora)
        lora = lora / "lora" if (lora / "lora").is_dir() else lora
        if not (lora / "pytorch_lora_weights.safetensors").is_file():
            raise SystemExit(f"--lora {args.lora}: no pytorch_lora_weights.safetensors there or in its lora/ folder")
        adapter.pipe.load_lora_weights(str(lora))
    reward = rewards.load("geneval", detector="shapes")
    metadata = [metadata[i] for i in rows]
    jobs = [(k, j) for k in range(len(metadata)) for j in range(args.samples)]
    images, scores, t0 = [], [], time.time()
    for start in range(0, len(jobs), args.batch):
        chunk = jobs[start : start + args.batch]
        prompts = [metadata[i]["prompt"] for i, _ in chunk]
        seeds = [args.seed + 1000 * rows[i] + j for i, j in chunk]  # the prompt's file row: --tags keeps its images
        x = generate(adapter, prompts, seeds, steps=args.steps, guidance_scale=args.guidance_scale, height=64,
                     width=64, max_sequence_length=args.max_sequence_length)  # fmt: skip
        out = reward(x, prompts, [metadata[i] for i, _ in chunk])
        images.append(x)
        scores.append(out.components)
    components = {k: torch.cat([s[k] for s in scores]) for k in scores[0]}
    tags = list(dict.fromkeys(m["tag"] for m in metadata))
    per_tag = {
        tag: {
            "strict": round(torch.nanmean(components[f"strict/{tag}"]).item(), 4),
            "partial": round(torch.nanmean(components[f"partial/{tag}"]).item(), 4),
            "n": int((~torch.isnan(components[f"strict/{tag}"])).sum()),
        }
        for tag in tags
    }
    result = {
        "pretrained": str(args.pretrained),
        "prompts": str(args.prompts),
        "samples_per_prompt": args.samples,
        "steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "seed": args.seed,
        "per_tag": per_tag,
        "overall": round(float(np.mean([v["strict"] for v in per_tag.values()])), 4),
        "overall_partial": round(float(np.mean([v["partial"] for v in per_tag.values()])), 4),
        "seconds": round(time.time() - t0, 1),
    }
    if args.per_prompt:
        strict, partial = (components[k].view(len(metadata), args.samples) for k in ("strict", "partial"))
        result["per_prompt"] = [{"prompt": m["prompt"], "tag": m["tag"], "strict": round(strict[i].mean().item(), 4),
                                 "partial": round(partial[i].mean().item(), 4)} for i, m in enumerate(metadata)]
    if args.lora:
        result["lora"] = str(args.lora)
    if args.grid:
        grid_image(torch.cat(images), columns=args.samples * args.grid_prompts_per_row).save(args.grid)
        result["grid"] = str(args.grid)
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pretrained", default=str(ROOT / "assets" / "tiny-sd3-shapes"), help="pipeline directory")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="GenEval metadata JSONL")
    p.add_argument("--samples", type=int, default=4, help="images per prompt (GenEval: 4)")
    p.add_argument("--steps", type=int, default=10, help="Euler ODE steps")
    p.add_argument("--guidance-scale", type=float, default=4.5, help="CFG scale (conf/model/sd3_shapes.yaml)")
    p.add_argument("--max-sequence-length", type=int, default=None, help="zero T5 tokens (None: pipeline default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=64, help="images per forward batch")
    p.add_argument("--grid", default=None, help="PNG grid ('' for none; default: the asset's sample sheet, "
                   "or none with --lora / --tags / --prompts so that the shipped sheet is never overwritten)")
    p.add_argument("--grid-prompts-per-row", type=int, default=2, help="prompts per grid row")
    p.add_argument("--json-out", default=None, help="also write the JSON here")
    p.add_argument("--lora", default=None, help="a trainer checkpoint dir (checkpoint-N or its lora/) to load first")
    p.add_argument("--tags", default=None, help="comma-separated GenEval tags to keep (default: all)")
    p.add_argument("--per-prompt", action="store_true", help="add each prompt's mean strict / partial")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.grid is None:
        own = args.lora is None and args.tags is None and Path(args.prompts) == DEFAULT_PROMPTS
        args.grid = str(ROOT / "assets" / "tiny-sd3-shapes-samples.png") if own else ""
    result = evaluate(args)
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
