"""``scripts/probe_conditioning.py``: word swaps, the loss measurement's zero point, the generation probe's report."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
_spec = importlib.util.spec_from_file_location("probe_conditioning", _SCRIPTS / "probe_conditioning.py")
pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_swap_words_touches_only_its_kind():
    prompt = "a red circle moving left and a blue square moving up"
    assert pc.swap_words(prompt, "direction") == "a red circle moving right and a blue square moving down"
    swapped = pc.swap_words(prompt, "appearance")
    assert swapped.split()[3:5] == ["moving", "left"] and swapped.split()[-2:] == ["moving", "up"]
    assert swapped.split()[1:3] != ["red", "circle"] and swapped.split()[7:9] != ["blue", "square"]
    assert pc.swap_words(prompt, "none") == prompt


@pytest.fixture(scope="module")
def toy_pipe(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("toy") / "pipe"
    pc.pw.build_pipeline("toy").save_pretrained(path)
    return path


def test_loss_gap_is_zero_for_an_unchanged_caption_and_finite_otherwise(toy_pipe):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(toy_pipe)
    report = pc.loss_gap(pipe, clips=3, sigmas=(0.9, 0.4), kinds=("none", "direction", "appearance"), num_frames=5)
    assert set(report) == {"0.9", "0.4", "first_frame_clean"}  # the last: a visible start, the rest noisy
    for row in report.values():
        assert row["none"]["increase"] == 0.0 and row["loss"] > 0
        assert all(abs(row[k]["increase"]) < 10 for k in ("direction", "appearance"))
    assert report["0.9"]["appearance"]["increase"] != 0.0  # the toy text encoder does see the words


def test_cli_writes_the_report_and_refuses_a_non_pipeline(toy_pipe, tmp_path):
    out = tmp_path / "probe.json"
    report = pc.main(["--pretrained", str(toy_pipe), "--clips", "2", "--samples", "1", "--steps", "1", "--threads", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["direction"]["clips"] == 16  # 4 pairs x 4 directions x 1 sample
    assert report["direction"]["tracked"] <= 16
    with pytest.raises(SystemExit, match="model_index.json"):
        pc.main(["--pretrained", str(tmp_path), "--skip-generation"])
