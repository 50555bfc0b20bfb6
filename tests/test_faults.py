"""Faults injected on purpose: a non-finite loss skips the optimizer update (the weights stay as they were), a run
with too many in a row stops with an error and finite checkpoints, and a transient one is survived and counted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.checkpoint import CheckpointManager
from flowgrpo.trainer import NonFiniteError, Trainer

CONF = str(Path(__file__).resolve().parents[1] / "conf")
BASE = ["model=tiny_sd3", "reward=jpeg_compressibility", "logger=none", "sampler.num_steps=4", "algo.window.size=2",
        "trainer.prompts_per_iteration=2", "trainer.group_size=2", "trainer.train_batch_size=4",
        "trainer.gradient_accumulation_steps=1", "trainer.eval_before=false", "trainer.eval_every=0",
        "trainer.gallery_every=0", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=10", "trainer.lr=3e-2"]


def make(tmp_path, *overrides) -> Trainer:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[*BASE, f"trainer.output_dir={tmp_path}", *overrides])
    return Trainer(cfg, tmp_path)


def poison(trainer: Trainer, iterations: set[int]) -> None:
    """Make the algorithm's loss NaN at the given iterations (as a diverged model or a broken reward would)."""
    loss_fn = trainer.algorithm.loss

    def loss(ctx, batch, rows, steps):
        value, info = loss_fn(ctx, batch, rows, steps)
        return (value * float("nan") if ctx.iteration in iterations else value), info

    trainer.algorithm.loss = loss


def weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


def test_repeated_non_finite_updates_stop_the_run_with_finite_weights_and_checkpoints(tmp_path):
    trainer = make(tmp_path, "trainer.iterations=6", "trainer.max_skipped_updates=2")
    poison(trainer, {1, 2, 3, 4, 5})
    with pytest.raises(NonFiniteError, match=r"2 optimizer updates in a row.*trainer\.max_skipped_updates=2"):
        trainer.fit()
    assert trainer.skipped_updates == 2 and trainer.updates == 1  # iteration 0 stepped; 1 and 2 were skipped
    good = torch.load(CheckpointManager(tmp_path / "checkpoints").latest() / "state.pt", weights_only=False)
    assert good["iteration"] == 2 and good["skipped_updates"] == 1
    for saved, live in zip(good["trainable"].values(), trainer.params):
        assert torch.isfinite(saved).all() and torch.equal(saved, live.detach())  # nothing moved after iteration 0


def test_a_transient_non_finite_update_is_skipped_counted_and_survived(tmp_path):
    trainer = make(tmp_path, "trainer.iterations=3")
    poison(trainer, {1})
    before = None

    step = trainer.step

    def watched_step():
        nonlocal before
        if trainer.iteration == 1:
            before = weights(trainer)
        scalars = step()
        if trainer.iteration == 2:  # iteration 1's update was skipped: the weights did not move
            assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))
            assert scalars["train/skipped_updates"] == 1 and math.isnan(scalars["train/loss"])
        return scalars

    trainer.step = watched_step
    summary = trainer.fit()
    assert summary["skipped_updates"] == 1 and summary["updates"] == 2 and trainer.iteration == 3
    assert all(torch.isfinite(p).all() for p in trainer.params)
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])  # the log kept going
