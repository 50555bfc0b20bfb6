"""``scripts/pretrain_tiny.py``: the world tokenizer, the collapsed-padding forward, resume, and the saved asset."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from PIL import Image

from flowgrpo.models import load_adapter
from flowgrpo.models.load import check_tokenizers
from flowgrpo.world import all_metadata

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pretrain_tiny.py"
_spec = importlib.util.spec_from_file_location("pretrain_tiny", _SCRIPT)
pt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pt)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_world_tokenizer_one_token_per_word_and_round_trip(tmp_path):
    tokenizer = pt.world_tokenizer()
    for meta in all_metadata():  # every prompt of the world: BOS + one token per word + EOS, nothing unknown
        ids = tokenizer(meta["prompt"]).input_ids
        assert len(ids) == len(meta["prompt"].split()) + 2 <= tokenizer.model_max_length
        assert tokenizer.unk_token_id not in ids[1:-1]
    assert len(tokenizer("zebra xylophone!").input_ids) > 2  # other text still tokenizes (bytes)
    tokenizer.save_pretrained(tmp_path)
    reloaded = type(tokenizer).from_pretrained(tmp_path)
    prompt = "a photo of four purple triangles below a yellow square"
    assert reloaded(prompt).input_ids == tokenizer(prompt).input_ids


def test_collapsed_padding_equals_pipeline_forward():
    """One pad token with logit + log N == the pipeline's N zero tokens (T5's place), for any N."""
    torch.manual_seed(0)
    pipe = pt.build_pipeline("toy")
    prompts = ["a photo of a red circle", ""]
    x, t = torch.randn(2, 4, 16, 16), torch.tensor([250.0, 900.0])
    with torch.no_grad():
        clip, pooled = pt.encode_clip(pipe, prompts)
        for n in (1, 77, 256):
            embeds, _, ref_pooled, _ = pipe.encode_prompt(prompts, None, None, do_classifier_free_guidance=False, max_sequence_length=n)
            assert torch.equal(embeds[:, : clip.shape[1]], clip) and torch.equal(ref_pooled, pooled)
            full = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=ref_pooled, return_dict=False)[0]
            collapsed = pt.collapsed_velocity(pipe.transformer, x, t, clip, pooled, torch.tensor([n, n]))
            torch.testing.assert_close(collapsed, full, rtol=1e-4, atol=1e-5)


def _args(tmp_path, *extra):
    return ["--size", "toy", "--vae-steps", "3", "--flow-steps", "3", "--vae-batch", "4", "--batch", "4",
            "--stat-batches", "1", "--warmup", "2", "--log-every", "2", "--ckpt-every", "2", "--threads", "1",
            "--device", "cpu", "--out", str(tmp_path / "pipe"), "--ckpt-dir", str(tmp_path / "ckpt"), *extra]  # fmt: skip


def _flat(trainer):
    state = trainer.state_dict()
    out = {f"{m}.{k}": v for m, sd in state["models"].items() for k, v in sd.items()}
    out.update({f"ema.{i}": e for i, e in enumerate(state["ema"])})
    for name in ("vae_opt", "flow_opt"):
        for pid, s in state[name]["state"].items():
            out.update({f"{name}.{pid}.{k}": v for k, v in s.items()})
    return out, state["vae_factors"], state["rng"]["numpy"]


def test_resume_matches_running_on_and_saved_pipeline_loads(tmp_path):
    straight = pt.main(_args(tmp_path / "a", "--omit-steps", "2"))
    pt.main(_args(tmp_path / "b", "--omit-steps", "2", "--stop-at", "4"))  # interrupted in the flow stage
    assert not (tmp_path / "b" / "pipe").exists() and (tmp_path / "b" / "ckpt" / "last.pt").exists()
    pt.main(_args(tmp_path / "b", "--omit-steps", "2", "--resume", "--stop-at", "7"))  # and in the caption-noise stage
    resumed = pt.main(_args(tmp_path / "b", "--omit-steps", "2", "--resume"))
    assert resumed.step == straight.step == 8 and straight.stage() == "omit"
    (a, fa, ra), (b, fb, rb) = _flat(straight), _flat(resumed)
    assert a.keys() == b.keys() and fa == fb and ra == rb
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert fa[0] != 1.0 and fa[1] != 0.0  # latent factors were set from data

    # The asset format: plain diffusers from_pretrained offline (no T5), and the project's loader.
    out = tmp_path / "a" / "pipe"
    pipe = StableDiffusion3Pipeline.from_pretrained(out, text_encoder_3=None, tokenizer_3=None)
    check_tokenizers(pipe, str(out))
    assert pipe.vae.config.scaling_factor == pytest.approx(fa[0]) and pipe.scheduler.config.shift == 3.0
    image = pipe("a photo of a red circle", num_inference_steps=2, height=64, width=64, output_type="pt",
                 generator=torch.Generator().manual_seed(0)).images  # fmt: skip
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()
    adapter = load_adapter("sd3", str(out))
    # The shipped weights are the EMA weights, not the last iterate.
    shipped = dict(adapter.pipe.transformer.named_parameters())
    trained = dict(straight.pipe.transformer.named_parameters())
    ema = dict(zip([n for m in ("transformer", "text_encoder", "text_encoder_2") for n, _ in getattr(straight.pipe, m).named_parameters()], straight.ema))
    name = "transformer_blocks.0.attn.to_q.weight"
    assert torch.equal(shipped[name], ema[name]) and not torch.equal(shipped[name], trained[name])


def test_caption_noise_leaves_out_one_named_object():
    """``--omit-prob``: the image lacks one of the objects its caption names; 0 keeps the clean data stream."""
    from scipy import ndimage

    from flowgrpo.world import render_array

    named = {m["prompt"]: sum(c["count"] for c in m["include"]) for m in all_metadata()}

    def objects(x):  # objects never touch (a gap apart), so connected non-white regions of [-1, 1] pixels are objects
        return ndimage.label((((x + 1.0) * 127.5).numpy() < 250).any(axis=0))[1]

    clean, clean_prompts = pt.render_batch(np.random.default_rng(3), 24, set())
    rng = np.random.default_rng(3)
    for image, prompt in zip(clean, clean_prompts):
        meta = pt.random_metadata(rng)
        assert meta["prompt"] == prompt
        reference = torch.from_numpy(render_array(meta, rng=rng)).permute(2, 0, 1).float() / 127.5 - 1.0
        assert torch.equal(image, reference)  # omit_prob=0 draws exactly what the clean stage drew
    assert all(objects(x) == named[p] for x, p in zip(clean, clean_prompts))
    noisy, prompts = pt.render_batch(np.random.default_rng(3), 24, set(), omit_prob=1.0)
    counts = [(objects(x), named[p]) for x, p in zip(noisy, prompts)]
    assert all(seen == want - 1 for seen, want in counts), counts
    assert {want for _, want in counts} >= {1, 2}  # blank images for one-object captions, fewer for the rest
    half, prompts = pt.render_batch(np.random.default_rng(4), 200, set(), omit_prob=0.4)
    left_out = np.mean([objects(x) < named[p] for x, p in zip(half, prompts)])
    assert 0.3 < left_out < 0.5


def test_eval_geneval_runs_on_a_saved_pipeline(tmp_path):
    pt.main(_args(tmp_path, "--flow-steps", "1", "--vae-steps", "1"))
    spec = importlib.util.spec_from_file_location("eval_geneval", _SCRIPT.with_name("eval_geneval.py"))
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    metas = [m for m in all_metadata() if m["tag"] in ("single_object", "position")][:4]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(m) + "\n" for m in metas))
    argv = ["--pretrained", str(tmp_path / "pipe"), "--prompts", str(prompts), "--samples", "2", "--samples-per-tag",
            "none", "--steps", "2", "--batch", "3", "--grid", str(tmp_path / "grid.png"), "--device", "cpu"]  # fmt: skip
    result = ev.main(argv)
    assert set(result["per_tag"]) == {"single_object", "position"}
    assert all(v["n"] == 2 * sum(m["tag"] == t for m in metas) for t, v in result["per_tag"].items())
    assert 0.0 <= result["overall"] <= 1.0
    assert Image.open(tmp_path / "grid.png").size == (2 + 4 * 66, 2 + 2 * 66)
    # Fixed seeds: the same images whatever the batch size.
    again = ev.main([*argv[:-6], "--batch", "8", "--grid", "", "--device", "cpu"])
    assert again["per_tag"] == result["per_tag"]

    # --tags / --per-prompt, and --lora: a trainer-format LoRA checkpoint changes the images
    only = ev.main([*argv[:-2], "--tags", "position", "--per-prompt", "--device", "cpu"])
    assert set(only["per_tag"]) == {"position"} and [r["prompt"] for r in only["per_prompt"]] == [
        m["prompt"] for m in metas if m["tag"] == "position"]
    assert only["per_tag"]["position"] == result["per_tag"]["position"]
    no_grid = [a for k, a in enumerate(argv) if "--grid" not in argv[max(k - 1, 0) : k + 1]]  # drop "--grid PATH"
    assert "grid" not in ev.main([*no_grid, "--tags", "position"])  # no grid unless asked for
    before = np.asarray(Image.open(tmp_path / "grid.png"))
    from peft import LoraConfig, get_peft_model_state_dict

    from flowgrpo.checkpoint import save_lora_weights

    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "pipe", text_encoder_3=None, tokenizer_3=None)
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_v"]))
    assert get_peft_model_state_dict(pipe.transformer)  # random A and B: the adapter changes the output
    save_lora_weights(pipe, tmp_path / "checkpoint-000001" / "lora")
    with_lora = ev.main([*argv, "--lora", str(tmp_path / "checkpoint-000001")])
    assert with_lora["lora"] == str(tmp_path / "checkpoint-000001")
    assert not np.array_equal(np.asarray(Image.open(tmp_path / "grid.png")), before)
    with pytest.raises(ValueError, match=r"--tags=\['dogs'\]: no prompt has tag\(s\) \['dogs'\]; the tags of .* are \['position', 'single_object'\]"):
        ev.main([*argv, "--tags", "dogs"])
    with pytest.raises(SystemExit, match="no pytorch_lora_weights.safetensors"):
        ev.main([*argv, "--lora", str(tmp_path)])
