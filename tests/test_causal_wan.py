"""CausalWan: KV-cached streaming over diffusers' Wan equals the full forward under the equivalent frame mask.

Float64 on a tiny random Wan whose weights are scaled up so every layer matters; tolerances 1e-10 where the two
computations are the same arithmetic in a different order, negative controls shown to differ by far more.
"""

import pytest
import torch
from diffusers import WanTransformer3DModel

from flowgrpo.models import CausalWan
from flowgrpo.models.causal_wan import (_Call, _apply_rope, _frame_attention, _gathers_frames, _rope_rotation, _rotate,
                                       _slot_runs, stream_mask, teacher_forcing_mask)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

C, H, W = 4, 4, 4          # latent channels, height, width: 2x2 patches → 4 tokens per frame
TIGHT = 1e-10


def tiny_wan(seed=0, rope_max_seq_len=64, layers=3):
    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=C, out_channels=C,
        text_dim=16, freq_dim=32, ffn_dim=48, num_layers=layers, rope_max_seq_len=rope_max_seq_len,
    ).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, C, 8, H, W, generator=g, dtype=torch.float64)        # 8 latent frames
    text = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    return x, text


def t_(batch, value):
    return torch.full((batch,), float(value), dtype=torch.float64)


def diff(a, b):
    return (a - b).abs().max().item()


def stream(wan, x, t, text, block):
    """Block by block: read the cache at t, then write the block (at the same t, as the full forward sees it)."""
    outs = []
    for s in range(0, x.shape[2], block):
        part = x[:, :, s:s + block]
        outs.append(wan(part, t, text, frame_offset=s))
        wan.write(part, text, frame_offset=s, timestep=t)
    return torch.cat(outs, 2)


@torch.no_grad()
def test_cached_stream_equals_block_causal_full_forward_and_negative_controls(data, monkeypatch):
    x, text = data
    wan = CausalWan(tiny_wan(), block_frames=2)
    t = t_(2, 600)
    full = wan.full(x, t, text, mask=stream_mask(8, 2))
    assert diff(stream(wan, x, t, text, 2), full) < TIGHT
    assert wan.cache.positions == list(range(8))
    # without the mask the full forward is bidirectional: far from the causal one
    assert diff(wan.full(x, t, text, mask=torch.ones(8, 8, dtype=torch.bool)), full) > 1e-2
    # forgetting the frame offset (every block roped as frames 0, 1) breaks the equality
    wan.reset()
    monkeypatch.setattr(wan, "_positions", lambda offset, frames: torch.arange(frames))
    assert diff(stream(wan, x, t, text, 2), full) > 1e-3


@torch.no_grad()
def test_clean_context_writes_then_noisy_block_equals_per_frame_timestep_forward(data):
    """Self-Forcing's semantics: context written at t=0, current block read at t == one forward with per-frame
    timesteps [0 ... 0, t t] under the block-causal mask."""
    x, text = data
    wan = CausalWan(tiny_wan(), block_frames=2)
    per_frame = torch.zeros(2, 8, dtype=torch.float64)
    per_frame[:, 6:] = torch.tensor([[450.0], [800.0]])          # two rows, two timesteps
    full = wan.full(x, per_frame, text, mask=stream_mask(8, 2))[:, :, 6:]
    for s in range(0, 6, 2):
        wan.write(x[:, :, s:s + 2], text, frame_offset=s)          # context_sigma 0: timestep 0
    out = wan(x[:, :, 6:], per_frame[:, 6], text, frame_offset=6)
    assert diff(out, full) < TIGHT


@torch.no_grad()
def test_teacher_forcing_sequence_trains_what_streaming_samples(data):
    """[clean; noisy] with the teacher-forcing mask: every noisy block's output == streaming's read of that block
    over the clean write-pass cache, each block at its own timestep."""
    x, text = data
    g = torch.Generator().manual_seed(3)
    noisy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    t_block = torch.tensor([[900.0, 300.0, 650.0, 100.0], [50.0, 999.0, 400.0, 700.0]], dtype=torch.float64)
    for sink, window in ((0, None), (2, 4)):
        wan = CausalWan(tiny_wan(), block_frames=2, sink_frames=sink, window_frames=window)
        per_frame = torch.cat([torch.zeros(2, 8, dtype=torch.float64), t_block.repeat_interleave(2, 1)], 1)
        mask = teacher_forcing_mask(8, 2, sink_frames=sink, window_frames=window)
        full = wan.full(torch.cat([x, noisy], 2), per_frame, text, mask=mask, frame_positions=list(range(8)) * 2)
        for s in range(0, 8, 2):
            wan.write(x[:, :, s:s + 2], text, frame_offset=s)
        reads = [wan(noisy[:, :, s:s + 2], t_block[:, s // 2], text, frame_offset=s) for s in range(0, 8, 2)]
        assert diff(torch.cat(reads, 2), full[:, :, 8:]) < TIGHT, (sink, window)
        # the clean half is what the write passes computed (their keys are the cache's)
        assert diff(wan.full(x, torch.zeros(2, 8, dtype=torch.float64), text, mask=stream_mask(8, 2, sink_frames=sink,
                    window_frames=window)), full[:, :, :8]) < TIGHT


@torch.no_grad()
def test_sink_and_rolling_window_equal_cache_eviction(data):
    x, text = data
    t = t_(2, 600)
    mask = stream_mask(8, 2, sink_frames=2, window_frames=4)
    # the block [6, 8) attends to the sink block 0, 1 and the window 4..7 (its own block included)
    assert mask[6].tolist() == [True, True, False, False, True, True, True, True]
    wan = CausalWan(tiny_wan(), block_frames=2, sink_frames=2, window_frames=4, cache_frames=6)
    full = wan.full(x, t, text, mask=mask)
    assert diff(stream(wan, x, t, text, 2), full) < TIGHT
    assert wan.cache.positions == [0, 1, 4, 5, 6, 7]            # evicted down to sink + newest 4, never re-roped
    assert wan.cache.keys[0].shape[1] == 6
    # the window matters: the same stream without it differs
    plain = CausalWan(tiny_wan(), block_frames=2)
    assert diff(stream(plain, x, t, text, 2), full) > 1e-3


@torch.no_grad()
def test_routed_selection_equals_custom_mask_shared_and_per_row(data):
    """The block at frame 6 attends to the sink block (0, 1), a routed older frame and the nearest frame (5); other blocks
    are unrouted. Per-row routes (a different older frame per batch row) equal per-row masked forwards."""
    x, text = data
    t = t_(2, 600)
    wan = CausalWan(tiny_wan(), block_frames=2, sink_frames=2, window_frames=4)

    def routed_mask(older):
        mask = stream_mask(8, 2, sink_frames=2, window_frames=4)
        mask[6:8, :6] = False
        mask[6:8, [0, 1, older, 5]] = True
        return mask

    def route_for(older):
        return lambda offset, frames, cached: [0, 1, older, 5] if offset == 6 else wan.context_positions(offset, frames)

    with wan.routed(route_for(2)):
        streamed = stream(wan, x, t, text, 2)
    assert diff(streamed, wan.full(x, t, text, mask=routed_mask(2))) < TIGHT
    unrouted = wan.full(x, t, text, mask=stream_mask(8, 2, sink_frames=2, window_frames=4))
    assert diff(streamed, unrouted) > 1e-3

    def per_row(offset, frames, cached):
        if offset != 6:
            return torch.tensor([wan.context_positions(offset, frames)] * 2)
        return torch.tensor([[0, 1, 2, 5], [0, 1, 3, 5]])

    wan.reset()
    with wan.routed(per_row):
        streamed = stream(wan, x, t, text, 2)
    for row, older in ((0, 2), (1, 3)):
        ref = wan.full(x[row:row + 1], t[:1], text[row:row + 1], mask=routed_mask(older))
        assert diff(streamed[row:row + 1], ref) < TIGHT
    with wan.routed(lambda offset, frames, cached: [offset]), pytest.raises(ValueError, match="route picked"):
        wan(x[:, :, :2], t, text, frame_offset=2)


@torch.no_grad()
def test_context_read_by_slices_or_by_index_equals_the_mask(data):
    """A selection in a few contiguous slot ranges is read as views of the cache, a fragmented or unordered one by
    index: both attend exactly the chosen frames."""
    assert _slot_runs(torch.tensor([0, 2, 3, 4])) == [(0, 1), (2, 5)]
    assert _slot_runs(torch.tensor([0, 2, 4, 6, 8])) is None                     # more than 4 ranges
    assert _slot_runs(torch.tensor([3, 0])) is None                              # unordered
    assert _slot_runs(torch.tensor([[0, 1], [0, 2]])) is None                    # per row
    x, text = data
    t = t_(2, 500)
    for older in ([0, 1, 2, 3, 4, 5, 6], [0, 2, 4, 6], [0, 1, 3, 5, 6], [6, 0, 3]):
        wan = CausalWan(tiny_wan(), block_frames=1)
        mask = stream_mask(8, 1)
        mask[7, :7] = False
        mask[7, older] = True
        with wan.routed(lambda offset, frames, cached: older if offset == 7 else range(offset)):
            streamed = stream(wan, x, t, text, 1)
        assert diff(streamed, wan.full(x, t, text, mask=mask)) < TIGHT, older


@pytest.mark.parametrize("per_row", [False, True])
def test_frame_gathered_attention_equals_masked_attention_with_its_gradients(per_row):
    """On the CPU a full-mode self-attention whose frames each see few others runs per query frame over the key
    frames gathered (a streaming or teacher-forcing mask): the same outputs and gradients as SDPA under the mask."""
    torch.manual_seed(0)
    B, F, T, H, D = 3, 12, 4, 2, 8
    rows = [teacher_forcing_mask(6, 1, sink_frames=1, window_frames=2),
            teacher_forcing_mask(6, 2, sink_frames=1, window_frames=2),
            stream_mask(12, 1, sink_frames=1, window_frames=3)]
    mask = torch.stack(rows) if per_row else rows[0]
    q, k, v = (torch.randn(B, F * T, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    call = _Call(torch.arange(F), mask=mask, tokens_per_frame=T)
    width = int(mask.sum(-1).max())                 # the most frames a query frame sees: 3 or 4 of 12
    assert _gathers_frames(call, q) and call.frame_keys[0].shape[-1] == width <= F // 3
    out = _frame_attention(q, k, v, call)
    frames = mask if mask.ndim == 3 else mask[None]
    dense_mask = frames.repeat_interleave(T, 1).repeat_interleave(T, 2)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           attn_mask=dense_mask).transpose(1, 2)
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-12)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(got, want))
    # a mask where frames see more than a third of the others keeps the masked kernel
    dense = _Call(torch.arange(F), mask=torch.ones(F, F, dtype=torch.bool).tril(), tokens_per_frame=T)
    assert not _gathers_frames(dense, q)


def test_complex_rope_is_diffusers_rotation():
    g = torch.Generator().manual_seed(0)
    angles = torch.rand(1, 6, 1, 4, generator=g, dtype=torch.float64) * 6
    cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)   # Wan's interleaved tables
    x = torch.randn(2, 6, 3, 8, generator=g, dtype=torch.float64)
    assert diff(_rotate(x, _rope_rotation(cos, sin)), _apply_rope(x, cos, sin)) < 1e-15
    half = x.to(torch.bfloat16)                 # low-precision inputs rotate in the tables' float32, as diffusers does
    a, b = _rotate(half, _rope_rotation(cos.float(), sin.float())), _apply_rope(half, cos.float(), sin.float())
    assert a.dtype == torch.bfloat16 and diff(a.double(), b.double()) <= 2 ** -7 * x.abs().max().item()


@torch.no_grad()
def test_save_restore_and_batched_fork_reproduce_each_branch(data):
    x, text = data
    wan = CausalWan(tiny_wan(), block_frames=2, sink_frames=2, window_frames=4)
    for s in range(0, 4, 2):
        wan.write(x[:, :, s:s + 2], text, frame_offset=s)
    prefix = wan.save_state()
    g = torch.Generator().manual_seed(5)
    branches = [torch.randn(2, C, 2, H, W, generator=g, dtype=torch.float64) for _ in range(3)]
    one_by_one = []
    for b in branches:                                   # restore, continue two blocks, compare
        wan.restore_state(prefix)
        wan.write(b, text, frame_offset=4)
        one_by_one.append(wan(x[:, :, 6:], t_(2, 300), text, frame_offset=6))
    assert wan.cache.positions == [0, 1, 2, 3, 4, 5]
    wan.restore_state(prefix)
    assert wan.cache.positions == [0, 1, 2, 3] and prefix.positions == [0, 1, 2, 3]   # the snapshot is intact
    # all branches at once: the prefix repeated per branch (rows: sample-major, branch-minor)
    wan.restore_state(prefix.repeat_interleave(3))
    stacked = torch.stack(branches, 1).flatten(0, 1)
    rep_text = text.repeat_interleave(3, 0)
    wan.write(stacked, rep_text, frame_offset=4)
    batched = wan(x[:, :, 6:].repeat_interleave(3, 0), t_(6, 300), rep_text, frame_offset=6).unflatten(0, (2, 3))
    for k in range(3):
        assert diff(batched[:, k], one_by_one[k]) < TIGHT
    assert diff(one_by_one[0], one_by_one[1]) > 1e-3       # the branches did differ
    with pytest.raises(ValueError, match="rows"):
        wan(x[:1, :, 6:], t_(1, 300), text[:1], frame_offset=6)


@torch.no_grad()
def test_prompt_switch_with_recache_equals_teacher_forcing_with_per_frame_prompts(data):
    """Blocks 0-1 under prompt A, a switch at frame 4: the sink block keeps A, the window before the switch is
    re-written under B, blocks 2-3 are read under B. One full forward over [sink, recached window, segment B;
    noisy segment B] with text_frames (sink: A, the rest: B) gives the same outputs."""
    x, text_a = data
    text_b = torch.randn(text_a.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    wan = CausalWan(tiny_wan(), block_frames=2, sink_frames=2, window_frames=4)
    g = torch.Generator().manual_seed(11)
    noisy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    t_block = torch.tensor([[300.0, 800.0], [650.0, 100.0]], dtype=torch.float64)   # blocks 2, 3 per row
    for s in (0, 2):
        wan.write(x[:, :, s:s + 2], text_a, frame_offset=s)
    before = wan.save_state()
    r = wan.recache_start(4)
    assert r == 2                                            # the window before the switch, after the sink
    wan.recache(x[:, :, r:4], text_b, frame_offset=r)
    assert wan.cache.positions == [0, 1, 2, 3]
    for layer in range(3):                                   # the sink is kept, the window rewritten
        assert diff(wan.cache.keys[layer][:, :2], before.keys[layer][:, :2]) == 0
    assert diff(wan.cache.keys[2][:, 2:], before.keys[2][:, 2:]) > 1e-3     # (layer 0 keys precede cross-attention)
    reads = []
    for k, s in enumerate((4, 6)):
        reads.append(wan(noisy[:, :, s:s + 2], t_block[:, k], text_b, frame_offset=s))
        wan.write(x[:, :, s:s + 2], text_b, frame_offset=s)
    clean_pos, noisy_pos = [0, 1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7]
    seq = torch.cat([x, noisy[:, :, 4:]], 2)
    per_frame = torch.cat([torch.zeros(2, 8, dtype=torch.float64), t_block.repeat_interleave(2, 1)], 1)
    mask = teacher_forcing_mask(clean_pos, 2, sink_frames=2, window_frames=4, noisy=noisy_pos)
    full = wan.full(seq, per_frame, torch.cat([text_a, text_b], 1), mask=mask,
                    frame_positions=clean_pos + noisy_pos, text_frames=[0, 0] + [1] * 10)
    assert diff(torch.cat(reads, 2), full[:, :, 8:]) < TIGHT
    # negative controls: the whole sequence under B (the sink's prompt forgotten), or no re-cache at all
    wrong = wan.full(seq, per_frame, text_b, mask=mask, frame_positions=clean_pos + noisy_pos)
    assert diff(wrong[:, :, 8:], full[:, :, 8:]) > 1e-4
    wan.restore_state(before)
    stale = wan(noisy[:, :, 4:6], t_block[:, 0], text_b, frame_offset=4)
    assert diff(stale, reads[0]) > 1e-4


def test_gradient_checkpointing_with_cache_matches_plain_backward(data):
    """Two cached reads at different offsets, one backward: recomputed blocks see the context of their own call,
    and never write."""
    x, text = data
    grads = []
    for checkpointing in (False, True):
        model = tiny_wan()
        if checkpointing:
            model.enable_gradient_checkpointing()
        model.train()
        wan = CausalWan(model, block_frames=2, sink_frames=2, window_frames=4)
        wan.write(x[:, :, :2], text, frame_offset=0)
        a = wan(x[:, :, 2:4], t_(2, 500), text, frame_offset=2)
        wan.write(x[:, :, 2:4], text, frame_offset=2)
        b = wan(x[:, :, 4:6], t_(2, 200), text, frame_offset=4)
        positions = list(wan.cache.positions)
        (a.square().mean() + b.sin().mean()).backward()
        assert wan.cache.positions == positions == [0, 1, 2, 3]
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 0
    assert diff(grads[0], grads[1]) < TIGHT


@torch.no_grad()
def test_state_dict_unchanged_and_plain_forward_outside_a_stream(data):
    x, text = data
    reference = tiny_wan()
    model = tiny_wan()
    keys = list(model.state_dict())
    wan = CausalWan(model, block_frames=2)
    assert list(model.state_dict()) == keys
    t = t_(2, 700)
    plain = reference(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    assert diff(model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0], plain) == 0
    # the full forward with an all-True mask is the same bidirectional model
    assert diff(wan.full(x, t, text, mask=torch.ones(8, 8, dtype=torch.bool)), plain) < TIGHT
    fresh = tiny_wan(seed=4)
    fresh.load_state_dict(model.state_dict())
    assert diff(fresh(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0], plain) == 0


@torch.no_grad()
def test_streams_past_rope_table_length(data):
    """Positions beyond rope_max_seq_len: the table grows and equals a model built with a longer one."""
    x, text = data
    short, long = CausalWan(tiny_wan(rope_max_seq_len=8), block_frames=2), CausalWan(
        tiny_wan(rope_max_seq_len=64), block_frames=2)
    t = t_(2, 400)
    for wan in (short, long):
        for s in (0, 10):
            wan.write(x[:, :, :2], text, frame_offset=s)
    a = short(x[:, :, 2:4], t, text, frame_offset=20)
    b = long(x[:, :, 2:4], t, text, frame_offset=20)
    assert short.transformer.rope.max_seq_len >= 22
    assert diff(a, b) < TIGHT


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="window_frames"):
        CausalWan(tiny_wan(), block_frames=3, window_frames=2)
    with pytest.raises(ValueError, match="cache_frames"):
        CausalWan(tiny_wan(), block_frames=1, sink_frames=2, window_frames=4, cache_frames=5)
    with pytest.raises(TypeError, match="WanTransformer3DModel"):
        CausalWan(torch.nn.Linear(2, 2))
    wan = CausalWan(tiny_wan(), block_frames=1, context_sigma=0.05)
    with pytest.raises(ValueError, match="noise"):
        wan.write(torch.zeros(1, C, 1, H, W, dtype=torch.float64), torch.zeros(1, 5, 16, dtype=torch.float64),
                  frame_offset=0)


@torch.no_grad()
def test_per_row_masks_and_prompts_equal_row_by_row_forwards(data):
    """The batched training forward: each row its own frame mask and its own per-frame prompts (padded prompt
    slots unread) == each row alone."""
    x, text_a = data
    text_b = torch.randn(text_a.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    wan = CausalWan(tiny_wan(), block_frames=2, sink_frames=2, window_frames=4)
    t = torch.rand(2, 8, generator=torch.Generator().manual_seed(13), dtype=torch.float64) * 1000
    masks = torch.stack([stream_mask(8, 2), stream_mask(8, 2, sink_frames=2, window_frames=4)])
    frames = torch.tensor([[0] * 8, [0, 0, 0, 0, 1, 1, 1, 1]])
    junk = torch.full_like(text_a, 1e3)                    # a third prompt slot nobody reads
    texts = torch.cat([text_a, text_b, junk], 1)
    both = wan.full(x, t, texts, mask=masks, text_frames=frames, prompt_tokens=text_a.shape[1])
    for row in range(2):
        alone = wan.full(x[row:row + 1], t[row:row + 1], texts[row:row + 1, :10], mask=masks[row],
                         text_frames=frames[row], prompt_tokens=5)
        assert diff(both[row:row + 1], alone) < TIGHT
    assert diff(both[1:], wan.full(x[1:], t[1:], text_a[1:], mask=masks[1])) > 1e-4


@torch.no_grad()
def test_write_pass_stops_after_the_last_layer_stored_its_keys(data):
    x, text = data
    wan = CausalWan(tiny_wan(), block_frames=2)
    ran = []
    last = wan.transformer.blocks[-1]
    hooks = [m.register_forward_hook(lambda *a, name=name: ran.append(name))
             for name, m in (("last_ffn", last.ffn), ("head", wan.transformer.proj_out))]
    wan.write(x[:, :, :2], text, frame_offset=0)
    assert ran == [] and all(k is not None for k in wan.cache.keys)
    wan(x[:, :, 2:4], t_(2, 300), text, frame_offset=2)        # a denoising read runs the whole model
    assert ran == ["last_ffn", "head"]
    for h in hooks:
        h.remove()


@torch.no_grad()
def test_write_pass_runs_to_the_end_when_a_hook_expects_the_forward_to_return(data):
    x, text = data
    reference = CausalWan(tiny_wan(), block_frames=2)
    reference.write(x[:, :, :2], text, frame_offset=0)
    wan = CausalWan(tiny_wan(), block_frames=2)
    last = wan.transformer.blocks[-1]
    for module in (wan.transformer, last, last.attn1):
        returned = []
        hook = module.register_forward_hook(lambda *a: returned.append(True))
        wan.reset()
        wan.write(x[:, :, :2], text, frame_offset=0)
        hook.remove()
        assert returned == [True], type(module).__name__
        assert all(torch.equal(a, b) for a, b in zip(wan.cache.keys, reference.cache.keys))
    last.attn1._hf_hook = object()  # accelerate's hooks (CPU offload) wrap forward and restore after it returns
    ran = []
    hook = last.ffn.register_forward_hook(lambda *a: ran.append(True))
    wan.reset()
    wan.write(x[:, :, :2], text, frame_offset=0)
    assert ran == [True]
    del last.attn1._hf_hook
    wan.reset()
    wan.write(x[:, :, :2], text, frame_offset=0)
    assert ran == [True]  # no hook on the cut modules: stops early again
    hook.remove()
