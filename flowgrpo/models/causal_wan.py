r"""Causal streaming Wan: block-by-block generation with a KV cache, over diffusers' ``WanTransformer3DModel``.

A streaming video model generates a video a few latent frames (a *block*) at a time; each block attends to itself
and to the keys and values of blocks generated before it, kept in a cache, so the cost per frame does not grow
with the stream. Self-Forcing (arXiv 2506.08009; github.com/guandeh17/Self-Forcing), CausVid (arXiv 2412.07772)
and LongLive (arXiv 2509.22622, github.com/NVlabs/LongLive) run Wan 2.1 this way; diffusers 0.42 has neither a
causal mode nor a cache for Wan. :class:`CausalWan` adds both to an existing transformer **without changing its
weights or state dict**: a Wan checkpoint (or our tiny one) loads as usual and is then made causal in place.

How (the design, and why):

- **RoPE with absolute frame positions.** The model's rotary embedding is replaced by one that places the frames
  of each forward at given absolute positions (``frame_offset``, or any list: a ``[clean; noisy]`` training
  sequence repeats them). Its tables are non-persistent buffers, so the state dict is unchanged, and they grow on
  demand (a position's frequencies do not depend on the table length), so a stream may run past
  ``rope_max_seq_len``.
- **The cache holds post-RoPE keys** with the absolute frame position of every cached frame. Keys are never
  re-roped: a sink frame stays at position 0 however far the stream goes, and a routed older frame keeps its
  true distance, as in every reference implementation. Frames are addressed by position, never by buffer slot.
- **What a block attends to**, for a block covering frames ``[s, e)``: itself, plus the cached frames at positions
  ``p < s`` with ``p < sink_frames`` or ``p >= e - window_frames`` (``window_frames`` counts the newest frames
  including the block itself; ``None`` keeps every earlier frame: plain block-causal attention). A *route*
  replaces that rule by any selection of cached positions (per batch row if wanted): the hook KV-cache routing
  exploration goes through. The same rule written as a mask (:func:`stream_mask`) gives a full forward equal to
  the streamed one, which the tests check to float64 precision.
- **Writes are separate, no-grad passes** (:meth:`CausalWan.write`): after a block is generated, its clean latents
  (timestep 0, or ``context_sigma`` > 0 with given noise; one choice, the same in training and sampling) run
  through the model once and every self-attention layer stores its keys and values (the pass ends there: the last
  layer's attention output and MLP and the output head are never computed). Denoising forwards only read.
  Cache updates are functional (new tensors, never in-place), so :meth:`CausalWan.save_state` is free and a
  prefix can be branched G ways (:meth:`CacheState.repeat_interleave` for a batched fork).
- **Gradient checkpointing is safe**: everything a forward reads (positions, mask, the selected cache frames) is
  fixed when the forward starts and travels with the rotary embedding, which diffusers hands unchanged to every
  block, also when a checkpointed block is recomputed in backward; a recomputed block never writes.
- Text cross-attention is untouched: a prompt switch is a different ``encoder_hidden_states``, plus
  :meth:`CausalWan.recache`, which re-encodes the newest frames under the new prompt (LongLive's re-cache) and
  keeps the sink frames as they were.

Without a stream call in progress the patched transformer is the plain bidirectional Wan: its own forward, and
so ``WanPipeline``, behave exactly as before.

Example:
    ```py
    >>> import torch
    >>> from flowgrpo.models import CausalWan, build_tiny_pipeline
    >>> wan = CausalWan(build_tiny_pipeline("wan").transformer, block_frames=1, sink_frames=1, window_frames=3)
    >>> text = torch.randn(1, 8, 32)
    >>> x = torch.randn(1, 16, 1, 4, 4)                     # one latent frame: the block at position 0
    >>> v = wan(x, torch.tensor([1000.0]), text, frame_offset=0)
    >>> wan.write(x - v, text, frame_offset=0)              # its clean estimate goes into the cache
    >>> wan.cache.positions
    [0]
    ```
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from diffusers import WanTransformer3DModel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, WanRotaryPosEmbed, _get_qkv_projections

__all__ = ["CausalWan", "CacheState", "stream_mask", "teacher_forcing_mask", "RouteFn"]

#: ``route(frame_offset, num_frames, cached_positions) -> positions``: the cached absolute frame positions a block
#: starting at ``frame_offset`` attends to (besides itself): a sequence of ints (every row the same), or a
#: ``[B, n]`` LongTensor (one selection per batch row, the same count in each).
RouteFn = Callable[[int, int, list], "Sequence[int] | torch.Tensor"]


# --------------------------------------------------------------------------------------------------- the cache


@dataclass
class CacheState:
    """The KV cache of every self-attention layer: post-RoPE keys and values of the cached frames.

    Attributes:
        keys, values: per layer ``[B, n, tokens_per_frame, heads, head_dim]`` (or ``None`` while empty).
        positions: the absolute frame position of each of the ``n`` cached frames, ascending.
    """

    keys: list
    values: list
    positions: list = field(default_factory=list)

    @classmethod
    def empty(cls, num_layers: int) -> "CacheState":
        return cls([None] * num_layers, [None] * num_layers, [])

    @property
    def batch_size(self) -> int | None:
        return None if self.keys[0] is None else self.keys[0].shape[0]

    def copy(self) -> "CacheState":
        """A snapshot: tensors are shared (cache updates never write in place), lists are not."""
        return CacheState(list(self.keys), list(self.values), list(self.positions))

    def map_tensors(self, fn) -> "CacheState":
        """The cache with ``fn`` applied to every key and value tensor (moved, copied, indexed)."""
        return CacheState([None if t is None else fn(t) for t in self.keys],
                          [None if t is None else fn(t) for t in self.values], list(self.positions))

    def repeat_interleave(self, repeats: int) -> "CacheState":
        """Each batch row ``repeats`` times in a row (fork a batch of prefixes into groups of branches)."""
        return self.map_tensors(lambda t: t.repeat_interleave(repeats, dim=0))

    def index_rows(self, rows) -> "CacheState":
        """The cache of a subset of batch rows."""
        return self.map_tensors(lambda t: t[rows])

    def index_frames(self, slots: Sequence[int]) -> "CacheState":
        """The cache of a subset of cached frames (by slot, kept in position order)."""
        idx = torch.as_tensor(list(slots), dtype=torch.long)
        out = self.map_tensors(lambda t: t[:, idx.to(t.device)])
        out.positions = [self.positions[i] for i in idx.tolist()]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)


@dataclass
class _Call:
    """What one forward of the patched transformer reads; fixed when it starts (see the module docstring)."""

    positions: torch.Tensor                 # [F] absolute frame position of each input frame
    mask: torch.Tensor | None = None        # full mode: bool [F, F] frame-level attention mask
    cache: CacheState | None = None         # cache mode: the cache read
    select: torch.Tensor | None = None      # cache mode: slots of ``cache`` attended, [n] or [B, n]
    runs: list | None = None                # cache mode: a 1-D ``select`` as ascending ``(start, stop)`` slot ranges
    write: CacheState | None = None         # cache mode: the cache being written (None: read only)
    keep: torch.Tensor | None = None        # write: the slots of ``cache`` kept, in the new order with the new frames
    new_positions: list | None = None       # write: positions after the write
    order: torch.Tensor | None = None       # write: permutation putting kept + new frames in position order (None: identity)
    tokens_per_frame: int = 0
    rotation: torch.Tensor | None = None    # the RoPE tables as complex rotations, built by the first layer
    token_mask: torch.Tensor | None = None  # full mode: ``mask`` expanded to tokens, built by the first layer
    frame_keys: tuple | None = None         # full mode on the CPU: each frame's key frames (_frame_keys), or (None, None)
    text_frames: torch.Tensor | None = None  # full mode: [F] or [B, F], the prompt of the concatenated text a frame reads
    prompt_tokens: int = 0                   # full mode with text_frames: tokens per prompt
    text_mask: torch.Tensor | None = None    # ``text_frames`` as a cross-attention mask, built by the first layer
    written: set = field(default_factory=set)
    stop_after_write: bool = False          # write: end the forward once the last layer has stored its keys

    def mark_written(self, layer: int) -> bool:
        """True the first time ``layer`` runs in this call; False when a checkpointed block is recomputed."""
        if layer in self.written:
            return False
        self.written.add(layer)
        return True


class _WriteDone(Exception):
    """Raised by the last self-attention layer of a write pass once its keys and values are stored: nothing after
    them (that layer's attention, cross-attention and MLP, the output head) is read by anyone."""


class _CallSlot:
    """The call the blocks are executing: set by each block's self-attention from the call it was handed (also when
    a checkpointed block is recomputed), read by that block's cross-attention, which gets no rotary embedding."""

    call: _Call | None = None


class _StreamRope(WanRotaryPosEmbed):
    """Wan's rotary embedding at explicit absolute frame positions; hands the current stream call to the layers."""

    def __init__(self, original: WanRotaryPosEmbed, theta: float = 10000.0):
        torch.nn.Module.__init__(self)
        self.attention_head_dim = original.attention_head_dim
        self.patch_size = original.patch_size
        self.max_seq_len = original.max_seq_len
        self.t_dim, self.h_dim, self.w_dim = original.t_dim, original.h_dim, original.w_dim
        self.theta = theta
        self.register_buffer("freqs_cos", original.freqs_cos, persistent=False)
        self.register_buffer("freqs_sin", original.freqs_sin, persistent=False)
        self.call: _Call | None = None

    def _grow(self, length: int) -> None:
        """Extend the tables to ``length`` positions (each row depends only on its position)."""
        cos, sin = [], []
        for dim in (self.t_dim, self.h_dim, self.w_dim):
            c, s = get_1d_rotary_pos_embed(dim, length, self.theta, use_real=True, repeat_interleave_real=True,
                                           freqs_dtype=torch.float64)
            cos.append(c)
            sin.append(s)
        like = self.freqs_cos
        self.freqs_cos = torch.cat(cos, dim=1).to(device=like.device, dtype=like.dtype)
        self.freqs_sin = torch.cat(sin, dim=1).to(device=like.device, dtype=like.dtype)
        self.max_seq_len = length

    def forward(self, hidden_states: torch.Tensor):
        call = self.call
        if call is None:
            return super().forward(hidden_states)
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        f, h, w = frames // p_t, height // p_h, width // p_w
        positions = call.positions.to(self.freqs_cos.device)
        if positions.numel() != f:
            raise ValueError(f"the stream call places {positions.numel()} frames but the input has {f}")
        if int(positions.max()) >= self.max_seq_len:
            self._grow(max(int(positions.max()) + 1, 2 * self.max_seq_len))
        split = [self.t_dim, self.h_dim, self.w_dim]
        tables = []
        for freqs in (self.freqs_cos, self.freqs_sin):
            t, hh, ww = freqs.split(split, dim=1)
            grid = torch.cat([
                t[positions].view(f, 1, 1, -1).expand(f, h, w, -1),
                hh[:h].view(1, h, 1, -1).expand(f, h, w, -1),
                ww[:w].view(1, 1, w, -1).expand(f, h, w, -1),
            ], dim=-1)
            tables.append(grid.reshape(1, f * h * w, 1, -1))
        call.tokens_per_frame = h * w
        return tables[0], tables[1], call


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Wan's interleaved-pair rotation, the arithmetic of diffusers' WanAttnProcessor.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _rope_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved (cos, sin) tables as one complex rotation per pair of channels: ``[1, S, 1, D/2]``."""
    return torch.complex(cos[..., 0::2].contiguous(), sin[..., 1::2].contiguous())


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """:func:`_apply_rope` as one complex product (channel pairs as complex numbers): the same products and sums,
    several times faster than the strided version for a stream's small calls."""
    real = rotation.real.dtype
    pairs = x.to(torch.promote_types(x.dtype, real)).unflatten(-1, (-1, 2))
    return torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * rotation).flatten(-2).type_as(x)


def _frame_mask(call: _Call, device: torch.device) -> torch.Tensor:
    """A full-mode call's frame mask on ``device`` as ``[B or 1, F, F]``."""
    mask = call.mask.to(device)
    return mask[None] if mask.ndim == 2 else mask


_ACCELERATOR_KERNELS = [0]


@contextmanager
def accelerator_attention():
    """Within it, full-mode self-attention takes the accelerator's path on the CPU too (the masked kernel, never
    :func:`_frame_attention`'s gathered keys): what a plan on CPU tensors of a GPU run must execute
    (``flowgrpo.planner``)."""
    _ACCELERATOR_KERNELS[0] += 1
    try:
        yield
    finally:
        _ACCELERATOR_KERNELS[0] -= 1


def _gathers_frames(call: _Call, query: torch.Tensor) -> bool:
    """Whether a full-mode self-attention runs as :func:`_frame_attention`: on the CPU, where SDPA under a mask
    computes every query-key pair, when each query frame sees at most a third of the frames (a streaming mask:
    sink + window). On an accelerator (or in :func:`accelerator_attention`) the masked kernel stays (gathering
    copies every key ``K`` times)."""
    if query.device.type != "cpu" or _ACCELERATOR_KERNELS[0]:
        return False
    if call.frame_keys is None:
        mask = _frame_mask(call, query.device)
        width = int(mask.sum(-1).max())
        call.frame_keys = (None, None) if 3 * width > mask.shape[-1] else _frame_keys(mask, width)
    return call.frame_keys[0] is not None


def _frame_keys(mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query frame of a frame mask ``[B or 1, F, F]``: the ``width`` key frames it may attend, ascending and
    padded (``[B or 1, F, width]`` long), and which of them are real (bool, same shape)."""
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices[..., :width]  # allowed frames first
    return order, mask.gather(-1, order)


def _frame_attention(query, key, value, call: _Call) -> torch.Tensor:
    """Masked self-attention over ``[B, S, H, D]`` (``S`` = frames × tokens per frame) computed per query frame over
    the key frames its mask allows (gathered), instead of over all ``S`` keys with the mask: the same keys, the same
    softmax, ``F / width`` times fewer products. Returns ``[B, S, H, D]``."""
    idx, valid = call.frame_keys
    B, S, H, D = query.shape
    T = call.tokens_per_frame
    F, W = S // T, idx.shape[-1]
    # the key frames of every query frame: one list for the batch, or one per row
    rows = torch.arange(B, device=query.device)[:, None, None] if idx.shape[0] > 1 else slice(None)
    index = idx if idx.shape[0] > 1 else idx[0]

    def gathered(t):                                          # [B, S, H, D] -> [B·F, H, W·T, D]
        return t.unflatten(1, (F, T))[rows, index].flatten(2, 3).flatten(0, 1).transpose(1, 2)

    q = query.unflatten(1, (F, T)).flatten(0, 1).transpose(1, 2)                 # [B·F, H, T, D]
    keep = valid.repeat_interleave(T, dim=-1).expand(B, F, W * T).reshape(B * F, 1, 1, W * T)
    out = torch.nn.functional.scaled_dot_product_attention(q, gathered(key), gathered(value), attn_mask=keep)
    return out.transpose(1, 2).unflatten(0, (B, F)).flatten(1, 2)                # [B, S, H, D]


class _CausalSelfAttnProcessor:
    """Wan's self-attention with a frame mask (full mode) or a KV cache (cache mode)."""

    def __init__(self, layer: int, slot: _CallSlot):
        self.layer, self.slot = layer, slot

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or getattr(attn, "add_k_proj", None) is not None:
            raise NotImplementedError("the causal processor is for Wan's text-to-video self-attention (attn1)")
        call = rotary_emb[2] if rotary_emb is not None and len(rotary_emb) == 3 else None
        self.slot.call = call
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if call is not None:
            if call.rotation is None:
                call.rotation = _rope_rotation(rotary_emb[0], rotary_emb[1])
            query, key = _rotate(query, call.rotation), _rotate(key, call.rotation)
        elif rotary_emb is not None:            # outside a stream: diffusers' arithmetic, unchanged
            query, key = _apply_rope(query, rotary_emb[0], rotary_emb[1]), _apply_rope(key, rotary_emb[0], rotary_emb[1])
        if call is not None and call.mask is not None and _gathers_frames(call, query):
            out = _frame_attention(query, key, value, call)
        else:
            mask = attention_mask
            if call is not None and call.mask is not None:
                if call.token_mask is None:
                    per = call.tokens_per_frame
                    frames = _frame_mask(call, query.device)                                # [B or 1, F, F]
                    call.token_mask = frames.repeat_interleave(per, 1).repeat_interleave(per, 2)[:, None]
                mask = call.token_mask
            elif call is not None and call.cache is not None:
                key, value = self._with_cache(call, key, value)
            out = dispatch_attention_fn(query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    @staticmethod
    def _merge(call: _Call, cached: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """The written cache tensor: the kept frames of ``cached`` and the ``new`` ones, in position order."""
        runs = _slot_runs(call.keep)
        kept = [cached[:, a:b] for a, b in runs] if runs is not None else [cached[:, call.keep.to(cached.device)]]
        merged = torch.cat([*kept, new], 1)
        if call.order is None:                  # new frames are the newest: already in position order
            return merged
        return merged[:, call.order.to(cached.device)]

    def _with_cache(self, call: _Call, key: torch.Tensor, value: torch.Tensor):
        li, per = self.layer, call.tokens_per_frame
        batch = key.shape[0]
        new_k = key.unflatten(1, (-1, per))      # [B, F, per, H, D]
        new_v = value.unflatten(1, (-1, per))
        cached_k, cached_v = call.cache.keys[li], call.cache.values[li]
        if cached_k is not None and cached_k.shape[0] != batch:
            raise ValueError(f"the KV cache holds {cached_k.shape[0]} rows but the input has {batch}: "
                             "restore or repeat the cache state for this batch")
        if call.write is not None and call.mark_written(li):
            # Detached: context never carries gradient into earlier blocks (a write pass runs without grad).
            k_all, v_all = new_k.detach(), new_v.detach()
            if cached_k is not None and call.keep.numel():
                k_all, v_all = (self._merge(call, old, new) for old, new in ((cached_k, k_all), (cached_v, v_all)))
            call.write.keys[li], call.write.values[li] = k_all, v_all
            if call.stop_after_write and li == len(call.write.keys) - 1:
                raise _WriteDone
        if cached_k is None or call.select is None or call.select.numel() == 0:
            return key, value
        if call.runs is not None:
            # Contiguous slot ranges are views of the cache: the one concatenation below is the only copy.
            ctx_k = [cached_k[:, a:b].flatten(1, 2) for a, b in call.runs]
            ctx_v = [cached_v[:, a:b].flatten(1, 2) for a, b in call.runs]
            return torch.cat([*ctx_k, key], 1), torch.cat([*ctx_v, value], 1)
        sel = call.select.to(cached_k.device)
        if sel.ndim == 1:
            ctx_k, ctx_v = cached_k[:, sel], cached_v[:, sel]
        else:
            rows = torch.arange(batch, device=sel.device)[:, None]
            ctx_k, ctx_v = cached_k[rows, sel], cached_v[rows, sel]
        return torch.cat([ctx_k.flatten(1, 2), key], 1), torch.cat([ctx_v.flatten(1, 2), value], 1)


class _SegmentedCrossAttnProcessor:
    """Wan's text cross-attention; in a full-mode call with ``text_frames``, each frame attends only the tokens of
    its own prompt among several concatenated ones (exactly a separate cross-attention per prompt: the softmax runs
    over that prompt's tokens alone). Used to train on streams whose prompt changes."""

    def __init__(self, slot: _CallSlot):
        self.slot, self.base = slot, WanAttnProcessor()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        call = self.slot.call
        if call is not None and call.text_frames is not None:
            if call.text_mask is None:
                owner = torch.arange(encoder_hidden_states.shape[1], device=hidden_states.device) // call.prompt_tokens
                frames = call.text_frames.to(hidden_states.device)
                frames = frames[None] if frames.ndim == 1 else frames                          # [B or 1, F]
                token_of = frames.repeat_interleave(call.tokens_per_frame, dim=1)              # [B or 1, S]
                call.text_mask = (token_of[:, :, None] == owner[None, None, :])[:, None]    # [B or 1, 1, S, P·L]
            attention_mask = call.text_mask
        return self.base(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


# ------------------------------------------------------------------------------------------------------ masks


def _slot_runs(select: torch.Tensor, max_runs: int = 4) -> list | None:
    """A 1-D slot selection as ascending ``(start, stop)`` ranges, or ``None`` when it is per row, unordered or more
    fragmented than ``max_runs`` (then it is gathered with an index)."""
    if select.ndim != 1 or select.numel() == 0:
        return None
    slots = select.tolist()
    runs = [[slots[0], slots[0] + 1]]
    for s in slots[1:]:
        if s == runs[-1][1]:
            runs[-1][1] += 1
        elif s > runs[-1][1]:
            runs.append([s, s + 1])
        else:
            return None
    return [tuple(r) for r in runs] if len(runs) <= max_runs else None


def _positions_arg(frames) -> torch.Tensor:
    if isinstance(frames, int):
        return torch.arange(frames)
    pos = torch.as_tensor(frames, dtype=torch.long).flatten()
    if pos.numel() > 1 and torch.any(pos[1:] <= pos[:-1]):
        raise ValueError(f"frame positions must increase strictly, got {pos.tolist()}")
    return pos


def _allowed(q: torch.Tensor, k: torch.Tensor, block_frames: int, sink_frames: int, window_frames: int | None,
             same_block: bool) -> torch.Tensor:
    """[len(q), len(k)]: may a query at absolute frame q attend a key at frame k (streaming's rule)."""
    q_start = (q // block_frames * block_frames)[:, None]
    q_end = q_start + block_frames
    k = k[None, :]
    earlier = k < q_start
    if window_frames is not None:
        earlier = earlier & ((k < sink_frames) | (k >= q_end - window_frames))
    if not same_block:
        return earlier
    return earlier | ((k >= q_start) & (k < q_end))


def stream_mask(frames, block_frames: int, *, sink_frames: int = 0, window_frames: int | None = None) -> torch.Tensor:
    """The frame-level attention mask ``[F, F]`` (query, key) that streaming computes over ``frames`` (a count:
    positions ``0..F-1``; or the ascending absolute positions present): a block attends to itself and to earlier
    frames that are sink frames or among the newest ``window_frames`` (its own block included). Blocks start at
    multiples of ``block_frames``."""
    pos = _positions_arg(frames)
    return _allowed(pos, pos, block_frames, sink_frames, window_frames, same_block=True)


def teacher_forcing_mask(clean, block_frames: int, *, sink_frames: int = 0, window_frames: int | None = None,
                         noisy=None) -> torch.Tensor:
    """The mask of a ``[clean; noisy]`` training sequence: ``clean`` frames (a count or ascending positions) attend
    as in :func:`stream_mask`, so their keys are the ones the write passes cache; each ``noisy`` frame (positions,
    default the clean ones) attends the noisy frames of its own block and the clean frames streaming would have
    cached before its block. One forward then trains every noisy block exactly as streaming samples it with clean
    context (CausVid / Self-Forcing teacher forcing). Frame positions of the sequence: ``clean`` then ``noisy``."""
    clean = _positions_arg(clean)
    noisy = clean if noisy is None else _positions_arg(noisy)
    rule = dict(block_frames=block_frames, sink_frames=sink_frames, window_frames=window_frames)
    top = torch.cat([_allowed(clean, clean, same_block=True, **rule),
                     torch.zeros(len(clean), len(noisy), dtype=torch.bool)], 1)
    blocks = noisy // block_frames
    bottom = torch.cat([_allowed(noisy, clean, same_block=False, **rule), blocks[:, None] == blocks[None, :]], 1)
    return torch.cat([top, bottom], 0)


# ---------------------------------------------------------------------------------------------- the controller


class CausalWan:
    r"""
    A ``WanTransformer3DModel`` made causal and streaming, in place (weights and state dict unchanged).

    Args:
        transformer (`WanTransformer3DModel`): the model; its rotary embedding and self-attention processors are
            replaced (cross-attention is untouched). Called outside a stream it is the plain bidirectional Wan.
        block_frames (`int`): latent frames generated per block.
        sink_frames (`int`): the first frames every block attends to (attention sink).
        window_frames (`int`, *optional*): a block attends to the newest ``window_frames`` frames, itself
            included, plus the sink; ``None``: every earlier frame (plain block-causal).
        cache_frames (`int`, *optional*): at most this many frames stay cached; past it the oldest non-sink frames
            are evicted. ``None``: keep every written frame (routing may reach any of them).
        context_sigma (`float`): the noise level of the clean context the write pass stores (0: the clean block).

    Calls (each returns the transformer's output, Wan's flow-matching velocity, in the model's dtype):
        ``wan(x, timestep, text, frame_offset=s)`` denoises the block at ``[s, s + F)`` against the cache;
        ``wan.write(x0, text, frame_offset=s)`` stores that block; ``wan.full(x, timestep, text, mask=...)`` is a
        whole-sequence forward under any frame mask (training, and the reference the tests compare with).
    """

    def __init__(self, transformer: WanTransformer3DModel, *, block_frames: int = 1, sink_frames: int = 0,
                 window_frames: int | None = None, cache_frames: int | None = None, context_sigma: float = 0.0):
        if not isinstance(transformer, WanTransformer3DModel):
            raise TypeError(f"CausalWan wraps a diffusers WanTransformer3DModel, got {type(transformer).__name__}")
        if transformer.config.patch_size[0] != 1:
            raise ValueError("CausalWan needs a temporal patch size of 1 (one token row per latent frame)")
        if transformer.config.image_dim is not None:
            raise NotImplementedError("image-conditioned Wan (I2V) is not supported by CausalWan")
        if block_frames < 1 or sink_frames < 0:
            raise ValueError(f"block_frames must be >= 1 and sink_frames >= 0, got {block_frames}, {sink_frames}")
        if sink_frames % block_frames:
            raise ValueError(f"sink_frames ({sink_frames}) must be whole blocks of block_frames ({block_frames})")
        if window_frames is not None and (window_frames < block_frames or window_frames % block_frames):
            raise ValueError(f"window_frames ({window_frames}) must be whole blocks of block_frames ({block_frames})")
        if cache_frames is not None and window_frames is not None and cache_frames < sink_frames + window_frames:
            raise ValueError(f"cache_frames ({cache_frames}) must hold the sink and the window "
                             f"({sink_frames} + {window_frames})")
        if not 0.0 <= context_sigma < 1.0:
            raise ValueError(f"context_sigma must be in [0, 1), got {context_sigma}")
        self.transformer = transformer
        self.block_frames, self.sink_frames, self.window_frames = block_frames, sink_frames, window_frames
        self.cache_frames, self.context_sigma = cache_frames, context_sigma
        rope = transformer.rope
        if not isinstance(rope, _StreamRope):
            transformer.rope = _StreamRope(rope)
        self._slot = _CallSlot()
        for i, block in enumerate(transformer.blocks):
            block.attn1.set_processor(_CausalSelfAttnProcessor(i, self._slot))
            block.attn2.set_processor(_SegmentedCrossAttnProcessor(self._slot))
        self.cache = CacheState.empty(len(transformer.blocks))
        self.route: RouteFn | None = None

    # -- state ---------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the cache (a new stream)."""
        self.cache = CacheState.empty(len(self.transformer.blocks))

    def save_state(self) -> CacheState:
        """The cache as it is now (free: cache updates never write in place)."""
        return self.cache.copy()

    def restore_state(self, state: CacheState) -> None:
        """Continue from a saved state (as often as wanted: the saved state is not consumed)."""
        self.cache = state.copy()

    @contextmanager
    def routed(self, route: RouteFn | None):
        """Within the block, blocks attend to the cached positions ``route`` picks instead of sink + window."""
        previous, self.route = self.route, route
        try:
            yield self
        finally:
            self.route = previous

    # -- attention context -----------------------------------------------------------------------------------------
    def context_positions(self, frame_offset: int, num_frames: int, cached: Sequence[int] | None = None) -> list[int]:
        """The positions a block at ``[frame_offset, frame_offset + num_frames)`` attends to besides itself
        (unrouted), among ``cached`` (default: the cache's)."""
        end = frame_offset + num_frames
        return [p for p in (self.cache.positions if cached is None else cached)
                if p < frame_offset and (self.window_frames is None or p < self.sink_frames
                                         or p >= end - self.window_frames)]

    def _select(self, frame_offset: int, num_frames: int) -> torch.Tensor:
        positions = self.cache.positions
        slot = {p: i for i, p in enumerate(positions)}
        if self.route is None:
            return torch.tensor([slot[p] for p in self.context_positions(frame_offset, num_frames)], dtype=torch.long)
        chosen = self.route(frame_offset, num_frames, list(positions))
        chosen = torch.as_tensor(chosen, dtype=torch.long).cpu()
        bad = [int(p) for p in chosen.flatten().tolist() if int(p) not in slot or int(p) >= frame_offset]
        if bad:
            raise ValueError(f"route picked positions {sorted(set(bad))} for the block at {frame_offset}: a route "
                             f"picks cached positions before the block (cached: {positions})")
        return chosen.apply_(lambda p: slot[p])

    def _positions(self, frame_offset: int, frames: int) -> torch.Tensor:
        if frame_offset < 0:
            raise ValueError(f"frame_offset must be >= 0, got {frame_offset}")
        return torch.arange(frame_offset, frame_offset + frames)

    # -- forwards --------------------------------------------------------------------------------------------------
    def _run(self, call: _Call, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
             module: torch.nn.Module | None = None) -> torch.Tensor:
        model = self.transformer
        timestep = torch.as_tensor(timestep, device=x.device)
        if timestep.ndim == 0:
            timestep = timestep.expand(x.shape[0])
        if timestep.ndim == 2:
            # one timestep per latent frame → per token (Wan's per-token timestep path), tokens frame-major
            _, p_h, p_w = model.config.patch_size
            timestep = timestep.repeat_interleave((x.shape[-2] // p_h) * (x.shape[-1] // p_w), dim=1)
        model.rope.call = call
        try:
            forward = model if module is None else module
            out = forward(hidden_states=x.to(model.dtype), timestep=timestep,
                          encoder_hidden_states=text.to(model.dtype), return_dict=False)[0]
        finally:
            model.rope.call = None
        return out

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor, *,
                 frame_offset: int, module: torch.nn.Module | None = None) -> torch.Tensor:
        """The model output for the block ``x`` ``[B, C, F, h, w]`` at absolute frames ``[frame_offset,
        frame_offset + F)``, attending to the cache (read only). ``timestep``: ``[B]`` or per frame ``[B, F]``.
        ``module``: what to call instead of the transformer itself (its DDP wrapper); it must wrap that very module,
        whose attention processors hold the stream."""
        frames = x.shape[2]
        select = self._select(frame_offset, frames)
        call = _Call(self._positions(frame_offset, frames), cache=self.cache, select=select, runs=_slot_runs(select))
        return self._run(call, x, timestep, encoder_hidden_states, module)

    @torch.no_grad()
    def write(self, x0: torch.Tensor, encoder_hidden_states: torch.Tensor, *, frame_offset: int,
              noise: torch.Tensor | None = None, timestep: torch.Tensor | None = None) -> None:
        """Store the block ``x0`` (clean latents at ``[frame_offset, frame_offset + F)``) in the cache: one no-grad
        forward at ``context_sigma`` (``noise`` required when it is > 0). Frames already cached at those positions
        are replaced. ``timestep`` (``[B]`` or ``[B, F]``) writes ``x0`` as given at that timestep instead (a
        cache of noisy frames, e.g. to compare with a full forward at one shared timestep)."""
        frames = x0.shape[2]
        x = x0
        if timestep is None and self.context_sigma > 0:
            if noise is None:
                raise ValueError(f"context_sigma={self.context_sigma}: pass the write pass's noise explicitly")
            x = (1 - self.context_sigma) * x0 + self.context_sigma * noise
        new = list(range(frame_offset, frame_offset + frames))
        old = self.cache.positions
        keep_pos = [p for p in old if p not in set(new)]
        if self.cache_frames is not None:
            merged = sorted(keep_pos + new)
            overflow = len(merged) - self.cache_frames
            evict = set([p for p in merged if p >= self.sink_frames and p not in new][:max(0, overflow)])
            keep_pos = [p for p in keep_pos if p not in evict]
        slot = {p: i for i, p in enumerate(old)}
        merged = keep_pos + new
        order = sorted(range(len(merged)), key=merged.__getitem__)
        written = CacheState([None] * len(self.cache.keys), [None] * len(self.cache.values), sorted(merged))
        select = self._select(frame_offset, frames)
        call = _Call(self._positions(frame_offset, frames), cache=self.cache, select=select, runs=_slot_runs(select),
                     write=written,
                     keep=torch.tensor([slot[p] for p in keep_pos], dtype=torch.long),
                     order=None if order == sorted(order) else torch.tensor(order, dtype=torch.long))
        if timestep is None:
            timestep = torch.full((x.shape[0],), 1000.0 * self.context_sigma, device=x.device)
        call.stop_after_write = self._may_stop_early()
        try:
            self._run(call, x, timestep, encoder_hidden_states)
        except _WriteDone:
            pass
        if any(k is None for k in written.keys):
            raise RuntimeError("the write pass did not reach every self-attention layer")
        self.cache = written

    def _may_stop_early(self) -> bool:
        """Whether a write pass may end at the last layer's keys: not when a forward hook (torch's, global or on
        the modules that pass would leave mid-call, or accelerate's ``_hf_hook``, e.g. CPU offload) expects the
        forward to return."""
        model = self.transformer
        last = model.blocks[-1]
        cut = (model, last, last.attn1)
        if torch.nn.modules.module._global_forward_hooks:
            return False
        return not any(m._forward_hooks or hasattr(m, "_hf_hook") for m in cut)

    def recache_start(self, switch_frame: int) -> int:
        """The first frame :meth:`recache` re-encodes for a prompt switch at ``switch_frame`` (block-aligned): the
        frames the next block attends besides the sink, ``max(sink, switch + block - window)`` (every frame after
        the sink without a window)."""
        if switch_frame % self.block_frames:
            raise ValueError(f"a prompt switch must start a block: {switch_frame} % {self.block_frames} != 0")
        if self.window_frames is None:
            return min(self.sink_frames, switch_frame)
        return max(min(self.sink_frames, switch_frame), switch_frame + self.block_frames - self.window_frames)

    def recache(self, latents: torch.Tensor, encoder_hidden_states: torch.Tensor, *, frame_offset: int,
                noise: torch.Tensor | None = None) -> None:
        """Prompt switch (LongLive's re-cache, arXiv 2509.22622): keep the sink frames as written, drop every other
        cached frame, and write ``latents`` (clean, ``[B, C, F, h, w]`` at ``[frame_offset, frame_offset + F)``,
        normally ``[recache_start(s), s)`` for a switch at ``s``) under the new prompt, block by block. The stream
        then continues as if those frames had been made under the new prompt after the sink: a
        :func:`teacher_forcing_mask` over the sink and these frames, with :meth:`full`'s ``text_frames`` giving the
        sink its old prompt, trains exactly what it samples.

        A route (:meth:`routed`) does not apply here: it decides which frames a block attends while it is
        generated, and the re-cache re-encodes the frames with the sink and each other as their context whichever
        route wrote them (KVPO, arXiv 2605.14278, routes only inside a chunk; its re-cache at a switch runs
        unperturbed)."""
        frames = latents.shape[2]
        if frame_offset < self.sink_frames or frame_offset % self.block_frames:
            raise ValueError(f"recache starts at a block after the sink ({self.sink_frames}), got {frame_offset}")
        keep = [i for i, p in enumerate(self.cache.positions) if p < self.sink_frames]
        self.cache = self.cache.index_frames(keep)
        with self.routed(None):
            for s in range(frame_offset, frame_offset + frames, self.block_frames):
                part = slice(s - frame_offset, s - frame_offset + self.block_frames)
                self.write(latents[:, :, part], encoder_hidden_states, frame_offset=s,
                           noise=None if noise is None else noise[:, :, part])

    def full(self, x: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor, *,
             mask: torch.Tensor, frame_positions: Sequence[int] | torch.Tensor | None = None,
             text_frames: Sequence[int] | torch.Tensor | None = None,
             prompt_tokens: int | None = None, module: torch.nn.Module | None = None) -> torch.Tensor:
        """One forward over the whole sequence ``x`` ``[B, C, F, h, w]`` under the frame-level bool ``mask``
        ``[F, F]`` (query, key); frames at ``frame_positions`` (default ``0..F-1``). No cache is read or written.
        ``module``: what to call instead of the transformer (its DDP wrapper), as in :meth:`__call__`.

        ``text_frames`` (``[F]``, or ``[B, F]`` per row, ints): ``encoder_hidden_states`` is several prompts'
        embeddings concatenated along the tokens (``[B, P·L, D]``, ``prompt_tokens`` = L each; default: as many
        prompts as ``text_frames`` names) and frame ``f`` reads prompt ``text_frames[f]`` alone. ``mask`` may also be
        per row, ``[B, F, F]``."""
        frames = x.shape[2]
        positions = (torch.arange(frames) if frame_positions is None
                     else torch.as_tensor(frame_positions, dtype=torch.long))
        mask = torch.as_tensor(mask, dtype=torch.bool)
        if mask.shape[-2:] != (frames, frames) or mask.ndim not in (2, 3):
            raise ValueError(f"mask must be [F, F] or [B, F, F] with F = {frames} (frame-level), got {tuple(mask.shape)}")
        call = _Call(positions, mask=mask)
        if text_frames is not None:
            call.text_frames = torch.as_tensor(text_frames, dtype=torch.long)
            if call.text_frames.shape[-1] != frames or call.text_frames.ndim > 2 or int(call.text_frames.min()) < 0:
                raise ValueError(f"text_frames must give each of the {frames} frames a prompt index >= 0, [F] or [B, F]")
            tokens = encoder_hidden_states.shape[1]
            prompts = int(call.text_frames.max()) + 1
            call.prompt_tokens = prompt_tokens or tokens // prompts
            if tokens % call.prompt_tokens or tokens // call.prompt_tokens < prompts:
                raise ValueError(f"text_frames names {prompts} prompts of {call.prompt_tokens} tokens but "
                                 f"encoder_hidden_states has {tokens} tokens")
        return self._run(call, x, timestep, encoder_hidden_states, module)
