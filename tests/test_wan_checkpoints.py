"""Streaming Wan checkpoints (Self-Forcing / CausVid / LongLive pickles) load into diffusers' WanTransformer3DModel.

A tiny random diffusers Wan is written back in the ORIGINAL Wan layout (the key names of Wan-AI's WanModel, as in
Self-Forcing's ``wan/modules/causal_model.py``) behind the wrapper prefix ``model.``, by an inverse key map written
here independently of diffusers' converter; loading it must give back the same weights and the same outputs. A
LongLive-style LoRA file is built from peft's own state dict of a peft-wrapped twin, so the key names and the
scaling are peft's; the merged load must match the peft model's outputs. Float32, CPU, about a second.
"""

import argparse
import copy
import logging
import re

import pytest
import torch
from diffusers import WanTransformer3DModel
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file

from flowgrpo.models import load_streaming_wan_state_dict, load_streaming_wan_transformer
from flowgrpo.models.wan_checkpoints import merge_lora

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LAYERS = 2
CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
              text_dim=16, freq_dim=32, ffn_dim=48, num_layers=LAYERS)
RANK, ALPHA = 4, 6.0  # scaling 1.5: a default (alpha = rank) or a 1/r-style mistake shows


def tiny_wan(seed):
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**CONFIG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # every weight matters, modulation and norms included
    return model


# --------------------------------------------------------------------------------------- the original Wan layout

# diffusers name → Wan-AI's original name (WanModel / CausalWanModel: text_embedding and time_embedding are
# nn.Sequential with the Linears at 0 and 2, time_projection = Sequential(SiLU, Linear), head = Head(norm, head,
# modulation), each block: self_attn / cross_attn with q, k, v, o, norm_q, norm_k; norm3 the affine cross-attention
# norm (norm1 / norm2 have no weights); ffn = Sequential(Linear, GELU, Linear); modulation).
_INVERSE = [
    (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"^condition_embedder\.time_proj\.", "time_projection.1."),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out\.", "head.head."),
    (r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation"),
    (r"^(blocks\.\d+)\.attn1\.", r"\1.self_attn."),
    (r"^(blocks\.\d+)\.attn2\.", r"\1.cross_attn."),
    (r"\.to_q\.", ".q."), (r"\.to_k\.", ".k."), (r"\.to_v\.", ".v."), (r"\.to_out\.0\.", ".o."),
    (r"^(blocks\.\d+)\.ffn\.net\.0\.proj\.", r"\1.ffn.0."),
    (r"^(blocks\.\d+)\.ffn\.net\.2\.", r"\1.ffn.2."),
    (r"^(blocks\.\d+)\.norm2\.", r"\1.norm3."),
]


def to_original(key):
    for pattern, repl in _INVERSE:
        key = re.sub(pattern, repl, key)
    return key


def original_wan_keys(layers):
    """Every parameter name of Wan-AI's T2V WanModel, written out from its module tree."""
    keys = ["patch_embedding.weight", "patch_embedding.bias", "head.head.weight", "head.head.bias", "head.modulation"]
    keys += [f"{m}.{p}" for m in ("text_embedding.0", "text_embedding.2", "time_embedding.0", "time_embedding.2",
                                  "time_projection.1") for p in ("weight", "bias")]
    for b in range(layers):
        blk = f"blocks.{b}"
        keys += [f"{blk}.modulation", f"{blk}.norm3.weight", f"{blk}.norm3.bias"]
        keys += [f"{blk}.ffn.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")]
        for attn in ("self_attn", "cross_attn"):
            keys += [f"{blk}.{attn}.{m}.{p}" for m in "qkvo" for p in ("weight", "bias")]
            keys += [f"{blk}.{attn}.norm_q.weight", f"{blk}.{attn}.norm_k.weight"]
    return keys


def original_layout(model, prefix="model."):
    return {prefix + to_original(k): v.clone() for k, v in model.state_dict().items()}


def block_linears(model):
    return [n for n, m in model.named_modules() if n.startswith("blocks.") and isinstance(m, torch.nn.Linear)]


@pytest.fixture(scope="module")
def twins():
    return tiny_wan(0), tiny_wan(1)  # "generator" and "generator_ema"


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(2)
    return dict(hidden_states=torch.randn(2, 4, 3, 4, 4, generator=g), timestep=torch.tensor([900.0, 250.0]),
                encoder_hidden_states=torch.randn(2, 5, 16, generator=g))


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@pytest.fixture(scope="module")
def ckpt(twins, tmp_path_factory):
    """A Self-Forcing-style release: generator, critic (any other state dict) and generator_ema."""
    gen, ema = twins
    path = tmp_path_factory.mktemp("ckpt") / "self_forcing_dmd.pt"
    torch.save({"generator": original_layout(gen), "critic": {"model.blocks.0.x": torch.zeros(1)},
                "generator_ema": original_layout(ema)}, path)
    return path


def same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# -------------------------------------------------------------------------------------------------- round trip


def test_the_inverse_map_is_a_bijection_onto_the_model_keys(twins):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    model_keys = list(twins[0].state_dict())
    originals = [to_original(k) for k in model_keys]
    assert len(set(originals)) == len(model_keys)                      # injective
    assert sorted(originals) == sorted(original_wan_keys(LAYERS))      # onto the original layout's names
    back = convert_wan_transformer_to_diffusers({o: torch.zeros(1) for o in originals})
    assert {to_original(k) for k in back} == set(originals) and set(back) == set(model_keys)


def test_round_trip_gives_the_same_weights_and_outputs_and_prefers_ema(ckpt, twins, inputs, flowgrpo_caplog):
    gen, ema = twins
    with flowgrpo_caplog.at_level(logging.INFO, logger="flowgrpo"):
        sd = load_streaming_wan_state_dict(ckpt)
    assert "entry 'generator_ema'" in flowgrpo_caplog.text
    same_state(sd, ema.state_dict())
    same_state(load_streaming_wan_state_dict(ckpt, key="generator"), gen.state_dict())

    loaded = load_streaming_wan_transformer(ckpt, CONFIG)
    assert not loaded.training
    same_state(loaded.state_dict(), ema.state_dict())
    assert torch.equal(run(loaded, inputs), run(ema, inputs))
    assert not torch.allclose(run(gen, inputs), run(ema, inputs), atol=1e-2)  # the choice matters
    assert torch.equal(run(load_streaming_wan_transformer(ckpt, CONFIG, key="generator"), inputs), run(gen, inputs))


@pytest.mark.parametrize("variant", ["diffusion_model_prefix", "no_prefix", "fsdp_tokens", "plain_state_dict",
                                     "legacy_pickle", "safetensors", "diffusers_layout"])
def test_prefix_and_file_variants(variant, twins, tmp_path):
    gen = twins[0]
    sd = original_layout(gen)
    if variant == "diffusion_model_prefix":
        obj = {"generator": original_layout(gen, "model.diffusion_model.")}
    elif variant == "no_prefix":
        obj = {"generator": original_layout(gen, "")}
    elif variant == "fsdp_tokens":  # EMA shadows gathered from nested FSDP units
        obj = {"generator": {k.replace("blocks.0.", "blocks.0._fsdp_wrapped_module."): v for k, v in sd.items()}}
    elif variant in ("plain_state_dict", "legacy_pickle"):  # legacy: torch.save's old format, not mappable
        obj = sd
    elif variant == "diffusers_layout":
        obj = {"generator": {f"model.{k}": v.clone() for k, v in gen.state_dict().items()}}
    if variant == "safetensors":
        path = tmp_path / "gen.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, path)
    else:
        path = tmp_path / "gen.pt"
        torch.save(obj, path, _use_new_zipfile_serialization=variant != "legacy_pickle")
    same_state(load_streaming_wan_state_dict(path), gen.state_dict())


def test_config_forms_and_dtype(ckpt, twins, tmp_path):
    ema = twins[1]
    ema.save_config(tmp_path / "pipe" / "transformer")                 # a diffusers pipeline dir
    for config in (ema.config, ema, tmp_path / "pipe", str(tmp_path / "pipe" / "transformer")):
        same_state(load_streaming_wan_transformer(ckpt, config).state_dict(), ema.state_dict())
    bf16 = load_streaming_wan_transformer(ckpt, CONFIG, torch_dtype="bf16")
    assert bf16.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert bf16.scale_shift_table.dtype == torch.float32                # diffusers' _keep_in_fp32_modules
    assert bf16.blocks[0].norm2.weight.dtype == torch.float32
    assert torch.equal(bf16.blocks[0].attn1.to_q.weight, ema.blocks[0].attn1.to_q.weight.bfloat16())
    with pytest.raises(OSError, match="config.json"):
        load_streaming_wan_transformer(ckpt, tmp_path)


def test_the_weight_free_build_is_the_loaders_module(ckpt, twins):
    """``build_streaming_wan_transformer`` (the planner's, no checkpoint) makes the module the loader makes: the same
    keys, shapes and dtypes (diffusers' float32 modules included), strictly assigned; the loader still refuses a
    checkpoint that does not fit."""
    from flowgrpo.models import build_streaming_wan_transformer

    loaded = load_streaming_wan_transformer(ckpt, CONFIG, torch_dtype="bf16").state_dict()
    built = build_streaming_wan_transformer(CONFIG, torch_dtype="bf16").state_dict()
    assert loaded.keys() == built.keys()
    for k in loaded:
        assert (built[k].shape, built[k].dtype) == (loaded[k].shape, loaded[k].dtype), k
    assert built["scale_shift_table"].dtype == torch.float32
    assert not any(t.is_meta for t in built.values())
    with pytest.raises(ValueError, match="does not fit"):
        load_streaming_wan_transformer(ckpt, dict(CONFIG, num_layers=CONFIG["num_layers"] + 1))


# ------------------------------------------------------------------------------------------------------ LoRA


@pytest.fixture(scope="module")
def peft_twin(twins):
    """The generator wrapped by peft as LongLive wraps its own (every Linear of every block), LoRA weights set."""
    gen = twins[0]
    model = get_peft_model(copy.deepcopy(gen), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=block_linears(gen)))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)  # lora_B starts at zero in peft: set both
    return model.eval()


def longlive_lora(peft_model):
    """peft's own LoRA state dict (as LongLive's trainer saves it), module names turned into the original layout."""
    out = {}
    for key, value in get_peft_model_state_dict(peft_model).items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.(lora_[AB]\.weight)", key)
        assert m, key  # exactly the names peft writes
        out[f"base_model.model.{to_original(m[1] + '.weight')[:-len('.weight')]}.{m[2]}"] = value.clone()
    return out


def test_longlive_lora_merge_equals_the_peft_model(ckpt, twins, peft_twin, inputs, tmp_path, flowgrpo_caplog):
    gen, ema = twins
    lora = longlive_lora(peft_twin)
    assert len(lora) == 2 * 10 * LAYERS and "base_model.model.blocks.0.self_attn.q.lora_A.weight" in lora
    assert "base_model.model.blocks.1.ffn.2.lora_B.weight" in lora
    lora_path = tmp_path / "lora.pt"
    torch.save({"generator_lora": lora, "critic_lora": {"x": torch.zeros(1)}, "step": 100}, lora_path)
    with flowgrpo_caplog.at_level(logging.INFO, logger="flowgrpo"):
        merged = load_streaming_wan_transformer(ckpt, CONFIG, lora_path=lora_path, lora_alpha=ALPHA)
    logged = flowgrpo_caplog.text
    assert "entry 'generator'" in logged and "into 20 linear layers" in logged  # the LoRA's base
    reference = run(peft_twin, inputs)
    assert torch.allclose(run(merged, inputs), reference, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(run(gen, inputs), reference, atol=1e-2)                     # the LoRA matters
    wrong_alpha = load_streaming_wan_transformer(ckpt, CONFIG, lora_path=lora_path)       # alpha = rank
    assert not torch.allclose(run(wrong_alpha, inputs), reference, atol=1e-2)

    # The same LoRA inside the checkpoint is found on its own; lora_key=None leaves it out.
    both = tmp_path / "both.pt"
    torch.save({"generator": original_layout(gen), "generator_ema": original_layout(ema), "generator_lora": lora}, both)
    same_state(load_streaming_wan_transformer(both, CONFIG, lora_alpha=ALPHA).state_dict(), merged.state_dict())
    same_state(load_streaming_wan_state_dict(both, lora_key=None), ema.state_dict())
    # A bare LoRA state dict as the LoRA file, merged by hand: W + (alpha / r) B A.
    bare = tmp_path / "bare.pt"
    torch.save(lora, bare)
    sd = load_streaming_wan_state_dict(ckpt, lora_path=bare, lora_alpha=ALPHA)
    a = lora["base_model.model.blocks.1.cross_attn.o.lora_A.weight"]
    b = lora["base_model.model.blocks.1.cross_attn.o.lora_B.weight"]
    expected = gen.state_dict()["blocks.1.attn2.to_out.0.weight"] + ALPHA / RANK * b @ a
    assert torch.allclose(sd["blocks.1.attn2.to_out.0.weight"], expected, atol=1e-6)
    assert torch.equal(sd["blocks.1.attn2.to_out.0.bias"], gen.state_dict()["blocks.1.attn2.to_out.0.bias"])


def test_lora_errors(twins, peft_twin):
    base = {k.removeprefix("model."): v for k, v in original_layout(twins[0]).items()}
    lora = longlive_lora(peft_twin)
    with pytest.raises(ValueError, match="not LoRA A/B weights.*lora_magnitude_vector"):
        merge_lora(base, {**lora, "base_model.model.blocks.0.self_attn.q.lora_magnitude_vector": torch.ones(24)})
    with pytest.raises(ValueError, match="no weight in the checkpoint.*blocks.0.attn1.to_q"):
        merge_lora(base, {"base_model.model.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(RANK, 24),
                          "base_model.model.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(24, RANK)})
    with pytest.raises(ValueError, match="only one of lora_A"):
        merge_lora(base, {"base_model.model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(RANK, 24)})
    with pytest.raises(ValueError, match="do not fit"):
        merge_lora(base, {"base_model.model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(RANK, 48),
                          "base_model.model.blocks.0.self_attn.q.lora_B.weight": torch.zeros(24, RANK)})


# ------------------------------------------------------------------------------------------------------ errors


def test_clear_errors(ckpt, twins, tmp_path):
    gen = twins[0]
    with pytest.raises(KeyError, match=r"has no entry 'generator_emma'.*'critic', 'generator', 'generator_ema'"):
        load_streaming_wan_state_dict(ckpt, key="generator_emma")
    with pytest.raises(KeyError, match="has no LoRA entry 'generator_lora'"):
        load_streaming_wan_state_dict(ckpt, lora_key="generator_lora")
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_streaming_wan_state_dict(tmp_path / "nope.pt")

    def saved(obj, name="c.pt"):
        torch.save(obj, tmp_path / name)
        return tmp_path / name

    with pytest.raises(KeyError, match=r"no generator state dict.*'optimizer', 'step'"):
        load_streaming_wan_state_dict(saved({"optimizer": {"lr": 1.0}, "step": 3}))
    with pytest.raises(ValueError, match="not a Wan transformer state dict"):                 # wrong layout
        load_streaming_wan_state_dict(saved({"generator": {"model.encoder.layer.0.weight": torch.zeros(2)}}))
    mixed = original_layout(gen)
    mixed["model.blocks.0.attn1.to_q.weight"] = mixed.pop("model.blocks.0.self_attn.q.weight")
    with pytest.raises(ValueError, match="mix the original Wan layout"):
        load_streaming_wan_state_dict(saved({"generator": mixed}))
    with pytest.raises(ValueError, match="weights_only=False"):
        load_streaming_wan_state_dict(saved({"generator": original_layout(gen), "args": argparse.Namespace(a=1)}))

    # Leftovers: a wrapper-level head outside "model.", a stray top-level module, an extra or a missing weight.
    zero = torch.zeros(1)
    extra = {**original_layout(gen), "_cls_pred_branch.0.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"left over outside the transformer.*_cls_pred_branch.0.weight.*ignore="):
        load_streaming_wan_state_dict(saved({"generator": extra}))
    same_state(load_streaming_wan_state_dict(saved({"generator": extra}), ignore=("_cls_pred_branch.",)),
               gen.state_dict())
    with pytest.raises(ValueError, match="not part of a Wan transformer.*register_tokens"):
        load_streaming_wan_state_dict(saved({"generator": {**original_layout(gen), "model.register_tokens.w": zero}}))
    with pytest.raises(ValueError, match=r"1 unexpected: 'blocks.0.ffn.x.weight'"):
        load_streaming_wan_transformer(
            saved({"generator": {**original_layout(gen), "model.blocks.0.ffn.x.weight": zero}}), CONFIG)
    short = original_layout(gen)
    del short["model.blocks.1.cross_attn.norm_k.weight"]
    with pytest.raises(ValueError, match=r"1 missing: 'blocks.1.attn2.norm_k.weight'"):
        load_streaming_wan_transformer(saved({"generator": short}), CONFIG)
    with pytest.raises(ValueError, match=r"another shape.*patch_embedding.weight"):
        load_streaming_wan_transformer(ckpt, {**CONFIG, "in_channels": 8})
