"""The real-model Wan presets (``model=wan21_1_3b``, ``model=wan22_5b``) and their experiment recipes, offline.

No weights are downloaded. Each preset is composed with ``model.pretrained`` pointing at a tiny random twin of its
layout saved with ``save_pretrained`` (Wan 2.1: 16 latent channels, x8 VAE, one timestep per sample; Wan 2.2
TI2V-5B: 48 latent channels, the x16 patchifying VAE, per-token timesteps) and loaded by the trainer's own path
(``flowgrpo.builders.build_adapter``). The adapter's velocity must be what the pipeline's transformer computes with the
pipeline's own timestep layout, and a short rollout must reproduce ``pipe(...)``. The experiments' numbers are
checked against each other and against a memory estimate from the published parameter counts (meta device).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanTransformer3DModel
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import rewards
import samplers
from flowgrpo.builders import REPO_ROOT, batch_plan, build_adapter, model_kwargs
from flowgrpo.config import validate
from flowgrpo.models import WanAdapter, build_tiny_pipeline

CONF = REPO_ROOT / "conf"
PROMPTS = ["a red kite rising over a beach", "two dogs running in the snow"]

# The published checkpoints' config.json values (no hub here): transformer and VAE architectures, the scheduler's
# flow_shift and the pipeline's expand_timesteps. The Wan 2.1 VAE is AutoencoderKLWan's class defaults.
PUBLISHED = {
    "wan21_1_3b": dict(
        hub="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        transformer=dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                         out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                         cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
        vae=dict(),
        flow_shift=3.0,
        expand_timesteps=False,
        fps=16,
    ),
    "wan22_5b": dict(
        hub="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        transformer=dict(patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=48,
                         out_channels=48, text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30,
                         cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
        vae=dict(base_dim=160, decoder_base_dim=256, z_dim=48, in_channels=12, out_channels=12, is_residual=True,
                 patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 48,
                 latents_std=[1.0] * 48),
        flow_shift=5.0,
        expand_timesteps=True,
        fps=24,
    ),
}
PRESETS = sorted(PUBLISHED)
EXPERIMENTS = {"flow_grpo_wan21_1_3b": "wan21_1_3b", "flow_grpo_wan22_5b": "wan22_5b"}
UMT5_XXL_PARAMS = 5.68e9  # google/umt5-xxl's encoder (embeddings shared with the input layer): 11.4 GB in bf16
GPUS, GPU_GB = 8, 80  # what the recipes are planned for


def _compose(overrides=()):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def _twin(name: str):
    """A tiny random pipeline with the preset's layout, as a real snapshot ships it (UniPC with its flow_shift)."""
    spec = PUBLISHED[name]
    pipe = build_tiny_pipeline("wan", ti2v=spec["expand_timesteps"])
    if pipe.transformer.config.rope_max_seq_len < 1024:  # the Wan 2.1 twin's RoPE table stops at 32 patches
        transformer = WanTransformer3DModel.from_config(pipe.transformer.config, rope_max_seq_len=1024)
        transformer.load_state_dict(pipe.transformer.state_dict())  # RoPE tables are buffers, not weights
        pipe.register_modules(transformer=transformer.eval())
    pipe.register_modules(scheduler=UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=spec["flow_shift"]))
    return pipe


@pytest.fixture(scope="module", params=PRESETS)
def saved_twin(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    _twin(request.param).save_pretrained(path)
    return request.param, path


def _pipeline_velocity(pipe, x, sigma, embeds, negative, guidance_scale):
    """The velocity the pipeline's denoising loop steps with at `sigma`, written as `WanPipeline.__call__` writes it:
    its timestep layout (per latent token under `expand_timesteps`), one forward per CFG branch."""
    t = torch.tensor(sigma, dtype=torch.float32) * pipe.scheduler.config.num_train_timesteps
    latents = x
    if pipe.config.expand_timesteps:
        mask = torch.ones(latents.shape, dtype=torch.float32)
        timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(latents.shape[0], -1)
    else:
        timestep = t.expand(latents.shape[0])
    dtype = pipe.transformer.dtype

    def branch(encoder_hidden_states):
        return pipe.transformer(hidden_states=latents.to(dtype), timestep=timestep,
                                encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]

    noise_pred = branch(embeds)
    if guidance_scale > 1:
        noise_uncond = branch(negative)
        noise_pred = noise_uncond + guidance_scale * (noise_pred - noise_uncond)
    return noise_pred.float()


# ------------------------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", PRESETS)
def test_preset_names_the_published_checkpoint_and_a_valid_clip(name):
    spec = PUBLISHED[name]
    m = validate(_compose([f"model={name}"])).model
    assert (m.family, m.pretrained, m.torch_dtype, m.vae_dtype) == ("wan", spec["hub"], "bfloat16", "float32")
    with torch.device("meta"):  # the published architectures, no weights
        vae = AutoencoderKLWan(**spec["vae"])
        transformer = WanTransformer3DModel(**spec["transformer"])
    spatial, temporal = vae.config.scale_factor_spatial, vae.config.scale_factor_temporal
    patch = spec["transformer"]["patch_size"]
    assert (m.num_frames - 1) % temporal == 0, "Wan needs num_frames = 4k + 1"
    assert m.height % (spatial * patch[1]) == 0 and m.width % (spatial * patch[2]) == 0
    assert 1.5 <= (m.num_frames - 1) / spec["fps"] <= 3, "a ~2 s clip at the model's frame rate"
    names = [n for n, mod in transformer.named_modules() if isinstance(mod, torch.nn.Linear)]
    for target in m.lora.target_modules:
        assert sum(n.endswith(target) for n in names) == 30 * (2 if target.startswith("to_") else 1), target
    assert m.gradient_checkpointing


@pytest.mark.filterwarnings("ignore:There are modules in")
@pytest.mark.usefixtures("one_thread")
def test_preset_loads_its_twin_and_the_velocity_is_the_pipeline_transformer(saved_twin):
    """At the preset's own clip size and dtype: the latent layout, and the velocity equal to the pipeline's
    transformer called with the pipeline's timestep layout (no CFG here: one forward each, bit for bit)."""
    name, path = saved_twin
    cfg = validate(_compose([f"model={name}", f"model.pretrained={path}"]))
    adapter = build_adapter(cfg.model)  # the trainer's loader
    pipe = adapter.pipe
    assert isinstance(adapter, WanAdapter) and adapter.dtype == torch.bfloat16
    assert pipe.vae.dtype == torch.float32  # model.vae_dtype
    assert bool(pipe.config.expand_timesteps) is PUBLISHED[name]["expand_timesteps"]
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert pipe.scheduler.config.shift == PUBLISHED[name]["flow_shift"]  # UniPC swapped for Euler, same shift

    mk = model_kwargs(cfg.model)
    size, m = mk["size"], cfg.model
    x = adapter.prepare_noise(1, generator=torch.Generator().manual_seed(0), **size)
    spatial = pipe.vae_scale_factor_spatial
    assert tuple(x.shape) == (1, pipe.transformer.config.in_channels, (m.num_frames - 1) // 4 + 1,
                              m.height // spatial, m.width // spatial)
    assert spatial == (16 if name == "wan22_5b" else 8)
    with torch.no_grad():
        cond = adapter.encode_prompts(PROMPTS[:1], mk["negative_prompt"], guidance_scale=1.0,
                                      max_sequence_length=mk["max_sequence_length"])
        assert tuple(cond.prompt_embeds.shape[:2]) == (1, m.max_sequence_length)
        seen = []
        hook = pipe.transformer.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append(tuple(kwargs["timestep"].shape)), with_kwargs=True)
        try:
            v = adapter.velocity(x, 0.75, cond, guidance_scale=1.0)
            ref = _pipeline_velocity(pipe, x, 0.75, cond.prompt_embeds, None, 1.0)
        finally:
            hook.remove()
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    assert torch.equal(v, ref)
    # The same timestep layout as the pipeline: Wan 2.2 one per latent token (13 x 22 x 40), Wan 2.1 one per clip.
    tokens = x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2)
    assert seen[0] == seen[1] == ((1, tokens) if PUBLISHED[name]["expand_timesteps"] else (1,))


@pytest.mark.filterwarnings("ignore:There are modules in")
def test_preset_rollout_with_cfg_reproduces_the_pipeline(saved_twin):
    """The preset's guidance and negative prompt at a small size (float32): one guided velocity against the
    pipeline's two-branch forward, then a 3-step Euler rollout and its decoded clip against ``pipe(...)``."""
    name, path = saved_twin
    small = ["model.height=32", "model.width=64", "model.num_frames=9", "model.max_sequence_length=64",
             "model.torch_dtype=float32", "model.vae_dtype=null"]
    cfg = validate(_compose([f"model={name}", f"model.pretrained={path}", *small]))
    adapter = build_adapter(cfg.model)
    mk = model_kwargs(cfg.model)
    g, seq = mk["guidance"]["guidance_scale"], mk["max_sequence_length"]
    assert g == 5.0 and mk["negative_prompt"]
    with torch.no_grad():
        cond = adapter.encode_prompts(PROMPTS, mk["negative_prompt"], guidance_scale=g, max_sequence_length=seq)
        x = adapter.prepare_noise(2, generator=torch.Generator().manual_seed(1), **mk["size"])
        v = adapter.velocity(x, 0.6, cond, guidance_scale=g)
        ref = _pipeline_velocity(adapter.pipe, x, 0.6, cond.prompt_embeds, cond.negative_prompt_embeds, g)
    assert (v - ref).abs().max() <= 1e-5 * ref.abs().max()  # batched CFG branches vs the pipeline's two forwards

    steps = 3
    sigmas = adapter.sigmas(steps, **mk["size"])
    traj = samplers.rollout(lambda z, s: adapter.velocity(z, s, cond, guidance_scale=g), x, sigmas,
                            sde_mask=torch.zeros(steps, dtype=torch.bool))
    common = dict(prompt=PROMPTS, negative_prompt=mk["negative_prompt"], num_inference_steps=steps,
                  guidance_scale=g, max_sequence_length=seq, **mk["size"])
    with torch.no_grad():
        pixels = adapter.decode(traj.final)
        ref_latents = adapter.pipe(generator=torch.Generator().manual_seed(1), output_type="latent", **common).frames
        ref_pixels = adapter.pipe(generator=torch.Generator().manual_seed(1), output_type="pt", **common).frames
    assert (traj.final - ref_latents).abs().max() <= 1e-4
    assert pixels.shape == ref_pixels.shape == (2, 9, 3, 32, 64)
    assert (pixels - ref_pixels).abs().max() <= 1e-4


@pytest.mark.parametrize("ti2v", [False, True], ids=["wan21", "wan22"])
def test_decode_in_chunks_is_the_one_call_decode(ti2v, monkeypatch):
    adapter = WanAdapter.from_pipeline(build_tiny_pipeline("wan", ti2v=ti2v))
    latents = adapter.prepare_noise(3, height=32, width=32, num_frames=5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = adapter.decode(latents)
        calls = []
        decode = adapter.pipe.vae.decode
        monkeypatch.setattr(adapter.pipe.vae, "decode", lambda z, **kw: calls.append(len(z)) or decode(z, **kw))
        monkeypatch.setattr(WanAdapter, "decode_pixels_per_call", 2 * 5 * 32 * 32)  # two clips per call
        chunked = adapter.decode(latents)
    assert calls == [2, 1] and chunked.shape == whole.shape == (3, 5, 3, 32, 32)
    assert (chunked - whole).abs().max() <= 1e-6
    calls.clear()  # on CPU the smaller of the two budgets chunks
    monkeypatch.setattr(WanAdapter, "decode_pixels_per_call", 2**25)
    monkeypatch.setattr(WanAdapter, "cpu_decode_pixels_per_call", 5 * 32 * 32)  # one clip per call
    with torch.no_grad():
        single = adapter.decode(latents)
    assert calls == [1, 1, 1] and (single - whole).abs().max() <= 1e-6


# ---------------------------------------------------------------------------------------- experiments


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def memory_plan(cfg, plan) -> dict[str, float]:
    """Per-GPU memory (GB) of one recipe, from the published parameter counts (meta device) and the clip size.

    Frozen weights in `model.torch_dtype` (the VAE in `model.vae_dtype`); LoRA weights, gradients and AdamW moments at
    4 bytes each; with gradient checkpointing, per clip and CFG branch: the 30 checkpointed block inputs (bf16),
    Wan 2.2's per-token modulation, and one block's recompute + backward (bf16 activations, fp32 norm temporaries,
    the FFN's hidden layer); a rollout forward holds one block's activations. Estimates, not measurements.
    """
    m = cfg.model
    spec = PUBLISHED[[k for k, v in PUBLISHED.items() if v["hub"] == m.pretrained][0]]
    with torch.device("meta"):
        transformer = WanTransformer3DModel(**spec["transformer"])
        vae = AutoencoderKLWan(**spec["vae"])
    width = {"bfloat16": 2, "float16": 2, "float32": 4}
    wb, vb = width[m.torch_dtype], width[m.vae_dtype or m.torch_dtype]
    gb = 1e9
    D, F = transformer.config.num_attention_heads * transformer.config.attention_head_dim, transformer.config.ffn_dim
    layers = transformer.config.num_layers
    spatial = vae.config.scale_factor_spatial * spec["transformer"]["patch_size"][1]
    latent_frames = (m.num_frames - 1) // vae.config.scale_factor_temporal + 1
    L = latent_frames * (m.height // spatial) * (m.width // spatial)
    lora_per_rank = sum(mod.in_features + mod.out_features for n, mod in transformer.named_modules()
                        if isinstance(mod, torch.nn.Linear) and any(n.endswith(t) for t in m.lora.target_modules))
    expand = spec["expand_timesteps"]
    modulation = L * 7 * D * 2 if expand else 0  # per-token timestep_proj [L, 6D] + temb [L, D], bf16, kept
    fp32_modulation = L * 6 * D * 4 if expand else 0  # each block's shift/scale/gate, fp32, one block at a time
    block = L * (48 * D + 8 * F) + fp32_modulation  # one block's recompute + backward
    saved_per_block = L * (24 * D + 6 * F)  # what one block keeps for its backward without checkpointing
    branches = 2 if (cfg.algo.cfg_in_training and m.guidance_scale > 1) else 1
    latent = vae.config.z_dim * latent_frames * (m.height // vae.config.scale_factor_spatial) * \
        (m.width // vae.config.scale_factor_spatial)
    pixels = m.num_frames * 3 * m.height * m.width * 4
    out = {
        "tokens": L,
        "weights": (wb * (_params(transformer) + UMT5_XXL_PARAMS) + vb * _params(vae)) / gb,
        "lora": 16 * lora_per_rank * m.lora.rank / gb,
        "trajectories": plan.rollouts_per_process * (cfg.sampler.num_steps + 1) * latent * 4 / gb,
        "rewards": 2.0,  # CLIP ViT-L/14 + DINO ViT-B/16 in fp32
        "train": plan.train_micro_batch * branches * (layers * L * D * 2 + modulation + block) / gb,
        "train_clip_without_checkpointing": branches * (layers * saved_per_block + modulation) / gb,
        "rollout": plan.rollout_batch_per_process * branches * (L * (8 * D + 2 * F) * 2 + modulation
                                                               + fp32_modulation) / gb,
        "decoded": 2 * plan.rollouts_per_process * pixels / gb,  # float32 clips and their clamped copy
    }
    out["peak"] = out["weights"] + out["lora"] + out["trajectories"] + out["rewards"] + max(
        out["train"], out["rollout"], out["decoded"])
    return out


@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
def test_experiment_composes_with_consistent_numbers(experiment):
    cfg = validate(_compose([f"experiment={experiment}", "data.train_file=prompts.txt"]))
    assert OmegaConf.missing_keys(cfg) == set()  # only the prompt list is left to the user
    raw = _compose([f"experiment={experiment}"])
    assert OmegaConf.missing_keys(raw) == {"data.train_file"}
    m = cfg.model
    assert m.pretrained == PUBLISHED[EXPERIMENTS[experiment]]["hub"]
    spatial = {"wan21_1_3b": 8, "wan22_5b": 16}[EXPERIMENTS[experiment]] * 2  # VAE x transformer patch
    assert (m.num_frames - 1) % 4 == 0 and m.height % spatial == 0 and m.width % spatial == 0
    assert m.gradient_checkpointing and m.torch_dtype == "bfloat16" and cfg.trainer.mixed_precision == "bf16"

    # Rewards: video rewards that exist, combined per component (their scales differ by orders of magnitude).
    assert cfg.reward.name == "multi" and cfg.reward.aggregate.name == "per_reward"
    names = [c.name for c in cfg.reward.kwargs.components]
    assert set(names) <= set(rewards.available()) and all(n.startswith("video_") for n in names)
    assert "video_clip" in names  # the only prompt-conditioned one: the others alone are won by a frozen / wild clip

    plan = batch_plan(cfg, num_processes=GPUS)  # divisibility of every global batch size over 8 GPUs
    assert plan.rollout_chunks >= 1 and plan.updates_per_iteration >= 1
    est = memory_plan(cfg, plan)
    assert est["peak"] < 0.75 * GPU_GB, est  # a quarter left for what the estimate misses
    # The recipe's comments state the published plan (scripts/plan.py on fake tensors at the real architectures),
    # and this arithmetic from the published parameter counts agrees with it.
    text = (CONF / "experiment" / f"{experiment}.yaml").read_text(encoding="utf-8")
    planned = json.loads((REPO_ROOT / "docs" / "results" / f"plan_{experiment}.json").read_text(encoding="utf-8"))
    stated = re.search(r"peak ([\d.]+) of ([\d.]+) GiB", text)
    assert stated, "the recipe states its planned peak memory per GPU ('peak X of Y GiB')"
    assert abs(float(stated.group(1)) - planned["peak_gib"]) <= 0.1, (stated.group(0), planned["peak_gib"])
    planned_gb = planned["peak_bytes"] / 1e9
    assert abs(est["peak"] - planned_gb) <= 0.10 * planned_gb, (est, planned_gb)
    assert f"{est['tokens']:,} tokens" in text
    # Without gradient checkpointing not even one clip's update fits next to the frozen weights.
    assert est["weights"] + est["train_clip_without_checkpointing"] > GPU_GB, est
