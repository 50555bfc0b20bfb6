"""Galleries: parquet, labelled PNG grid, each sample's own file and the HTML index always; each logger backend's
view of them (a W&B table and captioned panel, TensorBoard images and text); what is read back is what was logged;
the grid has one framed, labelled cell per sample; the trainer's gallery shows every prompt, the held-out one every
tag."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.builders import build_logger
from flowgrpo.gallery import Gallery, read_gallery, to_uint8

# the grid layout documented in flowgrpo.gallery
PAD, COLS, FRAMES = 2, 8, 8  # grey gap around cells (and between frames), images per row, frames per video row
MIN_SIDE, MARGIN, LINE_H = 128, 3, 13  # upscaled short side; label band = 2·MARGIN + LINE_H · lines
GREY = (128, 128, 128)


def band(lines: int) -> int:
    return 2 * MARGIN + LINE_H * lines


def upscaled(chw: torch.Tensor, s: int) -> np.ndarray:
    return chw.permute(1, 2, 0).numpy().repeat(s, axis=0).repeat(s, axis=1)


def dark(region: np.ndarray) -> int:
    """Text pixels: the label text is black on white."""
    return int((region.max(axis=-1) < 100).sum())


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


def logger_node(name: str, **kw):
    from omegaconf import OmegaConf

    from flowgrpo.config import LoggerConfig

    return OmegaConf.structured(LoggerConfig(name=name, **kw))


@pytest.fixture
def wandb_run(tmp_path, monkeypatch):
    """A ``logger=wandb`` RunLogger on a disabled run, and what its run was asked to log."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb"))
    logger = build_logger(logger_node("wandb"), output_dir=tmp_path / "wandb")
    logged = []
    run = logger.run
    original = run.log

    def spy(data, step=None, **kwargs):
        logged.append((step, data))
        return original(data, step=step, **kwargs)

    run.log = spy
    yield logger, logged
    logger.finish()


@pytest.mark.parametrize("with_wandb", [False, True], ids=["files-only", "wandb-disabled"])
def test_image_gallery_round_trip(tmp_path, request, with_wandb):
    run, logged = request.getfixturevalue("wandb_run") if with_wandb else (None, None)
    prompts, media, rewards, components, advantages = _batch(b=10)
    gallery = Gallery(tmp_path, logger=run, max_rows=9)
    out = gallery.log(12, prompts, media, rewards=rewards, components=components, advantages=advantages)

    folder = tmp_path / "gallery" / "train"
    assert out["parquet"] == folder / "step-000012.parquet" and out["grid"] == folder / "step-000012.png"
    assert out["media"] == [folder / "step-000012" / f"{i:03d}.png" for i in range(9)]
    assert out["index"] == tmp_path / "gallery" / "index.html"
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
    for i, path in enumerate(out["media"]):  # each sample's own file: its stored pixels, not upscaled
        assert np.array_equal(np.asarray(Image.open(path).convert("RGB")), expected[i].permute(1, 2, 0).numpy())

    grid = np.asarray(Image.open(out["grid"]).convert("RGB"))
    s = math.ceil(MIN_SIDE / 12)  # 12x16 images are shown 11 times larger: 132x176
    mh, mw = 12 * s, 16 * s
    lb = band(2)  # a short prompt on one line, "reward r  adv a" on the next
    ch = lb + 1 + mh
    assert grid.shape == (2 * (ch + PAD) + PAD, COLS * (mw + PAD) + PAD, 3)  # 9 images: rows of 8 and 1
    for i in range(9):
        y, x = PAD + (i // COLS) * (ch + PAD), PAD + (i % COLS) * (mw + PAD)
        assert np.array_equal(grid[y + lb + 1:y + ch, x:x + mw], upscaled(expected[i], s)), i  # nearest, exact
        for line in range(2):  # prompt, scores: each line of the label band has text
            assert dark(grid[y + MARGIN + line * LINE_H:y + MARGIN + (line + 1) * LINE_H, x:x + mw]) > 10, (i, line)
        assert (grid[y:y + MARGIN, x:x + mw] == 255).all()  # the band is white around its text
        assert (grid[y + lb, x:x + mw] == GREY).all()  # the line between label and image
        assert (grid[y:y + ch, x - PAD:x] == GREY).all() and (grid[y - PAD:y, x:x + mw] == GREY).all()  # frame
        assert (grid[y:y + ch, x + mw:x + mw + PAD] == GREY).all() and (grid[y + ch:y + ch + PAD, x:x + mw] == GREY).all()
    assert (grid[PAD + ch + PAD:, PAD + mw + PAD:] == GREY).all()  # no cell after the 9th
    assert not np.array_equal(grid[PAD:PAD + lb, PAD:PAD + mw], grid[PAD:PAD + lb, 2 * PAD + mw:2 * PAD + 2 * mw])

    if with_wandb:
        import wandb

        ((step, data),) = logged
        table = data["train/gallery"]
        assert step == 12 and isinstance(table, wandb.Table)
        assert table.columns == ["step", "prompt", "image", "strict", "partial/counting", "reward", "advantage"]
        assert len(table.data) == 9 and isinstance(table.data[0][2], wandb.Image)
        assert table.data[1][-3] is None  # NaN component (tag not applicable) → empty cell
        assert table.data[0][-1] == pytest.approx(float(advantages[0]))
        samples = data["train/samples"]  # the media panel: one captioned image per sample
        assert len(samples) == 9 and all(isinstance(x, wandb.Image) for x in samples)
        assert samples[3]._caption == f"{prompts[3]}\nreward {float(rewards[3]):.3f}  adv {float(advantages[3]):+.3f}"


@pytest.mark.parametrize("with_wandb", [False, True], ids=["files-only", "wandb-disabled"])
def test_video_gallery_round_trip(tmp_path, request, with_wandb):
    run, logged = request.getfixturevalue("wandb_run") if with_wandb else (None, None)
    t = 10
    prompts, media, rewards, components, _ = _batch(b=3, t=t, h=16, w=16, seed=1)
    out = Gallery(tmp_path, logger=run).log(5, prompts, media, rewards=rewards, components=components,
                                                 tag="eval", fps=4)

    rows = read_gallery(tmp_path / "gallery" / "eval")  # a directory: every step file
    expected = to_uint8(media)
    assert len(rows) == 3
    for i, row in enumerate(rows):
        assert row["num_frames"] == t and row["video"].shape == (t, 3, 16, 16)
        assert torch.equal(row["video"], expected[i])  # the PNG strip is lossless
        assert row["advantage"] is None and _same_float(row["reward"], rewards[i])
        assert row["pil"].size == (t * 16, 16)

    grid = np.asarray(Image.open(out["grid"]).convert("RGB"))  # one row per sample, 8 of the 10 frames
    s = MIN_SIDE // 16
    fw = 16 * s
    cw = FRAMES * (fw + PAD) - PAD
    lb = band(2)  # the prompt, then "reward r" (no advantages)
    ch = lb + 1 + fw
    assert grid.shape == (3 * (ch + PAD) + PAD, cw + 2 * PAD, 3)
    picked = [0, 1, 3, 4, 5, 6, 8, 9]  # round(linspace(0, 9, 8)): evenly spaced, first and last included
    for i in range(3):
        y = PAD + i * (ch + PAD)
        for line in range(2):
            assert dark(grid[y + MARGIN + line * LINE_H:y + MARGIN + (line + 1) * LINE_H, PAD:PAD + cw]) > 10
        for k, t in enumerate(picked):
            x = PAD + k * (fw + PAD)
            assert np.array_equal(grid[y + lb + 1:y + ch, x:x + fw], upscaled(expected[i, t], s)), (i, t)
            if k:
                assert (grid[y + lb + 1:y + ch, x - PAD:x] == GREY).all()  # frames apart
        assert (grid[y + ch:y + ch + PAD] == GREY).all()  # rows apart

    if with_wandb:
        import wandb

        ((step, data),) = logged
        table = data["eval/gallery"]
        assert step == 5 and table.columns[:3] == ["step", "prompt", "video"]
        assert isinstance(table.data[0][2], wandb.Video)
        samples = data["eval/samples"]
        assert len(samples) == 3 and all(isinstance(x, wandb.Video) for x in samples)
        assert samples[0]._caption.startswith(prompts[0] + "\nreward ")
    if importlib.util.find_spec("imageio_ffmpeg") is not None:  # with any logger: a video file per sample
        assert [p.name for p in out["media"]] == ["000.mp4", "001.mp4", "002.mp4"]
        import imageio.v3 as iio

        clip = iio.imread(out["media"][1])  # decodes: T frames of the clip's size, near its pixels (lossy)
        assert clip.shape == (10, 16, 16, 3)
        assert np.abs(clip.astype(float) - expected[1].permute(0, 2, 3, 1).numpy()).mean() < 40


def test_video_without_ffmpeg_falls_back_to_gifs(tmp_path, wandb_run, monkeypatch):
    import builtins

    import wandb

    run, logged = wandb_run
    real_import = builtins.__import__

    def no_imageio(name, *args, **kwargs):
        if name.startswith("imageio"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_imageio)
    prompts, media, rewards, _, _ = _batch(b=3, t=3, h=8, w=8)
    with pytest.warns(UserWarning, match="imageio-ffmpeg"):
        out = Gallery(tmp_path, logger=run).log(1, prompts, media, rewards=rewards)
    assert [p.name for p in out["media"]] == ["000.gif", "001.gif", "002.gif"]
    gif = Image.open(out["media"][2])  # random frames (the first two clips are one colour: a single GIF frame)
    assert gif.n_frames == 3 and gif.size == (8, 8)
    ((_, data),) = logged
    assert isinstance(data["train/gallery"].data[0][2], wandb.Video) and data["train/samples"][0]._format == "gif"


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


def test_a_failed_parquet_write_leaves_no_partial_file(tmp_path, monkeypatch):
    import errno
    import os

    import flowgrpo.gallery as gallery_module

    def full_disk(table, where, *args, **kwargs):
        Path(where).write_bytes(b"PAR1 half")  # half a file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))

    monkeypatch.setattr(gallery_module.pq, "write_table", full_disk)
    with pytest.raises(OSError, match="No space left"):
        Gallery(tmp_path).log(3, ["a red circle"], torch.rand(1, 3, 16, 16), rewards=torch.tensor([0.5]))
    assert [p.name for p in (tmp_path / "gallery").rglob("*") if p.is_file()] == []


def test_long_prompts_wrap_and_every_label_line_is_drawn(tmp_path):
    prompts, media, rewards, _, advantages = _batch(b=2, h=64, w=64)
    prompts = ["a photo of " + " ".join(["an extraordinarily purple elephant"] * 20), "two dogs"]
    out = Gallery(tmp_path).log(0, prompts, media, rewards=rewards, advantages=advantages)
    grid = np.asarray(Image.open(out["grid"]).convert("RGB"))
    mw = 64 * 2  # 64x64 samples show at 128x128
    lb = band(4 + 2)  # 4 prompt lines (cut), then reward and advantage: "reward r  adv a" is wider than 122 px
    ch = lb + 1 + mw
    assert grid.shape == (ch + 2 * PAD, 2 * (mw + PAD) + PAD, 3)
    lines = [[dark(grid[PAD + MARGIN + j * LINE_H:PAD + MARGIN + (j + 1) * LINE_H, x:x + mw]) for j in range(6)]
             for x in (PAD, 2 * PAD + mw)]
    assert all(n > 10 for n in lines[0]), lines[0]  # the long prompt fills its 4 lines, the scores 2 more
    assert all(n > 10 for n in lines[1][:3]) and lines[1][3:] == [0, 0, 0], lines[1]  # "two dogs", then scores
    assert read_gallery(out["parquet"])[0]["prompt"] == prompts[0]  # the parquet keeps the whole prompt


def test_group_size_shows_every_group(tmp_path):
    b, g = 12, 3
    prompts, media, rewards, components, advantages = _batch(b=b)
    prompts = [f"prompt {i // g}" for i in range(b)]
    for max_rows, rows in [(8, [0, 1, 3, 4, 6, 7, 9, 10]), (5, [0, 3, 6, 9]), (2, [0, 3, 6, 9]), (99, list(range(12)))]:
        out = Gallery(tmp_path / str(max_rows), max_rows=max_rows).log(
            3, prompts, media, rewards=rewards, components=components, advantages=advantages, group_size=g)
        got = read_gallery(out["parquet"])
        assert [r["prompt"] for r in got] == [prompts[i] for i in rows]
        assert [r["reward"] for r in got] == pytest.approx([float(rewards[i]) for i in rows])
        assert [r["advantage"] for r in got] == pytest.approx([float(advantages[i]) for i in rows])
        assert all(torch.equal(r["image"], to_uint8(media[i])) for r, i in zip(got, rows))
        cells = math.ceil(len(rows) / COLS)
        assert Image.open(out["grid"]).size[1] == cells * (band(2) + 1 + 12 * 11 + PAD) + PAD
    with pytest.raises(ValueError, match="groups of group_size=5"):
        Gallery(tmp_path).log(0, prompts, media, rewards=rewards, group_size=5)


def _record_payloads(path: Path) -> bytes:
    """The records of a W&B run file joined, without the log format's framing: a 7-byte file header, then 32 KiB
    blocks of chunks (4-byte checksum, 2-byte little-endian length, 1-byte type, the payload), a block's tail under 7
    bytes zero-padded. A record that crosses a block is split into chunks: joined again here, so a path in it reads
    whole."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    out, pos = [], 7
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero padding up to the block's end (a preallocated tail)
            pos += room
            continue
        out.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
    return b"".join(out)


def test_an_offline_wandb_run_copied_elsewhere_holds_every_media_file(tmp_path, monkeypatch):
    """logger=wandb offline, W&B's own directories (its staging area) outside the run dir: nothing is staged there and
    the run's record names no file outside the run's files (an offline run's tables are files of the run, not
    artifacts, whose files W&B would stage elsewhere and name by absolute path); after the run dir is copied elsewhere
    and the original and W&B's directories are deleted, the copy holds every media file the record and the tables
    reference, by a path relative to the run's files: our videos and images byte for byte, the tables and panels."""
    import re
    import shutil

    home = tmp_path / "home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(var, str(home))
    run_dir = tmp_path / "run"
    logger = build_logger(logger_node("wandb", mode="offline"), output_dir=run_dir, config={"trainer": {"seed": 0}})
    gallery = Gallery(run_dir, logger=logger)
    prompts, images, rewards, components, advantages = _batch(b=4, h=16, w=16, seed=2)
    logger.log({"reward/mean": 0.5}, step=1)
    ours = gallery.log(1, prompts, images, rewards=rewards, components=components, advantages=advantages)["media"]
    prompts, videos, rewards, _, _ = _batch(b=3, t=6, h=16, w=16, seed=3)
    ours += gallery.log(2, prompts, videos, rewards=rewards, tag="eval", fps=4)["media"]
    logger.log({"reward/mean": 0.6}, step=3)
    logger.finish()
    assert not list(home.rglob("staging")) and not list(run_dir.rglob("staging"))  # nothing staged for upload

    ours = {hashlib.sha256(p.read_bytes()).hexdigest() for p in ours}
    copy = tmp_path / "elsewhere" / "run"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(run_dir)
    shutil.rmtree(home)
    (sync_dir,) = copy.glob("wandb/offline-run-*")
    record = _record_payloads(next(sync_dir.glob("run-*.wandb")))
    assert b"run_table" not in record and b"artifacts" not in record  # no artifact to upload
    # the only absolute path in the record is the run's root directory, no file under it or elsewhere
    assert set(re.findall(re.escape(str(tmp_path).encode()) + rb"[\x21-\x7e]*", record)) <= {
        str(run_dir).encode() + b"b", str(run_dir).encode()}  # (protobuf's next field tag may follow the text)
    # the history names the panels' and the tables' files by their paths in the run's files: all in the copy
    files_dir = sync_dir / "files"
    named = set(re.findall(rb'media/(?:images|videos|table)/[\w/.-]+?\.(?:png|mp4|gif|table\.json)', record))
    assert len(named) == 4 + 3 + 2, sorted(named)
    for path in named:
        assert (files_dir / path.decode()).is_file(), path

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    def media_cells(table: dict) -> list[dict]:
        return [v for row in table["data"] for v in row if isinstance(v, dict) and "path" in v]

    # the tables' files: every media cell a path relative to the run's files, of a file there (our bytes)
    run_tables = sorted(files_dir.glob("media/table/**/*.table.json"))
    assert len(run_tables) == 2
    for path in run_tables:
        text = path.read_text()
        assert str(tmp_path) not in text  # no absolute path, of the original or anything else
        table = json.loads(text)
        cells = media_cells(table)
        assert len(cells) == len(table["data"]) > 0  # one media cell per row
        for cell in cells:
            assert cell["_type"] in ("image-file", "video-file") and not Path(cell["path"]).is_absolute()
            assert ".." not in Path(cell["path"]).parts and (files_dir / cell["path"]).is_file(), cell
            assert digest(files_dir / cell["path"]) == cell["sha256"] and cell["sha256"] in ours

    files = [p for p in copy.rglob("*") if p.is_file() and "gallery" not in p.relative_to(copy).parts]
    digests = {hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    assert ours <= digests  # our mp4s and PNGs, unchanged, in W&B's part of the run dir
    media = sync_dir / "files" / "media"
    assert len(list(media.glob("images/train/samples_*.png"))) == 4  # the panels: run files, synced with the run
    assert len(list(media.glob("videos/eval/samples_*.mp4"))) == 3
    (table,) = media.glob("table/eval/gallery_*.table.json")
    assert json.loads(table.read_text())["columns"] == ["step", "prompt", "video", "reward", "advantage"]


def test_the_training_gallery_shows_every_prompt_of_the_iteration(tmp_path):
    """4 prompts x 2 samples with gallery_size=2: every prompt still gets a labelled cell (its first sample)."""
    from hydra import compose, initialize_config_dir

    import flowgrpo.config  # noqa: F401  (registers the schemas)
    from flowgrpo.trainer import Trainer

    conf = str(Path(__file__).resolve().parents[1] / "conf")
    overrides = [
        "model=tiny_sd3", "reward=jpeg_compressibility", "logger=none", "algo=grpo", "sampler=sde",
        "sampler.num_steps=3", "sampler.eval_num_steps=2",
        "trainer.iterations=1", "trainer.prompts_per_iteration=4", "trainer.group_size=2",
        "trainer.train_batch_size=8", "trainer.gradient_accumulation_steps=1",
        "trainer.eval_before=false", "trainer.eval_every=0", "trainer.eval_num_prompts=1",
        "trainer.eval_samples_per_tag=null", "trainer.checkpoint_every=0",
        "trainer.gallery_every=1", "trainer.gallery_size=2", f"trainer.output_dir={tmp_path}",
    ]
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    trainer = Trainer(cfg, tmp_path)
    trainer.fit()
    batch = trainer._last_batch
    rows = read_gallery(tmp_path / "gallery" / "train" / "step-000001.parquet")
    assert [r["prompt"] for r in rows] == batch.prompts[::2]  # the first sample of each of the 4 groups
    assert [r["reward"] for r in rows] == pytest.approx(batch.rewards[::2].tolist())
    assert [r["advantage"] for r in rows] == pytest.approx(batch.advantages[::2].tolist())
    grid = Image.open(tmp_path / "gallery" / "train" / "step-000001.png")
    s = MIN_SIDE // 32  # the tiny model's 32x32 images show at 128x128
    assert grid.size[0] == 4 * (32 * s + PAD) + PAD  # one labelled cell per prompt


def test_a_marked_window_is_shown_and_barred_under_exactly_its_frames(tmp_path):
    """Videos with a marked frame window (KVPO's routed frames): the window's first, middle and last frame are among
    the shown frames, an orange bar runs under every shown frame inside it and nowhere else, an unmarked video gets
    a grey bar row, and the label carries the algorithm's notes."""
    from flowgrpo.gallery import labelled_grid

    T, H = 49, 64
    media = torch.rand(2, T, 3, H, H)
    marks = torch.tensor([[13.0, 20.0], [float("nan"), float("nan")]])
    plain = np.asarray(labelled_grid(media, ["a", "b"], [[], []]))
    marked = np.asarray(labelled_grid(media, ["a", "b"], [[], []], marks=marks.tolist()))
    s = MIN_SIDE // H
    picked = sorted(set(np.linspace(0, T - 1, FRAMES).round().astype(int).tolist()) | {13, 16, 20})
    fw = H * s + PAD
    assert marked.shape[1] == PAD + len(picked) * fw  # the strip widened by the window's frames (36 is already shown)
    for row in (0, 1):
        top = PAD + row * (band(1) + 1 + H * s + 4 + PAD) + band(1) + 1
        bar = marked[top + H * s: top + H * s + 4, PAD:]
        for k, t in enumerate(picked):
            cell = bar[:, k * fw: k * fw + H * s]
            orange = row == 0 and 13 <= t <= 20
            assert (cell == ((230, 110, 0) if orange else GREY)).all(), (row, t)
        k, t = (picked.index(16), 16) if row == 0 else (FRAMES - 1, T - 1)  # unmarked: 8 frames, then white
        shown = marked[top:top + H * s, PAD + k * fw: PAD + k * fw + H * s]
        assert np.array_equal(shown, upscaled(to_uint8(media[row, t]), s))
        filler = marked[top:top + H * s, PAD + (k + 1) * fw: PAD + (k + 1) * fw + H * s]
        assert row == 0 or (filler == 255).all()
    assert plain.shape[0] + 2 * 4 == marked.shape[0]
    with pytest.raises(ValueError, match=r"mark \(40, 60\) of sample 0 is not a frame range"):
        labelled_grid(media, ["a", "b"], [[], []], marks=[[40, 60], None])

    out = Gallery(tmp_path).log(3, ["a", "b"], media, rewards=torch.tensor([0.5, 0.25]), marks=marks,
                                notes=[["branch 0", "pi 0.600", "routed 13-20"], ["reference run"]])
    grid = np.asarray(Image.open(out["grid"]).convert("RGB"))
    # "reward 0.500  branch 0  pi 0.600  routed 13-20" under the prompt: two label lines per cell instead of one
    assert grid.shape == (marked.shape[0] + 2 * LINE_H, marked.shape[1], 3)
    assert (grid == (230, 110, 0)).all(axis=2).sum() == (marked == (230, 110, 0)).all(axis=2).sum()
    with pytest.raises(ValueError, match=r"marks must be \[2, 2\]"):
        Gallery(tmp_path).log(4, ["a", "b"], media, rewards=torch.tensor([0.5, 0.25]), marks=marks[:1])


def test_gallery_jobs_spread_over_tags_then_prompts():
    """A tag-ordered held-out set whose first prompt has many seeds: the gallery still shows every tag, distinct
    prompts within a tag before a second seed of any, the same choice every time."""
    from flowgrpo.builders import PromptSet
    from flowgrpo.evaluation import gallery_jobs

    tags = ["single_object"] + ["two_object"] * 3 + ["counting"] * 2 + ["colors"]
    prompts = PromptSet([f"prompt {i}" for i in range(len(tags))], [{"tag": t} for t in tags], "held-out")
    jobs = [(0, j) for j in range(16)] + [(i, j) for i in range(1, len(tags)) for j in range(2)]
    first = gallery_jobs(jobs, prompts, 16)
    assert first == gallery_jobs(jobs, prompts, 16) and len(first) == 16 == len(set(first))
    assert {tags[jobs[k][0]] for k in gallery_jobs(jobs, prompts, 4)} == set(tags)  # as many slots as tags
    shown = [jobs[k] for k in first]
    assert {i for i, _ in shown} == set(range(len(tags)))  # every prompt once there is room
    assert sum(i == 0 for i, _ in shown) < 16  # no longer the first prompt 16 times
    assert first == sorted(first)  # in job order: grouped as the held-out file is
    assert gallery_jobs(jobs, prompts, 5, among=[0, 2, 16, 17, 27, 99]) == [0, 2, 16, 17, 27]
    assert gallery_jobs(jobs, prompts, 2, among=[0, 2, 16, 27]) == [0, 27]  # colors and single_object, by name
    plain = PromptSet(["a", "b", "c"], None, "text")
    assert gallery_jobs([(0, 0), (0, 1), (1, 0), (2, 0)], plain, 3) == [0, 2, 3]  # no tags: prompts take turns


def test_the_held_out_gallery_shows_every_tag_and_leaves_the_scores_alone(tmp_path):
    """The evaluation gallery of a tag-ordered held-out set covers every tag; the evaluated numbers are those of
    the same jobs scored without a gallery."""
    from hydra import compose, initialize_config_dir

    import flowgrpo.config  # noqa: F401  (registers the schemas)
    from flowgrpo.trainer import Trainer

    conf = str(Path(__file__).resolve().parents[1] / "conf")
    overrides = [
        "model=tiny_sd3", "reward=jpeg_compressibility", "data=geneval_shapes", "logger=none", "algo=grpo",
        "sampler=sde", "sampler.num_steps=3", "sampler.eval_num_steps=2",
        "trainer.prompts_per_iteration=2", "trainer.group_size=2", "trainer.train_batch_size=4",
        "trainer.gradient_accumulation_steps=1", "trainer.eval_num_prompts=12", "trainer.eval_samples_per_prompt=1",
        "trainer.eval_samples_per_tag=4", "trainer.gallery_size=8", f"trainer.output_dir={tmp_path}",
    ]
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    trainer = Trainer(cfg, tmp_path)
    result = trainer.evaluate()
    jobs = trainer.eval_jobs()
    assert len(jobs) > 8 and jobs[:4] == [(0, 0), (0, 1), (0, 2), (0, 3)]  # the first prompt 4 times
    assert result == trainer.held_out_samples(jobs).scalars("eval")
    rows = read_gallery(tmp_path / "gallery" / "eval" / "step-000000.parquet")
    tags = {m["tag"]: None for m in trainer.val_set.subset([i for i, _ in jobs]).metadata}
    by_prompt = {p: m["tag"] for p, m in zip(trainer.val_set.prompts, trainer.val_set.metadata)}
    assert len(rows) == 8 and {by_prompt[r["prompt"]] for r in rows} == set(tags)


def test_tensorboard_events_hold_the_scalars_the_galleries_and_the_clips(tmp_path):
    """logger=tensorboard: reading the event file back finds every scalar, the labelled grid of each gallery (pixel
    for pixel), the captions and, per video, an animated GIF of all its frames."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = build_logger(logger_node("tensorboard"), output_dir=tmp_path, config={"trainer": {"seed": 3}})
    gallery = Gallery(tmp_path, logger=logger)
    logger.log({"reward/mean": 0.25, "loss": -1.5}, step=1)
    logger.log({"reward/mean": 0.5}, step=2)
    prompts, images, rewards, components, advantages = _batch(b=3, h=16, w=16, seed=4)
    grid = gallery.log(2, prompts, images, rewards=rewards, components=components, advantages=advantages)["grid"]
    clips = _batch(b=3, t=5, h=16, w=16, seed=5)  # a white clip, a black one, a random one
    gallery.log(2, clips[0], clips[1], rewards=clips[2], tag="eval")
    logger.finish()

    (events,) = {p.parent for p in tmp_path.glob("tensorboard/**/events.out.tfevents.*")}
    acc = EventAccumulator(str(events), size_guidance={"images": 0, "tensors": 0, "scalars": 0}).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, -1.5)]
    (shown,) = acc.Images("train/gallery")
    pixels = np.asarray(Image.open(io.BytesIO(shown.encoded_image_string)).convert("RGB"))
    assert shown.step == 2 and np.array_equal(pixels, np.asarray(Image.open(grid).convert("RGB")))
    assert len(acc.Images("eval/gallery")) == 1
    gifs = [Image.open(io.BytesIO(acc.Images(f"eval/video/{i:02d}")[0].encoded_image_string)) for i in range(3)]
    assert all(g.format == "GIF" and g.size == (16, 16) for g in gifs)
    assert [g.n_frames for g in gifs] == [1, 1, 5]  # a still clip is one GIF frame
    gifs[2].seek(3)
    assert np.abs(np.asarray(gifs[2].convert("RGB"), float) - upscaled(to_uint8(clips[1][2, 3]), 1)).mean() < 20
    text = acc.Tensors("train/captions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert all(p in text for p in prompts) and f"{float(rewards[2]):.4g}" in text
    assert "seed: 3" in acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def test_the_html_index_links_every_gallery_file_and_nothing_missing(tmp_path):
    """gallery/index.html after image and video galleries at two steps: every file under gallery/ is linked, every
    link is relative and points at a file that exists, and each sample's caption has its prompt and scores."""
    from html.parser import HTMLParser
    from urllib.parse import unquote, urlparse

    class Links(HTMLParser):
        def __init__(self):
            super().__init__()
            self.links, self.text = [], []

        def handle_starttag(self, tag, attrs):
            self.links += [v for k, v in attrs if k in ("href", "src") and not v.startswith("#")]

        def handle_data(self, data):
            self.text.append(data)

    gallery = Gallery(tmp_path, max_rows=4)
    prompts, images, rewards, components, advantages = _batch(b=4, h=16, w=16)
    prompts[2] = "a <b>bold</b> & odd prompt"
    for step in (1, 2):
        gallery.log(step, prompts, images, rewards=rewards, components=components, advantages=advantages)
    clips = _batch(b=2, t=4, h=16, w=16)
    index = gallery.log(2, clips[0], clips[1], rewards=clips[2], tag="eval")["index"]

    page = Links()
    page.feed(index.read_text())
    assert all(not urlparse(link).scheme and not link.startswith("/") for link in page.links)  # relative
    linked = {(index.parent / unquote(link)).resolve() for link in page.links}
    on_disk = {p.resolve() for p in (tmp_path / "gallery").rglob("*") if p.is_file() and p != index}
    assert linked == on_disk and len(on_disk) == 2 * (2 + 4) + 2 + 2
    text = " ".join(page.text)
    assert prompts[2] in text and "<b>" not in text.replace(prompts[2], "")  # escaped, shown as written
    assert f"reward {float(rewards[0]):.3f}" in text and f"adv {float(advantages[0]):+.3f}" in text
    assert f"partial/counting\xa0{float(components['partial/counting'][2]):.3f}" in text
    assert index.read_text().count("<video") == 2 and index.read_text().count("<img") == 8


def test_logger_choices_are_the_trackers_and_a_missing_package_is_named(tmp_path, monkeypatch):
    from flowgrpo.builders.logger import TRACKERS
    from flowgrpo.config import LoggerConfig

    conf = Path(__file__).resolve().parents[1] / "conf" / "logger"
    choices = LoggerConfig.__dataclass_fields__["name"].metadata["choices"]
    assert set(choices) == {"none", *TRACKERS} == {p.stem for p in conf.glob("*.yaml")}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aim" else real(name, *a))
    with pytest.raises(ImportError, match=r"logger=aim needs the 'aim' package: pip install aim"):
        build_logger(logger_node("aim"), output_dir=tmp_path)


def test_mlflow_gets_the_scalars_the_config_and_the_gallery_files(tmp_path, monkeypatch):
    import mlflow
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):  # a store of the run's own (and unset after)
        monkeypatch.delenv(var, raising=False)
    logger = build_logger(logger_node("mlflow", project="flowgrpo-test"), output_dir=tmp_path,
                          config={"trainer": {"seed": 3, "adam_betas": [0.9, 0.999]}})
    run_id = logger.tracker.active_run.info.run_id
    try:
        logger.log({"reward/mean": 0.25}, step=1)
        prompts, images, rewards, _, _ = _batch(b=2, h=16, w=16)
        out = Gallery(tmp_path, logger=logger).log(1, prompts, images, rewards=rewards)
    finally:
        logger.finish()
    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    assert run.data.metrics["reward/mean"] == 0.25
    assert run.data.params["trainer.seed"] == "3" and run.data.params["trainer.adam_betas"] == "[0.9, 0.999]"
    stored = {Path(p).relative_to(tmp_path / "mlruns").as_posix().split("/artifacts/", 1)[1]
              for p in map(str, (tmp_path / "mlruns").rglob("*")) if "/artifacts/" in p and Path(p).is_file()}
    assert stored == {"gallery/train/step-000001.png", "gallery/train/step-000001/000.png",
                      "gallery/train/step-000001/001.png", "gallery/train/step-000001/captions.json"}
    assert out["grid"].exists()
