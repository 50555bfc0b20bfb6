"""Checkpoints: atomic save / load round trips, resume resolution, pruning, crash safety, RNG, LoRA, SIGTERM."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from flowgrpo.checkpoint import (
    CheckpointManager,
    GracefulStop,
    capture_rng_state,
    restore_rng_state,
    save_lora_weights,
)


def _training_state(seed: int = 0) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=10)
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    sched.step()
    state = {
        "step": 7,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "ema": {"decay": 0.99, "shadow": {k: v.clone() * 2 for k, v in model.state_dict().items()}},
        "window": {"start": 3, "history": [1, 2, 3], "nested": {"sizes": (4, 4), "name": "progressive"}},
        "rng": capture_rng_state(),
    }
    return model, state


def _assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_save_load_round_trip_and_optimizer_resumes(tmp_path):
    model, state = _training_state()
    manager = CheckpointManager(tmp_path / "ckpt")
    path = manager.save(7, state)
    assert path == tmp_path / "ckpt" / "checkpoint-000007" and (path / "state.pt").is_file()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "checkpoint-000007"
    loaded = manager.load(path)
    _assert_same(state, loaded)
    # the loaded optimizer state drives the same next step as the live one
    model2 = torch.nn.Linear(4, 3)
    model2.load_state_dict(loaded["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3, betas=(0.9, 0.99))
    opt2.load_state_dict(loaded["optimizer"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    opt.load_state_dict(state["optimizer"])
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    assert torch.equal(model.weight, model2.weight)


def test_state_that_would_not_load_fails_at_save_naming_the_key(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(TypeError, match=r"state\['curriculum'\]\['ema'\] is a numpy.float64"):
        manager.save(1, {"curriculum": {"ema": np.float64(0.5)}})
    assert manager.checkpoints() == [] and manager.latest() is None
    assert [p.name for p in tmp_path.iterdir()] == []
    trusted = CheckpointManager(tmp_path, weights_only=False)
    assert trusted.load(trusted.save(1, {"x": np.float64(0.5)}))["x"] == 0.5


def test_latest_and_resolve(tmp_path):
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep=None)
    assert manager.latest() is None
    assert manager.resolve(None) is None and manager.resolve("none") is None
    assert manager.resolve("auto") is None  # first run of a self-resubmitting job
    with pytest.raises(FileNotFoundError, match=r"trainer\.resume=.*missing"):
        manager.resolve(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"trainer\.resume.*holds no checkpoint"):
        manager.resolve(str(tmp_path))  # exists but has no checkpoint

    first = manager.save(5, {"step": 5})
    second = manager.save(10, {"step": 10})
    assert manager.latest() == second
    assert manager.resolve("auto") == second
    assert manager.resolve(str(first)) == first  # a checkpoint dir
    assert manager.resolve(str(first / "state.pt")) == first  # its state file
    assert manager.resolve(str(root)) == second  # a root: its latest
    assert manager.load(manager.resolve("auto"))["step"] == 10

    # `latest` names what was written last, even a lower step (a resume that rolled back) ...
    again = manager.save(5, {"step": 5, "again": True})
    assert again == first and manager.latest() == first and manager.load(first)["again"]
    # ... and a pointer to a vanished checkpoint falls back to the highest complete step
    (root / "latest").write_text("checkpoint-000099\n")
    assert manager.latest() == second


def test_pruning_keeps_the_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        manager.save(step, {"step": step})
    assert [s for s, _ in manager.checkpoints()] == [3, 4]
    # a rolled-back resume writing step 2: the checkpoint just written always stays
    manager.save(2, {"step": 2})
    assert [s for s, _ in manager.checkpoints()] == [2, 4]
    assert manager.latest() == manager.path(2)
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    good = manager.save(1, {"step": 1, "w": torch.arange(3.0)})

    def half_written_then_crash(path):
        path.mkdir()
        (path / "adapter.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        manager.save(2, {"step": 2}, writers={"lora": half_written_then_crash})
    assert manager.latest() == good
    assert torch.equal(manager.load(manager.resolve("auto"))["w"], torch.arange(3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000001", "latest"]  # no partial, no temp

    # re-saving an existing step that crashes leaves the old copy of that step intact
    with pytest.raises(RuntimeError):
        manager.save(1, {"step": 1, "w": torch.zeros(3)}, writers={"lora": half_written_then_crash})
    assert torch.equal(manager.load(good)["w"], torch.arange(3.0))


def test_stale_temporaries_of_dead_processes_are_cleaned_live_ones_kept(tmp_path):
    manager = CheckpointManager(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f".tmp-checkpoint-000003.{host}.{dead.pid}.abcd1234"
    live = tmp_path / f".tmp-checkpoint-000003.{host}.{os.getpid()}.abcd1234"
    other_host = tmp_path / f".tmp-checkpoint-000003.elsewhere.{dead.pid}.abcd1234"
    for d in (stale, live, other_host):
        d.mkdir()
        (d / "state.pt").write_bytes(b"")
    assert manager.latest() is None  # half-written directories are never checkpoints
    manager.save(4, {"step": 4})
    assert not stale.exists() and live.exists() and other_host.exists()
    assert [s for s, _ in manager.checkpoints()] == [4]


def test_rng_capture_restore_repeats_next_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn(1)  # leave a cached Gaussian in numpy's legacy state
    state = capture_rng_state()
    # through a weights_only save / load, as on resume
    manager = CheckpointManager(tmp_path)
    state = manager.load(manager.save(0, {"rng": state}))["rng"]

    def draws():
        return random.random(), np.random.randn(3).tolist(), torch.rand(3), torch.randn(2)

    first = draws()
    restore_rng_state(state)
    second = draws()
    assert first[0] == second[0] and first[1] == second[1]
    assert torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])


# ----------------------------------------------------------------------------------------------- LoRA


def test_lora_checkpoint_loads_into_a_fresh_pipeline(tmp_path):
    peft = pytest.importorskip("peft")
    from flowgrpo.models import build_tiny_pipeline

    def generate(pipe):
        return pipe("a photo of a red circle", num_inference_steps=2, height=32, width=32, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images

    pipe = build_tiny_pipeline("sd3")
    base = generate(pipe)
    # lora_alpha != r: the scale alpha/r = 2 only survives if the LoraConfig is saved with the weights
    pipe.transformer.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                                 target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in pipe.transformer.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    tuned = generate(pipe)
    assert (tuned - base).abs().max() > 1e-2  # the perturbed LoRA matters

    manager = CheckpointManager(tmp_path)
    ckpt = manager.save(3, {"step": 3}, writers={"lora": lambda d: save_lora_weights(pipe, d)})
    assert (ckpt / "lora" / "pytorch_lora_weights.safetensors").is_file()

    fresh = build_tiny_pipeline("sd3")
    assert torch.equal(generate(fresh), base)
    with pytest.raises(ValueError, match="no LoRA adapter"):  # full fine-tuning has no LoRA to save
        save_lora_weights(fresh, tmp_path / "none")
    fresh.load_lora_weights(ckpt / "lora")
    loaded = generate(fresh)
    torch.testing.assert_close(loaded, tuned, atol=1e-5, rtol=0)
    assert (loaded - base).abs().max() > 1e-2

    # an explicitly passed (unwrapped) transformer saves the same file
    save_lora_weights(type(pipe), tmp_path / "again", transformer=pipe.transformer)
    from safetensors.torch import load_file

    a = load_file(ckpt / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "again" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(k.startswith("transformer.") and "lora_" in k for k in a)


# ------------------------------------------------------------------------------------------ signals


def _wait_for(predicate, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_graceful_stop_on_sigterm_and_double_sigint():
    before_term, before_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with GracefulStop() as stop:
        assert stop.active and not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert _wait_for(lambda: stop.requested)  # and we are still alive
        assert stop.signal == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):  # a stop is already requested: Ctrl-C now means "abort"
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for(lambda: False, timeout=1.0)
    assert signal.getsignal(signal.SIGTERM) is before_term
    assert signal.getsignal(signal.SIGINT) is before_int

    with GracefulStop() as stop:  # a first SIGINT is graceful too
        os.kill(os.getpid(), signal.SIGINT)
        assert _wait_for(lambda: stop.requested) and stop.signal == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before_int


def test_graceful_stop_outside_main_thread_is_a_noop():
    before = signal.getsignal(signal.SIGTERM)
    seen = {}

    def body():
        with GracefulStop() as stop:
            seen["active"] = stop.active
            seen["handler"] = signal.getsignal(signal.SIGTERM)
            stop.request()
            seen["requested"] = stop.requested

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"active": False, "handler": before, "requested": True}
