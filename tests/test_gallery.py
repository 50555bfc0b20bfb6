"""Galleries: parquet + labelled PNG grid always, a W&B Table when a run is given; what is read back is what was
logged; the grid has one framed, labelled cell per sample; the trainer's gallery shows every prompt."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

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


def test_wandb_offline_run_writes_the_table_and_the_mp4s(tmp_path, monkeypatch):
    """A real (offline) W&B run: the table file the run writes has the columns, and the mp4s it references by hash
    are copied into the run's storage."""
    wandb = pytest.importorskip("wandb")
    pytest.importorskip("imageio_ffmpeg")
    root = tmp_path / "wandb"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(var, str(root))
    prompts, media, rewards, components, advantages = _batch(b=3, t=6, h=16, w=16, seed=2)
    run = wandb.init(mode="offline", project="flowgrpo-test", dir=str(root))
    try:
        out = Gallery(tmp_path / "run", wandb_run=run).log(
            4, prompts, media, rewards=rewards, components=components, advantages=advantages, tag="train", fps=4)
    finally:
        run.finish()
    columns = ["step", "prompt", "video", "strict", "partial/counting", "reward", "advantage"]
    mp4s = sorted(out["mp4"].glob("*.mp4"))
    assert len(mp4s) == 3
    ours = {hashlib.sha256(p.read_bytes()).hexdigest() for p in mp4s}
    assert len(ours) == 3

    (table_file,) = root.glob("wandb/offline-run-*/files/media/table/train/gallery_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == columns
    assert [row[:2] for row in table["data"]] == [[4, p] for p in prompts]
    assert [row[-2] for row in table["data"]] == pytest.approx([float(r) for r in rewards])
    assert [row[-1] for row in table["data"]] == pytest.approx([float(a) for a in advantages])
    assert table["data"][1][4] is None  # a NaN component is an empty cell

    stored = [p for p in root.rglob("*") if p.is_file()]
    hashes = {hashlib.sha256(p.read_bytes()).hexdigest() for p in stored}
    assert ours <= hashes  # the videos themselves went into the run's storage
    tables = [json.loads(p.read_text()) for p in stored if p.read_bytes()[:1] == b"{" and b'"video-file"' in p.read_bytes()]
    assert tables, "no table with video cells was written"
    for t in tables:  # the table as W&B shows it: video cells that point at our mp4s
        assert t["columns"] == columns
        assert {row[2]["sha256"] for row in t["data"]} == ours and all(row[2]["_type"] == "video-file" for row in t["data"])


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
    from flowgrpo.build import PromptSet
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
    tags = {m["tag"]: None for m in trainer.test_set.subset([i for i, _ in jobs]).metadata}
    by_prompt = {p: m["tag"] for p, m in zip(trainer.test_set.prompts, trainer.test_set.metadata)}
    assert len(rows) == 8 and {by_prompt[r["prompt"]] for r in rows} == set(tags)
