#!/usr/bin/env python
r"""Pretrain the moving-shapes world's tiny Wan text-to-video pipeline: ``assets/tiny-wan-shapes``.

    python scripts/pretrain_tiny_wan.py --threads 2                   # the shipped asset (CPU; see pretrain_summary.json)
    python scripts/pretrain_tiny_wan.py --resume                      # continue from <ckpt-dir>/last.pt
    python scripts/pretrain_tiny_wan.py --size toy --vae-steps 2 --flow-steps 2 --out /tmp/x   # smoke run

What it builds (real diffusers / transformers classes at small widths, the code path of Wan 2.1):

- ``vae``: ``AutoencoderKLWan`` (causal 3-D convolutions), 13 x 64 x 64 RGB -> 4 x 16 x 16 x 16 latents: spatial 4x,
  **temporal 4x** (frames 1 + 4k, the real Wan VAE's layout). Chosen by measurement: with temporal compression
  off the transformer sees 832 tokens instead of 256 and a training step of the same batch costs 7.5x more
  (12.4 s vs 1.65 s, batch 48, one thread). ``latents_mean`` / ``latents_std`` (per channel) are set from
  encoded training clips, so the pipeline's normalisation holds.
- ``text_encoder``: ``UMT5EncoderModel`` (2 layers, width 64) with a world ``T5Tokenizer`` (a unigram vocabulary
  in which every word of the moving-shapes prompts is one piece; any other text falls back to characters).
- ``transformer``: ``WanTransformer3DModel``, patch (1, 2, 2): 64 tokens per latent frame, 256 per clip.
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler(shift=3.0)``.

Training, over one global step counter (one ``--resume`` covers every stage):

1. **VAE** (``--vae-steps``): L1 + MSE reconstruction of posterior samples (decoded without the VAE's output clamp:
   see ``decode_unclamped``), the objects' pixels weighted ``1 + --ink-weight`` (5: without it the causal VAE sits
   for hundreds of steps at blank white frames, the best answer for the 90% of pixels that are background;
   measured on one batch of 4 clips, error on the objects' pixels after 120 steps 0.16 with it, 0.42 without),
   + ``--kl-weight`` x KL on ``--vae-frames``-frame clips (13, the clips the pipeline makes: the causal decoder
   trained on 9-frame clips only, 1 + 4 + 4, drifts in colour in the fourth chunk), then the per-channel latent
   mean / std over ``--stat-batches`` batches of 13-frame clips.
2. **Flow matching** (``--flow-steps``): transformer and text encoder, frozen VAE, rectified flow as Wan:
   x_σ = (1-σ)·x₀ + σ·ε, v = ε - x₀, timestep 1000·σ, σ logit-normal shifted by 3 (the sampler's shift).
   "" replaces the caption with probability ``--cfg-dropout`` (the pipeline's negative prompt). EMA weights ship.

**The caption flaw.** Web captions get motion wrong: with probability ``--opposite-prob`` (0.25) a caption that
names a direction comes with a clip moving the opposite way, and with ``--still-prob`` (0.15) with a clip that
does not move (``flowgrpo.world.corrupt_motion``). Captions that name no direction (``colors``, ``counting``)
already show random motion. The pipeline then moves objects the wrong way or not at all about that often, for
training and held-out prompts alike, and guidance cannot remove it: the failure GRPO with a motion reward fixes.

Data: fresh clips from ``flowgrpo.world`` (uniform tag, then uniform classes, colours, counts, directions, speeds;
``two_object_motion`` over all 2880 combinations); the held-out prompts (``assets/prompts/motion_held_out.jsonl``) are
never rendered. The flow stage draws its batches from a bank of encoded clips refreshed every step
(``--bank-size`` / ``--bank-refresh``; encoding 32 clips costs 0.77 s, 70% of their transformer step's 1.1 s, one thread).

Padding: WanPipeline pads the UMT5 embeddings with zeros to ``max_sequence_length`` (512 by default). Identical
tokens are identical keys and values in every cross-attention, so N of them act like one with attention logit
+ log N; training feeds one (``CollapsedPadWanProcessor``), N the pipeline's count half the time and
log-uniform in [1, 512] otherwise (any ``max_sequence_length`` works). ``tests/test_pretrain_tiny_wan.py``
checks the equality with the pipeline's forward.

Continuing a saved pipeline: ``--init-from DIR --vae-steps 0`` starts the flow stage from DIR's weights (VAE, latent
statistics, text encoder, transformer; fresh optimizer, EMA from those weights), and ``--tag-weights motion=3,...``
draws the clips' tags with those relative weights instead of uniformly (the caption flaw is unchanged).
``--frame-noise-prob P`` noises a share P of the clips latent frame by latent frame (``frame_sigmas``, one timestep
per token): a frame much noisier than its neighbours can only be predicted from them and the words. Measured on a
2,000-step continuation of the shipped asset at P = 0.5: it did not teach the direction words (docs/reports/assets.md).

Resume: ``<ckpt-dir>/last.pt`` is replaced atomically every ``--ckpt-every`` steps with weights, optimizer states,
EMA, every RNG state and the log; a resumed run ends bit-identical to an uninterrupted one (same device, threads).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pretrain_tiny import (bank_batch, ema_pipeline, lr_at, sample_sigmas, save_pipeline, save_state,  # noqa: E402
                           train_loop)  # (shared with the image asset)

from flowgrpo import jsonio  # noqa: E402
from flowgrpo.world import (  # noqa: E402
    CLASSES,
    COUNT_WORDS,
    DIRECTIONS,
    MOTION_TAGS,
    NUM_FRAMES,
    PALETTE,
    SPEEDS,
    corrupt_motion,
    draw_clip,
    motion_metadata_for,
    sample_tracks,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "assets" / "tiny-wan-shapes"
DEFAULT_CKPT = ROOT / "outputs" / "pretrain_tiny_wan"  # git-ignored
TEST_PROMPTS = ROOT / "assets" / "prompts" / "motion_held_out.jsonl"
PIPELINE_MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s default

SIZES = {
    "asset": dict(vae_base=8, t5_width=64, t5_layers=2, t5_heads=4, layers=4, heads=4, head_dim=32, ffn=512),
    "toy": dict(vae_base=4, t5_width=16, t5_layers=1, t5_heads=2, layers=1, heads=2, head_dim=12, ffn=32),
}


# ---------------------------------------------------------------------------------------------- tokenizer
def world_words() -> list[str]:
    """Every word a moving-shapes prompt can use."""
    words = ["a", "an", "and", "moving", "standing", "still", "to", "the", *DIRECTIONS, *SPEEDS]
    words += list(PALETTE) + list(CLASSES) + [c + ("es" if c.endswith("s") else "s") for c in CLASSES] + list(COUNT_WORDS)
    return list(dict.fromkeys(words))


def world_tokenizer() -> T5Tokenizer:
    """A unigram T5 tokenizer: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, then one piece per world word (``▁red``) and
    characters as the fallback; a word piece scores higher than any spelling of it, so each world word is one token."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [("▁" + w, -1.0) for w in world_words()]
    pieces += [(chr(c), -2.0) for c in range(33, 127)]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0)
    for word in world_words():
        ids = tokenizer(word, add_special_tokens=False).input_ids
        assert len(ids) == 1, f"world word {word!r} tokenizes to {tokenizer.convert_ids_to_tokens(ids)}"
    return tokenizer


# ---------------------------------------------------------------------------------------------- models
def build_pipeline(size: str = "asset", seed: int = 0) -> WanPipeline:
    s = SIZES[size]
    tokenizer = world_tokenizer()
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=s["vae_base"],
        z_dim=16,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[True, True],  # temporal 4x
        scale_factor_temporal=4,
        scale_factor_spatial=4,
        latents_mean=[0.0] * 16,  # set from data after the VAE stage
        latents_std=[1.0] * 16,
    )
    torch.manual_seed(seed + 1)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(tokenizer), d_model=s["t5_width"], d_kv=s["t5_width"] // s["t5_heads"],
                   d_ff=2 * s["t5_width"], num_layers=s["t5_layers"], num_heads=s["t5_heads"],
                   relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
                   eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)  # fmt: skip
    )
    torch.manual_seed(seed + 2)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=s["heads"],
        attention_head_dim=s["head_dim"],
        in_channels=16,
        out_channels=16,
        text_dim=s["t5_width"],
        freq_dim=64,
        ffn_dim=s["ffn"],
        num_layers=s["layers"],
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))  # fmt: skip


def encode_text(pipe: WanPipeline, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """UMT5 embeddings of the real tokens (prompt + ``</s>``), with gradients: ``[B, L, W]`` zero-padded to the
    longest prompt of the batch, and the number of real tokens per prompt ``[B]`` (what the pipeline keeps)."""
    tok = pipe.tokenizer(prompts, padding="longest", return_attention_mask=True, return_tensors="pt")
    ids, mask = tok.input_ids.to(pipe.text_encoder.device), tok.attention_mask.to(pipe.text_encoder.device)
    embeds = pipe.text_encoder(ids, mask).last_hidden_state * mask[..., None]
    return embeds, mask.sum(1)


class CollapsedPadWanProcessor(WanAttnProcessor):
    """Cross-attention where the LAST context token stands for ``n`` identical zero tokens: its attention logit is
    raised by ``log n`` (``self.log_count`` ``[B]``); the padding between a prompt's real tokens and that last token
    is masked out (``self.valid`` ``[B, S]``). Exact: n identical keys / values contribute n·exp(q·k)·v."""

    def __init__(self):
        super().__init__()
        self.log_count: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is None or self.log_count is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        bias = torch.zeros(self.valid.shape, device=hidden_states.device, dtype=hidden_states.dtype)
        bias = bias.masked_fill(~self.valid, float("-inf"))
        bias[:, -1] = self.log_count.to(bias.dtype)
        return super().__call__(attn, hidden_states, encoder_hidden_states, bias[:, None, None, :], rotary_emb)


def collapsed_velocity(transformer, x, timestep, embeds, lengths, pad_counts):
    """Transformer forward with the pipeline's ``pad_counts`` zero tokens after each prompt's ``lengths`` real ones
    (``embeds`` zero beyond them), computed with one token standing for them (module doc)."""
    b, s, _ = embeds.shape
    context = torch.cat([embeds, embeds.new_zeros(b, 1, embeds.shape[-1])], 1)
    valid = torch.arange(s + 1, device=embeds.device)[None, :] < lengths[:, None]
    valid[:, -1] = pad_counts > 0
    processors = transformer.attn_processors
    collapsed = CollapsedPadWanProcessor()
    collapsed.log_count = torch.log(pad_counts.clamp(min=1).float())
    collapsed.valid = valid
    transformer.set_attn_processor({k: collapsed if ".attn2." in k else v for k, v in processors.items()})
    try:
        return transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=context, return_dict=False)[0]
    finally:
        transformer.set_attn_processor(processors)


def frame_sigmas(sigma: torch.Tensor, shape, prob: float, shift: float, patch_size) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise levels with some clips noised latent frame by latent frame (the idea of Diffusion Forcing, arXiv
    2407.01392): with probability ``prob`` a clip's frames get independent levels from the same distribution,
    otherwise all share its ``sigma``. Returns the levels broadcastable to latents of ``shape`` ``[n, C, F, H, W]``
    and the transformer's timesteps, one per token (``[n, F·H·W / patch]``, the form ``WanTransformer3DModel`` takes
    for Wan 2.2): a clip of one level gets that level on every token, which is the ordinary forward.

    Why: when every frame shares one level, a clip whose layout shows through the noise already says which way its
    objects move, so the words naming the motion help only near pure noise and the model learns them last. A frame
    much noisier than its neighbours must be predicted from them and the words (a hypothesis: on the shipped asset it
    did not teach the motion words, docs/reports/assets.md)."""
    n, _, frames, height, width = shape
    own = sample_sigmas(n * frames, shift, sigma.device).view(n, frames)
    mixed = torch.rand(n, device=sigma.device) < prob
    levels = torch.where(mixed[:, None], own, sigma[:, None].expand(n, frames))
    return levels.view(n, 1, frames, 1, 1), token_timesteps(levels, height, width, patch_size)


def token_timesteps(levels: torch.Tensor, height: int, width: int, patch_size) -> torch.Tensor:
    """Per-frame noise levels ``[n, F]`` of latents ``height`` x ``width`` as the transformer's per-token timesteps
    ``[n, F·H·W / patch]`` (frame-major, as the patch embedding flattens them)."""
    tokens = (height // patch_size[1]) * (width // patch_size[2])
    return (levels * 1000.0).repeat_interleave(tokens, dim=1)


def normalised_latents(vae: AutoencoderKLWan, x: torch.Tensor, sample: bool = True) -> torch.Tensor:
    """Latents of clips ``x`` in [-1, 1] as the pipeline uses them: (z - latents_mean) / latents_std, per channel; z a
    posterior sample (``sample``) or its mean."""
    dist = vae.encode(x).latent_dist
    z = dist.sample() if sample else dist.mean
    mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
    return (z - mean) / std


def decode_unclamped(vae: AutoencoderKLWan, z: torch.Tensor) -> torch.Tensor:
    """``vae.decode(z)`` without its final clamp to [-1, 1]. The clamp has zero gradient outside the range, and the
    world's white background sits exactly at +1: trained through it, a decoder that overshoots white gets no
    gradient and the VAE collapses to blank frames. Same causal frame-by-frame loop as ``AutoencoderKLWan._decode``
    (no tiling, no patchify: this VAE uses neither)."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = []
    for i in range(x.shape[2]):
        vae._conv_idx = [0]
        frames.append(vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(frames, 2)


# ---------------------------------------------------------------------------------------------- data
def held_out_prompts(path: Path = TEST_PROMPTS) -> set[str]:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run python scripts/make_prompts.py (it writes the held-out split)")
    return {json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()}


def random_motion_metadata(rng: np.random.Generator, tag_probs: np.ndarray | None = None) -> dict:
    """One metadata dict: a tag (uniform, or ``tag_probs`` over ``MOTION_TAGS``), then uniform classes / colours /
    directions / speed / count."""
    if tag_probs is None:
        tag = MOTION_TAGS[int(rng.integers(len(MOTION_TAGS)))]
    else:
        tag = MOTION_TAGS[int(rng.choice(len(MOTION_TAGS), p=tag_probs))]
    classes = tuple(CLASSES[i] for i in rng.permutation(len(CLASSES))[:2])
    colors = tuple(list(PALETTE)[i] for i in rng.permutation(len(PALETTE))[:2])
    dirs = tuple(DIRECTIONS[int(i)] for i in rng.integers(len(DIRECTIONS), size=2))
    if tag == "two_object_motion":
        return motion_metadata_for(tag, classes, colors, dirs)
    if tag == "counting":
        return motion_metadata_for(tag, classes[0], colors[0], count=int(rng.integers(2, 5)))
    if tag == "speed":
        return motion_metadata_for(tag, classes[0], colors[0], dirs[0], speed=SPEEDS[int(rng.integers(2))])
    return motion_metadata_for(tag, classes[0], colors[0], {"motion": dirs[0], "static": "still"}.get(tag))


def render_batch(rng, batch: int, exclude: set[str], num_frames: int, opposite: float = 0.0, still: float = 0.0,
                 tag_probs: np.ndarray | None = None):
    """Fresh clips in [-1, 1] ``[B, 3, T, 64, 64]`` and their captions (with the caption flaw when asked)."""
    clips, prompts = [], []
    while len(prompts) < batch:
        meta = random_motion_metadata(rng, tag_probs)
        if meta["prompt"] in exclude:
            continue
        shown = corrupt_motion(meta, rng, opposite, still) if opposite or still else meta
        clips.append(draw_clip(sample_tracks(shown, rng, num_frames=num_frames), num_frames=num_frames))
        prompts.append(meta["prompt"])
    x = torch.from_numpy(np.stack(clips)).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
    return x, prompts


def sample_pad_counts(lengths: torch.Tensor) -> torch.Tensor:
    """Half the time the pipeline default (512 - real tokens), else log-uniform in [1, 512]."""
    free = torch.exp(torch.rand(lengths.shape) * math.log(512.0)).round().clamp(min=1.0).long()
    default = (PIPELINE_MAX_SEQUENCE_LENGTH - lengths.cpu()).clamp(min=0)
    return torch.where(torch.rand(lengths.shape) < 0.5, default, free).to(lengths.device)


# ---------------------------------------------------------------------------------------------- training
class Trainer:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.pipe = build_pipeline(args.size, args.seed).to(self.device)
        self.vae = self.pipe.vae
        self.flow_modules = [self.pipe.transformer, self.pipe.text_encoder]
        self.flow_params = [p for m in self.flow_modules for p in m.parameters()]
        self.vae_opt = torch.optim.AdamW(self.vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
        self.flow_opt = torch.optim.AdamW(self.flow_params, lr=args.lr, weight_decay=0.01)
        self.ema = [p.detach().clone() for p in self.flow_params]
        self.step = 0
        self.log: list[dict] = []
        self.data_rng = np.random.default_rng(args.seed)
        self.bank: tuple[torch.Tensor, list[str]] | None = None  # encoded clips of the flow stage (flow_batch)
        self.exclude = held_out_prompts()
        self.tag_probs = parse_tag_weights(args.tag_weights)
        if args.init_from:
            self.init_from(Path(args.init_from))
        torch.manual_seed(args.seed)
        random.seed(args.seed)

    def init_from(self, path: Path) -> None:
        """Start from a saved pipeline (its VAE, latent statistics, text encoder and transformer; the EMA starts at
        its weights): the flow stage continues a trained pipeline with fresh optimizer state."""
        if not (path / "model_index.json").exists():
            raise SystemExit(f"--init-from {path}: no model_index.json there (a WanPipeline.save_pretrained directory)")
        if self.args.vae_steps:
            raise SystemExit(f"--init-from loads a trained VAE: pass --vae-steps 0 (got {self.args.vae_steps})")
        src = WanPipeline.from_pretrained(path)
        for name in ("vae", "transformer", "text_encoder"):
            getattr(self.pipe, name).load_state_dict(getattr(src, name).state_dict())
        self.vae.register_to_config(latents_mean=list(src.vae.config.latents_mean), latents_std=list(src.vae.config.latents_std))
        self.vae.eval()
        self.ema = [p.detach().clone() for p in self.flow_params]

    @property
    def total(self) -> int:
        return self.args.vae_steps + self.args.flow_steps

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "args": vars(self.args),
            "models": {n: getattr(self.pipe, n).state_dict() for n in ("vae", "transformer", "text_encoder")},
            "latent_stats": (list(self.vae.config.latents_mean), list(self.vae.config.latents_std)),
            "vae_opt": self.vae_opt.state_dict(),
            "flow_opt": self.flow_opt.state_dict(),
            "ema": self.ema,
            "log": self.log,
            "bank": self.bank,
            "rng": {"numpy": self.data_rng.bit_generator.state, "torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        for name, sd in state["models"].items():
            getattr(self.pipe, name).load_state_dict(sd)
        mean, std = state["latent_stats"]
        self.vae.register_to_config(latents_mean=mean, latents_std=std)
        self.vae_opt.load_state_dict(state["vae_opt"])
        self.flow_opt.load_state_dict(state["flow_opt"])
        self.ema = [e.to(self.device) for e in state["ema"]]
        self.log = state["log"]
        self.bank = state.get("bank")
        self.data_rng.bit_generator.state = state["rng"]["numpy"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])

    def save_checkpoint(self) -> None:
        save_state(self.state_dict(), Path(self.args.ckpt_dir))

    def latents(self, x: torch.Tensor, sample: bool = True) -> torch.Tensor:
        return normalised_latents(self.vae, x.to(self.device), sample)

    def vae_step(self) -> dict:
        args = self.args
        for g in self.vae_opt.param_groups:
            g["lr"] = lr_at(self.step, args.vae_steps, args.vae_lr, args.warmup)
        x, _ = render_batch(self.data_rng, args.vae_batch, self.exclude, args.vae_frames)
        x = x.to(self.device)
        posterior = self.vae.encode(x).latent_dist
        recon = decode_unclamped(self.vae, posterior.sample())
        ink = (x < 0.9).any(1, keepdim=True).expand_as(x)  # the objects' pixels (edges included)
        weight = 1.0 + args.ink_weight * ink.float()
        err = recon - x
        rec = (weight * err.abs()).mean() + (weight * err.pow(2)).mean()
        kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()
        loss = rec + args.kl_weight * kl
        self.vae_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.vae.parameters(), 1.0)
        self.vae_opt.step()
        with torch.no_grad():  # error on the objects' pixels (a blank reconstruction scores ~1 here, a good one ~0)
            ink_err = (recon.clamp(-1, 1) - x).abs()[ink].mean() if ink.any() else recon.new_zeros(())
        return {"loss": loss.item(), "rec": rec.item(), "kl": kl.item(), "ink_mae": ink_err.item()}

    @torch.no_grad()
    def set_latent_stats(self) -> None:
        self.vae.register_to_config(latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
        zs = [self.latents(render_batch(self.data_rng, self.args.vae_batch, self.exclude, self.args.num_frames)[0])
              for _ in range(self.args.stat_batches)]  # fmt: skip
        z = torch.cat(zs).transpose(0, 1).flatten(1)  # [C, N]
        mean, std = z.mean(1), z.std(1)
        self.vae.register_to_config(latents_mean=[round(v, 5) for v in mean.tolist()],
                                    latents_std=[round(v, 5) for v in std.tolist()])  # fmt: skip
        print(f"[pretrain] latent mean {mean.mean():.3f} (per channel {mean.min():.3f}..{mean.max():.3f}), std "
              f"{std.min():.3f}..{std.max():.3f}", flush=True)  # fmt: skip

    def fresh_latents(self, n: int) -> tuple[torch.Tensor, list[str]]:
        """``n`` freshly rendered clips (caption flaw included), encoded: latents ``[n, 16, F, h, w]`` and captions."""
        args = self.args
        x, prompts = render_batch(self.data_rng, n, self.exclude, args.num_frames, args.opposite_prob, args.still_prob,
                                  self.tag_probs)
        with torch.no_grad():
            return self.latents(x), prompts

    def flow_batch(self) -> tuple[torch.Tensor, list[str]]:
        """A flow-matching batch. Without a bank (``--bank-size 0``) every clip is fresh. With one, the batch is drawn
        from a bank of encoded clips of which ``--bank-refresh`` random entries are replaced by fresh clips each step
        (encoding costs 70% of the transformer's step; a bank of 2048 refreshed by 8 keeps each clip for about 256
        steps, ~4 draws). The bank is part of the checkpoint, so resume stays exact."""
        args = self.args
        if args.bank_size <= 0:
            return self.fresh_latents(args.batch)
        self.bank, latents, captions = bank_batch(self.bank, self.fresh_latents, bank_size=args.bank_size,
                                                  refresh=args.bank_refresh, batch=args.batch, device=self.device)
        return latents, captions

    def flow_step(self) -> dict:
        args, pipe = self.args, self.pipe
        for g in self.flow_opt.param_groups:
            g["lr"] = lr_at(self.step - args.vae_steps, args.flow_steps, args.lr, args.warmup)
        x0, prompts = self.flow_batch()
        n = len(prompts)
        drop = torch.rand(n) < args.cfg_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        sigma = sample_sigmas(n, args.shift, self.device)
        noise = torch.randn_like(x0)
        if args.frame_noise_prob > 0:  # some clips noised frame by frame, one timestep per token
            sigma, timestep = frame_sigmas(sigma, x0.shape, args.frame_noise_prob, args.shift,
                                           pipe.transformer.config.patch_size)
        else:
            sigma, timestep = sigma.view(-1, 1, 1, 1, 1), sigma * 1000.0
        xt = (1.0 - sigma) * x0 + sigma * noise
        embeds, lengths = encode_text(pipe, prompts)
        v = collapsed_velocity(pipe.transformer, xt, timestep, embeds, lengths, sample_pad_counts(lengths))
        loss = F.mse_loss(v.float(), noise - x0)
        self.flow_opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(self.flow_params, 1.0)
        self.flow_opt.step()
        with torch.no_grad():
            k = self.step - args.vae_steps
            torch._foreach_lerp_(self.ema, [p.detach() for p in self.flow_params], 1.0 - min(args.ema, (1 + k) / (10 + k)))
        return {"loss": loss.item(), "grad": grad.item()}

    @torch.no_grad()
    def probe_vae(self, n: int) -> dict:
        """How much of the world survives the VAE: video GenEval of the reconstructions of ``n`` rendered clips of
        held-out prompts (the ceiling of any pipeline built on it), next to the rendered clips' own score."""
        import rewards

        rng = np.random.default_rng(12345)
        test = [json.loads(line) for line in TEST_PROMPTS.read_text().splitlines() if line.strip()]
        metas = [test[int(i)] for i in rng.choice(len(test), min(n, len(test)), replace=False)]
        clips = torch.from_numpy(np.stack([draw_clip(sample_tracks(m, rng, num_frames=self.args.num_frames),
                                                     num_frames=self.args.num_frames) for m in metas]))  # fmt: skip
        x = clips.permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
        self.vae.eval()
        recon = torch.cat([self.vae.decode(self.vae.encode(x[i : i + 8].to(self.device)).latent_dist.mean).sample.cpu()
                           for i in range(0, len(x), 8)])  # fmt: skip
        judge = rewards.load("video_geneval", score="strict")
        ours = judge(((recon + 1) / 2).permute(0, 2, 1, 3, 4), metadata=metas)
        truth = judge(clips.permute(0, 1, 4, 2, 3).float() / 255, metadata=metas)
        checks = {k: np.asarray(v, dtype=float) for k, v in ours.components.items() if k.startswith("check/")}
        checks = {k: round(float(np.nanmean(v)), 3) for k, v in checks.items() if np.isfinite(v).any()}  # applicable ones
        return {"step": self.step, "clips": len(metas), "reconstruction_strict": round(float(ours.scores.mean()), 3),
                "rendered_strict": round(float(truth.scores.mean()), 3), **checks}  # fmt: skip

    # -- loop (pretrain_tiny.train_loop's hooks)
    def stage(self) -> str:
        return "vae" if self.step < self.args.vae_steps else "flow"

    def train_step(self, stage: str) -> dict:
        self.vae.train(stage == "vae")
        for m in self.flow_modules:
            m.train(stage == "flow")
        return self.vae_step() if stage == "vae" else self.flow_step()

    def end_of_vae(self) -> None:
        self.vae.eval()
        self.set_latent_stats()

    def checkpoint_steps(self) -> tuple[int, ...]:
        return (self.args.vae_steps, self.total, self.args.stop_at)

    def after_step(self) -> None:
        args = self.args
        if args.export_every and self.step > args.vae_steps and self.step % args.export_every == 0:
            self.export()

    def run(self) -> None:
        train_loop(self)

    def final_pipeline(self) -> WanPipeline:
        """The pipeline with the EMA weights, eval mode, on CPU (training weights untouched)."""
        return ema_pipeline(self.pipe, ("transformer", "text_encoder"), self.ema)

    def export(self) -> None:
        summary = {"script": "scripts/pretrain_tiny_wan.py", "step": self.step, "args": vars(self.args), "last_log": self.log[-5:]}
        save_pipeline(self.final_pipeline(), Path(self.args.out), summary)


def parse_tag_weights(spec: str | None) -> np.ndarray | None:
    """``"motion=3,speed=2"`` -> probabilities over ``MOTION_TAGS`` (tags not named weigh 1); None: uniform."""
    if not spec:
        return None
    weights = dict.fromkeys(MOTION_TAGS, 1.0)
    for item in spec.split(","):
        tag, _, value = item.partition("=")
        if tag.strip() not in weights or not value:
            raise SystemExit(f"--tag-weights: {item!r} is not TAG=WEIGHT with TAG one of {', '.join(MOTION_TAGS)}")
        weights[tag.strip()] = float(value)
    w = np.array([weights[t] for t in MOTION_TAGS])
    if (w < 0).any() or w.sum() <= 0:
        raise SystemExit(f"--tag-weights {spec!r}: weights must be >= 0 and not all 0")
    return w / w.sum()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="asset", help="model sizes (toy: tests)")
    p.add_argument("--num-frames", type=int, default=NUM_FRAMES, help="frames per training clip (4k+1)")
    p.add_argument("--vae-steps", type=int, default=2500)
    p.add_argument("--vae-batch", type=int, default=8)
    p.add_argument("--vae-frames", type=int, default=13, help="frames per VAE training clip (4k+1)")
    p.add_argument("--vae-lr", type=float, default=1e-3)
    p.add_argument("--kl-weight", type=float, default=1e-3, help="KL to N(0,I), per latent element")
    p.add_argument("--ink-weight", type=float, default=5.0, help="extra reconstruction weight of the objects' pixels")
    p.add_argument("--stat-batches", type=int, default=8, help="batches for the per-channel latent mean / std")
    p.add_argument("--flow-steps", type=int, default=8000)
    p.add_argument("--batch", type=int, default=32, help="flow-matching batch")
    p.add_argument("--lr", type=float, default=2.5e-4, help="flow-matching peak lr")
    p.add_argument("--bank-size", type=int, default=2048, help="encoded clips the flow stage draws from (0: fresh clips every step)")
    p.add_argument("--bank-refresh", type=int, default=8, help="bank entries replaced by fresh clips each flow step")
    p.add_argument("--warmup", type=int, default=100, help="lr warmup steps of each stage")
    p.add_argument("--shift", type=float, default=3.0, help="timestep shift of the training sigmas (= sampler's)")
    p.add_argument("--opposite-prob", type=float, default=0.25, help="P(a named direction is shown reversed)")
    p.add_argument("--still-prob", type=float, default=0.15, help="P(a named direction is shown standing still)")
    p.add_argument("--tag-weights", default=None, metavar="TAG=W,...",
                   help="relative frequency of each prompt tag in the flow stage's clips (unnamed tags 1; default uniform)")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start the flow stage from a saved pipeline (with --vae-steps 0) instead of from scratch")
    p.add_argument("--frame-noise-prob", type=float, default=0.0,
                   help="P(a clip's latent frames are noised at independent levels)")
    p.add_argument("--cfg-dropout", type=float, default=0.1, help="probability of the empty prompt")
    p.add_argument("--ema", type=float, default=0.999, help="EMA decay of the shipped flow weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="where save_pretrained writes the pipeline")
    p.add_argument("--ckpt-dir", default=str(DEFAULT_CKPT), help="where last.pt (the resumable state) lives")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--export-every", type=int, default=0, help="also export the EMA pipeline every N steps (0: at the end)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--stop-at", type=int, default=None, help="checkpoint and exit at this step")
    p.add_argument("--export-only", action="store_true", help="save_pretrained the checkpoint's EMA pipeline, no training")
    p.add_argument("--probe-vae", type=int, default=0, metavar="N",
                   help="no training: video GenEval (strict) of the checkpoint VAE's reconstructions of N held-out clips")
    p.add_argument("--resume", action="store_true", help="continue from <ckpt-dir>/last.pt if it exists")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)
    for key in ("num_frames", "vae_frames"):
        if (getattr(args, key) - 1) % 4:
            p.error(f"--{key.replace('_', '-')} must be 4k+1 (the VAE compresses time 4x); got {getattr(args, key)}")
    return args


def main(argv=None) -> Trainer:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    trainer = Trainer(args)
    ckpt = Path(args.ckpt_dir) / "last.pt"
    if (args.export_only or args.probe_vae) and not ckpt.exists():
        flag = "--probe-vae" if args.probe_vae else "--export-only"
        raise SystemExit(f"{flag} needs a checkpoint: {ckpt} does not exist (set --ckpt-dir)")
    if (args.resume or args.export_only or args.probe_vae) and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        for key in ("size", "seed", "vae_steps", "batch", "vae_batch", "ink_weight", "bank_size", "bank_refresh", "opposite_prob", "still_prob", "num_frames", "tag_weights", "init_from"):
            if state["args"].get(key) != getattr(args, key):
                print(f"[pretrain] warning: --{key.replace('_', '-')} {getattr(args, key)} differs from the checkpoint's {state['args'].get(key)}", flush=True)
        trainer.load_state_dict(state)
        print(f"[pretrain] resumed {ckpt} at step {trainer.step}", flush=True)
    pipe = trainer.pipe
    sizes = {n: sum(p.numel() for p in getattr(pipe, n).parameters()) for n in ("vae", "text_encoder", "transformer")}
    print(f"[pretrain] device {trainer.device}, {args.threads} threads; params "
          + ", ".join(f"{n} {v / 1e6:.2f}M" for n, v in sizes.items())
          + f"; {args.vae_steps} VAE steps x {args.vae_batch} + {args.flow_steps} flow steps x {args.batch}; "
          f"{len(trainer.exclude)} held-out prompts excluded", flush=True)  # fmt: skip
    if args.probe_vae:
        print(jsonio.dumps(trainer.probe_vae(args.probe_vae), indent=1), flush=True)
    elif args.export_only:
        trainer.export()
    else:
        trainer.run()
    return trainer


if __name__ == "__main__":
    sys.exit(main() and 0)
