"""Every embedded model under assets/ has a model card (README.md) that says how to call it: native size, steps,
guidance, a Python call naming its own directory with those settings, and what trained it; each call runs (a few
seconds on a CPU) and makes what it says; a re-export keeps the card."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "assets"
MODELS = sorted(p.parent.name for p in ASSETS.glob("*/model_index.json"))


def _card(name: str) -> tuple[str, str]:
    text = (ASSETS / name / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, f"assets/{name}/README.md: one Python call expected, found {len(blocks)}"
    return text, blocks[0]


def test_the_embedded_models_are_the_ones_the_configs_name():
    assert MODELS == ["tiny-causal-wan-shapes", "tiny-causal-wan-shapes-4step", "tiny-sd3-shapes", "tiny-wan-shapes"]


@pytest.mark.parametrize("name", MODELS)
def test_each_embedded_model_has_a_card_with_the_call_that_works(name):
    text, call = _card(name)
    for heading in ("native size", "steps", "guidance", "**Trained**"):
        assert heading in text, f"assets/{name}/README.md says nothing under {heading!r}"
    summary = json.loads((ASSETS / name / "pretrain_summary.json").read_text())
    assert summary["script"] in text, f"assets/{name}/README.md does not name its training script {summary['script']}"
    assert f'from_pretrained("assets/{name}")' in call
    settings = json.loads((ASSETS / name / "stream_config.json").read_text()) if (
        ASSETS / name / "stream_config.json").is_file() else None
    if settings is None:  # a clip or image pipeline: the call passes the size and steps its card states
        assert "height=64, width=64" in call and "num_inference_steps=10" in call and "guidance_scale=4.5" in call
    else:  # a streaming model: its size, steps and guidance come from stream_config.json, which the card states
        assert f"{settings['num_steps']} per block" in text and (settings["height"], settings["width"]) == (64, 64)
        assert ("none" if settings["guidance_scale"] == 1 else f"CFG {settings['guidance_scale']:g}") in text


def test_a_re_export_keeps_the_model_card(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    from pretrain_tiny import save_pipeline

    class Pipe:
        def save_pretrained(self, path):
            Path(path).mkdir(parents=True)
            (Path(path) / "model_index.json").write_text("{}")

    out = tmp_path / "model"
    save_pipeline(Pipe(), out, {"script": "x"})
    (out / "README.md").write_text("# model\n")
    save_pipeline(Pipe(), out, {"script": "y"})
    assert (out / "README.md").read_text() == "# model\n"
    assert json.loads((out / "pretrain_summary.json").read_text()) == {"script": "y"}


@pytest.mark.parametrize("name", MODELS)
def test_the_card_call_runs(name, monkeypatch, tmp_path):
    import torch

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    _, call = _card(name)
    scope: dict = {}
    exec(call.replace('"red_circle.mp4"', repr(str(tmp_path / "red_circle.mp4"))), scope)
    made = [scope[k] for k in ("image", "frames", "video") if k in scope]
    assert len(made) == 1
    size = made[0].size if name == "tiny-sd3-shapes" else tuple(made[0].shape)
    assert size == {"tiny-sd3-shapes": (64, 64), "tiny-wan-shapes": (13, 64, 64, 3)}.get(name, (49, 3, 64, 64))
