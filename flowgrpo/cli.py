"""What ``python train.py`` runs until the GRPO loop lands (issue 4).

It composes and validates the config, builds every object of the run (adapter, sampler, reward, prompt sets,
logger), prints the batch-arithmetic banner, runs ONE batched ODE rollout through the adapter with the
configured guidance for a few training prompts, decodes and scores it, and writes ``preview.png`` and the
resolved ``config.yaml`` into the run dir. It then says plainly that training is not implemented yet.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .build import (batch_plan, build_adapter, build_logger, build_prompts, build_reward, build_sampler,
                    model_kwargs)
from .config import validate

__all__ = ["main", "resolve_output_dir"]

PREVIEW_PROMPTS = 4  # prompts in the preview rollout (one sample each)


def resolve_output_dir(cfg: DictConfig) -> Path:
    """``trainer.output_dir`` when set, else Hydra's run dir (``hydra.runtime.output_dir``). Hydra never
    changes the working directory here (``hydra.job.chdir=false``), so outputs are written to this path."""
    if cfg.trainer.output_dir is not None:
        out = Path(cfg.trainer.output_dir)
    else:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            raise RuntimeError("no Hydra run dir (not started through train.py): set trainer.output_dir=PATH")
        out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _num_processes() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _save_grid(pixels: torch.Tensor, path: Path) -> None:
    """Images ``[B,3,H,W]`` → one row; videos ``[B,T,3,H,W]`` → one row of frames per sample."""
    from torchvision.utils import save_image

    if pixels.ndim == 5:
        nrow = pixels.shape[1]
        pixels = pixels.flatten(0, 1)
    else:
        nrow = pixels.shape[0]
    save_image(pixels.clamp(0, 1), str(path), nrow=nrow, padding=2, pad_value=1.0)


def main(cfg: DictConfig) -> dict[str, Any]:
    """Build everything from ``cfg`` and run the preview rollout. Returns the paths written and the scores."""
    validate(cfg)
    out = resolve_output_dir(cfg)
    OmegaConf.save(cfg, out / "config.yaml", resolve=True)
    torch.manual_seed(cfg.trainer.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    plan = batch_plan(cfg, _num_processes())
    print(plan.banner(), flush=True)

    train_prompts = build_prompts(cfg.data, "train")
    test_prompts = build_prompts(cfg.data, "test")
    reward = build_reward(cfg.reward)
    adapter = build_adapter(cfg.model, device=device)
    sampler = build_sampler(cfg.sampler, adapter=adapter, model=cfg.model)
    logger = build_logger(cfg.logger, output_dir=out, config=OmegaConf.to_container(cfg, resolve=True))
    print(f"model: {cfg.model.family} from {cfg.model.pretrained} ({cfg.model.torch_dtype}, {device}); "
          f"prompts: {len(train_prompts)} train, {len(test_prompts) if test_prompts else 0} held-out; "
          f"reward: {cfg.reward.name}; sampler: {cfg.sampler.name} ({sampler.num_steps} steps, "
          f"sde={sampler.sde}); algo: {cfg.algo.name}", flush=True)

    # One batched ODE rollout over the evaluation schedule, as the held-out evaluation will run it.
    batch = train_prompts.subset(range(min(PREVIEW_PROMPTS, len(train_prompts))))
    mk = model_kwargs(cfg.model)
    from samplers import rollout

    generator = torch.Generator(device).manual_seed(cfg.trainer.seed)
    with torch.no_grad():
        cond = adapter.encode_prompts(batch.prompts, mk["negative_prompt"],
                                      max_sequence_length=mk["max_sequence_length"], **mk["guidance"])
        noise = adapter.prepare_noise(len(batch), generator=generator, **mk["size"])
        steps = sampler.eval_sigmas.shape[0] - 1
        traj = rollout(lambda x, sigma: adapter.velocity(x, sigma, cond, **mk["guidance"]), noise,
                       sampler.eval_sigmas, torch.zeros(steps, dtype=torch.bool), solver="euler")
        pixels = adapter.decode(traj.final).cpu()
        scored = reward(pixels, batch.prompts, batch.metadata)
    grid = out / "preview.png"
    _save_grid(pixels, grid)
    logger.log({"preview/reward": float(scored.scores.mean())}, step=0)
    logger.finish()

    print(f"preview: {len(batch)} prompts, {traj.nfe}-step ODE, guidance {cfg.model.guidance_scale}: "
          f"reward {scored.scores.mean():.3f} → {grid}", flush=True)
    print(f"config: {out / 'config.yaml'}", flush=True)
    print("NOTE: the GRPO training loop is not implemented yet (issue 4); this run only composed the config, "
          "built every component, and rendered one preview rollout.", flush=True)
    return {"output_dir": out, "grid": grid, "config": out / "config.yaml", "scores": scored.scores, "plan": plan}
