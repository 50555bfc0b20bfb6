#!/usr/bin/env python
r"""Held-out GenEval of a pipeline with the trainer's evaluation protocol, images or videos.

    python scripts/eval_geneval.py                                    # the shipped asset: the trainer's iteration-0 eval
    python scripts/eval_geneval.py --pretrained outputs/pretrain_tiny/export --grid /tmp/grid.png
    python scripts/eval_geneval.py --lora outputs/DATE/TIME/checkpoints/checkpoint-000100 --tags counting \
        --samples 48 --per-prompt                                     # a trained run's LoRA, prompt by prompt
    python scripts/eval_geneval.py --video --grid /tmp/sheet.png      # the moving-shapes video world, a sample sheet
    python scripts/eval_geneval.py --set model=wan_shapes --set reward=video_geneval --set data=motion_shapes \
        --grid /tmp/sheet.png                                         # the same, spelled out

The protocol is :mod:`flowgrpo.evaluation`'s, the code ``Trainer.evaluate`` runs, on the config ``python train.py``
composes (``--set`` adds any override of its command line, e.g. ``--set model=tiny_sd3``): per held-out prompt of
``data.val_file`` (``--prompts``), ``trainer.eval_samples_per_prompt`` images (``--samples``), raised so that
every tag gets at least ``trainer.eval_samples_per_tag`` (``--samples-per-tag``; the shapes test set: 48, so 300
images); sample j of prompt i starts from the noise of the generator seeded by ``(trainer.eval_seed, i, j)``
(``--seed``), whatever the batching or the tags kept; deterministic Euler ODE over ``sampler.eval_num_steps``
(``--steps``) steps of the pipeline's own schedule, classifier-free guidance ``model.guidance_scale``
(``--guidance-scale``, negative prompt ``model.negative_prompt``), batched; scored by ``reward`` (GenEval with the
shapes detector). With no flags it scores the very samples of the trainer's evaluation at iteration 0 and prints
the same overall score.

Videos: ``--video`` is short for ``--set model=wan_shapes --set reward=video_geneval --set data=motion_shapes``
(the embedded moving-shapes text-to-video pipeline, the ``video_geneval`` reward, the moving-shapes held-out
prompts); ``--set`` overrides come after it and win (``--video --set model=tiny_wan``). Everything below holds
for clips as for images ("images" then counts clips): the video reward returns the same ``strict`` / ``partial``
and per-tag columns for its tags (``motion``, ``two_object_motion``, ``counting``, ``colors``, ``speed``,
``static``).

Prints JSON: per tag the GenEval (``strict``, GenEval's benchmark verdict), Flow-GRPO's partial credit
(``partial``) and the number of images ``n``; ``overall`` / ``overall_partial`` = the mean over tags
(:func:`rewards.geneval_summary`: tags weigh equally, whatever their number of prompts), what the trainer logs as
``eval/geneval`` / ``eval/geneval_partial``. ``--lora`` loads a trainer checkpoint's LoRA (``checkpoint-N`` or
its ``lora/`` folder) with ``pipe.load_lora_weights``; ``--tags`` keeps the prompts of some tags (their images
are those of the full evaluation); ``--per-prompt`` adds each prompt's mean strict / partial; ``--grid`` writes a
PNG. Images: ``--grid-prompts-per-row`` prompts per row in file order (grouped by tag), each prompt's first
``--grid-samples`` images (default 4) side by side, unlabelled. Videos: a sample sheet, one labelled row per clip,
each prompt's first ``--grid-samples`` clips (default 1) in file order: a strip of the clip's frames (all of
them, or ``--grid-frames`` = 13 evenly spaced ones, first and last included), upscaled by nearest neighbour by
an integer factor until a frame is at least 96 pixels high and wide (a 64x64 frame shows at 128x128), under a
white label band with the prompt and the verdict -- ``[tag] #j`` (the clip's seed index), ``strict PASS`` or
``strict FAIL``, ``partial`` credit, and every check that failed (the reward's ``check/<name>`` components at 0,
e.g. ``motion x``, ``identity x``); cells framed in grey. The sheet is :func:`flowgrpo.gallery.labelled_grid`,
the training galleries' renderer.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from flowgrpo import jsonio
from flowgrpo.builders import batch_plan, build_adapter, build_prompts, build_reward, build_sampler, model_kwargs, tag_rows
from flowgrpo.evaluation import held_out_jobs, score_jobs
from flowgrpo.gallery import labelled_grid, to_uint8
from rewards import geneval_prefixes

ROOT = Path(__file__).resolve().parents[1]
VIDEO = ("model=wan_shapes", "reward=video_geneval", "data=motion_shapes")  # --video
SHEET_MIN_SIDE = 96  # a video sheet's frames are upscaled (nearest, integer factor) until both sides reach this


def compose(overrides: list[str]):
    """The config ``python train.py OVERRIDES`` composes."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import flowgrpo.config  # noqa: F401  (registers the schemas)

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def _per_tag(text: str) -> int:
    return 0 if text.lower() in ("none", "null") else int(text)


def grid_image(cells: list[torch.Tensor | None], columns: int, pad: int = 2) -> Image.Image:
    """Images ``[3, H, W]`` (None: an empty cell) in row-major order on a light grey canvas."""
    h, w = next(c for c in cells if c is not None).shape[-2:]
    rows = (len(cells) + columns - 1) // columns
    canvas = np.full((rows * (h + pad) + pad, columns * (w + pad) + pad, 3), 200, dtype=np.uint8)
    for k, cell in enumerate(cells):
        if cell is None:
            continue
        r, c = divmod(k, columns)
        a = (cell.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        canvas[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = a
    return Image.fromarray(canvas)


def verdict_notes(components: dict[str, torch.Tensor], prefix: str, row: int) -> list[str]:
    """A sheet label's verdict of scored row ``row``: ``strict PASS|FAIL``, ``partial 0.57`` and ``<check> x`` per
    failed check (a ``<prefix>check/<name>`` component at 0; NaN: the check does not apply)."""
    notes = [f"strict {'PASS' if components[f'{prefix}strict'][row] >= 0.5 else 'FAIL'}",
             f"partial {float(components[f'{prefix}partial'][row]):.2f}"]
    checks = f"{prefix}check/"
    for name, values in components.items():
        if name.startswith(checks) and float(values[row]) == 0.0:
            notes.append(f"{name[len(checks):]} x")
    return notes


def sample_sheet(videos: dict[int, torch.Tensor], samples, prefix: str, max_frames: int) -> Image.Image:
    """The labelled sheet of the clips ``{row: [T, 3, H, W]}`` of scored ``samples``, one row per clip in job order."""
    rows = sorted(videos)
    meta = samples.prompts.metadata
    notes = [[f"[{meta[r]['tag']}] #{samples.jobs[r][1]}" if meta else f"#{samples.jobs[r][1]}",
              *verdict_notes(samples.components, prefix, r)] for r in rows]
    return labelled_grid(torch.stack([videos[r] for r in rows]), [samples.prompts.prompts[r] for r in rows], notes,
                         columns=1, max_frames=max_frames, min_side=SHEET_MIN_SIDE)


def autocast_factory(mixed_precision: str, device: str):
    """The autocast the trainer's accelerator applies around each velocity for ``trainer.mixed_precision``."""
    if mixed_precision == "no":
        return nullcontext
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
    return partial(torch.autocast, device_type=torch.device(device).type, dtype=dtype)


def config(args):
    """The composed config with the flags applied (they override ``--set``)."""
    cfg = compose([*(VIDEO if args.video else ()), *args.set])
    flags = {
        ("model", "pretrained"): args.pretrained,
        ("model", "guidance_scale"): args.guidance_scale,
        ("model", "max_sequence_length"): args.max_sequence_length,
        ("data", "val_file"): args.prompts,
        ("sampler", "eval_num_steps"): args.steps,
        ("trainer", "eval_seed"): args.seed,
        ("trainer", "eval_samples_per_prompt"): args.samples,
    }
    for (group, key), value in flags.items():
        if value is not None:
            cfg[group][key] = value
    if args.samples_per_tag is not None:
        cfg.trainer.eval_samples_per_tag = args.samples_per_tag or None
    return cfg


def evaluate(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config(args)
    t = cfg.trainer
    prompts = build_prompts(cfg.data, "val")
    if prompts is None:
        raise SystemExit("data.val_file is null: no held-out prompts to evaluate (give --prompts)")
    tags = None
    if args.tags is not None:
        tags = [s.strip() for s in args.tags.split(",") if s.strip()]
        tag_rows(prompts.metadata or [], tags, "--tags", prompts.source)  # names --tags when a tag is unknown
    jobs = held_out_jobs(prompts, t.eval_samples_per_prompt, t.eval_samples_per_tag, num_prompts=t.eval_num_prompts,
                         tags=tags)
    adapter = build_adapter(cfg.model, device=args.device)
    if args.lora:
        lora = Path(args.lora)
        lora = lora / "lora" if (lora / "lora").is_dir() else lora
        if not (lora / "pytorch_lora_weights.safetensors").is_file():
            raise SystemExit(f"--lora {args.lora}: no pytorch_lora_weights.safetensors there or in its lora/ folder")
        adapter.pipe.load_lora_weights(str(lora))
    reward = build_reward(cfg.reward)
    sigmas = build_sampler(cfg.sampler, adapter=adapter, model=cfg.model).eval_sigmas
    batch = args.batch or batch_plan(cfg, 1).rollout_batch_per_process  # the trainer's batches by default
    images, videos = [], {}  # the grid's images; the sheet's clips by row, uint8 (only the clips it shows)

    def keep(start, p, x, out):
        if x.ndim == 4:
            images.append(x.cpu())
            return
        shown = args.grid_samples or 1
        for k in range(x.shape[0]):
            if jobs[start + k][1] < shown:
                videos[start + k] = to_uint8(x[k])

    t0 = time.time()
    samples = score_jobs(adapter, reward, prompts, jobs, seed=t.eval_seed, sigmas=sigmas, model_kw=model_kwargs(cfg.model),
                         batch_size=batch, autocast=autocast_factory(t.mixed_precision, args.device),
                         on_batch=keep if args.grid else None)
    seconds = time.time() - t0
    found = geneval_prefixes(samples.components)
    if len(found) != 1:
        raise SystemExit(f"reward={cfg.reward.name}: {len(found)} GenEval rewards among its components "
                         f"{sorted(samples.components)}; this script summarises exactly one")
    prefix = found[0]
    summary = samples.geneval(prefix)
    result = {
        "pretrained": str(cfg.model.pretrained),
        "prompts": prompts.source,
        "samples_per_prompt": t.eval_samples_per_prompt,
        "samples_per_tag": t.eval_samples_per_tag,
        "images": len(jobs),
        "steps": cfg.sampler.eval_num_steps,
        "guidance_scale": cfg.model.guidance_scale,
        "seed": t.eval_seed,
        "per_tag": {tag: {"strict": round(v["strict"], 4), "partial": round(v["partial"], 4), "n": v["n"]}
                    for tag, v in summary["per_tag"].items()},
        "overall": round(summary["overall"], 4),
        "overall_partial": round(summary["overall_partial"], 4),
        "seconds": round(seconds, 1),
    }
    rows_of: dict[int, list[int]] = {}
    for row, (i, _) in enumerate(samples.jobs):
        rows_of.setdefault(i, []).append(row)
    if args.per_prompt:
        strict, partial_ = samples.components[f"{prefix}strict"], samples.components[f"{prefix}partial"]
        result["per_prompt"] = [
            {"prompt": prompts.prompts[i], "tag": prompts.metadata[i]["tag"] if prompts.metadata else None,
             "strict": round(strict[rows].mean().item(), 4), "partial": round(partial_[rows].mean().item(), 4),
             "n": len(rows)}
            for i, rows in rows_of.items()
        ]
    if args.lora:
        result["lora"] = str(args.lora)
    if args.grid and videos:
        sample_sheet(videos, samples, prefix, args.grid_frames).save(args.grid)
        result["grid"] = str(args.grid)
    elif args.grid:
        every = torch.cat(images)
        width = min(args.grid_samples or 4, max(len(rows) for rows in rows_of.values()))
        cells = [every[rows[k]] if k < len(rows) else None for rows in rows_of.values() for k in range(width)]
        grid_image(cells, columns=width * args.grid_prompts_per_row).save(args.grid)
        result["grid"] = str(args.grid)
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a train.py override (repeatable), e.g. --set model=tiny_sd3; the flags below win over it")
    p.add_argument("--video", action="store_true",
                   help=f"the moving-shapes video world: --set {' --set '.join(VIDEO)} before the other --set")
    p.add_argument("--pretrained", default=None, help="pipeline directory (default: model.pretrained)")
    p.add_argument("--prompts", default=None, help="GenEval metadata JSONL (default: data.val_file)")
    p.add_argument("--samples", type=int, default=None,
                   help="images per prompt (default: trainer.eval_samples_per_prompt; GenEval: 4)")
    p.add_argument("--samples-per-tag", type=_per_tag, default=None,
                   help="at least this many images per tag, 0 or 'none' for no minimum "
                   "(default: trainer.eval_samples_per_tag)")
    p.add_argument("--steps", type=int, default=None, help="Euler ODE steps (default: sampler.eval_num_steps)")
    p.add_argument("--guidance-scale", type=float, default=None, help="CFG scale (default: model.guidance_scale)")
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help="text-encoder tokens (default: model.max_sequence_length)")
    p.add_argument("--seed", type=int, default=None, help="held-out seed (default: trainer.eval_seed)")
    p.add_argument("--batch", type=int, default=None,
                   help="images per forward batch (default: the trainer's rollout batch; seeds are per image)")
    p.add_argument("--grid", default=None,
                   help="write a PNG here: a grid of the images, or for videos a labelled sample sheet")
    p.add_argument("--grid-samples", type=int, default=None,
                   help="samples per prompt in the grid (default: 4 images, 1 video)")
    p.add_argument("--grid-prompts-per-row", type=int, default=2, help="prompts per image-grid row")
    p.add_argument("--grid-frames", type=int, default=13,
                   help="frames per clip in a video sheet, evenly spaced (all when the clip has fewer)")
    p.add_argument("--json-out", default=None, help="also write the JSON here")
    p.add_argument("--lora", default=None, help="a trainer checkpoint dir (checkpoint-N or its lora/) to load first")
    p.add_argument("--tags", default=None, help="comma-separated GenEval tags to keep (default: all)")
    p.add_argument("--per-prompt", action="store_true", help="add each prompt's mean strict / partial")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave torch's setting)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = evaluate(args)
    text = jsonio.dumps(result, indent=2)
    print(text, flush=True)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
