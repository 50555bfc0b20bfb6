"""``real`` detector: GenEval's detection pipeline on transformers models.

GenEval (github djghosh13/geneval, ``evaluation/evaluate_images.py``) [code] detects with mmdetection's
Mask2Former Swin-S COCO instance model (``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco``) and classifies
colours with OpenAI CLIP ViT-L/14. Here the same models come from transformers checkpoints:

- detector: :class:`transformers.Mask2FormerForUniversalSegmentation` + its image processor, default
  ``facebook/mask2former-swin-small-coco-instance`` (the Swin-S COCO instance model), kwarg ``detector_path``;
- colours: :class:`transformers.CLIPModel` + tokenizer + image processor, default
  ``openai/clip-vit-large-patch14``, kwarg ``clip_path``.

Post-processing follows mmdet's ``Mask2Former.instance_postprocess`` (which GenEval calls): class
probabilities without the no-object column, the top ``max_per_image`` (100) (query, class) pairs, binary
masks ``logit > 0`` at the original resolution, score = class probability x mean mask probability inside
the mask, box = the mask's extent (``mask2bbox``). A query may thus appear under several classes, as in
GenEval. Colour, as GenEval: the image is composited over grey ``#999`` outside the mask, cropped to the
box, and classified zero-shot among the ten GenEval colours with the prompts "a photo of a {c} {class}",
"a photo of a {c}-colored {class}", "a photo of a {c} object" (normalised text embeddings averaged per
colour, clip_benchmark style). Colours are computed only for classes that a colour clause of the image's
metadata asks about, for the detections GenEval could look at (score > 0.3, best 16).

Needs ``scipy`` (transformers' Mask2Former imports it for its training loss).
"""

from __future__ import annotations

import importlib.util
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .._loading import MissingWeightsError, check_tokenizer
from .rules import MAX_OBJECTS, THRESHOLD, Detection

__all__ = ["DEFAULT_CLIP", "DEFAULT_DETECTOR", "GENEVAL_CLASSES", "GENEVAL_COLORS", "RealDetector"]

DEFAULT_DETECTOR = "facebook/mask2former-swin-small-coco-instance"
DEFAULT_CLIP = "openai/clip-vit-large-patch14"
GENEVAL_COLORS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
# GenEval's object_names.txt (COCO's 80 classes, GenEval spelling), in order.
GENEVAL_CLASSES: tuple[str, ...] = tuple(
    "person,bicycle,car,motorcycle,airplane,bus,train,truck,boat,traffic light,fire hydrant,stop sign,parking meter,"
    "bench,bird,cat,dog,horse,sheep,cow,elephant,bear,zebra,giraffe,backpack,umbrella,handbag,tie,suitcase,frisbee,"
    "skis,snowboard,sports ball,kite,baseball bat,baseball glove,skateboard,surfboard,tennis racket,bottle,wine glass,"
    "cup,fork,knife,spoon,bowl,banana,apple,sandwich,orange,broccoli,carrot,hot dog,pizza,donut,cake,chair,couch,"
    "potted plant,bed,dining table,toilet,tv,laptop,computer mouse,tv remote,computer keyboard,cell phone,microwave,"
    "oven,toaster,sink,refrigerator,book,clock,vase,scissors,teddy bear,hair drier,toothbrush".split(",")
)
# transformers' COCO label names that GenEval spells differently.
CLASS_ALIASES = {"mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard"}
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")


def _missing(what: str, path: str, kwarg: str, err: Exception) -> MissingWeightsError:
    return MissingWeightsError(
        "geneval", f"{what} of the 'real' detector", path, kwarg,
        reason=f"{type(err).__name__}: {str(err).splitlines()[0]}",
        example=f"rewards.load('geneval', detector='real', {kwarg}='/path/to/checkpoint')",
    )


class RealDetector:
    """Mask2Former instance detections + CLIP colours, in GenEval's form (see module doc).

    Pass paths / hub ids (``detector_path``, ``clip_path``) or ready objects (``model``, ``image_processor``,
    ``clip_model``, ``clip_tokenizer``, ``clip_image_processor``), e.g. tiny random twins in tests.
    """

    colors: tuple[str, ...] = GENEVAL_COLORS

    def __init__(
        self,
        detector_path: str = DEFAULT_DETECTOR,
        clip_path: str = DEFAULT_CLIP,
        *,
        device: str | torch.device | None = None,
        max_per_image: int = 100,
        color_min_score: float = THRESHOLD,
        color_max_objects: int = MAX_OBJECTS,
        background: tuple[int, int, int] = (153, 153, 153),
        model=None,
        image_processor=None,
        clip_model=None,
        clip_tokenizer=None,
        clip_image_processor=None,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if model is None or image_processor is None:
            from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation

            if importlib.util.find_spec("scipy") is None:
                raise ImportError("the 'real' GenEval detector needs scipy (transformers' Mask2Former imports it): pip install scipy")
            try:
                if model is None:
                    model = Mask2FormerForUniversalSegmentation.from_pretrained(detector_path)
                if image_processor is None:
                    image_processor = AutoImageProcessor.from_pretrained(detector_path)
            except OSError as err:
                raise _missing("Mask2Former instance-segmentation checkpoint", detector_path, "detector_path", err) from err
        if clip_model is None or clip_tokenizer is None or clip_image_processor is None:
            from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

            try:
                if clip_model is None:
                    clip_model = CLIPModel.from_pretrained(clip_path)
                if clip_tokenizer is None:
                    clip_tokenizer = AutoTokenizer.from_pretrained(clip_path)
                if clip_image_processor is None:
                    clip_image_processor = AutoImageProcessor.from_pretrained(clip_path)
            except OSError as err:
                raise _missing("CLIP model / tokenizer / image processor", clip_path, "clip_path", err) from err
        # a missing CLIP tokenizer can load as a near-empty one
        check_tokenizer(clip_tokenizer, clip_path, reward="geneval", kwarg="clip_path",
                        example="rewards.load('geneval', detector='real', clip_path='/path/to/checkpoint')")
        self.model = model.to(self.device).eval()
        self.image_processor = image_processor
        self.clip_model = clip_model.to(self.device).eval()
        self.clip_tokenizer = clip_tokenizer
        self.clip_image_processor = clip_image_processor
        id2label = self.model.config.id2label
        names = [str(id2label[i]).strip().lower() for i in range(len(id2label))]
        self.label_names = [CLASS_ALIASES.get(n, n) for n in names]
        self.classes = tuple(dict.fromkeys(self.label_names))
        self.max_per_image = max_per_image
        self.color_min_score = color_min_score
        self.color_max_objects = color_max_objects
        self.background = tuple(background)
        self._color_classifiers: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------------------------------ detection

    @torch.no_grad()
    def detect(self, images: Sequence[np.ndarray]) -> list[dict[str, list[Detection]]]:
        """Raw Mask2Former detections (no colours) of uint8 ``[H, W, 3]`` images."""
        inputs = self.image_processor(images=list(images), return_tensors="pt")
        pixel_values = inputs["pixel_values"].to(self.device, self.model.dtype)
        pixel_mask = inputs.get("pixel_mask")
        out = self.model(pixel_values=pixel_values, pixel_mask=None if pixel_mask is None else pixel_mask.to(self.device))
        cls_prob = out.class_queries_logits.float().softmax(-1)[..., :-1]  # [B, Q, C], no-object dropped
        mask_logits = out.masks_queries_logits.float()  # [B, Q, h, w]
        num_classes = cls_prob.shape[-1]
        results = []
        for b, image in enumerate(images):
            height, width = image.shape[:2]
            k = min(self.max_per_image, cls_prob[b].numel())
            scores, flat = cls_prob[b].flatten().topk(k)
            queries, labels = flat // num_classes, flat % num_classes
            uniq, inverse = torch.unique(queries, return_inverse=True)
            size = pixel_values.shape[-2:]
            masks = F.interpolate(mask_logits[b, uniq][None], size=size, mode="bilinear", align_corners=False)[0]
            if pixel_mask is not None:  # crop the padding the processor added, then back to the original size
                valid = pixel_mask[b].bool()
                rows, cols = int(valid.any(1).sum()), int(valid.any(0).sum())
                masks = masks[:, :rows, :cols]
            masks = F.interpolate(masks[None], size=(height, width), mode="bilinear", align_corners=False)[0]
            binary = masks > 0
            mask_score = (masks.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
            binary_np = binary.cpu().numpy()
            dets: dict[str, list[Detection]] = {}
            for score, label, qi in zip(scores.tolist(), labels.tolist(), inverse.tolist()):
                mask = binary_np[qi]
                ys, xs = np.nonzero(mask)
                box = (0.0, 0.0, 0.0, 0.0)
                if len(xs):  # mmdet's mask2bbox: the mask's extent, exclusive on the right / bottom
                    box = (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))
                dets.setdefault(self.label_names[label], []).append(
                    Detection(box=box, score=float(score * mask_score[qi].item()), mask=mask)
                )
            results.append(dets)
        return results

    def __call__(self, images: Sequence[np.ndarray], metadata: Sequence[dict] | None = None) -> list[dict[str, list[Detection]]]:
        """Detections per image, with colours where the metadata has a colour clause for the class."""
        results = self.detect(images)
        for image, dets, meta in zip(images, results, metadata or [{}] * len(results)):
            wanted = {c["class"] for c in meta.get("include", []) if c.get("color") is not None}
            for cls in wanted:
                cands = sorted((d for d in dets.get(cls, []) if d.score > self.color_min_score), key=lambda d: -d.score)
                cands = cands[: self.color_max_objects]
                if cands:
                    for det, color in zip(cands, self.classify_colors(image, cands, cls)):
                        det.color = color
        return results

    # --------------------------------------------------------------------------------------------- colour

    def _features(self, out) -> torch.Tensor:
        feats = out if isinstance(out, torch.Tensor) else out.pooler_output  # transformers 5 returns an output object
        return F.normalize(feats.float(), dim=-1)

    @torch.no_grad()
    def _classifier(self, cls: str) -> torch.Tensor:
        if cls not in self._color_classifiers:
            weights = []
            for color in self.colors:
                texts = [t.format(c=color, cls=cls) for t in COLOR_TEMPLATES]
                tokens = self.clip_tokenizer(texts, padding=True, truncation=True, return_tensors="pt").to(self.device)
                emb = self._features(self.clip_model.get_text_features(**tokens)).mean(0)
                weights.append(F.normalize(emb, dim=-1))
            self._color_classifiers[cls] = torch.stack(weights, 1)  # [D, colours]
        return self._color_classifiers[cls]

    @torch.no_grad()
    def classify_colors(self, image: np.ndarray, dets: Sequence[Detection], cls: str) -> list[str]:
        """GenEval's colour classification of detections of one class (grey-composited mask crops)."""
        pil = Image.fromarray(image).convert("RGB")
        blank = Image.new("RGB", pil.size, self.background)
        crops = []
        for det in dets:
            img = pil if det.mask is None else Image.composite(pil, blank, Image.fromarray(det.mask.astype(np.uint8) * 255))
            x1, y1, x2, y2 = (int(round(v)) for v in det.box)
            crops.append(img.crop((x1, y1, max(x2, x1 + 1), max(y2, y1 + 1))))
        pixels = self.clip_image_processor(images=crops, return_tensors="pt")["pixel_values"]
        pixels = pixels.to(self.device, self.clip_model.dtype)
        feats = self._features(self.clip_model.get_image_features(pixel_values=pixels))
        logits = feats @ self._classifier(cls)
        return [self.colors[i] for i in logits.argmax(1).tolist()]
