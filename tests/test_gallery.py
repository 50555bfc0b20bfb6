"""Galleries: parquet + PNG grid always, a W&B Table when a run is given; what is read back is what was logged."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.gallery import Gallery, read_gallery, to_uint8

PAD, COLS, FRAMES = 2, 8, 8  # the grid layout documented in flowgrpo.gallery


def _batch(b=10, t=None, h=12, w=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (b, 3, h, w) if t is None else (b, t, 3, h, w)
    media = torch.rand(shape, generator=g)
    media[0].fill_(1.0)
    media[1].fill_(0.0)  # the ends of [0, 1] survive the uint8 rounding
    prompts = [f"a photo of {i} circles" for i in range(b)]
    rewards = torch.rand(b, generator=g)
    components = {
        "strict": (rewards > 0.5).float(),
        "partial/counting": torch.where(torch.arange(b) % 2 == 0, rewards, torch.full((b,), math.nan)),
    }
    advantages = torch.randn(b, generator=g)
    return prompts, media, rewards, components, advantages


def _same_float(a: float | None, b: torch.Tensor) -> bool:
    b = float(b)
    return (a is None and math.isnan(b)) or (a is not None and (a == b or (math.isnan(a) and math.isnan(b))))


@pytest.fixture
def wandb_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb"))
    run = wandb.init(mode="disabled", project="flowgrpo-test", dir=str(tmp_path / "wandb"))
    logged = []
    original = run.log

    def spy(data, step=None, **kwargs):
        logged.append((step, data))
        return original(data, step=step, **kwargs)

    run.log = spy
    yield run, logged
    run.finish()


@pytest.mark.parametrize("with_wandb", [False, True], ids=["files-only", "wandb-disabled"])
def test_image_gallery_round_trip(tmp_path, request, with_wandb):
    run, logged = request.getfixturevalue("wandb_run") if with_wandb else (None, None)
    prompts, media, rewards, components, advantages = _batch(b=10)
    gallery = Gallery(tmp_path, wandb_run=run, max_rows=9)
    out = gallery.log(12, prompts, media, rewards=rewards, components=components, advantages=advantages)

    folder = tmp_path / "gallery" / "train"
    assert out == {"parquet": folder / "step-000012.parquet", "grid": folder / "step-000012.png"}
    rows = read_gallery(out["parquet"])
    assert len(rows) == 9  # max_rows
    expected = to_uint8(media)
    assert torch.equal(expected, (media * 255).round().to(torch.uint8))
    for i, row in enumerate(rows):
        assert row["step"] == 12 and row["prompt"] == prompts[i] and row["num_frames"] is None
        assert row["image"].dtype == torch.uint8 and torch.equal(row["image"], expected[i])  # PNG is lossless
        assert _same_float(row["reward"], rewards[i]) and _same_float(row["advantage"], advantages[i])
        for name, values in components.items():
            assert _same_float(row[name], values[i]), name
    assert rows[0]["image"].eq(255).all() and rows[1]["image"].eq(0).all()

    grid = Image.open(out["grid"])
    h, w = media.shape[-2:]
    assert grid.size == (COLS * (w + PAD) + PAD, 2 * (h + PAD) + PAD)  # 9 images: rows of 8 and 1
    cell = np.asarray(grid)[PAD + h + PAD:PAD + h + PAD + h, PAD:PAD + w]  # second row, first cell = sample 8
    assert np.array_equal(cell, expected[8].permute(1, 2, 0).numpy())

    if with_wandb:
        import wandb

        ((step, data),) = logged
        table = data["train/gallery"]
        assert step == 12 and isinstance(table, wandb.Table)
        assert table.columns == ["step", "prompt", "image", "strict", "partial/counting", "reward", "advantage"]
        assert len(table.data) == 9 and isinstance(table.data[0][2], wandb.Image)
        assert table.data[1][-3] is None  # NaN component (tag not applicable) → empty cell
        assert table.data[0][-1] == pytest.approx(float(advantages[0]))


@pytest.mark.parametrize("with_wandb", [False, True], ids=["files-only", "wandb-disabled"])
def test_video_gallery_round_trip(tmp_path, request, with_wandb):
    run, logged = request.getfixturevalue("wandb_run") if with_wandb else (None, None)
    t = 10
    prompts, media, rewards, components, _ = _batch(b=3, t=t, h=16, w=16, seed=1)
    out = Gallery(tmp_path, wandb_run=run).log(5, prompts, media, rewards=rewards, components=components,
                                                 tag="eval", fps=4)

    rows = read_gallery(tmp_path / "gallery" / "eval")  # a directory: every step file
    expected = to_uint8(media)
    assert len(rows) == 3
    for i, row in enumerate(rows):
        assert row["num_frames"] == t and row["video"].shape == (t, 3, 16, 16)
        assert torch.equal(row["video"], expected[i])  # the PNG strip is lossless
        assert row["advantage"] is None and _same_float(row["reward"], rewards[i])
        assert row["pil"].size == (t * 16, 16)

    grid = Image.open(out["grid"])  # one row per sample, 8 of the 10 frames, evenly spaced
    assert grid.size == (FRAMES * (16 + PAD) + PAD, 3 * (16 + PAD) + PAD)
    first, last = (np.asarray(grid)[PAD:PAD + 16, x:x + 16] for x in (PAD, PAD + 7 * (16 + PAD)))
    assert np.array_equal(first, expected[0, 0].permute(1, 2, 0).numpy())
    assert np.array_equal(last, expected[0, -1].permute(1, 2, 0).numpy())

    if with_wandb:
        import wandb

        ((step, data),) = logged
        table = data["eval/gallery"]
        assert step == 5 and table.columns[:3] == ["step", "prompt", "video"]
        if importlib.util.find_spec("imageio_ffmpeg") is not None:
            assert isinstance(table.data[0][2], wandb.Video)
            mp4s = sorted(out["mp4"].glob("*.mp4"))
            assert len(mp4s) == 3 and all(p.stat().st_size > 0 for p in mp4s)
        else:
            assert isinstance(table.data[0][2], wandb.Image)


def test_video_without_ffmpeg_falls_back_to_frame_strips(tmp_path, wandb_run, monkeypatch):
    import builtins

    import wandb

    run, logged = wandb_run
    real_import = builtins.__import__

    def no_imageio(name, *args, **kwargs):
        if name.startswith("imageio"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_imageio)
    prompts, media, rewards, _, _ = _batch(b=2, t=3, h=8, w=8)
    with pytest.warns(UserWarning, match="imageio-ffmpeg"):
        out = Gallery(tmp_path, wandb_run=run).log(1, prompts, media, rewards=rewards)
    assert "mp4" not in out
    ((_, data),) = logged
    assert isinstance(data["train/gallery"].data[0][2], wandb.Image)


def test_bad_inputs_say_what_is_wrong(tmp_path):
    prompts, media, rewards, components, _ = _batch(b=4)
    gallery = Gallery(tmp_path)
    with pytest.raises(ValueError, match="clash"):
        gallery.log(0, prompts, media, rewards=rewards, components={"reward": rewards})
    with pytest.raises(ValueError, match="media must be"):
        gallery.log(0, prompts, media[:, 0], rewards=rewards)
    with pytest.raises(ValueError, match="rewards has 2 values"):
        gallery.log(0, prompts, media, rewards=rewards[:2])
    assert not (tmp_path / "gallery" / "train" / "step-000000.parquet").exists()
