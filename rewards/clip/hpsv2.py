"""HPSv2.1 (Wu et al., "Human Preference Score v2", arXiv 2306.09341): an open_clip ViT-H/14 fine-tuned on HPD v2.

Reference ``hpsv2/img_score.py`` (github tgxs002/HPSv2) [code]: ``create_model_and_transforms('ViT-H-14', ...,
light_augmentation=True, output_dict=True)``, ``model.load_state_dict(torch.load(cp)['state_dict'])``, the
tokenizer ``get_tokenizer('ViT-H-14')``, and ``hps = diag(image_features @ text_features.T)`` -- the cosine of
the L2-normalised embeddings, no logit scale (about 0.2-0.35 on real images).

HPSv2 ships its own fork of open_clip; its ViT-H-14 has the same state-dict keys, tokenizer and forward as
open_clip 3's (checked on a tiny config, see the test module), so the model is built with ``open_clip`` here. Its
``preprocess_val`` is not open_clip's, though: ``ToTensor -> ResizeMaxSize(224) -> Normalize`` (longest side to
224, centred zero padding), reproduced by :func:`rewards.clip.transforms.resize_longest_pad`.

The checkpoint ``HPS_v2.1_compressed.pt`` lives in the hub repo ``xswu/HPSv2``; it is not downloaded here: pass
its path as ``checkpoint``. It holds the whole model, so no LAION weights are needed.
"""

from __future__ import annotations

import torch

from ..base import RewardOutput, register
from ..images import to_uint8_images
from .._loading import MissingWeightsError, load_state_dict_file, resolve_device, resolve_dtype
from .common import check_prompts, encode_unique, in_chunks
from .transforms import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, resize_longest_pad

__all__ = ["HPSv21"]

CHECKPOINT_NAME = "HPS_v2.1_compressed.pt"
FETCH = (f"Get {CHECKPOINT_NAME} from the hub repo xswu/HPSv2 (`huggingface-cli download xswu/HPSv2 "
         f"{CHECKPOINT_NAME}` where a hub is reachable)")


@register("hpsv21")
class HPSv21:
    """HPSv2.1 score of each (image, prompt) pair.

    Args:
        checkpoint: path to ``HPS_v2.1_compressed.pt`` (a dict with ``state_dict``, or a bare state dict).
            HPSv2.0's ``HPS_v2_compressed.pt`` loads the same way.
        model_name: the open_clip architecture (``ViT-H-14``; tests register a tiny one).
        device, dtype, batch_size: as for every learned reward (the reference runs CUDA autocast fp16).

    Components: ``hpsv21`` (the cosine, the score).
    """

    def __init__(self, checkpoint: str | None = None, *, model_name: str = "ViT-H-14", device=None, dtype=None,
                 batch_size: int = 32):
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.batch_size = int(batch_size)
        example = f"rewards.load('hpsv21', checkpoint='/path/to/{CHECKPOINT_NAME}')"
        state = load_state_dict_file(checkpoint, reward="hpsv21", what=f"HPSv2.1 checkpoint ({CHECKPOINT_NAME})",
                                     kwarg="checkpoint", fetch=FETCH, example=example)
        state = state.get("state_dict", state)
        state = {k.removeprefix("module."): v for k, v in state.items()}  # saved from DDP in some copies

        import open_clip

        if open_clip.get_model_config(model_name) is None:
            raise ValueError(f"hpsv21: open_clip has no architecture {model_name!r} (model_name=); HPSv2.1 is 'ViT-H-14'")
        model = open_clip.create_model(model_name, pretrained=None, output_dict=True)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise MissingWeightsError("hpsv21", f"HPSv2.1 checkpoint ({CHECKPOINT_NAME})", str(checkpoint), "checkpoint",
                                      reason=f"its tensors do not fit open_clip {model_name!r}: {str(err)[:300]}",
                                      fetch=FETCH, example=example) from err
        self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(model_name)
        size = self.model.visual.image_size
        self.image_size = int(size[0] if isinstance(size, (tuple, list)) else size)
        self.mean = tuple(getattr(self.model.visual, "image_mean", None) or OPENAI_CLIP_MEAN)
        self.std = tuple(getattr(self.model.visual, "image_std", None) or OPENAI_CLIP_STD)

    def preprocess(self, arrays) -> torch.Tensor:
        """uint8 ``[H, W, 3]`` arrays -> HPSv2's ``preprocess_val``."""
        return resize_longest_pad(arrays, self.image_size, mean=self.mean, std=self.std)

    def _image_features(self, arrays) -> torch.Tensor:
        pixels = self.preprocess(arrays).to(self.device, self.dtype)
        return self.model.encode_image(pixels, normalize=True).float()

    def _text_features(self, prompts: list[str]) -> torch.Tensor:
        return self.model.encode_text(self.tokenizer(prompts).to(self.device), normalize=True).float()

    @torch.no_grad()
    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        arrays = to_uint8_images(images, reward="hpsv21")
        prompts = check_prompts(prompts, len(arrays), "hpsv21")
        if not arrays:
            return RewardOutput(torch.zeros(0), {"hpsv21": torch.zeros(0)})
        image = torch.cat([self._image_features(arrays[s]) for s in in_chunks(len(arrays), self.batch_size)])
        score = (image * encode_unique(prompts, self._text_features, self.batch_size)).sum(-1).cpu()
        return RewardOutput(scores=score, components={"hpsv21": score})
