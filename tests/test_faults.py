"""Faults injected on purpose: a non-finite loss skips the optimizer update (the weights stay as they were), a run
with too many in a row stops with an error and finite checkpoints, and a transient one is survived and counted; an
exception in the loop checkpoints the last completed iteration (resuming then equals a run that never failed);
trainer.resume finds runs and skips corrupt checkpoints; a full disk; a reward server that is down for a while.
docs/reliability.md lists them."""

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
        "trainer.gallery_every=0", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=10", "trainer.lr=3e-2",
        # the final held-out evaluation on 2 prompts, one image each, 2 steps (the default 300 images take minutes)
        "trainer.eval_num_prompts=2", "trainer.eval_samples_per_tag=null", "sampler.eval_num_steps=2"]


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


def test_an_update_that_blows_the_weights_up_is_rolled_back_and_the_run_stops_with_the_weights_before_it(tmp_path):
    """lr 1e6 keeps the loss and gradient finite but makes the LoRA weights huge: each such step moves the weights
    by far more than trainer.max_update_ratio times their norm, is undone (weights and optimizer state), counted as
    skipped, and after trainer.max_skipped_updates in a row the run stops with the weights it started with; no
    checkpoint holds diverged weights."""
    trainer = make(tmp_path, "trainer.iterations=4", "trainer.lr=1e6", "trainer.max_skipped_updates=2")
    start = weights(trainer)
    with pytest.raises(NonFiniteError, match=r"2 optimizer updates in a row.*times their norm.*rolled back") as info:
        trainer.fit()
    assert "trainer.resume_force=true" in str(info.value)  # resuming at a lower lr is a change of the run
    assert trainer.skipped_updates == 2 and trainer.updates == 0
    # what the run recommends resuming from is the checkpoint of iteration 1, whose weights are the starting ones
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resume_from"].endswith("checkpoint-000001") and summary["error"]["iteration"] == 2
    for before, live in zip(start, trainer.params):
        assert torch.equal(before, live.detach())
    assert all(not s for s in trainer.optimizer.state.values())  # the undone steps left no Adam moments
    for path in CheckpointManager(tmp_path / "checkpoints").checkpoints():
        saved = torch.load(path[1] / "state.pt", weights_only=False)["trainable"]
        assert all(torch.equal(a, b) for a, b in zip(saved.values(), start))


def test_a_full_fine_tuning_update_that_blows_the_weights_up_is_rolled_back_too(tmp_path):
    """The same guard with model.finetune=full (its copy kept on the host): every weight of the transformer is
    trained, lr 1e6 blows them up, each step is undone (weights and Adam moments), counted, and the run stops after
    trainer.max_skipped_updates naming the last good checkpoint; no checkpoint holds diverged weights."""
    from diffusers import SD3Transformer2DModel

    trainer = make(tmp_path, "model.finetune=full", "trainer.iterations=4", "trainer.lr=1e6",
                   "trainer.max_skipped_updates=2")
    start = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters()}
    assert len(trainer.params) == len(start)  # every transformer weight is trained
    with pytest.raises(NonFiniteError, match=r"2 optimizer updates in a row.*times their norm.*rolled back") as info:
        trainer.fit()
    assert trainer._update_guard is True and trainer.skipped_updates == 2 and trainer.updates == 0
    assert any("checkpoint-000001" in note for note in info.value.__notes__)  # the last good one, named
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resume_from"].endswith("checkpoint-000001") and summary["error"]["iteration"] == 2
    for n, p in trainer.unwrapped.named_parameters():
        assert torch.equal(start[n], p.detach()), n
    assert all(not s for s in trainer.optimizer.state.values())
    manager = CheckpointManager(tmp_path / "checkpoints")
    assert [s for s, _ in manager.checkpoints()] == [1]
    saved = SD3Transformer2DModel.from_pretrained(manager.path(1) / "transformer")
    assert all(torch.equal(p, start[n]) for n, p in saved.named_parameters())


def test_a_rollout_that_is_not_finite_stops_the_run_and_no_checkpoint_of_those_weights_is_resumed(tmp_path):
    """The weights after iteration 2 draw NaN samples in iteration 3 (as a diverged model does): the run stops there
    with NonFiniteError before any reward reads them, writes no crash checkpoint, marks iteration 2's checkpoint
    (those weights) as diverged, and what it recommends — and what resume=auto takes — is iteration 1's."""
    trainer = make(tmp_path, "trainer.iterations=4", "trainer.checkpoint_every=1")
    real = trainer.rollout

    def rollout(batch, iteration):
        batch = real(batch, iteration)
        if iteration == 2:
            batch.latents[1, -1] = float("nan")
        return batch

    trainer.rollout = rollout
    with pytest.raises(NonFiniteError, match=r"iteration 3: 1 of the rollout's samples are not finite.*checkpoint-000001"):
        trainer.fit()
    manager = CheckpointManager(tmp_path / "checkpoints")
    assert [s for s, _ in manager.checkpoints()] == [1, 2]  # no crash checkpoint written
    assert "marked diverged" in manager.verify(manager.path(2)) and manager.latest() == manager.path(1)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["checkpoint"] is None and summary["resume_from"].endswith("checkpoint-000001")
    again = make(tmp_path, "trainer.iterations=4", "trainer.checkpoint_every=1", f"trainer.resume={tmp_path}")
    with pytest.warns(RuntimeWarning, match="marked diverged"):
        assert again.maybe_resume()
    assert again.iteration == 1


def test_finite_latents_that_decode_to_inf_are_caught_before_the_reward(tmp_path):
    """Weights that blow the latents up without making them infinite decode to inf or NaN pixels (clamping would
    hide an inf): caught after decoding, before the reward reads them, as a divergence of the weights that drew
    them (iteration 2's checkpoint is marked; iteration 1's is recommended)."""
    trainer = make(tmp_path, "trainer.iterations=4")
    real_decode, real_reward, scored = trainer.adapter.decode, trainer.reward, []

    def decode(latents):
        images = real_decode(latents)
        return images * float("inf") if trainer.iteration == 2 else images

    def reward(images, prompts, metadata=None):
        scored.append(trainer.iteration)
        return real_reward(images, prompts, metadata)

    trainer.adapter.decode, trainer.reward = decode, reward
    with pytest.raises(NonFiniteError, match=r"iteration 3: 4 of the decoded samples are not finite.*checkpoint-000001"):
        trainer.fit()
    assert scored == [0, 1]  # the reward never saw iteration 3's pixels
    manager = CheckpointManager(tmp_path / "checkpoints")
    assert "marked diverged" in manager.verify(manager.path(2)) and manager.latest() == manager.path(1)


def test_samples_that_are_not_finite_before_any_update_blame_the_model_and_write_no_checkpoint(tmp_path):
    """NaN samples in iteration 1 come from the model itself (or its precision), not from training: the error says
    so, and no checkpoint is written or recommended."""
    trainer = make(tmp_path, "trainer.iterations=2")
    real = trainer.rollout

    def rollout(batch, iteration):
        batch = real(batch, iteration)
        batch.latents[0, -1] = float("inf")
        return batch

    trainer.rollout = rollout
    with pytest.raises(NonFiniteError, match=r"iteration 1: 1 of the rollout's samples are not finite before any "
                                             r"update: check model\.pretrained") as info:
        trainer.fit()
    assert "nothing to resume from" in "\n".join(info.value.__notes__)
    assert not CheckpointManager(tmp_path / "checkpoints").checkpoints()


_SMALL = ["logger=none", "trainer.prompts_per_iteration=2", "trainer.group_size=2", "trainer.train_batch_size=4",
          "trainer.gradient_accumulation_steps=1", "trainer.eval_before=false", "trainer.eval_at_end=false",
          "trainer.eval_every=0", "trainer.gallery_every=0", "trainer.checkpoint_every=0", "trainer.iterations=3",
          "trainer.lr=1e6", "trainer.max_skipped_updates=2"]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("world", [["experiment=video_shapes", "trainer.rollout_batch_size=null"],
                                   ["experiment=stream_grpo_shapes", "data.max_prompts=8"]], ids=["video", "stream"])
def test_a_blow_up_is_rolled_back_on_the_video_and_streaming_worlds_too(tmp_path, world):
    """The same lr 1e6 on the embedded text-to-video (AWM) and streaming (streaming GRPO) models: every step is
    undone, the run stops after max_skipped_updates with the weights it started with."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[*world, *_SMALL, f"trainer.output_dir={tmp_path}"])
    trainer = Trainer(cfg, tmp_path)
    start = weights(trainer)
    with pytest.raises(NonFiniteError, match=r"2 optimizer updates in a row.*times their norm.*rolled back"):
        trainer.fit()
    assert trainer.skipped_updates == 2 and trainer.updates == 0
    assert all(torch.equal(a, b.detach()) for a, b in zip(start, trainer.params))


def test_an_ordinary_update_is_not_taken_for_a_divergence(tmp_path):
    # LoRA at the tests' learning rate, full fine-tuning at one of its own (1e-4: published full fine-tunes use 1e-5)
    for finetune, lr in (("lora", 3e-2), ("full", 1e-4)):
        trainer = make(tmp_path / finetune, "trainer.iterations=2", f"model.finetune={finetune}", f"trainer.lr={lr}")
        trainer.fit()
        assert trainer.skipped_updates == 0 and trainer.updates > 0 and trainer._update_guard is True, finetune


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


# ------------------------------------------------------------------------------------- crash checkpoints

CRASH = ["trainer.iterations=3", "trainer.checkpoint_every=0", "trainer.inner_epochs=2"]  # 2 updates / iteration


def _rows(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("straight")
    trainer = make(out, *CRASH)
    summary = trainer.fit()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"params": weights(trainer), "history": _rows(trainer.history), "evals": trainer.evals,
            "summary": summary, "metrics": _rows(metrics)}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("where,done,failed,phase", [
    ("reward", 1, 2, "score"),
    ("update", 1, 2, "update"),
    ("log", 2, 2, "between iterations (logging, gallery, evaluation or checkpoint)"),
], ids=["reward", "update", "log"])
def test_an_exception_checkpoints_the_last_iteration_and_resuming_equals_an_uninterrupted_run(tmp_path, capsys, where,
                                                                                            done, failed, phase,
                                                                                            uninterrupted):
    """The reward server goes down in iteration 2 (before any weight moved), the update fails after the iteration's
    first optimizer step, or logging fails after iteration 2: the checkpoint is the last completed iteration's,
    summary.json holds the error (numbered from 1, as the checkpoints), and trainer.resume=auto in the same run dir
    finishes the run exactly as if nothing had happened."""
    trainer = make(tmp_path, *CRASH)
    if where == "reward":
        real = trainer.reward

        def reward(images, prompts, metadata=None):
            if trainer.iteration == 1:
                raise ConnectionError("reward server down")
            return real(images, prompts, metadata)

        trainer.reward = reward
    elif where == "update":
        loss_fn, calls = trainer.algorithm.loss, {"n": 0}

        def loss(ctx, batch, rows, steps):
            if ctx.iteration == 1:
                calls["n"] += 1
                if calls["n"] == 3:  # second inner epoch: the first update of the iteration is done
                    raise ConnectionError("reward server down")
            return loss_fn(ctx, batch, rows, steps)

        trainer.algorithm.loss = loss
    else:
        real_log = trainer.logger.log

        def log(scalars, step):
            if step == 2:
                raise ConnectionError("reward server down")
            return real_log(scalars, step)

        trainer.logger.log = log
    with pytest.raises(ConnectionError, match="reward server down") as info:
        trainer.fit()
    assert trainer._weights_touched == (where != "reward")
    assert any("resume with trainer.resume=" in note for note in info.value.__notes__)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["error"] == {"type": "ConnectionError", "message": "reward server down", "iteration": failed,
                                "phase": phase}
    assert summary["stopped"] == f"error in iteration {failed}"
    assert summary["iterations"] == done and summary["checkpoint"].endswith(f"checkpoint-{done:06d}")
    manager = CheckpointManager(tmp_path / "checkpoints")
    assert [s for s, _ in manager.checkpoints()] == [done] and manager.verify(manager.path(done)) is None
    assert manager.load(manager.path(done))["history"] == trainer.history[:done]

    resumed = make(tmp_path, *CRASH, "trainer.resume=auto")
    capsys.readouterr()
    summary = resumed.fit()
    assert "trainer.resume=auto: resumed from" in capsys.readouterr().out
    assert summary["iterations"] == 3 and summary["updates"] == uninterrupted["summary"]["updates"]
    assert all(torch.equal(a, b) for a, b in zip(weights(resumed), uninterrupted["params"]))
    assert _rows(resumed.history) == uninterrupted["history"]
    assert resumed.evals == uninterrupted["evals"]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert _rows(metrics) == uninterrupted["metrics"]


FULL = ["model.finetune=full", "trainer.lr=1e-3", "trainer.ema.enabled=true"]


def _fail_after_first_update(trainer: Trainer) -> None:
    """The update of iteration 2 raises once its first optimizer step is done (2 inner epochs, 1 update each)."""
    loss_fn, calls = trainer.algorithm.loss, {"n": 0}

    def loss(ctx, batch, rows, steps):
        if ctx.iteration == 1:
            calls["n"] += 1
            if calls["n"] == 3:
                raise ConnectionError("reward server down")
        return loss_fn(ctx, batch, rows, steps)

    trainer.algorithm.loss = loss


@pytest.mark.usefixtures("one_thread")
def test_full_fine_tuning_checkpoints_the_last_iteration_from_the_update_guards_copy(tmp_path, capsys):
    """Full fine-tuning (with an EMA): an error after iteration 2's first optimizer step still checkpoints iteration
    1, built from the host copy the update guard (trainer.max_update_ratio) took before that step, and resuming from
    it finishes exactly as a run that never failed. With the guard off no copy exists: no crash checkpoint, and
    summary.json says why."""
    straight = make(tmp_path / "straight", *CRASH, *FULL)
    straight.fit()
    trainer = make(tmp_path / "run", *CRASH, *FULL)
    _fail_after_first_update(trainer)
    with pytest.raises(ConnectionError, match="reward server down"):
        trainer.fit()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == 1 and summary["checkpoint"].endswith("checkpoint-000001")
    resumed = make(tmp_path / "run", *CRASH, *FULL, "trainer.resume=auto")
    capsys.readouterr()
    assert resumed.fit()["updates"] == straight.updates
    assert "trainer.resume=auto: resumed from" in capsys.readouterr().out
    assert all(torch.equal(a, b) for a, b in zip(weights(resumed), weights(straight)))
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.shadow, straight.ema.shadow))
    assert _rows(resumed.history) == _rows(straight.history)

    off = make(tmp_path / "off", *CRASH, *FULL, "trainer.max_update_ratio=null")
    _fail_after_first_update(off)
    with pytest.raises(ConnectionError, match="reward server down"):
        off.fit()
    summary = json.loads((tmp_path / "off" / "summary.json").read_text())
    assert summary["checkpoint"] is None and "trainer.max_update_ratio=null keeps no copy" in summary["note"]
    assert summary["resume_from"] is None  # no periodic checkpoint either (trainer.checkpoint_every=0)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("eval_before", [False, True], ids=["nothing_done", "baseline_evaluated"])
def test_an_exception_before_anything_is_done_leaves_no_checkpoint_to_resume(tmp_path, eval_before):
    """An error in iteration 1 with nothing done leaves no checkpoint-000000 (a fresh run is the same) and
    recommends no resume; once the baseline evaluation ran, its checkpoint keeps that evaluation for the resume."""
    trainer = make(tmp_path, "trainer.iterations=2", f"trainer.eval_before={str(eval_before).lower()}")
    real = trainer.reward

    def reward(images, prompts, metadata=None):
        if trainer._phase == "score":  # the training rollout's reward; the evaluation's goes through
            raise ConnectionError("reward server down")
        return real(images, prompts, metadata)

    trainer.reward = reward
    with pytest.raises(ConnectionError) as info:
        trainer.fit()
    note = "\n".join(info.value.__notes__)
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = [s for s, _ in CheckpointManager(tmp_path / "checkpoints").checkpoints()]
    if eval_before:
        assert steps == [0] and "resume with trainer.resume=" in note
        assert trainer.ckpt.load(trainer.ckpt.latest())["evals"] == trainer.evals and len(trainer.evals) == 1
    else:
        assert steps == [] and summary["checkpoint"] is None and summary["resume_from"] is None
        assert "no checkpoint (no iteration completed" in note and "nothing to resume from" in note


@pytest.mark.usefixtures("one_thread")
def test_a_crash_whose_summary_cannot_be_written_still_raises_its_own_error(tmp_path, monkeypatch):
    """The reward fails and then the disk is full: the crash checkpoint is named, the summary's failure is noted,
    the original error propagates (neither the note nor the write failure replaces it)."""
    import errno
    import os

    import flowgrpo.run_state as run_state_module

    trainer = make(tmp_path, "trainer.iterations=2", "trainer.checkpoint_every=0")
    real_reward, real_write = trainer.reward, run_state_module.atomic_write_text

    def reward(images, prompts, metadata=None):
        if trainer.iteration == 1:
            raise ConnectionError("reward server down")
        return real_reward(images, prompts, metadata)

    def write(path, text):
        if Path(path).name == "summary.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write(path, text)

    trainer.reward = reward
    monkeypatch.setattr(run_state_module, "atomic_write_text", write)
    with pytest.raises(ConnectionError, match="reward server down") as info:
        trainer.fit()
    note = "\n".join(info.value.__notes__)
    assert f"could not write {tmp_path / 'summary.json'}: No space left on device" in note, note
    assert "checkpoint of the 1 completed iterations" in note and "resume with trainer.resume=" in note
    assert not (tmp_path / "summary.json").exists()
    assert [s for s, _ in CheckpointManager(tmp_path / "checkpoints").checkpoints()] == [1]


@pytest.mark.usefixtures("one_thread")
def test_sigterm_still_stops_cleanly_without_an_error_summary(tmp_path):
    import os
    import signal

    trainer = make(tmp_path, "trainer.iterations=3", "trainer.checkpoint_every=0")
    real = trainer.reward

    def reward(images, prompts, metadata=None):
        if trainer.iteration == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(images, prompts, metadata)

    trainer.reward = reward
    summary = trainer.fit()  # no exception
    assert summary["stopped"].endswith("iteration 2 abandoned") and trainer.iteration == 1
    assert not (tmp_path / "summary.json").exists()  # written by the CLI on a clean stop, by the trainer on errors
    assert trainer.ckpt.load(trainer.ckpt.latest())["iteration"] == 1


# ------------------------------------------------------------------------------------------------- resume


@pytest.mark.usefixtures("one_thread")
def test_resume_auto_in_a_fresh_timestamped_run_dir_finds_the_latest_run_of_the_same_experiment(tmp_path, capsys):
    outputs = tmp_path / "outputs"
    first = outputs / "2026-01-01" / "10-00-00"
    make(first, "trainer.iterations=1").fit()
    make(outputs / "2026-01-01" / "11-00-00", "trainer.iterations=1", "trainer.seed=7").fit()  # other seed

    again = make(outputs / "2026-01-02" / "09-00-00", "trainer.iterations=2", "trainer.resume=auto")
    capsys.readouterr()
    assert again.maybe_resume() and again.iteration == 1
    out = capsys.readouterr().out
    assert f"resumed from {first / 'checkpoints' / 'checkpoint-000001'} after iteration 1" in out
    assert f"this run writes to {outputs / '2026-01-02' / '09-00-00'}" in out

    fresh = make(outputs / "2026-01-02" / "10-00-00", "trainer.resume=auto", "trainer.seed=3")
    assert not fresh.maybe_resume() and fresh.iteration == 0
    assert "trainer.resume=auto: nothing to resume" in capsys.readouterr().out
    # a stable run dir (hydra.run.dir / trainer.output_dir) only looks at itself
    stable = make(tmp_path / "stable", "trainer.resume=auto")
    assert not stable.maybe_resume()
    assert f"no checkpoint in {tmp_path / 'stable' / 'checkpoints'}" in capsys.readouterr().out


@pytest.mark.usefixtures("one_thread")
def test_resume_skips_a_corrupt_checkpoint_and_stops_when_none_is_intact(tmp_path):
    from flowgrpo.checkpoint import CheckpointError

    run = tmp_path / "run"
    make(run, "trainer.iterations=2").fit()  # checkpoints 1 and 2
    state = run / "checkpoints" / "checkpoint-000002" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    trainer = make(tmp_path / "next", "trainer.iterations=3", f"trainer.resume={run}")
    with pytest.warns(RuntimeWarning, match=r"checkpoint-000002/state\.pt is truncated.*next older"):
        assert trainer.maybe_resume()
    assert trainer.iteration == 1

    lora = next((run / "checkpoints" / "checkpoint-000001" / "lora").iterdir())
    data = bytearray(lora.read_bytes())
    data[len(data) // 2] ^= 0x01
    lora.write_bytes(bytes(data))
    trainer = make(tmp_path / "last", f"trainer.resume={run}")
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError, match=r"no intact checkpoint(.|\n)*lora.*corrupt"):
        trainer.fit()  # never a silent fresh start
    assert trainer.iteration == 0 and not (tmp_path / "last" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------- disk full


def _enospc(path=None):
    import errno

    return OSError(errno.ENOSPC, "No space left on device", path)


@pytest.mark.usefixtures("one_thread")
def test_a_full_disk_at_a_checkpoint_stops_the_run_naming_the_path_and_keeps_the_previous_one(tmp_path, monkeypatch):
    from flowgrpo.checkpoint import CheckpointWriteError

    trainer = make(tmp_path, "trainer.iterations=3")
    real_save, calls = torch.save, {"n": 0}

    def save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1:  # the first checkpoint fits, then the disk is full
            raise _enospc()
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint-000002.*No space left on device.*"
                                                   r"checkpoint-000001 is intact"):
        trainer.fit()
    monkeypatch.setattr(torch, "save", real_save)
    manager = CheckpointManager(tmp_path / "checkpoints")
    assert manager.latest() == manager.path(1) and manager.verify(manager.path(1)) is None
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["error"]["type"] == "CheckpointWriteError" and "No space left" in summary["error"]["message"]
    assert summary["checkpoint"] is None and summary["resume_from"] == str(manager.path(1))
    assert "crash checkpoint could not be written" in summary["note"]


@pytest.mark.usefixtures("one_thread")
def test_gallery_and_metrics_write_failures_are_warnings_and_the_run_goes_on(tmp_path, monkeypatch):
    import builtins

    import flowgrpo.trainer as trainer_module

    trainer = make(tmp_path, "trainer.iterations=3", "trainer.checkpoint_every=0", "trainer.gallery_every=1")
    real_log, failed = trainer.gallery.log, {"gallery": 0, "metrics": 0}

    def gallery_log(step, *args, **kwargs):
        if step == 1:
            failed["gallery"] += 1
            raise _enospc(str(tmp_path / "gallery" / "train" / "step-000001.png"))
        return real_log(step, *args, **kwargs)

    def full_open(path, mode="r", *args, **kwargs):
        if "a" in mode and failed["metrics"] == 0:  # the first append: half a line, then the disk is full
            failed["metrics"] += 1
            with builtins.open(path, mode) as f:
                f.write('{"iteration": 1, "rew')
            raise _enospc()
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(trainer.gallery, "log", gallery_log)
    monkeypatch.setattr(trainer_module, "open", full_open, raising=False)
    with pytest.warns(RuntimeWarning) as record:
        summary = trainer.fit()
    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert any("train gallery of iteration 1" in m and "step-000001.png" in m and "No space left on device" in m
               and "the run goes on" in m for m in messages), messages
    assert any("metrics.jsonl" in m and "No space left on device" in m for m in messages), messages
    assert failed == {"gallery": 1, "metrics": 1} and summary["iterations"] == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]  # healed
    assert [r["iteration"] for r in rows if "reward/mean" in r] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "gallery" / "train").glob("*.png")) == ["step-000002.png",
                                                                                   "step-000003.png"]


# ------------------------------------------------------------------------------------------ remote reward


class _FlakyServer:
    """A local reward server that answers ``code`` while ``down()`` is true, then scores every image 1.0."""

    def __init__(self, down, code=503):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        server = self
        self.calls = 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompts"])
                server.calls += 1
                body, status = json.dumps({"scores": [1.0] * n}).encode(), 200
                if down():
                    body, status = b'{"error": "loading the model"}', code
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # loopback only
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_remote_reward_retries_an_outage_logging_each_retry(caplog):
    import logging
    import time

    from rewards.remote import RemoteReward

    failures = {"left": 3}

    def down():
        failures["left"] -= 1
        return failures["left"] >= 0

    server = _FlakyServer(down)
    try:
        reward = RemoteReward(server.url, retries=1, backoff=0.05, retry_window=5.0)
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rewards.remote"):
            out = reward(torch.rand(2, 3, 8, 8), ["a", "b"])
        assert out.scores.tolist() == [1.0, 1.0] and server.calls == 4 and time.monotonic() - start < 3
    finally:
        server.close()
    retries = [r.getMessage() for r in caplog.records if r.name == "rewards.remote"]
    assert len(retries) == 3
    for attempt, (message, wait) in enumerate(zip(retries, ("0.1s", "0.1s", "0.2s")), start=1):
        assert f"attempt {attempt} failed (HTTP 503 Service Unavailable" in message and "loading the model" in message
        assert f"retrying in {wait}" in message and server.url in message


@pytest.mark.parametrize("down_for,survives", [(3.0, True), (100.0, True), (200.0, False)])
def test_remote_reward_defaults_ride_out_a_server_down_for_minutes(monkeypatch, down_for, survives):
    """conf/reward/remote.yaml's retries / backoff with the default window, on a virtual clock: a server answering 503
    for 3 s or for 100 s does not stop the run; one down for longer than the window does, naming the URL."""
    import types

    import rewards.remote as remote

    clock = {"now": 0.0}
    monkeypatch.setattr(remote, "time", types.SimpleNamespace(monotonic=lambda: clock["now"],
                                                              sleep=lambda s: clock.__setitem__("now", clock["now"] + s)))
    server = _FlakyServer(lambda: clock["now"] < down_for)
    try:
        reward = remote.RemoteReward(server.url, retries=2, backoff=1.0)  # the yaml's values
        assert reward.retry_window >= 60
        if survives:
            assert reward(torch.rand(1, 3, 8, 8), ["a"]).scores.tolist() == [1.0]
            assert down_for <= clock["now"] <= down_for + reward.max_backoff
        else:
            with pytest.raises(remote.RemoteRewardError, match=r"/score: HTTP 503.*gave up after \d+ attempts over 120"):
                reward(torch.rand(1, 3, 8, 8), ["a"])
    finally:
        server.close()


def test_remote_reward_gives_up_after_its_window_naming_the_url():
    import socket
    import time

    from rewards.remote import RemoteReward, RemoteRewardError

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reward = RemoteReward(f"http://127.0.0.1:{port}/score", timeout=1, retries=1, backoff=0.05, retry_window=0.4)
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=rf"127\.0\.0\.1:{port}/score: no answer.*gave up after \d+ attempts"):
        reward(torch.rand(1, 3, 8, 8), ["a"])
    assert 0.35 < time.monotonic() - start < 3


@pytest.mark.usefixtures("one_thread")
def test_the_fraction_of_degenerate_samples_is_logged_every_iteration(tmp_path):
    """A collapsing model is visible in the training rows whatever the reward: half the decoded images are made
    flat black -> reward/degenerate_fraction 0.5; large images are judged on a strided subsample, with the same
    verdicts."""
    from flowgrpo.trainer import degenerate_flags

    trainer = make(tmp_path, "trainer.iterations=1")
    decode = trainer.adapter.decode

    def half_black(latents):
        images = decode(latents)
        images[::2] = 0.0
        return images

    trainer.adapter.decode = half_black
    scalars = trainer.step()
    assert scalars["reward/degenerate_fraction"] == 0.5
    big = torch.ones(3, 3, 512, 512)
    big[1] = torch.rand(3, 512, 512, generator=torch.Generator().manual_seed(0))
    big[2, :, 100:200, 300:400] = 0.0
    assert degenerate_flags(big).tolist() == [1.0, 1.0, 0.0]
    clips = torch.ones(2, 5, 3, 64, 64)
    clips[1, :, :, 10:20, 10:20] = 0.0
    assert degenerate_flags(clips).tolist() == [1.0, 0.0]


class _KillableServer:
    """A reward server on a fixed loopback port that scores each PNG by its mean brightness; ``kill()`` closes the
    port (connections are refused, as when the process dies), ``start()`` serves again on the same port."""

    def __init__(self):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/score"
        self.requests, self.httpd = 0, None
        self.start()

    def start(self):
        import base64
        import io
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        import numpy as np
        from PIL import Image

        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                pixels = [np.asarray(Image.open(io.BytesIO(base64.b64decode(png)))) for png in request["media"]["data"]]
                body = json.dumps({"scores": [float(p.mean()) / 255.0 for p in pixels]}).encode()
                server.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def kill(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.usefixtures("one_thread")
def test_a_reward_server_killed_mid_run_checkpoints_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """reward=remote against a real HTTP server that dies after scoring iteration 1: the run retries for its window,
    stops with RemoteRewardError naming the URL, keeps iteration 1's checkpoint and a summary.json with the error;
    with the server back, trainer.resume=auto finishes the run with the weights and metrics of one that never failed."""
    from rewards.remote import RemoteRewardError

    server = _KillableServer()
    remote = ["reward=remote", f"reward.kwargs.url={server.url}", "reward.kwargs.retries=1", "reward.kwargs.backoff=0.05",
              "reward.kwargs.retry_window=0.5", "trainer.iterations=3", "trainer.checkpoint_every=0"]
    try:
        straight = make(tmp_path / "straight", *remote)
        straight.fit()
        expected = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]

        out = tmp_path / "killed"
        trainer = make(out, *remote)
        real = trainer.reward

        def reward(*args, **kwargs):  # the server process dies once iteration 1 has been scored
            if trainer.iteration == 1 and server.httpd is not None:
                server.kill()
                server.httpd = None
            return real(*args, **kwargs)

        trainer.reward = reward
        with pytest.raises(RemoteRewardError, match=rf"127\.0\.0\.1:{server.port}/score: no answer.*gave up after"):
            trainer.fit()
        summary = json.loads((out / "summary.json").read_text())
        assert summary["error"]["type"] == "RemoteRewardError" and summary["error"]["iteration"] == 2
        assert summary["checkpoint"].endswith("checkpoint-000001")
        assert [s for s, _ in CheckpointManager(out / "checkpoints").checkpoints()] == [1]

        server.start()
        resumed = make(out, *remote, "trainer.resume=auto")
        assert resumed.fit()["iterations"] == 3
        assert all(torch.equal(a, b) for a, b in zip(weights(resumed), weights(straight)))
        got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert _rows(got) == _rows(expected) and any("reward/mean" in row for row in got)
    finally:
        if server.httpd is not None:
            server.kill()
