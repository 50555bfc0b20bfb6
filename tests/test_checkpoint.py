"""Checkpoints: atomic save / load round trips, resume resolution, pruning, crash safety, RNG, LoRA, SIGTERM;
manifests (a corrupt or incomplete checkpoint is named and skipped), earlier runs of an experiment, a full disk."""

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


# ------------------------------------------------------------------------------- manifests and resume


def _flip_byte(path, offset=-10):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_checkpoint_carries_a_manifest_of_its_files_written_last(tmp_path):
    import hashlib
    import json

    manager = CheckpointManager(tmp_path)

    def writer(d):
        d.mkdir()
        (d / "weights.bin").write_bytes(b"\x01\x02\x03")

    path = manager.save(4, {"w": torch.arange(5.0)}, writers={"lora": writer}, meta={"run": {"algo": "grpo", "seed": 0}})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["meta"] == {"run": {"algo": "grpo", "seed": 0}}
    assert sorted(manifest["files"]) == ["lora/weights.bin", "state.pt"]
    for rel, info in manifest["files"].items():
        data = (path / rel).read_bytes()
        assert info == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert manager.verify(path) is None
    assert not [p for p in path.rglob("*") if p.name.startswith(".")]  # the manifest's own temporary is gone
    # strict JSON: a non-finite value in the meta is written null (a strict parser refuses NaN)
    nan_meta = manager.save(5, {"w": torch.arange(5.0)}, meta={"run": {"lr": float("nan")}})
    strict = json.loads((nan_meta / "manifest.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert strict["meta"] == {"run": {"lr": None}}


@pytest.mark.parametrize("fault,named", [
    ("truncated state.pt", r"checkpoint-000002/state\.pt is truncated"),
    ("missing state.pt", r"checkpoint-000002/state\.pt is missing"),
    ("flipped byte in state.pt", r"checkpoint-000002/state\.pt is corrupt"),
    ("flipped byte in the LoRA", r"checkpoint-000002/lora/weights\.bin is corrupt"),
    ("missing manifest and state.pt", r"checkpoint-000002 is not usable: incomplete"),
])
def test_a_corrupt_or_incomplete_checkpoint_is_named_skipped_and_the_next_older_one_used(tmp_path, fault, named):
    manager = CheckpointManager(tmp_path, keep=None)

    def writer(d):
        d.mkdir()
        (d / "weights.bin").write_bytes(bytes(range(64)))

    for step in (1, 2):
        manager.save(step, {"step": step, "w": torch.full((100,), float(step))}, writers={"lora": writer})
    bad = manager.path(2)
    state = bad / "state.pt"
    if fault == "truncated state.pt":
        state.write_bytes(state.read_bytes()[:300])
    elif fault == "missing state.pt":
        state.unlink()
    elif fault == "flipped byte in state.pt":
        _flip_byte(state)
    elif fault == "flipped byte in the LoRA":
        _flip_byte(bad / "lora" / "weights.bin")
    else:
        state.unlink()
        (bad / "manifest.json").unlink()
    assert manager.verify(manager.path(1)) is None and manager.verify(bad) is not None
    for candidates in (manager.candidates(), manager.resume_candidates(str(tmp_path)),
                       manager.resume_candidates(str(bad))):  # the root, or the bad checkpoint itself
        assert candidates[0] == bad
        with pytest.warns(RuntimeWarning, match=named + r".*skipped, trying the next older one"):
            path, loaded = manager.load_intact(candidates)
        assert path == manager.path(1) and loaded["step"] == 1


def test_no_intact_checkpoint_is_a_clear_error_naming_each(tmp_path):
    from flowgrpo.checkpoint import CheckpointError

    manager = CheckpointManager(tmp_path, keep=None)
    for step in (1, 2):
        manager.save(step, {"step": step, "w": torch.zeros(100)})
    _flip_byte(manager.path(1) / "state.pt")
    (manager.path(2) / "state.pt").unlink()
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError) as info:
        manager.load_intact(manager.candidates())
    message = str(info.value)
    assert "no intact checkpoint" in message and "trainer.resume=null" in message
    assert "checkpoint-000002/state.pt is missing" in message and "checkpoint-000001/state.pt is corrupt" in message


def test_a_checkpoint_without_manifest_that_does_not_load_is_named(tmp_path):
    """Checkpoints written before manifests: checked by loading; a truncated one names its file (not a bare torch
    zip error) and the older one is used."""
    from flowgrpo.checkpoint import CheckpointError

    manager = CheckpointManager(tmp_path, keep=None)
    for step in (1, 2):
        (manager.save(step, {"step": step, "w": torch.zeros(1000)}) / "manifest.json").unlink()
    state = manager.path(2) / "state.pt"
    state.write_bytes(state.read_bytes()[:300])
    assert manager.verify(manager.path(2)) is None  # nothing to check it against
    with pytest.raises(CheckpointError, match=r"checkpoint-000002/state\.pt cannot be loaded"):
        manager.load(manager.path(2))
    with pytest.warns(RuntimeWarning, match=r"checkpoint-000002/state\.pt cannot be loaded"):
        path, loaded = manager.load_intact(manager.candidates())
    assert path == manager.path(1) and loaded["step"] == 1


def test_resume_paths_run_dirs_checkpoint_dirs_and_roots(tmp_path):
    run = tmp_path / "run"
    manager = CheckpointManager(run / "checkpoints", keep=None)
    for step in (1, 2, 3):
        manager.save(step, {"step": step})
    c1, c2, c3 = (manager.path(s) for s in (1, 2, 3))
    assert manager.resume_candidates(str(run)) == [c3, c2, c1]  # a run dir: its checkpoints/
    assert manager.resume_candidates(str(run / "checkpoints")) == [c3, c2, c1]
    assert manager.resume_candidates(str(c2)) == [c2, c1]  # a checkpoint: it, then the older ones
    assert manager.resume_candidates(str(c2 / "state.pt")) == [c2, c1]
    assert manager.resolve(str(run)) == c3
    manager.save(2, {"step": 2})  # `latest` names the last written (a rolled-back resume) first
    assert manager.candidates() == [c2, c3, c1]
    with pytest.raises(FileNotFoundError, match=r"trainer\.resume=.*holds no checkpoint"):
        manager.resume_candidates(str(tmp_path))  # holds a run, but is not one


def test_find_runs_matches_the_experiment_newest_first(tmp_path):
    from flowgrpo.checkpoint import find_runs

    me, other = {"run": {"algo": "grpo", "seed": 0}}, {"run": {"algo": "grpo", "seed": 1}}
    runs = {}
    for name, meta in (("2026-01-01/10-00-00", me), ("2026-01-01/11-00-00", other), ("2026-01-02/09-00-00", me),
                       ("2026-01-02/12-00-00", None)):
        runs[name] = tmp_path / name
        if meta is not None:
            CheckpointManager(runs[name] / "checkpoints").save(1, {"x": 1}, meta=meta)
            time.sleep(0.01)
    (runs["2026-01-02/12-00-00"] / "checkpoints").mkdir(parents=True)  # a run that never checkpointed
    assert find_runs(tmp_path, me) == [runs["2026-01-02/09-00-00"], runs["2026-01-01/10-00-00"]]
    assert find_runs(tmp_path, me, exclude=[runs["2026-01-02/09-00-00"]]) == [runs["2026-01-01/10-00-00"]]
    assert find_runs(tmp_path, other) == [runs["2026-01-01/11-00-00"]]
    assert find_runs(tmp_path / "missing", me) == []


# --------------------------------------------------------------------------------------------- disk full


def _enospc(*_, **__):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["state", "writer"])
def test_disk_full_while_saving_names_the_path_and_the_cause_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                                             where):
    import errno

    from flowgrpo.checkpoint import CheckpointWriteError

    manager = CheckpointManager(tmp_path, keep=1)
    good = manager.save(1, {"w": torch.arange(3.0)})
    writers = {}
    if where == "state":
        real_save = torch.save

        def half_then_full(obj, f, *a, **k):  # some bytes reach the file, then the disk is full
            f.write(b"PK\x03\x04partial")
            _enospc()

        monkeypatch.setattr(torch, "save", half_then_full)
    else:
        def writer(d):
            d.mkdir()
            (d / "part.safetensors").write_bytes(b"partial")
            _enospc()

        writers["lora"] = writer
    with pytest.raises(CheckpointWriteError) as info:
        manager.save(2, {"w": torch.zeros(3)}, writers=writers)
    err = info.value
    assert err.errno == errno.ENOSPC and isinstance(err, OSError)
    message = str(err)
    assert str(manager.path(2)) in message and "No space left on device" in message
    assert ("state.pt" if where == "state" else "'lora'") in message
    assert f"previous checkpoint {good} is intact" in message and "MiB free" in message
    if where == "state":
        monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000001", "latest"]  # no partial, no temp
    assert manager.latest() == good and manager.verify(good) is None
    assert torch.equal(manager.load(good)["w"], torch.arange(3.0))
