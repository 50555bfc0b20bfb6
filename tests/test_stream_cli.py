"""``python -m flowgrpo.stream``: a stream with switches from a streaming model directory, mp4 + labelled PNG."""

import json

import pytest
from PIL import Image

from flowgrpo.models import StreamingWanPipeline, build_tiny_pipeline
from flowgrpo.models.stream_pipeline import StreamConfig
from flowgrpo.stream import main

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream_model")
    config = StreamConfig(block_frames=1, num_steps=2, sink_frames=1, window_frames=3, height=64, width=64)
    StreamingWanPipeline(build_tiny_pipeline("wan"), config).save_pretrained(path)
    return path


def test_prompts_and_switches_give_an_mp4_and_a_row_per_segment(model_dir, tmp_path):
    summary = main(["--model", str(model_dir), "--prompt", "a red circle moving left", "--prompt",
                    "a red circle standing still", "--prompt", "a red circle moving up", "--switch", "13", "--switch",
                    "25", "--num-frames", "33", "--out", str(tmp_path), "--threads", "1"])
    assert summary["switch_blocks"] == [4, 7]          # pixel 13 is in latent frame 4 (frames 13-16), 25 in 7
    import imageio.v3 as iio

    frames = iio.imread(tmp_path / "stream.mp4")
    assert frames.shape[0] == 33 and frames.shape[1:3] == (64, 64)
    sheet = Image.open(tmp_path / "stream.png")
    one_row = Image.open(main(["--model", str(model_dir), "--prompt", "a red circle", "--num-frames", "33", "--out",
                               str(tmp_path / "one"), "--no-mp4", "--threads", "1"])["png"])
    assert sheet.height > 2.5 * one_row.height                                      # three labelled rows


def test_metadata_streams_are_scored(model_dir, tmp_path):
    from flowgrpo.world.streams import sample_stream_metadata

    meta = sample_stream_metadata(0)
    (tmp_path / "s.jsonl").write_text(json.dumps(meta) + "\n")
    summary = main(["--model", str(model_dir), "--metadata", str(tmp_path / "s.jsonl"), "--score", "--no-mp4",
                    "--out", str(tmp_path / "o"), "--threads", "1"])
    assert summary["prompts"] == [s["prompt"] for s in meta["segments"]]
    assert 0.0 <= summary["reward"] <= 1.0 and len(summary["rewards"]) > 3
    assert summary["scored_by"].startswith("long_video v2")  # which rules scored it
    with pytest.raises(SystemExit, match="stream_config.json"):
        main(["--model", str(tmp_path), "--prompt", "x"])
    with pytest.raises(SystemExit, match="--metadata"):
        main(["--model", str(model_dir), "--prompt", "x", "--score"])


def test_eval_streams_scores_held_out_streams_whatever_the_batching(model_dir, tmp_path):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "eval_streams.py"
    spec = importlib.util.spec_from_file_location("eval_streams", script)
    es = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(es)
    common = ["--model", str(model_dir), "--streams", "3", "--samples", "2", "--threads", "1"]
    one = es.main(common + ["--batch", "1", "--sheet", str(tmp_path / "s.png"), "--sheet-streams", "2"])
    many = es.main(common + ["--batch", "4", "--json-out", str(tmp_path / "r.json")])
    assert one["videos"] == many["videos"] == 6 and one["scored_by"] == "long_video v2 (score=mean)"
    assert one["overall"] == many["overall"]          # each video's noise is its own, whatever the batch
    assert set(one["overall"]) >= {"reward", "adherence", "direction", "identity", "recovery", "anti_freeze"}
    assert json.loads((tmp_path / "r.json").read_text())["overall"] == many["overall"]
    assert Image.open(tmp_path / "s.png").height > 0
