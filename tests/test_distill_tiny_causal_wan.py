"""``scripts/distill_tiny_causal_wan.py``: the teacher's targets are its flow map along the student's own sampler,
teacher data that do not depend on restarts, an exact student resume, and an export that streams guidance-free."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from flowgrpo.models import StreamingWanPipeline
from flowgrpo.models.stream_adapter import StreamAdapter
from samplers import stream_sigmas

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "distill_tiny_causal_wan.py"
_spec = importlib.util.spec_from_file_location("distill_tiny_causal_wan", _SCRIPT)
dt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dt)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NUM_FRAMES = 33  # 9 latent frames, 9 blocks


def _args(tmp_path, *extra):
    return ["--teacher", "toy", "--streams", "3", "--shard", "2", "--steps", "3", "--batch", "2", "--warmup", "1",
            "--num-frames", str(NUM_FRAMES), "--student-steps", "2", "--teacher-steps", "4", "--log-every", "1",
            "--ckpt-every", "1", "--export-every", "0", "--threads", "1",
            "--out", str(tmp_path / "pipe"), "--ckpt-dir", str(tmp_path / "ckpt"), *extra]


def _draws(blocks, steps, shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((2, blocks, *shape), generator=gen), torch.randn((2, blocks, steps - 1, *shape), generator=gen)


def _setup():
    teacher = dt.load_teacher("toy")
    adapter = StreamAdapter(teacher)
    metas = dt.training_metas(__import__("numpy").random.default_rng(0), 2, NUM_FRAMES)
    channels, frames, h, w = teacher.adapter._latent_shape(1, 64, 64, NUM_FRAMES)[1:]
    return teacher, adapter, metas, frames, (channels, 1, h, w)


def test_one_level_flow_map_is_the_models_own_one_step_sampler():
    """With one student level on a one-step teacher grid the teacher's ODE solve from σ=1 is one Euler step to 0,
    which is exactly the sampler's clean prediction x − σ·v: the two paths agree, cache writes included."""
    _, adapter, metas, blocks, shape = _setup()
    noise, renoise = _draws(blocks, 1, shape)
    grid = torch.cat([stream_sigmas(1, 3.0), torch.zeros(1)])
    inputs, targets = dt.teacher_chain(adapter, metas, noise, renoise, grid=grid, starts=[0], guidance=4.5,
                                       num_frames=NUM_FRAMES, max_sequence_length=16)
    own = dt.reference_chain(adapter, metas, noise, renoise, levels=stream_sigmas(1, 3.0), guidance=4.5,
                             num_frames=NUM_FRAMES, max_sequence_length=16)
    assert torch.equal(inputs[:, :, 0], noise)
    torch.testing.assert_close(targets[:, :, -1], own, rtol=1e-5, atol=1e-5)


def test_each_level_input_is_the_previous_target_renoised_at_the_students_levels():
    """The data follow the student's sampler: input j+1 = (1 − σ_{j+1})·target_j + σ_{j+1}·ε_j, the levels are points
    of the teacher's grid, and a coarser teacher grid gives other targets (the targets are the teacher's solves)."""
    _, adapter, metas, blocks, shape = _setup()
    noise, renoise = _draws(blocks, 3, shape)
    grid = torch.cat([stream_sigmas(6, 3.0), torch.zeros(1)])
    starts = dt.level_indices(6, 3)
    assert starts == [0, 2, 4]
    levels = stream_sigmas(3, 3.0)
    torch.testing.assert_close(grid[starts], levels)
    inputs, targets = dt.teacher_chain(adapter, metas, noise, renoise, grid=grid, starts=starts,
                                       guidance=1.0, num_frames=NUM_FRAMES, max_sequence_length=16)
    assert inputs.shape == targets.shape == (2, blocks, 3, *shape)
    for j in range(2):
        s = float(levels[j + 1])
        torch.testing.assert_close(inputs[:, :, j + 1], (1 - s) * targets[:, :, j] + s * renoise[:, :, j])
    coarse = torch.cat([stream_sigmas(3, 3.0), torch.zeros(1)])
    _, other = dt.teacher_chain(adapter, metas, noise, renoise, grid=coarse, starts=[0, 1, 2], guidance=1.0,
                                num_frames=NUM_FRAMES, max_sequence_length=16)
    assert not torch.allclose(other[:, 0, 0], targets[:, 0, 0])
    with pytest.raises(ValueError, match="multiple of --student-steps"):
        dt.level_indices(10, 4)


def test_teacher_shards_do_not_depend_on_restarts_and_the_student_resumes_exactly(tmp_path):
    straight = dt.main(_args(tmp_path / "a"))
    # another directory makes shard 1 first, alone: the same streams as the run that made shard 0 before it
    args = dt.parse_args(_args(tmp_path / "c"))
    data = dt.TeacherData(args, dt.load_teacher("toy"))
    data.make(1)
    alone = torch.load(data.path(1), weights_only=False)
    first = torch.load(tmp_path / "a" / "ckpt" / "teacher" / "shard-0001.pt", weights_only=False)
    assert alone["metas"] == first["metas"] and torch.equal(alone["targets"], first["targets"])

    dt.main(_args(tmp_path / "b", "--stop-at", "2"))
    resumed = dt.main(_args(tmp_path / "b", "--resume"))
    for p, q in zip(straight.params, resumed.params):
        assert torch.equal(p, q)
    assert [e["loss"] for e in straight.log] == [e["loss"] for e in resumed.log]

    out = tmp_path / "a" / "pipe"
    summary = json.loads((out / "pretrain_summary.json").read_text())
    assert summary["step"] == 3 and summary["teacher_streams"] == 3
    pipe = StreamingWanPipeline.from_pretrained(out)
    assert pipe.config.guidance_scale == 1.0 and pipe.config.num_steps == 2 and pipe.config.recache is False
    video = pipe(["a red circle moving left", "a red circle standing still"], switch_frames=[17],
                 num_frames=NUM_FRAMES, generator=torch.Generator().manual_seed(0)).videos
    assert video.shape == (1, NUM_FRAMES, 3, 64, 64) and torch.isfinite(video).all()


def test_the_shipped_guidance_free_asset_loads_offline_and_streams():
    """assets/tiny-causal-wan-shapes-4step: a plain WanPipeline directory (from_pretrained, no extra arguments) plus
    its stream settings (4 steps, no guidance, the teacher's geometry), under 30 MB; a short stream with a switch is
    a video in [0, 1]."""
    from diffusers import WanPipeline

    asset = Path(__file__).resolve().parents[1] / "assets" / "tiny-causal-wan-shapes-4step"
    size = sum(f.stat().st_size for f in asset.rglob("*") if f.is_file())
    assert size < 30 * 2**20, size
    assert isinstance(WanPipeline.from_pretrained(asset), WanPipeline)
    pipe = StreamingWanPipeline.from_pretrained(asset)
    c = pipe.config
    assert (c.num_steps, c.guidance_scale, c.recache) == (4, 1.0, False)
    assert (c.block_frames, c.sink_frames, c.window_frames) == (1, 1, 4)
    summary = json.loads((asset / "pretrain_summary.json").read_text())
    assert summary["script"] == "scripts/distill_tiny_causal_wan.py" and summary["step"] == summary["args"]["steps"]
    video = pipe(["a red circle moving left", "a red circle standing still"], switch_frames=[9], num_frames=17,
                 generator=torch.Generator().manual_seed(0)).videos
    assert video.shape == (1, 17, 3, 64, 64) and 0 <= float(video.min()) <= float(video.max()) <= 1


def test_the_student_can_start_from_an_earlier_student(tmp_path):
    """``--init-student DIR``: the student's first weights are that model's transformer, not the teacher's; a
    directory that is not a streaming model stops before any training."""
    dt.main(_args(tmp_path / "a", "--export-every", "3"))
    args = dt.parse_args(_args(tmp_path / "b", "--init-student", str(tmp_path / "a" / "pipe")))
    teacher = dt.load_teacher("toy")
    data = dt.TeacherData(args, teacher)
    data.ensure()
    again = dt.Student(args, teacher, data)
    exported = StreamingWanPipeline.from_pretrained(tmp_path / "a" / "pipe").pipe.transformer.state_dict()
    assert all(torch.equal(again.transformer.state_dict()[k], v) for k, v in exported.items())
    toy = dt.load_teacher("toy").pipe.transformer.state_dict()
    assert not all(torch.equal(toy[k], v) for k, v in exported.items())  # the teacher's weights were replaced
    bad = dt.parse_args(_args(tmp_path / "c", "--init-student", str(tmp_path)))
    with pytest.raises(SystemExit, match="--init-student"):
        dt.Student(bad, dt.load_teacher("toy"), data)
