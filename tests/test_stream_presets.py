"""The streaming-model presets (``model=self_forcing_wan``, ``model=longlive_wan``), offline, through tiny twins.

No weights are downloaded. Each preset is composed with its paths pointing at tiny files of the real layouts: a
tiny diffusers Wan pipeline saved with ``save_pretrained`` as the base (``model.pretrained``), a Self-Forcing-style
checkpoint (``generator``, ``critic``, ``generator_ema`` in the original Wan layout behind ``model.``) and a
LongLive-style base + LoRA pair built from peft's own state dict (as in tests/test_wan_checkpoints.py). The loaded
transformer must hold the checkpoint's weights (the EMA entry for Self-Forcing; the ``generator`` entry with the LoRA
merged, as peft merges it, for LongLive), the stream settings must be the references' (docs/streaming_checkpoints.md),
and ``python -m flowgrpo.stream --preset ... --set ...`` must make a stream. The trainer refuses both presets before
anything loads. Float32, CPU, a few seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import runpy
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from peft import LoraConfig, get_peft_model
from PIL import Image
from test_wan_checkpoints import block_linears, longlive_lora, original_layout  # tests/test_wan_checkpoints.py

from flowgrpo.builders import REPO_ROOT, build_adapter
from flowgrpo.config import ConfigError, StreamModelConfig, validate
from flowgrpo.models import StreamingWanPipeline, build_tiny_pipeline, load_stream_pipeline
from flowgrpo.models.stream_load import MODEL_KEYS, stream_config_of
from flowgrpo.models.stream_pipeline import StreamConfig
from flowgrpo.stream import main as stream_main
from samplers import stream_sigmas

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CONF = REPO_ROOT / "conf"
PRESETS = ["longlive_wan", "self_forcing_wan"]
HUB = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
# The reference settings (docs/streaming_checkpoints.md), written out here independently of the preset files.
REFERENCE = {
    "self_forcing_wan": dict(block_frames=3, num_steps=4, shift=5.0, sink_frames=0, window_frames=None,
                             cache_frames=None, context_sigma=0.0, recache=False, guidance_scale=1.0,
                             negative_prompt="", max_sequence_length=512),
    "longlive_wan": dict(block_frames=3, num_steps=4, shift=5.0, sink_frames=3, window_frames=9, cache_frames=12,
                         context_sigma=0.0, recache=True, guidance_scale=1.0, negative_prompt="",
                         max_sequence_length=512),
}
LATENT_FRAMES = {"self_forcing_wan": 21, "longlive_wan": 120}  # image_or_video_shape; num_output_frames
WEIGHTS = {"self_forcing_wan": ("generator_ema", None, {"model.stream.checkpoint"}),
           "longlive_wan": ("generator", 256.0, {"model.stream.checkpoint", "model.stream.lora_checkpoint"})}
# The twin's size: 2 blocks of 3 latent frames, 32x32 pixels, float32, a short text.
SMALL = ["model.height=32", "model.width=32", "model.num_frames=21", "model.torch_dtype=float32",
         "model.vae_dtype=null", "model.max_sequence_length=16"]
RANK = 4  # the tiny LoRA's rank: with the preset's alpha 256 its scaling is 64, so an alpha mistake shows


def _compose(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def _perturbed(model, seed, scale=0.05):
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return twin.eval()


def same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The base pipeline directory, a Self-Forcing checkpoint, a LongLive base + LoRA, and the weights each gives."""
    root = tmp_path_factory.mktemp("stream_presets")
    pipe = build_tiny_pipeline("wan")
    pipe.save_pretrained(root / "base")
    base = pipe.transformer
    gen, ema = _perturbed(base, 1), _perturbed(base, 2)
    torch.save({"generator": original_layout(gen), "critic": {"model.blocks.0.x": torch.zeros(1)},
                "generator_ema": original_layout(ema)}, root / "self_forcing_dmd.pt")
    # LongLive: peft wraps every Linear of every block of the generator, as LongLive wraps its own.
    peft_model = get_peft_model(copy.deepcopy(gen),
                                LoraConfig(r=RANK, lora_alpha=256, target_modules=block_linears(gen)))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.02)  # lora_B starts at zero in peft: set both
    lora = longlive_lora(peft_model)
    torch.save({"generator": original_layout(gen), "generator_ema": original_layout(ema)}, root / "longlive_base.pt")
    torch.save({"generator_lora": lora, "critic_lora": {"x": torch.zeros(1)}, "step": 100}, root / "lora.pt")
    merged = peft_model.merge_and_unload().eval()  # peft's own merge: W + (alpha / r) B A
    return {"root": root, "base": root / "base", "base_state": base.state_dict(), "gen": gen.state_dict(),
            "self_forcing_wan": ema.state_dict(), "longlive_wan": merged.state_dict()}


def paths(name, files):
    sets = [f"model.pretrained={files['base']}"]
    if name == "self_forcing_wan":
        return sets + [f"model.stream.checkpoint={files['root'] / 'self_forcing_dmd.pt'}"]
    return sets + [f"model.stream.checkpoint={files['root'] / 'longlive_base.pt'}",
                   f"model.stream.lora_checkpoint={files['root'] / 'lora.pt'}"]


# ------------------------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_validates_and_holds_the_reference_settings(name):
    cfg = _compose([f"model={name}"])
    m = validate(cfg.model)
    key, alpha, missing = WEIGHTS[name]
    assert set(OmegaConf.missing_keys(cfg)) == missing  # the checkpoint files are the user's
    assert (m.family, m.pretrained, m.torch_dtype, m.vae_dtype) == ("causal_wan", HUB, "bfloat16", "float32")
    assert (m.height, m.width) == (480, 832)
    assert (m.stream.checkpoint_key, m.stream.lora_alpha) == (key, alpha)
    assert (m.num_frames - 1) % 4 == 0 and (m.num_frames - 1) // 4 + 1 == LATENT_FRAMES[name]
    assert stream_config_of(m) == StreamConfig(**REFERENCE[name], height=480, width=832)
    # Both warp [1000, 750, 500, 250] by shift 5 at the same indices of the 1000-step schedule: 5σ / (1 + 4σ).
    sigma = torch.tensor([1000, 750, 500, 250], dtype=torch.float64) / 1000
    warped = stream_sigmas(m.stream.num_steps, m.stream.shift)
    assert torch.allclose(warped.double(), 5 * sigma / (1 + 4 * sigma), atol=1e-6)
    first = (CONF / "model" / f"{name}.yaml").read_text().splitlines()[0]
    assert first.startswith(f"# python -m flowgrpo.stream --preset {name} --set model.stream.checkpoint=PATH")


def test_the_schema_is_stream_config_plus_the_files():
    """``model.stream`` holds StreamConfig's fields (same defaults) but the model's own keys, plus the files."""
    ours = {f.name: f.default for f in dataclasses.fields(StreamModelConfig)}
    theirs = {f.name: f.default for f in dataclasses.fields(StreamConfig) if f.name not in MODEL_KEYS}
    assert {k: ours[k] for k in theirs} == theirs
    assert set(ours) - set(theirs) == {"checkpoint", "checkpoint_key", "lora_checkpoint", "lora_alpha"}
    assert set(MODEL_KEYS) | set(theirs) == {f.name for f in dataclasses.fields(StreamConfig)}


# ------------------------------------------------------------------------------------------- twins


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_its_twin_and_streams_from_the_command(name, files, tmp_path):
    cfg = validate(_compose([f"model={name}", *paths(name, files), *SMALL]).model)
    pipe = load_stream_pipeline(cfg)
    assert isinstance(pipe, StreamingWanPipeline)
    loaded, expected = pipe.pipe.transformer.state_dict(), files[name]
    if name == "self_forcing_wan":
        same_state(loaded, expected)  # the EMA entry, bit for bit
    else:
        assert loaded.keys() == expected.keys()
        for k in loaded:  # the generator entry with the LoRA merged as peft merges it (float32 rounding apart)
            assert torch.allclose(loaded[k], expected[k], rtol=1e-5, atol=1e-6), k
        lora_weight = "blocks.1.attn2.to_out.0.weight"
        assert not torch.allclose(loaded[lora_weight], files["gen"][lora_weight], atol=1e-3)  # the LoRA matters
        rank_alpha = load_stream_pipeline(validate(_compose(
            [f"model={name}", *paths(name, files), *SMALL, "model.stream.lora_alpha=null"]).model))
        assert not torch.allclose(rank_alpha.pipe.transformer.state_dict()[lora_weight], loaded[lora_weight],
                                  atol=1e-3)  # and so does its alpha (256 over rank 4)
    assert not torch.equal(loaded["proj_out.weight"], files["base_state"]["proj_out.weight"])  # not the base's
    assert pipe.config == StreamConfig(**{**REFERENCE[name], "max_sequence_length": 16}, height=32, width=32)
    wan = pipe.wan
    assert (wan.block_frames, wan.sink_frames, wan.window_frames) == tuple(
        REFERENCE[name][k] for k in ("block_frames", "sink_frames", "window_frames"))

    sets = [a for s in [*paths(name, files), *SMALL] for a in ("--set", s)]
    summary = stream_main(["--preset", name, *sets, "--prompt", "a red kite rising", "--prompt",
                           "a red kite diving", "--switch", "9", "--no-mp4", "--out", str(tmp_path), "--threads", "1"])
    assert summary["num_frames"] == 21 and summary["switch_blocks"] == [1]  # the preset's frame count, 2 blocks
    assert summary["model"] == f"preset {name}" and "mp4" not in summary
    sheet = Image.open(summary["png"])
    assert sheet.width > 32 and sheet.height > 2 * 32  # two labelled segment rows of 32-pixel frames


def test_a_streaming_model_directory_loads_with_a_null_checkpoint(files, tmp_path, flowgrpo_caplog):
    name = "longlive_wan"
    converted = load_stream_pipeline(validate(_compose([f"model={name}", *paths(name, files), *SMALL]).model))
    converted.config = dataclasses.replace(converted.config, recache=False)  # as saved: differs from the preset
    converted.save_pretrained(tmp_path / "longlive")
    overrides = [f"model={name}", f"model.pretrained={tmp_path / 'longlive'}", "model.stream.checkpoint=null",
                 "model.stream.lora_checkpoint=null", *SMALL]
    with flowgrpo_caplog.at_level(logging.WARNING, logger="flowgrpo"):
        pipe = load_stream_pipeline(validate(_compose(overrides).model))
    same_state(pipe.pipe.transformer.state_dict(), converted.pipe.transformer.state_dict())
    # the config's, with a warning
    assert pipe.config.recache is True and "recache=True (saved: False)" in flowgrpo_caplog.text


def test_a_random_init_streaming_model_is_built_in_code_and_made_causal(monkeypatch):
    """``model.pretrained=random-init:wan21_1_3b`` (scripts/gpu_check.py) builds the architecture's pipeline and makes
    it causal with the node's stream settings; the 1.4B-parameter build is stood in for by the tiny Wan twin."""
    import flowgrpo.models.random_init as random_init

    built = []

    def build(arch, *, torch_dtype=torch.bfloat16, seed=0):
        built.append((arch, torch_dtype, build_tiny_pipeline("wan", torch_dtype=torch_dtype)))
        return built[-1][2]

    monkeypatch.setattr(random_init, "build_random_pipeline", build)
    m = validate(_compose(["model=self_forcing_wan", "model.pretrained=random-init:wan21_1_3b",
                           "model.stream.checkpoint=null", "model.stream.lora_checkpoint=null", *SMALL]).model)
    pipe = load_stream_pipeline(m)
    (arch, dtype, wan), = built
    assert (arch, dtype) == ("wan21_1_3b", torch.float32)  # the node's model.torch_dtype
    assert isinstance(pipe, StreamingWanPipeline) and pipe.pipe is wan and pipe.pipe.transformer is wan.transformer
    assert pipe.config == stream_config_of(m) and pipe.config.block_frames == 3  # the preset's, not the twin's
    assert not pipe.pipe.transformer.training
    # the trainer's route to it: build_adapter sends a streaming model to load_stream_pipeline
    adapter = build_adapter(m)
    assert len(built) == 2 and adapter.pipe is built[1][2] and adapter.config == pipe.config


def test_a_random_init_streaming_model_refuses_a_checkpoint(monkeypatch):
    import flowgrpo.models.random_init as random_init

    monkeypatch.setattr(random_init, "build_random_pipeline", lambda arch, **kw: build_tiny_pipeline("sd3"))
    random = ["model=longlive_wan", "model.pretrained=random-init:wan21_1_3b", *SMALL]
    checkpoint = (r"model\.stream\.checkpoint='sf\.pt' with model\.pretrained='random-init:wan21_1_3b'.*loads no "
                  r"checkpoint")
    for overrides in (["model.stream.checkpoint=sf.pt", "model.stream.lora_checkpoint=null"],
                      ["model.stream.checkpoint=sf.pt", "model.stream.lora_checkpoint=lora.pt"]):
        cfg = _compose([*random, *overrides])
        with pytest.raises(ValueError, match=checkpoint):  # before any file is looked for
            load_stream_pipeline(cfg.model)
        with pytest.raises(ConfigError, match=checkpoint):  # and by the config checks, before anything loads
            validate(cfg.model)
    unset = ["model.stream.checkpoint=null", "model.stream.lora_checkpoint=null"]
    with pytest.raises(ValueError, match=r"model\.stream\.lora_checkpoint is required"):  # unset keys, as before
        load_stream_pipeline(_compose([*random, "model.stream.checkpoint=null"]).model)
    with pytest.raises(ValueError, match=r"random-init:sd35_medium' is not a Wan architecture"):
        load_stream_pipeline(_compose([*random, *unset, "model.pretrained=random-init:sd35_medium"]).model)
    with pytest.raises(ValueError, match=r"unknown architecture 'wan99'.*random-init:wan21_1_3b"):
        load_stream_pipeline(_compose([*random, *unset, "model.pretrained=random-init:wan99"]).model)


# ------------------------------------------------------------------------------------------- errors


def test_missing_paths_and_unset_keys_name_the_key(files, tmp_path):
    def load(name, *overrides):
        return load_stream_pipeline(_compose([f"model={name}", *SMALL, *overrides]).model)

    base = f"model.pretrained={files['base']}"
    sf = f"model.stream.checkpoint={files['root'] / 'self_forcing_dmd.pt'}"
    with pytest.raises(ValueError, match=r"model\.stream\.checkpoint is required"):
        load("self_forcing_wan", base)
    with pytest.raises(FileNotFoundError, match=r"model\.stream\.checkpoint='.*nope\.pt': no such file"):
        load("self_forcing_wan", base, f"model.stream.checkpoint={tmp_path / 'nope.pt'}")
    with pytest.raises(ValueError, match=r"model\.stream\.lora_checkpoint is required"):
        load("longlive_wan", base, f"model.stream.checkpoint={files['root'] / 'longlive_base.pt'}")
    with pytest.raises(FileNotFoundError, match=r"model\.stream\.lora_checkpoint='.*lora_nope\.pt'"):
        load("longlive_wan", base, f"model.stream.checkpoint={files['root'] / 'longlive_base.pt'}",
             f"model.stream.lora_checkpoint={tmp_path / 'lora_nope.pt'}")
    with pytest.raises(FileNotFoundError, match=r"model\.pretrained='.*no_base': no such directory"):
        load("self_forcing_wan", sf, f"model.pretrained={tmp_path / 'no_base'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match=r"model\.pretrained='.*empty'"):
        load("self_forcing_wan", sf, f"model.pretrained={tmp_path / 'empty'}")
    with pytest.raises(FileNotFoundError, match=r"model\.stream\.checkpoint is null.*stream_config\.json"):
        load("self_forcing_wan", base, "model.stream.checkpoint=null")
    # The command says the same, without a traceback.
    with pytest.raises(SystemExit, match=r"--preset longlive_wan: model\.stream\.checkpoint is required"):
        stream_main(["--preset", "longlive_wan", "--set", base, "--prompt", "a kite"])
    with pytest.raises(SystemExit, match=r"not a streaming model preset.*longlive_wan, self_forcing_wan"):
        stream_main(["--preset", "tiny_wan", "--prompt", "a kite"])
    with pytest.raises(SystemExit, match=r"(?s)--preset self_forcing_wan: .*model\.stream\.window_frames=4"):
        stream_main(["--preset", "self_forcing_wan", "--set", "model.stream.window_frames=4", "--prompt", "a kite"])
    with pytest.raises(SystemExit, match="--set overrides a preset"):
        stream_main(["--set", base, "--prompt", "a kite"])


@pytest.mark.parametrize("overrides,message", [
    (["model.stream.window_frames=4"], r"model\.stream\.window_frames=4 must be whole blocks"),
    (["model.stream.sink_frames=1"], r"model\.stream\.sink_frames=1 must be whole blocks"),
    (["model.stream.cache_frames=6"], r"model\.stream\.cache_frames=6 must hold the sink and the window"),
    (["model.num_frames=17"], r"model\.num_frames=17 must be 4·k \+ 1 frames .* \(e\.g\. 21\)"),
    (["model.attention=xformers"], r"model\.attention='xformers'.*use model\.attention=sdpa"),
    (["model.stream.checkpoint=null", "model.stream.lora_checkpoint=lora.pt"], r"lora_checkpoint is merged into"),
    (["model.stream.block_frames=0"], r"model\.stream\.block_frames=0 must be >= 1"),
])
def test_stream_settings_are_checked_before_loading(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(_compose(["model=longlive_wan", *overrides]).model)


def test_stream_keys_belong_to_streaming_models():
    with pytest.raises(ConfigError, match=r"model\.stream must be set for model\.family='causal_wan'"):
        validate(_compose(["model=wan21_1_3b", "model.family=causal_wan"]).model)


# ------------------------------------------------------------------------------------------- training


def test_train_py_refuses_a_streaming_model_with_a_clip_algorithm_before_anything_loads(tmp_path, monkeypatch):
    import flowgrpo.cli

    def started(cfg):
        raise AssertionError("the trainer started")

    monkeypatch.setattr(flowgrpo.cli, "main", started)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # Hydra re-raises the error instead of printing it and exiting
    monkeypatch.setattr(sys, "argv", ["train.py", "model=self_forcing_wan", f"hydra.run.dir={tmp_path / 'run'}",
                                      "hydra/job_logging=none", "hydra/hydra_logging=none"])
    from hydra.core.global_hydra import GlobalHydra

    try:
        with pytest.raises(ConfigError) as info:
            runpy.run_path(str(REPO_ROOT / "train.py"), run_name="__main__")
    finally:
        GlobalHydra.instance().clear()
    text = str(info.value)
    assert "model=self_forcing_wan is a streaming model" in text
    assert "python -m flowgrpo.stream --preset self_forcing_wan" in text
    assert "algo=mix_grpo trains a model that denoises whole clips" in text and "algo=stream_grpo" in text

    # The same from the whole config and from the model loader, whatever else the config holds.
    cfg = _compose(["model=longlive_wan", "model.stream.checkpoint=a.pt", "model.stream.lora_checkpoint=b.pt"])
    with pytest.raises(ConfigError, match="is a streaming model"):
        validate(cfg)
    with pytest.raises(FileNotFoundError, match="model.stream.checkpoint='a.pt': no such file"):
        build_adapter(cfg.model)  # a streaming model loads through its own loader
