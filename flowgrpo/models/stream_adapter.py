r"""A streaming Wan as the trainer sees a model: block-by-block generation with a conditioning that carries the KV cache.

The trainer drives image and clip models through a flow adapter (``encode_prompts``, ``prepare_noise``,
``velocity``, ``decode``). A streaming model makes its video one block of latent frames at a time, each block
denoised against the cache the blocks before it wrote, so its "conditioning" changes from block to block.
:class:`StreamAdapter` gives it that interface with a chunk axis (chunk = block):

* :meth:`StreamAdapter.encode_prompts` encodes each row's segment prompts (a stream switches prompt at the frames
  its metadata names) and returns the conditioning of block 0, a :class:`StreamCond` (an empty cache);
* :meth:`StreamAdapter.velocity` ``(x, σ, cond)`` denoises the block ``cond.block`` against ``cond``'s cache;
* :meth:`StreamAdapter.commit` ``(x0, cond)`` writes the finished block into the cache (the no-grad write pass;
  a prompt switch re-caches when the model does) and returns the next block's conditioning; ``cond`` is unchanged,
  so the update can rescore any block under exactly the context it was sampled with
  (``samplers.chunked_rollout`` keeps every block's conditioning).

Each block is integrated over ``[σ_0, …, σ_{S−1}, 0]`` (:meth:`StreamAdapter.sigmas`, the model's few-step list):
the step into ``σ_{j+1} > 0`` is the re-noise ``x_{j+1} ~ N((1 − σ_{j+1})·x̂₀, σ_{j+1}²·I)``, which is the ``cps``
kernel at noise level 1 (``samplers.sde_step``), and the last step, into 0, returns ``x̂₀``. So the streaming sampler
is ``samplers.chunked_rollout(velocity, commit, noise, sigmas, mask, kernel="cps", noise_level=1)`` with the SDE mask
on the first ``S − 1`` steps of every block (``samplers.stream_sde_mask``), and its log-probabilities are the exact
Gaussian ones of those re-noise draws.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Sequence

import torch

from samplers import chunked_rollout, stream_sde_mask, stream_sigmas

from ..registry import TEMPORAL_FACTORS
from .base import TransformerAccess
from .causal_wan import CacheState, teacher_forcing_mask
from .stream_pipeline import StreamingWanPipeline

__all__ = ["StreamCond", "StreamAdapter", "ForcingRun"]


def _cat_cache(a: CacheState, b: CacheState) -> CacheState:
    if a.positions != b.positions:
        raise ValueError(f"cannot join caches of different frames ({a.positions} vs {b.positions})")
    join = [None if x is None else torch.cat([x, y]) for x, y in zip(a.keys, b.keys)]
    vals = [None if x is None else torch.cat([x, y]) for x, y in zip(a.values, b.values)]
    return CacheState(join, vals, list(a.positions))


def _rows(cache: CacheState, index) -> CacheState:
    return cache if cache.batch_size is None else cache.index_rows(index)


@dataclass
class StreamCond:
    """The conditioning of one block of a batch of streams (indexable by rows, like ``PromptEmbeds``).

    Attributes:
        text: ``[B, P, L, D]`` each row's segment prompt embeddings (rows with fewer segments repeat their last).
        negative: ``[B, L, D]`` the negative prompt's embeddings (classifier-free guidance), or ``None``.
        segments: ``[B, K]`` long: the segment each block of each row is made under.
        cache: the KV cache of the prompt branch, ``B`` rows (written by the blocks before ``block``).
        negative_cache: the negative branch's cache (its own rows, as CFG runs two streams), or ``None``.
        block: the block this conditioning denoises.
        past: ``[B, C, f, h, w]`` the clean blocks so far, kept only for a model that re-caches at a switch.
    """

    text: torch.Tensor
    negative: torch.Tensor | None
    segments: torch.Tensor
    cache: CacheState
    negative_cache: CacheState | None
    block: int = 0
    past: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.text.shape[0]

    def __getitem__(self, index) -> "StreamCond":
        if isinstance(index, int):
            index = slice(index, index + 1)
        elif not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        dev = self.text.device

        def pick(t):
            return None if t is None else t[index.to(t.device) if isinstance(index, torch.Tensor) else index]

        return replace(self, text=pick(self.text), negative=pick(self.negative),
                       segments=self.segments[index.cpu() if isinstance(index, torch.Tensor) else index],
                       cache=_rows(self.cache, index.to(dev) if isinstance(index, torch.Tensor) else index),
                       negative_cache=None if self.negative_cache is None else _rows(
                           self.negative_cache, index.to(dev) if isinstance(index, torch.Tensor) else index),
                       past=pick(self.past))

    @classmethod
    def cat(cls, items: Sequence["StreamCond"]) -> "StreamCond":
        """Join the rows of conditionings of the same block (the same cached frames)."""
        first = items[0]
        if any(c.block != first.block for c in items):
            raise ValueError("cannot join the conditionings of different blocks")

        def join(values):
            return None if values[0] is None else torch.cat(values)

        def join_caches(caches):
            if caches[0] is None:
                return None
            out = caches[0]
            for c in caches[1:]:
                out = out if c.batch_size is None else _cat_cache(out, c)
            return out

        return replace(first, text=join([c.text for c in items]), negative=join([c.negative for c in items]),
                       segments=join([c.segments for c in items]), cache=join_caches([c.cache for c in items]),
                       negative_cache=join_caches([c.negative_cache for c in items]),
                       past=join([c.past for c in items]))

    def map_tensors(self, fn) -> "StreamCond":
        """The conditioning with ``fn`` applied to every tensor it holds on the model's device (the prompt
        embeddings, the caches, the clean blocks so far); ``segments`` (host indices) is shared."""

        def apply(t):
            return None if t is None else fn(t)

        return replace(self, text=fn(self.text), negative=apply(self.negative), cache=self.cache.map_tensors(fn),
                       negative_cache=None if self.negative_cache is None else self.negative_cache.map_tensors(fn),
                       past=apply(self.past))

    def repeat_interleave(self, repeats: int) -> "StreamCond":
        """Each row ``repeats`` times in a row (G members of a group)."""
        return self[torch.arange(len(self)).repeat_interleave(repeats)]

    @property
    def has_negative(self) -> bool:
        return self.negative is not None

    def block_text(self) -> torch.Tensor:
        """``[B, L, D]``: each row's prompt embeddings for this block."""
        seg = self.segments[:, self.block].to(self.text.device)
        return self.text[torch.arange(len(self), device=self.text.device), seg]


@dataclass(frozen=True)
class ForcingRun:
    """Part of a stream's teacher-forced sequence (:meth:`StreamAdapter.forcing_runs`): the noisy ``blocks`` it trains
    and the clean frames the stream's cache held for them.

    Attributes:
        clean: ascending latent frame positions of the clean context.
        clean_text: the segment whose prompt each clean frame was written under.
        blocks: the blocks (consecutive) whose noisy copies this run trains.
    """

    clean: tuple
    clean_text: tuple
    blocks: tuple


def _routed_mask(mask: torch.Tensor, layout: tuple, route, block_frames: int) -> torch.Tensor:
    """A teacher-forced sequence's frame mask (``layout``: per run, its clean positions and its blocks, the sequence
    being each run's clean frames then its noisy blocks) with every trained block's clean and noisy query frames
    attending, besides their own block, the clean frames ``route(block start, block_frames, the run's clean
    positions before it)`` picks: what a routed stream's write pass and denoising calls attend."""
    mask = mask.clone()
    start = 0
    for clean, blocks in layout:
        clean = list(clean)
        index = {p: start + i for i, p in enumerate(clean)}
        first_noisy = start + len(clean)
        for b in blocks:
            s, e = b * block_frames, (b + 1) * block_frames
            chosen = [int(p) for p in torch.as_tensor(route(s, block_frames, [p for p in clean if p < s])).tolist()]
            if any(p not in index or p >= s for p in chosen):
                raise ValueError(f"the route picks {chosen} for the block at {s}, but the run's clean frames before "
                                 f"it are {[p for p in clean if p < s]}")
            context = [index[p] for p in chosen]
            noisy = [first_noisy + (p - blocks[0] * block_frames) for p in range(s, e)]
            for rows, own in (([index[p] for p in range(s, e)], [index[p] for p in range(s, e)]), (noisy, noisy)):
                mask[rows] = False
                for r in rows:
                    mask[r, context + own] = True
        start = first_noisy + len(blocks) * block_frames
    return mask


class StreamAdapter(TransformerAccess):
    r"""
    The trainer's view of a :class:`~flowgrpo.models.StreamingWanPipeline` (see the module docstring).

    Args:
        stream (`StreamingWanPipeline`): the streaming model. Its transformer is the trained module
            (``adapter.pipe.transformer``); assign a wrapped one (DDP) to ``adapter.transformer``.
    """

    family = "causal_wan"
    is_video = True
    chunked = True  # the trainer integrates chunk by chunk (samplers.chunked_rollout)
    #: Pixel frames per latent frame after the first: Wan's (:attr:`WanAdapter.temporal_factor`), on the class before a
    #: model loads; on an adapter, its VAE's.
    temporal_factor: int = TEMPORAL_FACTORS["causal_wan"]

    def __init__(self, stream: StreamingWanPipeline):
        if stream.config.context_sigma != 0:
            raise NotImplementedError(f"model.stream.context_sigma={stream.config.context_sigma}: training writes the "
                                      "clean block to the cache (context_sigma=0, as Self-Forcing and LongLive do)")
        self.stream = stream
        self.pipe = stream.pipe
        self.wan = stream.wan
        self.config = stream.config
        self.frames = stream.adapter  # the Wan adapter: text encoding, latent layout, decoding
        self.temporal_factor = stream.temporal_factor
        self._transformer = None

    def __repr__(self) -> str:
        c = self.config
        return (f"StreamAdapter(blocks of {c.block_frames} latent frames, {c.num_steps} steps, sink {c.sink_frames}, "
                f"window {c.window_frames}, recache {c.recache})")

    # ------------------------------------------------------------------ layout
    def sigmas(self, num_steps: int, **size) -> torch.Tensor:
        """``[S + 1]``: the model's ``S`` noise levels per block, then 0 (``num_steps`` must be its ``S``)."""
        c = self.config
        if num_steps != c.num_steps:
            raise ValueError(f"the streaming model denoises each block in {c.num_steps} steps (model.stream.num_steps); "
                             f"sampler.num_steps={num_steps} must match it")
        return torch.cat([stream_sigmas(c.num_steps, c.shift), torch.zeros(1)])

    def stream_layout(self) -> dict:
        """The streaming geometry in latent frames, what a rollout that routes a stream's context plans with:
        ``block_frames``, ``sink_frames``, ``window_frames``, ``cache_frames``, ``recache``."""
        c = self.config
        return {"block_frames": c.block_frames, "sink_frames": c.sink_frames, "window_frames": c.window_frames,
                "cache_frames": c.cache_frames, "recache": c.recache}

    def num_chunks(self, num_frames: int) -> int:
        """Blocks of a video of ``num_frames`` pixel frames."""
        return self.stream.latent_frames(num_frames) // self.config.block_frames

    def segments_of(self, metadata: dict, num_frames: int) -> list[int]:
        """The segment each block of a stream is made under, from its metadata's segment starts (pixel frames)."""
        segments = metadata.get("segments") if isinstance(metadata, dict) else None
        if not segments:
            raise ValueError("a streaming model needs each prompt's metadata to list its segments "
                             "(data: a streams JSONL such as assets/prompts/streams_train.jsonl)")
        if int(metadata.get("num_frames", num_frames)) != num_frames:
            raise ValueError(f"a stream of {metadata['num_frames']} frames, but model.num_frames={num_frames}: "
                             "set model.num_frames to the streams' length")
        switches = [int(s["start"]) for s in segments[1:]]
        return self.stream.layout(len(segments), switches, num_frames)[1]

    def join_chunks(self, blocks: torch.Tensor) -> torch.Tensor:
        """``[B, K, C, F, h, w]`` clean blocks → the video latents ``[B, C, K·F, h, w]``."""
        return torch.cat(blocks.unbind(1), dim=2)

    # ------------------------------------------------------------------ conditioning
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], negative_prompt: str | None = "", *, guidance_scale: float = 1.0,
                       max_sequence_length: int | None = None, metadata: Sequence[dict] | None = None,
                       num_frames: int | None = None) -> StreamCond:
        """Block 0's conditioning of one stream per metadata record (``prompts`` only name the rows)."""
        if metadata is None or len(metadata) != len(prompts):
            raise ValueError("a streaming model encodes each stream's segment prompts from its metadata: pass one "
                             "metadata record per prompt")
        if num_frames is None:
            raise ValueError("pass num_frames (model.num_frames)")
        segs = [self.segments_of(m, num_frames) for m in metadata]
        texts = [[str(s["prompt"]) for s in m["segments"]] for m in metadata]
        width = max(len(t) for t in texts)
        flat = [t[min(j, len(t) - 1)] for t in texts for j in range(width)]
        embeds = self.frames.encode_prompts(flat, negative_prompt, guidance_scale=guidance_scale,
                                            max_sequence_length=max_sequence_length)
        B = len(texts)
        text = embeds.prompt_embeds.view(B, width, *embeds.prompt_embeds.shape[1:])
        negative = None
        if embeds.has_negative:
            negative = embeds.negative_prompt_embeds.view(B, width, *embeds.prompt_embeds.shape[1:])[:, 0]
        empty = CacheState.empty(len(self.pipe.transformer.blocks))
        return StreamCond(text=text, negative=negative, segments=torch.tensor(segs, dtype=torch.long), cache=empty,
                          negative_cache=None if negative is None else empty.copy(), block=0,
                          past=None)

    def prepare_noise(self, batch_size: int, *, height: int, width: int, num_frames: int,
                      generator=None, group_size: int = 1, shared: bool = False) -> torch.Tensor:
        """``[B, K, C, F, h, w]``: each row's initial noise of the whole video (drawn as the clip adapter draws it),
        cut into its ``K`` blocks of ``F`` latent frames."""
        noise = self.frames.prepare_noise(batch_size, height=height, width=width, num_frames=num_frames,
                                          generator=generator, group_size=group_size, shared=shared)
        return torch.stack(noise.split(self.config.block_frames, dim=2), dim=1)

    # ------------------------------------------------------------------ model calls
    def _check_module(self, module: torch.nn.Module | None) -> None:
        if module is None:
            return
        inner = getattr(module, "module", module)
        if inner is not self.pipe.transformer:
            raise NotImplementedError("a streaming model runs its own causal attention on its transformer: a "
                                      "separate reference copy (model.finetune=full with algo.kl_beta > 0) is not "
                                      "supported; use model.finetune=lora, or algo.kl_beta=0")

    @contextmanager
    def _both_branches(self, cfg: bool):
        """Under CFG the transformer runs the negative rows then the prompt rows: a per-row route (one row per
        stream) is given to both."""
        route = self.wan.route
        if not cfg or route is None:
            yield
            return

        def twice(frame_offset, num_frames, cached):
            chosen = route(frame_offset, num_frames, cached)
            if isinstance(chosen, torch.Tensor) and chosen.ndim == 2:
                return torch.cat([chosen, chosen])
            return chosen

        with self.wan.routed(twice):
            yield

    def velocity(self, x: torch.Tensor, sigma: float | torch.Tensor, cond: StreamCond, *, guidance_scale: float = 1.0,
                 transformer: torch.nn.Module | None = None, **_) -> torch.Tensor:
        """The (guided) velocity of the block ``cond.block`` at ``x`` ``[B, C, F, h, w]`` and ``σ`` (a float or ``[B]``),
        against ``cond``'s cache. Differentiable; float32."""
        self._check_module(transformer)
        batch = x.shape[0]
        if len(cond) != batch:
            raise ValueError(f"cond has {len(cond)} streams for a batch of {batch} blocks")
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
        sigma = sigma.expand(batch) if sigma.ndim == 0 else sigma.reshape(batch)
        timestep = (sigma.double() * 1000.0).float()  # as the streaming pipeline rounds it
        text = cond.block_text()
        cfg = guidance_scale > 1.0
        if cfg and cond.negative is None:
            raise ValueError("guidance_scale > 1 needs a conditioning encoded with the negative prompt")
        offset = cond.block * self.config.block_frames
        if cfg:
            self.wan.cache = _cat_cache(cond.negative_cache, cond.cache)
            with self._both_branches(True):
                v = self.wan(torch.cat([x, x]), torch.cat([timestep, timestep]), torch.cat([cond.negative, text]),
                             frame_offset=offset, module=transformer).float()
            v_uncond, v_cond = v.chunk(2)
            return v_uncond + guidance_scale * (v_cond - v_uncond)
        self.wan.cache = cond.cache
        return self.wan(x, timestep, text, frame_offset=offset, module=transformer).float()

    def routed(self, route) -> ContextManager[None]:
        """A context in which the blocks attend the cached frames ``route(frame_offset, num_frames, cached)`` picks
        instead of their sink + window (``CausalWan.routed``)."""
        return self.wan.routed(route)

    @torch.no_grad()
    def commit(self, x0: torch.Tensor, cond: StreamCond) -> StreamCond:
        """Write the finished block ``x0`` into the cache; the conditioning of the next block (``cond`` unchanged).
        At a prompt switch a model that re-caches re-writes its window under the new prompt (every row of the batch
        must switch at that block)."""
        c = self.config
        k, bf = cond.block, c.block_frames
        text = cond.block_text()
        cfg = cond.negative_cache is not None and cond.negative is not None
        batch = len(cond)

        x0 = x0.to(self.device)
        if cfg:
            self.wan.cache = _cat_cache(cond.negative_cache, cond.cache)
            with self._both_branches(True):
                self.wan.write(torch.cat([x0, x0]), torch.cat([cond.negative, text]), frame_offset=k * bf)
        else:
            self.wan.cache = cond.cache
            self.wan.write(x0, text, frame_offset=k * bf)
        past = None if not c.recache else (x0 if cond.past is None else torch.cat([cond.past, x0], dim=2))
        nxt = k + 1
        if c.recache and nxt < cond.segments.shape[1]:
            switching = cond.segments[:, nxt] != cond.segments[:, k]
            if bool(switching.any()):
                if not bool(switching.all()):
                    raise ValueError("this model re-caches at a prompt switch (model.stream.recache=true), which "
                                     "needs every stream of a rollout batch to switch at the same frames; use streams "
                                     "that share their switch frames")
                start = self.wan.recache_start(nxt * bf)
                if start < nxt * bf:
                    new_text = replace(cond, block=nxt).block_text()
                    window = past[:, :, start:]
                    if cfg:
                        self.wan.recache(torch.cat([window, window]), torch.cat([cond.negative, new_text]),
                                         frame_offset=start)
                    else:
                        self.wan.recache(window, new_text, frame_offset=start)
        cache = self.wan.cache
        if cfg:
            negative_cache, cache = cache.index_rows(slice(0, batch)), cache.index_rows(slice(batch, 2 * batch))
        else:
            negative_cache = None
        return replace(cond, cache=cache, negative_cache=negative_cache, block=nxt, past=past)

    # ------------------------------------------------------------------ the teacher-forced forward
    def forcing_runs(self, segments: Sequence[int]) -> list[ForcingRun]:
        """How one stream's blocks (``segments``: the segment of each block) are trained in one forward: a run per
        stretch of blocks that read the same cache history. Without re-cache that is one run, every clean frame
        under its own segment's prompt (what the write passes stored). With re-cache, a prompt switch at frame ``s``
        that re-wrote the window ``[r, s)`` (:meth:`CausalWan.recache_start`) starts a new run whose clean
        context is the sink as first written, ``[r, s)`` under the new prompt, then its own frames: exactly the
        cache its blocks read. The runs of a stream become one sequence under a block-diagonal mask."""
        c = self.config
        bf, K = c.block_frames, len(segments)
        if c.window_frames is None and c.cache_frames is not None:
            raise NotImplementedError(
                f"model.stream.cache_frames={c.cache_frames} without model.stream.window_frames: the cache evicts "
                "frames that a block without a window would attend, which a teacher-forced forward does not "
                "reproduce; set model.stream.window_frames")
        segments = [int(k) for k in segments]
        starts = [0]
        if c.recache:
            starts += [b for b in range(1, K)
                       if segments[b] != segments[b - 1] and self.wan.recache_start(b * bf) < b * bf]
        runs = []
        for i, b0 in enumerate(starts):
            b1 = starts[i + 1] if i + 1 < len(starts) else K
            s, e = b0 * bf, b1 * bf
            if b0 == 0:
                clean = list(range(e))
                text = [segments[p // bf] for p in clean]
            else:  # after a re-cache: the sink as first written, the window re-written under the new prompt
                r = self.wan.recache_start(s)
                sink = list(range(min(c.sink_frames, r)))
                clean = sink + list(range(r, e))
                text = ([segments[p // bf] for p in sink] + [segments[b0]] * (s - r)
                        + [segments[p // bf] for p in range(s, e)])
            runs.append(ForcingRun(tuple(clean), tuple(text), tuple(range(b0, b1))))
        return runs

    def teacher_forced_velocity(self, clean: torch.Tensor, noisy: torch.Tensor, sigma: torch.Tensor,
                                cond: StreamCond, *, routes: Sequence[Any] | None = None,
                                transformer: torch.nn.Module | None = None) -> torch.Tensor:
        """The conditional velocity of every block of a batch of streams in one forward per stream: the sequence
        ``[clean context; noisy blocks]`` under :func:`~flowgrpo.models.causal_wan.teacher_forcing_mask`
        (block-diagonal over :meth:`forcing_runs`), each frame under its own segment's prompt, clean frames at
        timestep 0, each noisy block at its own ``σ``. Block ``k``'s output equals :meth:`velocity` (without
        guidance) of ``noisy[:, k]`` at ``sigma[:, k]`` against the cache the stream wrote from ``clean``.

        Args:
            clean: ``[B, K, C, F, h, w]`` the clean blocks the stream committed.
            noisy: ``[B, K, C, F, h, w]`` the blocks to denoise.
            sigma: ``[B, K]`` each noisy block's noise level.
            cond: the streams' conditioning (any block's: its segment prompts and segments are read).
            routes: per stream, the route its blocks were streamed under (``CausalWan.routed``'s
                ``route(frame_offset, num_frames, cached_positions)``, one list of positions), or ``None``
                (unrouted; the default for every stream). A routed block's clean and noisy frames then attend the
                clean frames its route picks from the run's clean frames before it (and their own block), as the
                routed write pass and denoising calls did: KVPO's branches (arXiv 2605.14278) trained by a
                teacher-forced forward.
            transformer: what to call instead of the transformer (its wrapper; the reference policy's context).

        Returns ``[B, K, C, F, h, w]`` float32, differentiable (the gradient also flows through the clean context,
        whose keys the same weights compute)."""
        self._check_module(transformer)
        B, K = clean.shape[:2]
        if noisy.shape != clean.shape or tuple(sigma.shape) != (B, K) or len(cond) != B:
            raise ValueError(f"clean {tuple(clean.shape)}, noisy {tuple(noisy.shape)}, sigma {tuple(sigma.shape)} "
                             f"and cond ({len(cond)} streams) must describe the same [B, K] blocks")
        if cond.segments.shape[1] != K:
            raise ValueError(f"cond lays out {cond.segments.shape[1]} blocks per stream, the input has {K}")
        if routes is not None and len(routes) != B:
            raise ValueError(f"routes has {len(routes)} entries for {B} streams (one route or None per stream)")
        c = self.config
        bf = c.block_frames
        frames = K * bf
        video = torch.cat([self.join_chunks(clean), self.join_chunks(noisy)], dim=2)  # clean frames, then noisy
        t_noisy = (sigma.to(video.device, torch.float32).double() * 1000.0).float().repeat_interleave(bf, dim=1)
        t_all = torch.cat([torch.zeros_like(t_noisy), t_noisy], dim=1)                # [B, 2·K·bf]
        text = cond.text.flatten(1, 2)                                                # [B, P·L, D]
        prompt_tokens = cond.text.shape[2]
        layouts: dict[tuple, list[int]] = {}
        runs_of = []
        for row in range(B):
            runs = self.forcing_runs(cond.segments[row].tolist())
            runs_of.append(runs)
            layouts.setdefault(tuple((r.clean, r.blocks) for r in runs), []).append(row)
        out = video.new_zeros((B, video.shape[1], frames, *video.shape[3:]), dtype=torch.float32)
        for layout, rows in layouts.items():
            source, positions, masks = [], [], []
            for clean_pos, blocks in layout:
                noisy_pos = list(range(blocks[0] * bf, (blocks[-1] + 1) * bf))
                source += list(clean_pos) + [frames + p for p in noisy_pos]
                positions += list(clean_pos) + noisy_pos
                masks.append(teacher_forcing_mask(list(clean_pos), bf, sink_frames=c.sink_frames,
                                                  window_frames=c.window_frames, noisy=noisy_pos))
            mask = torch.block_diag(*masks)
            if routes is not None and any(routes[row] is not None for row in rows):
                mask = torch.stack([mask if routes[row] is None else _routed_mask(mask, layout, routes[row], bf)
                                    for row in rows])
            text_frames = []
            for row in rows:
                seg = cond.segments[row].tolist()
                per = []
                for run in runs_of[row]:
                    per += list(run.clean_text) + [seg[p // bf] for p in range(run.blocks[0] * bf,
                                                                                (run.blocks[-1] + 1) * bf)]
                text_frames.append(per)
            idx = torch.tensor(rows, dtype=torch.long, device=video.device)
            src = torch.tensor(source, dtype=torch.long, device=video.device)
            v = self.wan.full(video[idx][:, :, src], t_all[idx][:, src], text[idx.to(text.device)],
                              mask=mask, frame_positions=positions, text_frames=torch.tensor(text_frames),
                              prompt_tokens=prompt_tokens, module=transformer)
            # the runs take the blocks in order, so the noisy frames of the sequence are frames 0 … K·bf−1 in order
            out[idx] = v[:, :, src >= frames].float()
        return torch.stack(out.split(bf, dim=2), dim=1)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Video latents ``[B, C, F, h, w]`` → ``[B, T, 3, H, W]`` in [0, 1]."""
        return self.frames.decode(latents)

    # ------------------------------------------------------------------ sampling (held-out evaluation)
    @torch.no_grad()
    def generate(self, prompts: list[str], metadata: Sequence[dict], generators: list[torch.Generator], *,
                 sigmas: torch.Tensor, model_kw: dict[str, Any],
                 autocast: Callable[[], ContextManager] = nullcontext, decode: bool = True) -> torch.Tensor:
        """Videos ``[B, T, 3, H, W]`` in [0, 1], one per generator: the model's own sampler (re-noise at every step
        but the last, ``cps`` at noise level 1), sample ``b``'s initial noise and then its re-noise draws from
        ``generators[b]`` alone. ``decode=False``: the clean blocks ``[B, K, C, F, h, w]`` instead."""
        guidance = model_kw["guidance"]
        size = model_kw["size"]
        cond = self.encode_prompts(prompts, model_kw["negative_prompt"], guidance_scale=guidance["guidance_scale"],
                                   max_sequence_length=model_kw["max_sequence_length"], metadata=metadata,
                                   num_frames=size["num_frames"])
        noise = self.prepare_noise(len(prompts), generator=generators, **size)

        def velocity(x, sigma, c):
            with autocast():
                return self.velocity(x, sigma, c, guidance_scale=guidance["guidance_scale"])

        # only the samples are needed: no block's conditioning (its KV cache) is kept past the block after it, and
        # the recorded states go before the decode
        final = chunked_rollout(velocity, self.commit, noise, sigmas, stream_sde_mask(sigmas.shape[0] - 1),
                                cond=cond, kernel="cps", noise_level=1.0, generator=generators,
                                keep_cond=False).final.clone()
        del cond
        if not decode:
            return final
        return self.decode(self.join_chunks(final)).float().clamp_(0, 1)

