"""Model adapters on tiny random-initialised twins of SD3, FLUX and Wan (CPU, offline, in-memory tokenizers).

The central claim: an Euler ODE rollout through ``adapter.velocity`` over ``adapter.sigmas`` from
``adapter.prepare_noise`` reproduces ``pipe(...)`` for the same seed and guidance, latents and decoded pixels.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

import samplers
from flowgrpo.models import (
    FlowAdapter,
    FluxAdapter,
    PromptEmbeds,
    SD3Adapter,
    WanAdapter,
    build_tiny_pipeline,
    load_adapter,
)

PROMPTS = ["a photo of a red circle", "a photo of two blue squares"]
NEGATIVE = "blurry"
STEPS = 4
MAX_SEQ = 32  # short T5 sequences keep FLUX / Wan fast; passed to both the pipeline and the adapter

# Per family: output size, and guidance settings as (adapter velocity kwargs, pipeline kwargs).
SIZE = {
    "sd3": dict(height=32, width=32),
    "flux": dict(height=32, width=48),  # non-square: exercises packing / unpacking and the FLUX mu
    "wan": dict(height=32, width=32, num_frames=9),
}
CASES = [
    pytest.param("sd3", dict(guidance_scale=4.5), id="sd3-cfg"),
    pytest.param("sd3", dict(guidance_scale=1.0), id="sd3-nocfg"),
    pytest.param("flux", dict(guidance_scale=3.5, true_cfg_scale=2.0), id="flux-truecfg"),
    pytest.param("flux", dict(guidance_scale=3.5), id="flux-distilled"),
    pytest.param("wan", dict(guidance_scale=5.0), id="wan-cfg"),
]


@functools.cache
def _adapter(family: str) -> FlowAdapter:
    return FlowAdapter.from_pipeline(build_tiny_pipeline(family))


def _seq_kwargs(adapter: FlowAdapter) -> dict:
    return {} if adapter.family == "sd3" else {"max_sequence_length": MAX_SEQ}


def _pipe_output(adapter: FlowAdapter, guidance: dict, seed: int, output_type: str) -> torch.Tensor:
    out = adapter.pipe(
        PROMPTS,
        negative_prompt=NEGATIVE,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(seed),
        output_type=output_type,
        **SIZE[adapter.family],
        **guidance,
        **_seq_kwargs(adapter),
    )
    return out[0]


def _our_rollout(adapter: FlowAdapter, guidance: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode once, seeded noise, Euler ODE over the adapter's sigmas via samplers.rollout, decode."""
    size = SIZE[adapter.family]
    cfg_kwargs = {k: v for k, v in guidance.items() if k != "guidance_scale"}
    cond = adapter.encode_prompts(
        PROMPTS, NEGATIVE, guidance_scale=guidance["guidance_scale"], **cfg_kwargs, **_seq_kwargs(adapter)
    )
    noise = adapter.prepare_noise(len(PROMPTS), generator=torch.Generator().manual_seed(seed), **size)
    sigmas = adapter.sigmas(STEPS, **size)
    traj = samplers.rollout(
        lambda x, s: adapter.velocity(x, s, cond, **guidance),
        noise,
        sigmas,
        sde_mask=torch.zeros(STEPS, dtype=torch.bool),
    )
    with torch.no_grad():
        return traj.final, adapter.decode(traj.final)


def _as_pipeline_latents(adapter: FlowAdapter, latents: torch.Tensor) -> torch.Tensor:
    if adapter.family != "flux":
        return latents
    batch, channels, height, width = latents.shape  # FluxPipeline returns packed tokens for "latent"
    return adapter.pipe._pack_latents(latents, batch, channels, height, width)


@pytest.mark.parametrize("family, guidance", CASES)
def test_rollout_reproduces_pipeline(family, guidance):
    adapter = _adapter(family)
    latents, pixels = _our_rollout(adapter, guidance, seed=3)
    ref_latents = _pipe_output(adapter, guidance, seed=3, output_type="latent")
    ref_pixels = _pipe_output(adapter, guidance, seed=3, output_type="pt")
    assert (_as_pipeline_latents(adapter, latents) - ref_latents).abs().max() <= 1e-4
    assert pixels.shape == ref_pixels.shape
    assert (pixels - ref_pixels).abs().max() <= 1e-4
    assert pixels.dtype == torch.float32 and 0 <= pixels.min() and pixels.max() <= 1
    expected = (2, 9, 3, 32, 32) if family == "wan" else (2, 3, SIZE[family]["height"], SIZE[family]["width"])
    assert tuple(pixels.shape) == expected
    # Guidance matters on these twins, so the comparison above could fail if the adapter ignored it.
    if guidance["guidance_scale"] > 1 and family != "flux":
        unguided, _ = _our_rollout(adapter, {"guidance_scale": 1.0}, seed=3)
        assert (unguided - latents).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["sd3", "flux", "wan"])
def test_save_load_same_output(family, tmp_path):
    adapter = _adapter(family)
    adapter.pipe.save_pretrained(tmp_path)
    loaded = load_adapter(family, str(tmp_path))  # also runs the tokenizer sanity check
    assert type(loaded) is type(adapter) and loaded.pipe is not adapter.pipe
    guidance = {"guidance_scale": 3.5, "true_cfg_scale": 2.0} if family == "flux" else {"guidance_scale": 4.0}
    latents, pixels = _our_rollout(adapter, guidance, seed=0)
    latents_loaded, pixels_loaded = _our_rollout(loaded, guidance, seed=0)
    assert torch.equal(adapter.sigmas(STEPS, **SIZE[family]), loaded.sigmas(STEPS, **SIZE[family]))
    assert (latents - latents_loaded).abs().max() <= 1e-6
    assert (pixels - pixels_loaded).abs().max() <= 1e-6


def test_load_rejects_broken_tokenizer(tmp_path):
    # Offline, a tokenizer whose files are missing loads as a near-empty one instead of raising.
    _adapter("sd3").pipe.save_pretrained(tmp_path)
    for path in (tmp_path / "tokenizer").iterdir():
        if path.name != "tokenizer_config.json":
            path.unlink()
    with pytest.raises(OSError, match="tokenizer.*model.pretrained"):
        load_adapter("sd3", str(tmp_path))


def test_tiny_random_loader():
    adapter = load_adapter("wan", "tiny-random:wan", torch_dtype="fp32")
    assert isinstance(adapter, WanAdapter) and adapter.is_video and adapter.dtype == torch.float32
    assert all(not m.training for m in adapter.pipe.components.values() if isinstance(m, torch.nn.Module))
    with pytest.raises(ValueError, match="model.family"):
        load_adapter("sd3", "tiny-random:flux")


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_vae_dtype_casts_only_the_decoder(family):
    """``vae_dtype`` (``model.vae_dtype``): a bfloat16 decoder, float32 transformer, float32 pixels close to fp32's."""
    full = load_adapter(family, f"tiny-random:{family}")
    half = load_adapter(family, f"tiny-random:{family}", vae_dtype="bfloat16")
    assert half.pipe.vae.dtype == torch.bfloat16 and half.dtype == torch.float32 and full.pipe.vae.dtype == torch.float32
    channels = full.pipe.vae.config.latent_channels
    latents = torch.randn(2, channels, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = full.decode(latents), half.decode(latents)
    assert b.dtype == torch.float32 and b.shape == a.shape
    assert 0 < (a - b).abs().max() < 0.05  # bfloat16 rounding, nothing else


@pytest.mark.parametrize("family", ["sd3", "flux", "wan"])
def test_per_sample_sigma_matches_scalar_calls(family):
    adapter = _adapter(family)
    guidance = {"guidance_scale": 3.5, "true_cfg_scale": 2.0} if family == "flux" else {"guidance_scale": 4.0}
    cond = adapter.encode_prompts(PROMPTS, NEGATIVE, **guidance, **_seq_kwargs(adapter))
    x = adapter.prepare_noise(2, generator=torch.Generator().manual_seed(1), **SIZE[family])
    sigma = torch.tensor([0.9, 0.35])
    with torch.no_grad():
        batched = adapter.velocity(x, sigma, cond, **guidance)
        single = [adapter.velocity(x[i : i + 1], float(sigma[i]), cond[i], **guidance) for i in range(2)]
    assert batched.shape == x.shape and batched.dtype == torch.float32
    assert (batched - torch.cat(single)).abs().max() <= 1e-5
    assert (batched[0] - batched[1]).abs().max() > 1e-4  # different sigmas and prompts, different v


@pytest.mark.parametrize("family", ["sd3", "wan"])
def test_shared_noise_per_group(family):
    adapter = _adapter(family)
    noise = adapter.prepare_noise(
        6, generator=torch.Generator().manual_seed(0), group_size=3, shared=True, **SIZE[family]
    )
    assert noise.dtype == torch.float32 and noise.shape[0] == 6
    assert torch.equal(noise[0], noise[1]) and torch.equal(noise[0], noise[2])
    assert torch.equal(noise[3], noise[5])
    assert not torch.equal(noise[0], noise[3])
    # The groups draw what an unshared batch of 2 would draw.
    unshared = adapter.prepare_noise(2, generator=torch.Generator().manual_seed(0), **SIZE[family])
    assert torch.equal(noise[::3], unshared)
    with pytest.raises(ValueError, match="group_size"):
        adapter.prepare_noise(5, group_size=3, shared=True, **SIZE[family])


@pytest.mark.parametrize("family, guidance", CASES)
def test_cfg_is_one_batched_forward(family, guidance):
    adapter = _adapter(family)
    cond = adapter.encode_prompts(PROMPTS, NEGATIVE, **guidance, **_seq_kwargs(adapter))
    x = adapter.prepare_noise(2, **SIZE[family])
    batches = []
    handle = adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: batches.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            adapter.velocity(x, 0.5, cond, **guidance)
    finally:
        handle.remove()
    # FLUX: guidance_scale feeds the distilled-guidance embedding; only true_cfg_scale runs two branches.
    cfg = guidance.get("true_cfg_scale", 1.0) > 1 if family == "flux" else guidance["guidance_scale"] > 1
    assert batches == [4 if cfg else 2]
    assert cond.has_negative == cfg


def test_velocity_is_differentiable():
    adapter = _adapter("sd3")
    cond = adapter.encode_prompts(PROMPTS, guidance_scale=4.0)
    x = adapter.prepare_noise(2, **SIZE["sd3"]).requires_grad_(True)
    adapter.velocity(x, torch.tensor([0.8, 0.3]), cond, guidance_scale=4.0).square().mean().backward()
    weights = adapter.transformer.proj_out.weight
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert weights.grad is not None and weights.grad.abs().sum() > 0
    adapter.transformer.zero_grad(set_to_none=True)


def test_velocity_without_negative_embeddings_raises():
    adapter = _adapter("sd3")
    cond = adapter.encode_prompts(PROMPTS, guidance_scale=1.0)
    with pytest.raises(ValueError, match="negative"):
        adapter.velocity(adapter.prepare_noise(2, **SIZE["sd3"]), 0.5, cond, guidance_scale=4.0)


def test_prompt_embeds_helpers():
    cond = _adapter("sd3").encode_prompts(PROMPTS, guidance_scale=4.0)
    assert len(cond) == 2 and cond.has_negative
    grouped = cond.repeat_interleave(3)
    assert len(grouped) == 6
    assert torch.equal(grouped.prompt_embeds[2], cond.prompt_embeds[0])
    assert torch.equal(grouped.negative_pooled_prompt_embeds[3], cond.negative_pooled_prompt_embeds[1])
    assert len(grouped[4]) == 1 and torch.equal(grouped[4].pooled_prompt_embeds, cond.pooled_prompt_embeds[1:])
    assert len(grouped[torch.tensor([0, 5])]) == 2 and len(grouped[1:3]) == 2
    assert torch.equal(PromptEmbeds.cat([cond[0], cond[1]]).prompt_embeds, cond.prompt_embeds)
    assert grouped.to("cpu").prompt_embeds.device.type == "cpu"


@pytest.mark.parametrize("family", ["sd3", "flux", "wan"])
def test_sigmas_agree_with_samplers_flow_sigmas(family):
    adapter = _adapter(family)
    size = SIZE[family]
    ours = adapter.sigmas(10, **size)
    assert ours.dtype == torch.float32 and ours.shape == (11,) and ours[-1] == 0
    assert torch.all(ours[1:] < ours[:-1])
    if family == "flux":
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        seq_len = (size["height"] // 4) * (size["width"] // 4)  # vae scale 2, then 2x2 packing
        expected = samplers.flow_sigmas(10, mu=calculate_shift(seq_len, 256, 4096, 0.5, 1.15))
    else:
        expected = samplers.flow_sigmas(10, shift=adapter.pipe.scheduler.config.shift)
    assert (ours - expected).abs().max() <= 1e-6


def test_wan22_expand_timesteps_reproduces_pipeline():
    # Wan 2.2 TI2V: the transformer takes one timestep per latent token ([B, seq] path), as the pipeline feeds it.
    pipe = build_tiny_pipeline("wan")
    pipe.register_to_config(expand_timesteps=True)
    adapter = WanAdapter.from_pipeline(pipe)
    latents, _ = _our_rollout(adapter, {"guidance_scale": 5.0}, seed=2)
    reference = _pipe_output(adapter, {"guidance_scale": 5.0}, seed=2, output_type="latent")
    assert (latents - reference).abs().max() <= 1e-4


def test_wan_vae_channel_norms_are_swapped_and_agree_with_the_original():
    """The Wan adapter swaps its VAE's ``WanRMS_norm`` for the sum-of-squares form: same state dict, same values up
    to float rounding (float32 and bfloat16, both channel layouts), and the swapped VAE decodes as the original."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    from flowgrpo.models.wan import _ChannelRMSNorm, use_fast_channel_norms

    torch.manual_seed(0)
    for channel_first, images, shape in ((True, False, (2, 8, 3, 5, 6)), (True, True, (2, 8, 5, 6)),
                                         (False, False, (2, 5, 8))):
        ref = WanRMS_norm(8, channel_first=channel_first, images=images)
        with torch.no_grad():
            ref.gamma.normal_()
        fast = _ChannelRMSNorm(8, channel_first=channel_first, images=images)
        fast.load_state_dict(ref.state_dict())
        x = torch.randn(shape)
        x[0, ..., 0] = 0.0  # an all-zero channel vector: F.normalize's eps keeps it at zero
        assert (fast(x) - ref(x)).abs().max() <= 1e-6
        xb = x.bfloat16()
        assert fast(xb).dtype == ref(xb).dtype  # float32 parameters promote, as the original's
        assert (fast(xb).float() - ref(xb).float()).abs().max() <= 2e-2  # one bfloat16 ulp at |y| ~ 3
    pipe = build_tiny_pipeline("wan")
    before = {k: v.clone() for k, v in pipe.vae.state_dict().items()}
    latents = torch.randn(1, pipe.vae.config.z_dim, 2, 4, 4)
    with torch.no_grad():
        expected = pipe.vae.decode(latents).sample
    norms = sum(type(m) is WanRMS_norm for m in pipe.vae.modules())
    assert norms > 0
    WanAdapter.from_pipeline(pipe)
    assert sum(type(m) is _ChannelRMSNorm for m in pipe.vae.modules()) == norms
    assert use_fast_channel_norms(pipe.vae) == 0  # already swapped
    after = pipe.vae.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        assert (pipe.vae.decode(latents).sample - expected).abs().max() <= 1e-5


def test_from_pipeline_dispatch_and_wan_scheduler_swap():
    from diffusers import UniPCMultistepScheduler

    assert isinstance(_adapter("sd3"), SD3Adapter) and isinstance(_adapter("flux"), FluxAdapter)
    with pytest.raises(TypeError, match="wraps a FluxPipeline"):
        FluxAdapter.from_pipeline(_adapter("sd3").pipe)
    pipe = build_tiny_pipeline("wan")
    # Real Wan checkpoints ship UniPC with `flow_shift`; the adapter steps Euler with the same shift.
    pipe.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    adapter = WanAdapter.from_pipeline(pipe)
    assert type(adapter.pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert adapter.pipe.scheduler.config.shift == 3.0


def test_missing_pretrained_names_config_key(tmp_path):
    for missing in (str(tmp_path / "no-such-pipeline"), "no-such-org/no-such-model"):
        with pytest.raises(OSError, match="model.pretrained") as info:
            load_adapter("sd3", missing)
        assert missing in str(info.value)


def test_bad_options_name_config_keys():
    with pytest.raises(ValueError, match="model.attention"):
        load_adapter("sd3", "tiny-random:sd3", attention="bogus")
    with pytest.raises(ValueError, match="model.family"):
        load_adapter("sdxl", "tiny-random:sd3")
    with pytest.raises(ValueError, match="model.torch_dtype"):
        load_adapter("sd3", "tiny-random:sd3", torch_dtype="float8")


def test_xformers_missing_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xformers" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match=r"pip install flowgrpo\[xformers\]"):
        load_adapter("sd3", "tiny-random:sd3", attention="xformers")


def test_tiny_pipeline_is_deterministic():
    a, b, c = build_tiny_pipeline("flux"), build_tiny_pipeline("flux"), build_tiny_pipeline("flux", seed=1)
    state_a, state_b, state_c = (p.transformer.state_dict() for p in (a, b, c))
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a)


def test_embedded_asset_loads_with_plain_from_pretrained_and_its_t5_changes_nothing():
    """`assets/tiny-sd3-shapes` was trained without T5 and ships an all-zero placeholder T5 so that diffusers loads it
    with no extra argument: its prompt embeddings equal those of the pipeline loaded without T5, bit for bit, and
    `load_adapter` drops the placeholder (a T5 with real weights it keeps)."""
    from pathlib import Path

    from diffusers import DiffusionPipeline, StableDiffusion3Pipeline

    from flowgrpo.models.load import drop_zero_t5

    path = Path(__file__).resolve().parents[1] / "assets" / "tiny-sd3-shapes"
    plain = StableDiffusion3Pipeline.from_pretrained(path)
    assert isinstance(DiffusionPipeline.from_pretrained(path), StableDiffusion3Pipeline)
    no_t5 = StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None, tokenizer_3=None)
    assert plain.text_encoder_3 is not None and no_t5.text_encoder_3 is None
    for max_sequence_length in (256, 1):  # the pipeline's default; the trainer's (conf/model/sd3_shapes.yaml)
        kwargs = dict(prompt=PROMPTS, prompt_2=None, prompt_3=None, negative_prompt=NEGATIVE,
                      do_classifier_free_guidance=True, max_sequence_length=max_sequence_length)  # fmt: skip
        for got, want in zip(plain.encode_prompt(**kwargs), no_t5.encode_prompt(**kwargs), strict=True):
            assert torch.equal(got, want)

    adapter = load_adapter("sd3", str(path))
    assert adapter.pipe.text_encoder_3 is None and adapter.pipe.tokenizer_3 is None
    with_t5 = build_tiny_pipeline("sd3", with_t5=True)
    assert not drop_zero_t5(with_t5) and with_t5.text_encoder_3 is not None


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_image_decode_in_chunks_is_the_one_call_decode(family, monkeypatch):
    """The image families decode a batch in chunks of whole images under ``decode_pixels_per_call`` (the trainer
    decodes every rollout of a process at once: 144 images of 512x512 per GPU in Flow-GRPO's GenEval preset)."""
    from flowgrpo.models import FlowAdapter, build_tiny_pipeline

    adapter = FlowAdapter.from_pipeline(build_tiny_pipeline(family))
    latents = adapter.prepare_noise(3, height=32, width=32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = adapter.decode(latents)
        calls = []
        decode = adapter.pipe.vae.decode
        monkeypatch.setattr(adapter.pipe.vae, "decode", lambda z, **kw: calls.append(len(z)) or decode(z, **kw))
        monkeypatch.setattr(type(adapter), "decode_pixels_per_call", 2 * 32 * 32)  # two images per call
        chunked = adapter.decode(latents)
    assert calls == [2, 1] and chunked.shape == whole.shape == (3, 3, 32, 32)
    assert (chunked - whole).abs().max() <= 1e-6
