"""LAION aesthetic predictor v2 ("improved aesthetic predictor", github christophschuhmann/improved-aesthetic-predictor).

Reference ``simple_inference.py`` [code]: OpenAI CLIP ViT-L/14 ``encode_image`` of the ``clip.load`` preprocess
(``Resize(224, BICUBIC)``, ``CenterCrop(224)``, ``ToTensor``, ``Normalize`` with OpenAI mean / std), the embedding
L2-normalised, then a linear MLP ``768 -> 1024 -> 128 -> 64 -> 16 -> 1`` with dropouts 0.2, 0.2, 0.1 between the
first four layers and no activations (``nn.Sequential`` indices 0, 2, 4, 6, 7 hold the linears, as the checkpoint
``sac+logos+ava1-l14-linearMSE.pth`` stores them). The score is on the AVA scale, about 1-10 (most images 4-7).

The CLIP here is transformers' ``CLIPModel`` of ``openai/clip-vit-large-patch14`` (the same weights as OpenAI's
ViT-L/14; ``get_image_features`` = ``encode_image``); the prompt is not used.
"""

from __future__ import annotations

import torch
from torch import nn

from ..base import RewardOutput, register
from ..images import to_uint8_images
from .._loading import MissingWeightsError, load_state_dict_file, resolve_device, resolve_dtype
from .common import in_chunks, load_hf_clip, normalized, pooled
from .transforms import resize_center_crop

__all__ = ["AestheticMLP", "LaionAesthetic"]

DEFAULT_CLIP = "openai/clip-vit-large-patch14"
CHECKPOINT_NAME = "sac+logos+ava1-l14-linearMSE.pth"
CHECKPOINT_URL = "https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/sac+logos+ava1-l14-linearMSE.pth"


class AestheticMLP(nn.Module):
    """The predictor head (and ImageReward's, which copied it): linears with dropouts, no activations."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@register("aesthetic")
class LaionAesthetic:
    """LAION aesthetic score of each image (prompts are accepted and ignored).

    Args:
        checkpoint: path to ``sac+logos+ava1-l14-linearMSE.pth`` (the MLP's state dict; not on a hub we load from).
        clip_path: hub id or directory of the CLIP ViT-L/14 checkpoint the MLP was trained on.
        device, dtype, batch_size: as for every learned reward (the MLP always runs in float32).

    Components: ``aesthetic`` (the predictor's output, the score).
    """

    def __init__(self, checkpoint: str | None = None, clip_path: str = DEFAULT_CLIP, *, device=None, dtype=None,
                 batch_size: int = 32):
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.batch_size = int(batch_size)
        example = f"rewards.load('aesthetic', checkpoint='/path/to/{CHECKPOINT_NAME}')"
        state = load_state_dict_file(checkpoint, reward="aesthetic", what=f"aesthetic MLP ({CHECKPOINT_NAME})",
                                     kwarg="checkpoint", fetch=f"Get {CHECKPOINT_NAME} from {CHECKPOINT_URL}",
                                     example=example)
        self.clip, _, self.image_config = load_hf_clip(
            clip_path, clip_path, reward="aesthetic", model_kwarg="clip_path", processor_kwarg="clip_path",
            device=self.device, dtype=self.dtype, with_tokenizer=False)
        self.mlp = AestheticMLP(self.clip.config.projection_dim)
        try:
            self.mlp.load_state_dict(state)
        except RuntimeError as err:
            raise MissingWeightsError("aesthetic", f"aesthetic MLP ({CHECKPOINT_NAME})", str(checkpoint), "checkpoint",
                                      reason=f"its tensors do not fit the 768-1024-128-64-16-1 MLP: {err}",
                                      fetch=f"Get {CHECKPOINT_NAME} from {CHECKPOINT_URL}", example=example) from err
        self.mlp = self.mlp.to(self.device).eval().requires_grad_(False)

    def preprocess(self, arrays) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` arrays -> OpenAI CLIP's preprocess (torchvision crop offset)."""
        return resize_center_crop(arrays, **self.image_config, crop_rounding="round")

    def _scores(self, arrays) -> torch.Tensor:
        pixels = self.preprocess(arrays).to(self.device, self.dtype)
        embeds = normalized(pooled(self.clip.get_image_features(pixel_values=pixels)))
        return self.mlp(embeds).squeeze(-1)

    @torch.no_grad()
    def __call__(self, images, prompts=None, metadata=None) -> RewardOutput:
        arrays = to_uint8_images(images, reward="aesthetic")
        if not arrays:
            return RewardOutput(torch.zeros(0), {"aesthetic": torch.zeros(0)})
        score = torch.cat([self._scores(arrays[s]) for s in in_chunks(len(arrays), self.batch_size)]).float().cpu()
        return RewardOutput(scores=score, components={"aesthetic": score})
