"""The run planner (``flowgrpo.planner``, ``scripts/plan.py``): its peak against a real run at tiny size, its tracker
against PyTorch's own, its FLOPs against an analytic count, and the shipped architecture configs against the
published parameter counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from flowgrpo.planner import ARCH_ROOT, GiB, MemoryTracker, build_pipeline, default_dtype, fake_mode, flop_counter, plan_run

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["model=tiny_sd3", "trainer.prompts_per_iteration=2", "trainer.group_size=4", "trainer.rollout_batch_size=4",
        "trainer.train_batch_size=4", "trainer.gradient_accumulation_steps=2", "sampler.num_steps=3",
        "sampler.eval_num_steps=3", "trainer.mixed_precision=bf16", "model.gradient_checkpointing=true",
        "trainer.ema.enabled=true"]


def _compose(overrides):
    from plan import compose

    return compose(["logger=none", *overrides])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny SD3 twin saved as a diffusers folder: the planner builds it from its configs (fake tensors), the
    real run loads its weights."""
    from flowgrpo.models.tiny import build_tiny_pipeline

    path = tmp_path_factory.mktemp("tiny-sd3")
    build_tiny_pipeline("sd3").save_pretrained(path)
    return path


def _load_tiny_sd3(model):
    """The real run's pipeline: the tiny twin's weights loaded from its folder."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(model.pretrained, text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_plan_peak_equals_real_run_at_tiny_size(tiny_dir):
    """Every phase's peak under fake tensors equals the same phases on real tensors (real weights loaded from disk)
    within 1% — what the fake mode, the tracker and the planner's bookkeeping add or lose, at zero cost."""
    cfg = _compose([*TINY, f"model.pretrained={tiny_dir}"])
    planned = plan_run(cfg, num_processes=1)
    real = plan_run(cfg, num_processes=1, fake=False, build=_load_tiny_sd3)
    assert [p.name for p in planned.phases] == ["rollout", "update", "eval"]
    for p, r in zip(planned.phases, real.phases):
        assert p.peak_bytes > 0 and r.peak_bytes > 0
        assert abs(p.peak_bytes - r.peak_bytes) <= 0.01 * r.peak_bytes, (p.name, p.peak_bytes, r.peak_bytes)
        assert p.flops == r.flops, p.name
        for cat in ("weights", "optimizer"):
            assert p.split[cat] == r.split[cat], (p.name, cat)
    update = planned.phases[1]
    assert update.split["activations"] > 0 and update.split["weights"] > 0
    assert planned.params["trainable"] < planned.params["transformer"]  # LoRA


def test_rows_that_share_their_leaders_noise_are_planned_as_they_run(tiny_dir):
    """DanceGRPO's shared initial noise (``algo.shared_noise=true``: a group's rows start from its leader's state,
    which the rollout checks by comparing their noise) plans on fake tensors, whose values cannot be compared, and
    equals the real run. At 128 px the noise is large enough to stay fake in the plan (as at real size)."""
    cfg = _compose([*TINY, f"model.pretrained={tiny_dir}", "sampler=dance", "algo=dance_grpo", "algo.shared_noise=true",
                    "trainer.ema.enabled=false", "model.height=128", "model.width=128"])
    planned = plan_run(cfg, num_processes=1, phases=("rollout",))
    real = plan_run(cfg, num_processes=1, fake=False, phases=("rollout",), build=_load_tiny_sd3)
    (p,), (r,) = planned.phases, real.phases
    assert abs(p.peak_bytes - r.peak_bytes) <= 0.01 * r.peak_bytes and p.flops == r.flops > 0


def test_tracker_agrees_with_pytorch_memtracker():
    """Our storage accounting against ``torch.distributed._tools.mem_tracker.MemTracker`` on a real full fine-tuning
    step (every parameter trained: the case MemTracker supports): the same peak within 2%."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from flowgrpo.models.tiny import build_tiny_pipeline

    def run(tracker_cls):
        torch.manual_seed(0)
        model = build_tiny_pipeline("sd3").transformer.train()
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        x = torch.randn(4, 4, 16, 16)
        emb, pooled = torch.randn(4, 8, 64), torch.randn(4, 64)
        def step():
            out = model(hidden_states=x, timestep=torch.full((4,), 500.0), encoder_hidden_states=emb,
                        pooled_projections=pooled, return_dict=False)[0]
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

        step()  # the optimizer state exists: the steady state is tracked
        if tracker_cls is MemTracker:
            tracker = MemTracker()
            tracker.track_external(model, opt)
        else:
            tracker = MemoryTracker()
            tracker.track_module(model)
            for state in opt.state.values():
                for v in state.values():
                    tracker.track(v, "optimizer")
            tracker.watch_gradients(list(model.parameters()))
        with tracker:
            step()
        if tracker_cls is MemTracker:
            snapshot = tracker.get_tracker_snapshot("peak")
            return max(v["Total"] for v in snapshot.values())
        return tracker.peak

    ours, theirs = run(MemoryTracker), run(MemTracker)
    assert abs(ours - theirs) <= 0.02 * theirs, (ours, theirs)


def test_flops_of_one_wan_block_equal_the_analytic_count():
    """One Wan2.1-1.3B transformer block at 480x832x33 (14,040 tokens, 512 text tokens) under fake tensors: the
    planner's FLOPs equal the matmul count written out — forward, and forward + backward with every weight trained
    (linears 3x the forward; attention's backward recomputes the scores: 2.5x its forward)."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    B, L, Lt, D, F, H = 2, 14040, 512, 1536, 8960, 12
    linear = 2 * B * (4 * L * D * D + 2 * L * D * D + 2 * Lt * D * D + 2 * L * D * F)  # self qkvo, cross qo/kv, FFN
    attention = 2 * 2 * B * D * (L * L + L * Lt)  # QK^T and AV, self and cross
    with fake_mode():
        with default_dtype(torch.bfloat16):
            block = WanTransformerBlock(D, F, H, "rms_norm_across_heads", True, 1e-6)
        x = torch.empty(B, L, D, requires_grad=True)
        context = torch.empty(B, Lt, D, requires_grad=True)
        temb = torch.empty(B, 6, D)
        rope = (torch.empty(1, L, 1, D // H), torch.empty(1, L, 1, D // H))
        with torch.no_grad(), flop_counter() as fc:
            block(x, context, temb, rope)
        assert fc.get_total_flops() == linear + attention
        with flop_counter() as fc:
            block(x, context, temb, rope).sum().backward()
        assert fc.get_total_flops() == 3 * linear + attention * 7 // 2


def test_masked_attention_is_planned_as_the_gpu_kernel_holds_it():
    """A masked attention (a streaming model's full-sequence forward) is planned as the GPU's memory-efficient kernel
    holds it: the output, its log-sum-exp and the mask as an additive bias of the mask's shape, never the
    ``[B, H, S, S]`` scores the math kernel materialises (48 times the bias here). And a plan runs a streaming
    model's frame-masked attention through the masked kernel, not the CPU-only gathered-keys shortcut."""
    from flowgrpo.models.causal_wan import _Call, _gathers_frames, accelerator_attention, stream_mask

    B, H, S, D = 2, 12, 4096, 128
    with fake_mode():
        q = torch.empty(B, H, S, D, dtype=torch.bfloat16, requires_grad=True)
        mask = torch.ones(1, 1, S, S, dtype=torch.bool)
        tracker = MemoryTracker()
        with tracker:
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            out.sum().backward()
    kept = B * H * S * D * 2 + B * H * S * 4 + S * S * 2  # output (bf16), log-sum-exp (fp32), bias (bf16)
    grads = 3 * B * H * S * D * 2
    assert kept <= tracker.peak <= kept + grads + 4096
    assert tracker.peak < B * H * S * S * 4 / 10
    frames = stream_mask(24, 3, sink_frames=3, window_frames=3)  # each frame sees at most 6 of 24 frames
    query = torch.empty(1, 24 * 4, 2, 8)
    assert _gathers_frames(_Call(torch.arange(24), mask=frames), query)  # the CPU's shortcut ...
    with accelerator_attention():
        assert not _gathers_frames(_Call(torch.arange(24), mask=frames), query)  # ... not in a plan


# Published parameter counts of the architectures shipped in assets/configs (model cards and papers; billions).
PUBLISHED = {
    ("stabilityai--stable-diffusion-3.5-medium", "transformer"): 2.47,
    ("stabilityai--stable-diffusion-3.5-large", "transformer"): 8.06,
    ("black-forest-labs--FLUX.1-dev", "transformer"): 11.90,
    ("Wan-AI--Wan2.1-T2V-1.3B-Diffusers", "transformer"): 1.42,
    ("Wan-AI--Wan2.2-TI2V-5B-Diffusers", "transformer"): 5.00,
    ("Wan-AI--Wan2.1-T2V-1.3B-Diffusers", "text_encoder"): 5.68,  # UMT5-XXL encoder
    ("stabilityai--stable-diffusion-3.5-medium", "text_encoder_3"): 4.76,  # T5-XXL encoder
}


@pytest.mark.parametrize("folder,component", sorted(PUBLISHED))
def test_shipped_architectures_have_the_published_sizes(folder, component):
    """The config files under assets/configs build (fake tensors, no memory) to the published parameter counts."""
    import flowgrpo.planner as planner

    index = planner._read(ARCH_ROOT / folder / "model_index.json")
    with fake_mode():
        module = planner._build_component(ARCH_ROOT / folder / component, *index[component], torch.bfloat16)
        stored = {t.untyped_storage()._cdata: t.numel() for t in module.state_dict().values()}  # tied: once
        count = sum(stored.values()) / 1e9  # what the checkpoint stores (SD3's position table is a buffer)
    assert count == pytest.approx(PUBLISHED[folder, component], rel=0.02)


def test_missing_architecture_names_the_key():
    from omegaconf import OmegaConf

    with pytest.raises(FileNotFoundError, match="model.pretrained='someone/unknown'.*assets/configs/someone--unknown"):
        build_pipeline(OmegaConf.create({"pretrained": "someone/unknown", "torch_dtype": "bfloat16",
                                         "vae_dtype": None, "family": "sd3"}))


def test_plan_script_writes_json(tiny_dir, tmp_path):
    """``scripts/plan.py`` with train.py's overrides prints the table and writes the JSON it reports."""
    import json

    from plan import main

    out = tmp_path / "plan.json"
    result = main([*TINY, f"model.pretrained={tiny_dir}", "--gpus", "1", "--phases", "rollout,update",
                   "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["peak_bytes"] == result["peak_bytes"] == max(p["peak_bytes"] for p in saved["phases"])
    assert saved["fits"] and saved["headroom_gib"] > 70
    assert [p["name"] for p in saved["phases"]] == ["rollout", "update"]
    assert saved["peak_gib"] == round(saved["peak_bytes"] / GiB, 2)


# ------------------------------------------------------------------------------------------------ streaming

STREAMS = {  # tiny twins of the streaming presets: (overrides, pixel frames, prompt switches, phases planned)
    "stream_grpo": (["experiment=stream_grpo_shapes", "trainer.prompts_per_iteration=1", "trainer.group_size=2",
                     "trainer.train_batch_size=2", "trainer.gradient_accumulation_steps=1"], 17, (9,),
                    ("rollout", "update", "eval")),
    "stream_awm": (["experiment=stream_awm_shapes", "trainer.group_size=2", "trainer.train_batch_size=2",
                    "trainer.gradient_accumulation_steps=2"], 17, (9,), ("rollout", "update")),
    # a group of 2 routed branches + the reference run, split over micro-batches (the partial-group path), two
    # branches streamed at a time, forks after the switch
    "kvpo": (["experiment=kvpo_shapes", "model=causal_wan_shapes_4step", "trainer.prompts_per_iteration=1",
              "trainer.group_size=3", "trainer.train_batch_size=1", "trainer.gradient_accumulation_steps=3",
              "algo.branch_batch=2"], 33, (13,), ("rollout", "update")),
}


@pytest.mark.usefixtures("one_thread")  # fake tensors compute nothing; the real run is tiny
# KVPO's real run (branches per fork) is the longest of the suite: run by hand with pytest -m slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "kvpo" else n for n in sorted(STREAMS)])
def test_streaming_plan_equals_real_run_at_tiny_size(name):
    """A streaming run planned on fake tensors (the transformer built without a checkpoint, as the planner builds a
    real-size one) against the same phases on real tensors with the embedded model's weights loaded by
    ``load_stream_pipeline``: the KV caches of every block, the branched rollout, the replays and the teacher-forced
    forward, peak by peak within 1% (equal to the byte here) and FLOP for FLOP."""
    from flowgrpo.models import load_stream_pipeline

    overrides, frames, switches, phases = STREAMS[name]
    cfg = _compose(["trainer.prompts_per_iteration=2", *overrides, f"model.num_frames={frames}",
                    "model.gradient_checkpointing=true"])
    planned = plan_run(cfg, num_processes=1, switch_frames=switches, phases=phases)
    real = plan_run(cfg, num_processes=1, fake=False, build=load_stream_pipeline, switch_frames=switches,
                    phases=phases)
    assert [p.name for p in planned.phases] == list(phases)
    for p, r in zip(planned.phases, real.phases):
        assert p.peak_bytes > 0 and abs(p.peak_bytes - r.peak_bytes) <= 0.01 * r.peak_bytes, (p.name, p.peak_bytes,
                                                                                                r.peak_bytes)
        assert p.flops == r.flops > 0, p.name
        for cat in ("weights", "optimizer"):
            assert p.split[cat] == r.split[cat], (p.name, cat)
    assert planned.flops_per_iteration == real.flops_per_iteration
    update = planned.phases[1]
    assert update.split["activations"] > 0 and update.split["gradients"] >= 0
    assert any(f"prompt switches at pixel frames {list(switches)} of {frames}" in n for n in planned.notes)


def test_streaming_presets_build_at_real_size_without_checkpoints():
    """experiment=kvpo_longlive builds on fake tensors from the Wan2.1-1.3B architecture config alone (its streaming
    checkpoint is never read) with the preset's geometry: 585 frames in 49 blocks of 3, a 33-frame KV buffer with a
    3-frame sink; the real loader still refuses to run without the checkpoint."""
    from flowgrpo.models import StreamAdapter, load_stream_pipeline
    from flowgrpo.planner import build_stream_pipeline

    cfg = _compose(["experiment=kvpo_longlive"])
    with fake_mode():
        adapter = StreamAdapter(build_stream_pipeline(cfg.model))
        params = sum(p.numel() for p in adapter.pipe.transformer.parameters())
    assert params == pytest.approx(1.42e9, rel=0.03)
    assert adapter.num_chunks(585) == 49
    c = adapter.config
    assert (c.block_frames, c.sink_frames, c.window_frames, c.cache_frames, c.recache) == (3, 3, 9, 33, True)
    assert adapter.pipe.transformer.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="model.stream.checkpoint is required"):
        load_stream_pipeline(cfg.model)


def test_a_random_init_streaming_model_is_planned_causal():
    """``model.pretrained=random-init:wan21_1_3b`` on a streaming model (scripts/gpu_check.py's streaming rows) is
    planned as the loader builds it: Wan2.1-1.3B's architecture made causal with the preset's stream settings."""
    from flowgrpo.models import StreamAdapter, StreamingWanPipeline

    cfg = _compose(["model=self_forcing_wan", "model.pretrained=random-init:wan21_1_3b", "model.stream.checkpoint=null",
                    "model.stream.lora_checkpoint=null"])
    with fake_mode():
        pipe = build_pipeline(cfg.model)
        adapter = StreamAdapter(pipe)
        params = sum(p.numel() for p in adapter.pipe.transformer.parameters())
    assert isinstance(pipe, StreamingWanPipeline) and params == pytest.approx(1.42e9, rel=0.03)
    assert adapter.num_chunks(81) == 7
    c = adapter.config
    assert (c.block_frames, c.sink_frames, c.window_frames, c.cache_frames, c.recache) == (3, 0, None, None, False)
    assert adapter.pipe.transformer.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert next(adapter.pipe.vae.parameters()).dtype == torch.float32  # model.vae_dtype


def test_results_of_real_inputs_stay_real_when_small_and_fake_when_large():
    """Under fake tensors an op on real inputs alone (bookkeeping) runs real when its result is small, so code can
    read it back, and stays fake when large: a streaming frame mask expanded to a real-size run's tokens (65,520² at
    Self-Forcing's size) is only computed with, and made real it would take that memory on the planning machine. An
    op whose shape depends on the data (``nonzero``) runs real. The large one is still planned (tracked). Each runs
    real once at most: an in-place op on a real tensor is applied once, inside ``_real()`` too."""
    from torch._subclasses.fake_tensor import FakeTensor

    from flowgrpo.planner import _real

    tracker = MemoryTracker()
    tracker.small_real = 65536
    with fake_mode(), tracker:
        frames = torch.ones(4, 4, dtype=torch.bool).tril()  # a frame mask: small, real
        assert not isinstance(frames, FakeTensor) and int(frames.sum(-1).max()) == 4
        rows = frames.repeat_interleave(256, 0)  # 4,096 elements: real
        tokens = rows.repeat_interleave(256, 1)  # 1,048,576: fake
        assert not isinstance(rows, FakeTensor) and isinstance(tokens, FakeTensor) and tokens.shape == (1024, 1024)
        assert tracker.peak >= 1024 * 1024
        where = frames.nonzero()
        assert not isinstance(where, FakeTensor) and where.shape == (10, 2)
        counts = torch.zeros(3)
        counts.add_(1)
        with _real():
            counts.add_(1)
        assert counts.tolist() == [2.0, 2.0, 2.0]


def test_tracker_counts_host_copies_apart_from_the_gpu():
    """A storage made in host memory (what ``flowgrpo.offload`` reports to a plan) is counted apart from the GPU's
    memory and its categories, its peak kept per phase; freeing it frees the host's count; one moved there (joined
    rows) leaves the GPU's count."""
    from flowgrpo.offload import observe_host_copies, to_device, to_host

    tracker = MemoryTracker()
    with tracker, observe_host_copies(tracker.to_host, scope=lambda: tracker.labelled("host")):
        a = torch.zeros(256)  # 1 KiB
        tracker.reset_peak()
        b = to_host(a)  # a copy, although both live on the CPU: the plan counts it on the host, made there
        assert b.data_ptr() != a.data_ptr() and (tracker.current, tracker.host, tracker.host_peak) == (1024, 1024, 1024)
        assert tracker.peak == 1024  # never counted on the GPU, not even while it was being made
        assert sum(tracker.by_category.values()) == tracker.current
        del a
        c = to_device(b, "cpu")  # brought back for the work that reads it: counted on the GPU again
        assert c.data_ptr() != b.data_ptr() and (tracker.current, tracker.host) == (1024, 1024)
        del b
        assert (tracker.host, tracker.host_peak) == (0, 1024)
        tracker.reset_peak()
        assert tracker.host_peak == 0 and tracker.current == 1024
        d = torch.ones(256)
        tracker.to_host(d)
        assert (tracker.current, tracker.host) == (1024, 1024) and sum(tracker.by_category.values()) == 1024
    assert to_host(c) is c  # no observer, on the CPU: nothing to copy


@pytest.mark.slow
def test_offloaded_context_leaves_the_gpu_for_host_memory():
    """trainer.offload_kept_context=true planned: the trained blocks' caches are counted in host memory from the
    rollout to the update, the rollout's GPU peak falls by at least the share they held there, the update brings a
    micro-batch's share back, and the computation (FLOPs) is the same."""
    overrides, frames, switches, _ = STREAMS["stream_grpo"]
    base = [*overrides, f"model.num_frames={frames}", "trainer.prompts_per_iteration=1",
            "trainer.gradient_accumulation_steps=1"]
    kept, offloaded = (plan_run(_compose([*base, f"trainer.offload_kept_context={o}"]), num_processes=1,
                                switch_frames=switches, phases=("rollout", "update")) for o in ("false", "true"))
    (r0, u0), (r1, u1) = kept.phases, offloaded.phases
    assert r0.host_bytes == u0.host_bytes == 0 < r1.host_bytes
    assert u1.host_bytes >= r1.host_bytes * 0.99  # still held while the update reads it
    assert r1.peak_bytes < r0.peak_bytes and u1.peak_bytes <= u0.peak_bytes
    assert r0.flops == r1.flops and u0.flops == u1.flops
    assert "host" in r1.row() and "host" not in r0.row()
