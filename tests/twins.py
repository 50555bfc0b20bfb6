"""Tiny random-initialised checkpoints shared by the reward tests (saved like hub checkpoints, CPU seconds)."""

from __future__ import annotations

from pathlib import Path


def byte_level_clip_tokenizer():
    """A tiny working CLIP tokenizer over the 256 byte-level symbols (built in memory: no model hub offline)."""
    from flowgrpo.models.tiny import tiny_clip_tokenizer  # tests may import every package; one builder

    return tiny_clip_tokenizer()


def save_tiny_clip(path: Path) -> Path:
    """A tiny transformers CLIP (model + tokenizer + 32-px image processor) saved at ``path``; its weights are drawn
    from torch's global RNG, so seed before calling for reproducible twins."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    tok = byte_level_clip_tokenizer()
    CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         max_position_embeddings=77, bos_token_id=512, eos_token_id=513, pad_token_id=513),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2),
        projection_dim=16,
    )).save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return Path(path)
