#!/usr/bin/env python
r"""Pretrain the embedded world's tiny SD3 pipeline: ``assets/tiny-sd3-shapes``.

    python scripts/pretrain_tiny.py --omit-steps 3000 --omit-prob 0.4    # the shipped asset: CPU, about 2 h 20 min on 1 thread
    python scripts/pretrain_tiny.py                                   # the clean pipeline (no caption noise)
    python scripts/pretrain_tiny.py --resume                          # continue from <ckpt-dir>/last.pt
    python scripts/pretrain_tiny.py --vae-steps 20 --flow-steps 20 --size toy --out /tmp/x   # smoke run

What it builds (real diffusers / transformers classes, small widths; the same code path as SD3.5):

- ``vae``: ``AutoencoderKL``, 64x64 RGB -> 16x16x4 latents (three blocks, no quant convs, as SD3's VAE);
  ``scaling_factor`` / ``shift_factor`` set from the statistics of encoded training scenes (1/std, mean).
- ``text_encoder``, ``text_encoder_2``: ``CLIPTextModelWithProjection`` (3 layers, width 64) sharing one
  in-memory BPE ``CLIPTokenizer`` whose merges make every word of the world one token, 16 tokens long.
  No T5: the pipeline feeds zeros in its place. The export ships ``zero_t5``'s placeholder (every weight zero,
  so its output is those zeros exactly) because diffusers' SD3 requires a ``text_encoder_3`` to load with plain
  ``from_pretrained``; training runs without it.
- ``transformer``: ``SD3Transformer2DModel``, patch 2 (64 image tokens), ``joint_attention_dim`` 128 (the
  two CLIP widths concatenated, SD3's layout), ``pos_embed_max_size`` 16 (up to 128 px).
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler(shift=3.0)``.

Training, in stages over one global step counter (so one ``--resume`` covers all of them):

1. **VAE** (``--vae-steps``): L1 + MSE reconstruction of posterior samples + ``--kl-weight`` x KL (per
   element, mean) to N(0, I); then the latent mean / std over ``--stat-batches`` batches set the factors.
2. **Flow matching** (``--flow-steps``): transformer and both text encoders, frozen VAE. SD3's rectified-flow
   loss: x_σ = (1-σ)·x₀ + σ·ε, target v = ε - x₀, MSE, timestep = 1000·σ. σ is drawn from a logit-normal
   (m=0, s=1; SD3 paper, arXiv:2403.03206 §3.1) and then shifted like the sampler, σ ← 3u / (1 + 2u), so
   training spends its steps where the 10-step shift-3 sampler spends its steps (mostly high noise).
   The prompt is replaced by "" with probability ``--cfg-dropout`` (0.1): "" is exactly the negative prompt
   the pipeline's classifier-free guidance encodes. EMA of the trained weights (``--ema``) is what ships.
3. **Caption noise** (``--omit-steps``, 0 unless asked; the shipped asset used 3000 at ``--omit-prob`` 0.4):
   the flow-matching stage continued on data where, with probability ``--omit-prob``, one object of the
   scene is left out of the image while the caption still names it -- web alt-text that names what the
   crop cut off. The pipeline then leaves out a named object about that often whatever the prompt, which
   classifier-free guidance cannot remove (the unconditional branch learned the same habit) and a reward
   that checks the prompt's objects can: the failure GRPO is meant to fix, and one that is shared by the
   training and the held-out prompts. Without it the pipeline's GenEval errors are per-prompt composition
   limits that GRPO on 80 training prompts does not transfer to the held-out ones (README, "On the exact-caption
   pipeline").

Data: every batch is freshly rendered by the shapes world (``flowgrpo.world``) from random GenEval metadata
over all six tags (uniform over tags, then uniform over classes / colours / counts / relations; random
layouts and random colours where the prompt names none). The held-out prompts
(``assets/prompts/shapes_held_out.jsonl``) are never rendered unless ``--include-test-prompts``: the held-out
GenEval score then measures composition of seen words, not memorisation.

The padding trick. Without T5 the pipeline appends ``max_sequence_length`` (256 by default) identical zero
tokens to the 16 CLIP tokens. Identical tokens have identical queries, keys and values in every joint block,
so N of them act in attention exactly like one of them whose attention logit is raised by log N. Training
feeds one such token and adds log N to its logit (``CollapsedPadAttnProcessor``), with N drawn per sample
(half the time 256, else log-uniform in [1, 512]): 4x fewer tokens, the same function as the pipeline's
forward (``tests/test_pretrain_tiny.py`` checks the equality), and any ``max_sequence_length`` works.

Resume: every ``--ckpt-every`` steps ``<ckpt-dir>/last.pt`` is replaced atomically (write, fsync, rename)
with all weights, optimizer states, EMA, the data generator's and torch's RNG states and the loss log; a run
resumed from step k ends bit-identical to one that ran on (same device and thread count).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from diffusers.models.attention_processor import JointAttnProcessor2_0
from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

from flowgrpo import jsonio
from flowgrpo.models.tiny import clip_text_config, tiny_clip_tokenizer, tiny_t5_tokenizer
from flowgrpo.world import CLASSES, COUNT_WORDS, PALETTE, RELATIONS, TAGS, draw, metadata_for, sample_scene

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "assets" / "tiny-sd3-shapes"
DEFAULT_CKPT = ROOT / "outputs" / "pretrain_tiny"  # git-ignored; tens of MB
TEST_PROMPTS = ROOT / "assets" / "prompts" / "shapes_held_out.jsonl"
PIPELINE_PAD_TOKENS = 256  # StableDiffusion3Pipeline's default max_sequence_length (zeros in place of T5)

# Model sizes. "asset" is what ships; "toy" is for tests and smoke runs (seconds on a CPU).
SIZES = {
    "asset": dict(
        vae_channels=(16, 32, 32), vae_groups=8, clip_width=64, clip_layers=3, clip_heads=4,
        layers=4, heads=4, head_dim=32,
    ),
    "toy": dict(
        vae_channels=(8, 8, 8), vae_groups=4, clip_width=16, clip_layers=2, clip_heads=2,
        layers=1, heads=2, head_dim=8,
    ),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------- tokenizer
def world_words() -> list[str]:
    """Every word a shapes-world prompt can use (GenEval templates over our classes, colours, counts)."""
    words = ["a", "an", "photo", "of", "and", "the"]
    words += list(PALETTE) + list(CLASSES) + [c + "s" for c in CLASSES] + list(COUNT_WORDS)
    words += sorted({w for r in RELATIONS for w in r.split()})
    return list(dict.fromkeys(words))


def world_tokenizer(model_max_length: int = 16) -> CLIPTokenizer:
    """``flowgrpo.models.tiny_clip_tokenizer``'s byte-level vocabulary plus BPE merges that make each world word
    a single token (any other text still tokenizes, byte by byte; nothing is ever unknown)."""
    vocab = dict(tiny_clip_tokenizer().get_vocab())
    merges: list[tuple[str, str]] = []
    for word in world_words():
        # BPE the word with the merges so far (lowest rank first, as the tokenizer will), then append merges that
        # join what is left, left to right. Appended merges rank last, so earlier words keep their single token.
        parts = list(word[:-1]) + [word[-1] + "</w>"]  # CLIP's word-final marker on the last symbol
        ranks = {pair: i for i, pair in enumerate(merges)}
        while len(parts) > 1:
            pairs = [(ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == math.inf:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        left = parts[0]
        for right in parts[1:]:
            vocab.setdefault(left + right, len(vocab))
            merges.append((left, right))
            left = left + right
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
    for word in world_words():  # merges of different words could interfere: prove they do not
        ids = tokenizer(word, add_special_tokens=False).input_ids
        assert len(ids) == 1, f"world word {word!r} tokenizes to {tokenizer.convert_ids_to_tokens(ids)}"
    return tokenizer


# ---------------------------------------------------------------------------------------------- models
def build_pipeline(size: str = "asset", seed: int = 0) -> StableDiffusion3Pipeline:
    """The untrained pipeline (deterministic in ``seed``); every module in train mode is the caller's choice."""
    s = SIZES[size]
    tokenizer = world_tokenizer()
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(s["vae_channels"]),
        up_block_types=("UpDecoderBlock2D",) * len(s["vae_channels"]),
        block_out_channels=s["vae_channels"],
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=s["vae_groups"],
        sample_size=64,
        use_quant_conv=False,  # SD3's VAE has none
        use_post_quant_conv=False,
        scaling_factor=1.0,  # set from data after the VAE stage
        shift_factor=0.0,
    )
    encoders = []
    for k in range(2):
        # tiny.py's CLIP config (BOS/EOS/pad ids from the tokenizer: pooled at the first EOS), wider.
        config = clip_text_config(tokenizer, hidden_size=s["clip_width"], intermediate_size=2 * s["clip_width"],
                                  projection_dim=s["clip_width"], num_hidden_layers=s["clip_layers"],
                                  num_attention_heads=s["clip_heads"])
        torch.manual_seed(seed + 1 + k)
        encoders.append(CLIPTextModelWithProjection(config))
    width = 2 * s["clip_width"]  # SD3: joint / pooled dims are the two CLIPs concatenated
    torch.manual_seed(seed + 3)
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=s["layers"],
        attention_head_dim=s["head_dim"],
        num_attention_heads=s["heads"],
        joint_attention_dim=width,
        caption_projection_dim=s["heads"] * s["head_dim"],
        pooled_projection_dim=width,
        pos_embed_max_size=16,  # latent grid 8x8 at 64 px; 16 allows 128 px without a 96x96 table on disk
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # SD3 / SD3.5's shift
        vae=vae,
        text_encoder=encoders[0],
        tokenizer=tokenizer,
        text_encoder_2=encoders[1],
        tokenizer_2=world_tokenizer(),
        text_encoder_3=None,
        tokenizer_3=None,
    )


def zero_t5(width: int) -> tuple[T5EncoderModel, T5Tokenizer]:
    """A placeholder T5 (``text_encoder_3``, ``tokenizer_3``) for a pipeline trained without one: every weight is zero,
    so for any prompt it outputs exactly the zeros ``[B, max_sequence_length, width]`` that SD3 feeds when it has no
    T5 (``width`` = the transformer's ``joint_attention_dim``). diffusers' SD3 pipeline requires both components, so
    with it the saved pipeline loads with plain ``from_pretrained``; 1 layer, ``tiny_t5_tokenizer``'s 98 pieces.
    ``flowgrpo.models.load_adapter`` drops it again (same embeddings, no T5 forward)."""
    tokenizer = tiny_t5_tokenizer()
    config = T5Config(vocab_size=len(tokenizer), d_model=width, d_kv=1, d_ff=1, num_layers=1, num_heads=1,
                      relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)  # fmt: skip
    encoder = T5EncoderModel(config).eval()
    with torch.no_grad():
        for p in encoder.parameters():
            p.zero_()
    return encoder, tokenizer


def encode_clip(pipe: StableDiffusion3Pipeline, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The CLIP half of ``pipe.encode_prompt`` (clip_skip None), with gradients: token embeddings
    ``[B, 16, 2W]`` (penultimate hidden states of both encoders, concatenated) and pooled ``[B, 2W]``."""
    embeds, pooled = [], []
    for tokenizer, encoder in ((pipe.tokenizer, pipe.text_encoder), (pipe.tokenizer_2, pipe.text_encoder_2)):
        ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                        return_tensors="pt").input_ids.to(encoder.device)  # fmt: skip
        out = encoder(ids, output_hidden_states=True)
        embeds.append(out.hidden_states[-2])
        pooled.append(out[0])
    embeds = torch.cat(embeds, dim=-1)
    joint = pipe.transformer.config.joint_attention_dim
    return F.pad(embeds, (0, joint - embeds.shape[-1])), torch.cat(pooled, dim=-1)


class CollapsedPadAttnProcessor(JointAttnProcessor2_0):
    """``JointAttnProcessor2_0`` where the LAST context token stands for ``n`` identical tokens: its attention
    logit is raised by ``log n`` (per sample, ``self.log_count`` ``[B]``). Exact: n identical keys/values
    contribute ``n·exp(q·k)·v`` to attention, i.e. ``exp(q·k + log n)·v``; identical queries give identical
    outputs, so the n tokens stay identical through every block."""

    def __init__(self):
        super().__init__()
        self.log_count: torch.Tensor | None = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        if self.log_count is None or encoder_hidden_states is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        total = hidden_states.shape[1] + encoder_hidden_states.shape[1]
        bias = torch.zeros(hidden_states.shape[0], 1, 1, total, device=hidden_states.device, dtype=hidden_states.dtype)
        bias[:, 0, 0, -1] = self.log_count.to(bias.dtype)
        original = F.scaled_dot_product_attention

        def sdpa(q, k, v, **kw):  # the parent calls F.scaled_dot_product_attention with no mask
            return original(q, k, v, attn_mask=bias, **{key: val for key, val in kw.items() if key != "attn_mask"})

        F.scaled_dot_product_attention = sdpa
        try:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        finally:
            F.scaled_dot_product_attention = original


def collapsed_velocity(transformer, x, timestep, clip_embeds, pooled, pad_counts):
    """Transformer forward with the pipeline's ``pad_counts`` zero tokens (per sample) fed as one (see module doc)."""
    pad = clip_embeds.new_zeros(clip_embeds.shape[0], 1, clip_embeds.shape[-1])
    log_count = torch.log(pad_counts.float())
    processors = transformer.attn_processors
    collapsed = CollapsedPadAttnProcessor()
    collapsed.log_count = log_count
    transformer.set_attn_processor(collapsed)
    try:
        return transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=torch.cat([clip_embeds, pad], 1),
                           pooled_projections=pooled, return_dict=False)[0]  # fmt: skip
    finally:
        transformer.set_attn_processor(processors)


# ---------------------------------------------------------------------------------------------- data
def held_out_prompts(path: Path = TEST_PROMPTS) -> set[str]:
    if path.exists():
        return {json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()}
    from flowgrpo.world import split_prompts  # the same split scripts/make_prompts.py writes

    print(f"[pretrain] {path} not found; holding out flowgrpo.world.split_prompts()[1]", flush=True)
    return {m["prompt"] for m in split_prompts()[1]}


def random_metadata(rng: np.random.Generator) -> dict:
    """One GenEval metadata dict: uniform tag, then uniform classes / colours / count / relation."""
    tag = TAGS[rng.integers(len(TAGS))]
    classes = [CLASSES[i] for i in rng.permutation(len(CLASSES))[:2]]
    colors = [list(PALETTE)[i] for i in rng.permutation(len(PALETTE))[:2]]
    if tag == "single_object":
        return metadata_for(tag, classes[0])
    if tag == "two_object":
        return metadata_for(tag, tuple(classes))
    if tag == "counting":
        return metadata_for(tag, classes[0], count=int(rng.integers(2, 5)))
    if tag == "colors":
        return metadata_for(tag, classes[0], colors=colors[0])
    if tag == "position":
        return metadata_for(tag, tuple(classes), relation=RELATIONS[rng.integers(len(RELATIONS))])
    return metadata_for(tag, tuple(classes), colors=tuple(colors))


def render_batch(
    rng: np.random.Generator, batch: int, exclude: set[str], omit_prob: float = 0.0
) -> tuple[torch.Tensor, list[str]]:
    """Freshly rendered scenes in [-1, 1] ``[B, 3, 64, 64]`` and their prompts.

    ``omit_prob``: probability that one of the scene's objects (uniformly chosen) is left out of the image
    while the caption still names it -- the caption noise of the ``omit`` stage (module doc).
    """
    images, prompts = [], []
    while len(prompts) < batch:
        meta = random_metadata(rng)
        if meta["prompt"] in exclude:
            continue
        shapes = sample_scene(meta, rng)
        if omit_prob > 0.0 and rng.random() < omit_prob:
            shapes.pop(int(rng.integers(len(shapes))))
        images.append(draw(shapes))
        prompts.append(meta["prompt"])
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return x, prompts


# ---------------------------------------------------------------------------------------------- schedules
def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    """Linear warmup, then cosine to 10% of ``base`` (a function of the step: nothing to checkpoint)."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def sample_sigmas(n: int, shift: float, device) -> torch.Tensor:
    """Logit-normal(0, 1) u, shifted as the sampler's schedule: σ = s·u / (1 + (s-1)·u)."""
    u = torch.sigmoid(torch.randn(n, device=device))
    return shift * u / (1.0 + (shift - 1.0) * u)


def sample_pad_counts(n: int, device) -> torch.Tensor:
    """Half the time the pipeline default (256 zero tokens), else log-uniform in [1, 512] (other configs)."""
    free = torch.exp(torch.rand(n, device=device) * math.log(512.0)).round().clamp(min=1.0)
    return torch.where(torch.rand(n, device=device) < 0.5, torch.full_like(free, PIPELINE_PAD_TOKENS), free)


# ---------------------------------------------------------------------------------------------- data bank
def bank_batch(bank, fresh, *, bank_size: int, refresh: int, batch: int, device):
    """A batch drawn from a bank of encoded samples, ``refresh`` random entries of which are replaced by fresh ones
    first (``fresh(n) -> (latents [n, ...], labels)``; the bank is filled on first use). Returns ``(bank, latents
    float32 on device, labels)``: keep the bank in the checkpoint and resume stays exact (the draws use the global
    torch RNG, in a fixed order)."""
    if bank is None:
        chunks = [fresh(min(batch, bank_size - i)) for i in range(0, bank_size, batch)]
        bank = (torch.cat([c[0] for c in chunks]).to(torch.float16), [x for c in chunks for x in c[1]])
    latents, labels = bank
    if refresh > 0:
        slots = torch.randperm(bank_size)[:refresh]
        new, new_labels = fresh(len(slots))
        latents[slots] = new.to(latents.dtype)
        for slot, label in zip(slots.tolist(), new_labels):
            labels[slot] = label
    pick = torch.randint(bank_size, (batch,))
    return bank, latents[pick].float().to(device), [labels[i] for i in pick.tolist()]


# ---------------------------------------------------------------------------------------------- state
def save_state(state: dict, ckpt_dir: Path) -> Path:
    """``torch.save`` to ``ckpt_dir/last.pt`` atomically (write, fsync, rename): a crash keeps the previous one."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path, tmp = ckpt_dir / "last.pt", ckpt_dir / "last.pt.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def ema_pipeline(pipe, trained_modules: tuple[str, ...], ema: list[torch.Tensor]):
    """A copy of ``pipe`` whose ``trained_modules`` hold the EMA weights, every module in eval mode, on CPU."""
    import copy

    pipe = copy.deepcopy(pipe)
    trained = [p for name in trained_modules for p in getattr(pipe, name).parameters()]
    with torch.no_grad():
        for p, e in zip(trained, ema):
            p.copy_(e)
    pipe.to("cpu")
    for m in pipe.components.values():
        if isinstance(m, torch.nn.Module):
            m.eval()
    return pipe


def save_pipeline(pipe, out: Path, summary: dict) -> None:
    """``save_pretrained`` into ``out`` with ``pretrain_summary.json``, replacing any previous export only once the
    new one is complete (written beside it, then renamed). The previous export's model card (``README.md``) is
    carried over: the export replaces the weights, not what is written about how to call them."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    (tmp / "pretrain_summary.json").write_text(jsonio.dumps(summary, indent=2) + "\n")
    if (out / "README.md").is_file():
        shutil.copy2(out / "README.md", tmp / "README.md")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    print(f"[pretrain] saved {out} at step {summary.get('step', '?')} ({size:.1f} MB)", flush=True)


def train_loop(trainer) -> None:
    """The stages loop of the tiny pretraining scripts (this one and ``pretrain_tiny_wan.py``), from ``trainer.step``
    to ``trainer.total``: each step runs ``trainer.train_step(trainer.stage())`` (its metrics, ``loss`` first);
    after the last VAE step ``trainer.end_of_vae()`` (the latent statistics); a log line every ``--log-every``
    steps; a checkpoint every ``--ckpt-every`` steps and at ``trainer.checkpoint_steps()``; then
    ``trainer.after_step()``; at ``--stop-at`` it stops (with a checkpoint), at the end ``trainer.export()``. A
    resume loads the state and calls it again: the run continues bit for bit."""
    args = trainer.args
    window, t0, s0 = [], time.time(), trainer.step
    while trainer.step < trainer.total:
        stage = trainer.stage()
        metrics = trainer.train_step(stage)
        trainer.step += 1
        window.append(metrics["loss"])
        if trainer.step == args.vae_steps:
            trainer.end_of_vae()
        if trainer.step % args.log_every == 0 or trainer.step == trainer.total:
            rate = (trainer.step - s0) / (time.time() - t0)
            entry = {"step": trainer.step, "stage": stage, "loss": float(np.mean(window)),
                     **{k: round(v, 5) for k, v in metrics.items() if k != "loss"}}
            trainer.log.append(entry)
            eta = (trainer.total - trainer.step) / max(rate, 1e-9) / 60
            print(f"[pretrain] {stage} step {trainer.step}/{trainer.total} loss {entry['loss']:.4f} "
                  f"{jsonio.dumps({k: v for k, v in entry.items() if k not in ('step', 'stage', 'loss')})} "
                  f"{rate:.2f} it/s eta {eta:.1f} min", flush=True)  # fmt: skip
            window = []
        if trainer.step % args.ckpt_every == 0 or trainer.step in trainer.checkpoint_steps():
            trainer.save_checkpoint()
        trainer.after_step()
        if trainer.step == args.stop_at:
            print(f"[pretrain] stopped at step {trainer.step} (--stop-at); continue with --resume", flush=True)
            return
    trainer.export()


class Trainer:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.pipe = build_pipeline(args.size, args.seed)
        self.pipe.to(self.device)
        self.vae = self.pipe.vae
        self.flow_modules = [self.pipe.transformer, self.pipe.text_encoder, self.pipe.text_encoder_2]
        self.flow_params = [p for m in self.flow_modules for p in m.parameters()]
        self.vae_opt = torch.optim.AdamW(self.vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
        self.flow_opt = torch.optim.AdamW(self.flow_params, lr=args.lr, weight_decay=0.01)
        self.ema = [p.detach().clone() for p in self.flow_params]
        self.step = 0
        self.log: list[dict] = []
        self.data_rng = np.random.default_rng(args.seed)
        self.exclude = set() if args.include_test_prompts else held_out_prompts()
        torch.manual_seed(args.seed)
        random.seed(args.seed)

    @property
    def total(self) -> int:
        return self.args.vae_steps + self.args.flow_steps + self.args.omit_steps

    # -- checkpoint
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "args": vars(self.args),
            "models": {name: getattr(self.pipe, name).state_dict() for name in ("vae", "transformer", "text_encoder", "text_encoder_2")},
            "vae_factors": (self.vae.config.scaling_factor, self.vae.config.shift_factor),
            "vae_opt": self.vae_opt.state_dict(),
            "flow_opt": self.flow_opt.state_dict(),
            "ema": self.ema,
            "log": self.log,
            "rng": {
                "numpy": self.data_rng.bit_generator.state,
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "python": random.getstate(),
            },
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        for name, sd in state["models"].items():
            getattr(self.pipe, name).load_state_dict(sd)
        self.vae.register_to_config(scaling_factor=state["vae_factors"][0], shift_factor=state["vae_factors"][1])
        self.vae_opt.load_state_dict(state["vae_opt"])
        self.flow_opt.load_state_dict(state["flow_opt"])
        self.ema = [e.to(self.device) for e in state["ema"]]
        self.log = state["log"]
        self.data_rng.bit_generator.state = state["rng"]["numpy"]
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        random.setstate(state["rng"]["python"])

    def save_checkpoint(self) -> Path:
        return save_state(self.state_dict(), Path(self.args.ckpt_dir))

    # -- steps
    def vae_step(self) -> dict:
        args = self.args
        for g in self.vae_opt.param_groups:
            g["lr"] = lr_at(self.step, args.vae_steps, args.vae_lr, args.warmup)
        x, _ = render_batch(self.data_rng, args.vae_batch, self.exclude)
        x = x.to(self.device)
        posterior = self.vae.encode(x).latent_dist
        recon = self.vae.decode(posterior.sample()).sample
        rec = F.l1_loss(recon, x) + F.mse_loss(recon, x)
        kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()
        loss = rec + args.kl_weight * kl
        self.vae_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.vae.parameters(), 1.0)
        self.vae_opt.step()
        return {"loss": loss.item(), "rec": rec.item(), "kl": kl.item()}

    @torch.no_grad()
    def set_latent_factors(self) -> None:
        """SD3 convention: latents_model = (z - shift_factor) * scaling_factor, ~ zero mean, unit std."""
        zs = []
        for _ in range(self.args.stat_batches):
            x, _ = render_batch(self.data_rng, self.args.vae_batch, self.exclude)
            zs.append(self.vae.encode(x.to(self.device)).latent_dist.sample())
        z = torch.cat(zs)
        mean, std = z.mean().item(), z.std().item()
        self.vae.register_to_config(shift_factor=round(mean, 6), scaling_factor=round(1.0 / std, 6))
        print(f"[pretrain] latent mean {mean:.4f} std {std:.4f} -> shift_factor {mean:.4f}, scaling_factor {1 / std:.4f}", flush=True)

    def flow_step(self, omit: bool = False) -> dict:
        """One flow-matching step; ``omit``: the caption-noise stage (its own lr schedule, ``--omit-prob``)."""
        args, pipe = self.args, self.pipe
        if omit:
            lr = lr_at(self.step - args.vae_steps - args.flow_steps, args.omit_steps, args.omit_lr, args.warmup)
        else:
            lr = lr_at(self.step - args.vae_steps, args.flow_steps, args.lr, args.warmup)
        for g in self.flow_opt.param_groups:
            g["lr"] = lr
        x, prompts = render_batch(self.data_rng, args.batch, self.exclude, args.omit_prob if omit else 0.0)
        n = len(prompts)
        with torch.no_grad():
            z = self.vae.encode(x.to(self.device)).latent_dist.sample()
            x0 = (z - self.vae.config.shift_factor) * self.vae.config.scaling_factor
        drop = torch.rand(n) < args.cfg_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        sigma = sample_sigmas(n, args.shift, self.device)
        noise = torch.randn_like(x0)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1.0 - s) * x0 + s * noise
        embeds, pooled = encode_clip(pipe, prompts)
        v = collapsed_velocity(pipe.transformer, xt, sigma * 1000.0, embeds, pooled, sample_pad_counts(n, self.device))
        loss = F.mse_loss(v.float(), noise - x0)
        self.flow_opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(self.flow_params, 1.0)
        self.flow_opt.step()
        with torch.no_grad():
            decay = min(self.args.ema, (1 + self.step - args.vae_steps) / (10 + self.step - args.vae_steps))
            torch._foreach_lerp_(self.ema, [p.detach() for p in self.flow_params], 1.0 - decay)
        return {"loss": loss.item(), "grad": grad.item()}

    # -- loop (train_loop's hooks)
    def stage(self) -> str:
        args = self.args
        if self.step < args.vae_steps:
            return "vae"
        return "flow" if self.step < args.vae_steps + args.flow_steps else "omit"

    def train_step(self, stage: str) -> dict:
        if stage == "vae":
            self.vae.train()
            return self.vae_step()
        self.vae.eval()
        return self.flow_step(omit=stage == "omit")

    def end_of_vae(self) -> None:
        self.vae.eval()
        self.set_latent_factors()

    def checkpoint_steps(self) -> tuple[int, ...]:
        args = self.args
        return (args.vae_steps, args.vae_steps + args.flow_steps, self.total, args.stop_at)

    def after_step(self) -> None:
        pass

    def run(self) -> None:
        for m in (self.vae, *self.flow_modules):
            m.train()
        train_loop(self)

    def final_pipeline(self) -> StableDiffusion3Pipeline:
        """The pipeline with EMA weights, in eval mode, on CPU (the training weights are left untouched)."""
        return ema_pipeline(self.pipe, ("transformer", "text_encoder", "text_encoder_2"), self.ema)

    def export(self) -> None:
        pipe = self.final_pipeline()
        text_encoder_3, tokenizer_3 = zero_t5(pipe.transformer.config.joint_attention_dim)
        pipe.register_modules(text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3)  # plain from_pretrained loads it
        summary = {"script": "scripts/pretrain_tiny.py", "step": self.step, "args": vars(self.args), "last_log": self.log[-5:]}
        save_pipeline(pipe, Path(self.args.out), summary)


def count_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="asset", help="model sizes (toy: tests)")
    p.add_argument("--vae-steps", type=int, default=800, help="VAE stage steps")
    p.add_argument("--vae-batch", type=int, default=16)
    p.add_argument("--vae-lr", type=float, default=1e-3)
    p.add_argument("--kl-weight", type=float, default=1e-3, help="KL to N(0,I), per latent element")
    p.add_argument("--stat-batches", type=int, default=8, help="batches for the latent mean / std")
    p.add_argument("--flow-steps", type=int, default=10000, help="flow-matching stage steps")
    p.add_argument("--batch", type=int, default=48, help="flow-matching batch")
    p.add_argument("--lr", type=float, default=5e-4, help="flow-matching peak lr (transformer + text encoders)")
    p.add_argument("--warmup", type=int, default=100, help="lr warmup steps of each stage")
    p.add_argument("--shift", type=float, default=3.0, help="timestep shift of the training sigmas (= sampler's)")
    p.add_argument("--omit-steps", type=int, default=0, help="caption-noise stage steps, after the flow stage (module doc)")
    p.add_argument("--omit-prob", type=float, default=0.4, help="probability that a caption names an object the image leaves out")
    p.add_argument("--omit-lr", type=float, default=2e-4, help="peak lr of the caption-noise stage")
    p.add_argument("--cfg-dropout", type=float, default=0.1, help="probability of the empty prompt")
    p.add_argument("--ema", type=float, default=0.999, help="EMA decay of the shipped flow weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--include-test-prompts", action="store_true", help="also render the held-out prompts")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="where save_pretrained writes the pipeline")
    p.add_argument("--ckpt-dir", default=str(DEFAULT_CKPT), help="where last.pt (the resumable state) lives")
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--stop-at", type=int, default=None, help="checkpoint and exit at this step (a planned pause)")
    p.add_argument("--export-only", action="store_true", help="save_pretrained the checkpoint's EMA pipeline to --out, no training")
    p.add_argument("--resume", action="store_true", help="continue from <ckpt-dir>/last.pt if it exists")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: fastest on a busy 2-core machine)")
    args = p.parse_args(argv)
    return args


def main(argv=None) -> Trainer:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    trainer = Trainer(args)
    ckpt = Path(args.ckpt_dir) / "last.pt"
    if args.export_only and not ckpt.exists():
        raise SystemExit(f"--export-only needs a checkpoint: {ckpt} does not exist (set --ckpt-dir)")
    if (args.resume or args.export_only) and ckpt.exists():
        # CPU first: RNG states must stay CPU tensors; weights and optimizer states follow their parameters.
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        for key in ("size", "seed", "vae_steps", "flow_steps", "omit_steps", "omit_prob", "batch", "vae_batch"):
            if state["args"].get(key, 0) != getattr(args, key):
                print(f"[pretrain] warning: --{key.replace('_', '-')} {getattr(args, key)} differs from the checkpoint's {state['args'].get(key, 0)}", flush=True)
        trainer.load_state_dict(state)
        print(f"[pretrain] resumed {ckpt} at step {trainer.step}", flush=True)
    elif args.resume:
        print(f"[pretrain] --resume: no {ckpt}, starting from scratch", flush=True)
    pipe = trainer.pipe
    sizes = {n: count_params(getattr(pipe, n)) for n in ("vae", "text_encoder", "text_encoder_2", "transformer")}
    print(f"[pretrain] device {trainer.device}, {args.threads} threads; params "
          + ", ".join(f"{n} {v / 1e6:.2f}M" for n, v in sizes.items())
          + f"; {args.vae_steps} VAE steps x {args.vae_batch} + {args.flow_steps} flow steps + {args.omit_steps} caption-noise steps x {args.batch}; "
          f"{len(trainer.exclude)} held-out prompts excluded", flush=True)  # fmt: skip
    if args.export_only:
        trainer.export()
    else:
        trainer.run()
    return trainer


if __name__ == "__main__":
    sys.exit(main() and 0)
