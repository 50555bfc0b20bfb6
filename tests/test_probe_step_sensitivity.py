"""``scripts/probe_step_sensitivity.py``: the step is the size it says, undone exactly enough to leave the model
as it was, and it moves a streaming model's samples by nothing at lr 0 and by something at lr > 0."""

import importlib.util
from pathlib import Path

import pytest
import torch

from flowgrpo.models import StreamConfig, StreamingWanPipeline

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "probe_step_sensitivity.py"
_spec = importlib.util.spec_from_file_location("probe_step_sensitivity", _SCRIPT)
ps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ps)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _toy_stream(tmp_path) -> Path:
    from flowgrpo.models import build_tiny_pipeline

    pipe = StreamingWanPipeline(build_tiny_pipeline("wan"), StreamConfig(num_steps=2, shift=3.0, window_frames=4,
                                                                         recache=False, guidance_scale=1.0,
                                                                         max_sequence_length=16, height=64, width=64))
    pipe.save_pretrained(tmp_path / "toy")
    return tmp_path / "toy"


def test_the_step_is_one_adam_steps_lora_update():
    layer = torch.nn.Module()
    layer.to_q = torch.nn.Linear(32, 16)
    layer.proj = torch.nn.Linear(32, 32)  # not a target
    deltas = ps.lora_step(layer, lr=1e-3, rank=4, alpha=8.0, seed=0)
    assert set(deltas) == {"to_q"}
    delta = deltas["to_q"]
    assert delta.shape == (16, 32) and torch.linalg.matrix_rank(delta) == 4
    # |B| = lr, |A| <= 1/sqrt(fan_in), scale alpha/rank: every entry below (alpha/rank)·rank·lr/sqrt(fan_in)
    assert float(delta.abs().max()) <= 2.0 * 4 * 1e-3 / 32 ** 0.5
    before = layer.to_q.weight.detach().clone()
    ps.apply(layer, deltas, +1.0)
    assert not torch.equal(layer.to_q.weight, before)
    ps.apply(layer, deltas, -1.0)
    torch.testing.assert_close(layer.to_q.weight, before, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="no linear layer"):
        ps.lora_step(torch.nn.Linear(2, 2), lr=1e-3, rank=1, alpha=1.0, seed=0)


def test_a_step_moves_a_streams_blocks_and_lr_zero_does_not(tmp_path):
    model = str(_toy_stream(tmp_path))
    zero = ps.main(["--models", model, "--samples", "2", "--lr", "0"])["models"][0]
    assert zero["kind"] == "stream" and len(zero["step_rms"]) == 13 and max(zero["step_rms"]) == 0.0
    assert min(zero["redraw_rms"]) > 0
    moved = ps.main(["--models", model, "--samples", "2", "--lr", "1e-2"])["models"][0]
    assert min(moved["step_rms"]) > 0 and moved["mean_step_over_redraw"] > 0
