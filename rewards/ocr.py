"""OCR reward: does the image show the text the prompt quotes? (Flow-GRPO's text-rendering reward, arXiv 2505.05470.)

Flow-GRPO (``flow_grpo/ocr.py``) reads the image with PaddleOCR and scores ``1 − min(d, L)/L`` with ``d`` the
Levenshtein distance between the recognised text and the target, both lower-cased with spaces removed, ``L`` the
target's length, and ``d = 0`` when the target occurs inside the recognised text. We keep that formula and read
the image with **RapidOCR** (``pip install rapidocr-onnxruntime``: PaddleOCR's PP-OCRv4 detection and recognition
models converted to ONNX and **shipped inside the wheel**, so nothing is fetched at run time).

Differences from the reference, on purpose:

* the target is the text between the first pair of double quotes of the prompt (``'a sign that says "OPEN"'``),
  or ``metadata["text"]`` when given; a prompt with neither raises (the reference crashes on ``split('"')[1]``);
* an OCR failure raises, naming the image; the reference scored it 0 (a silent fallback);
* recognised lines are joined in RapidOCR's reading order (top-to-bottom, left-to-right), as PaddleOCR's;
* a degenerate image (uniform -- all black, all white, one flat colour -- or pure noise,
  :func:`rewards.images.degenerate`) reads as no text and scores 0 without running OCR (whatever a recogniser
  might read in noise would be made-up partial credit); images holding NaN or inf raise ``ValueError`` naming them.

Components: ``ocr`` (the score) and ``ocr_exact`` (1 when the normalised target occurs in the recognised text).

>>> normalized_edit_score("Hello World", "helloworld"), normalized_edit_score("Hello", "Helo"), normalized_edit_score("ab", "")
(1.0, 0.8, 0.0)
"""

from __future__ import annotations

import re

import numpy as np
import torch

from .base import RewardOutput, register
from .images import degenerate, to_uint8_images

__all__ = ["OcrReward", "levenshtein", "normalized_edit_score", "quoted_text"]

_QUOTED = re.compile(r'"([^"]+)"|“([^”]+)”')


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character, each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def _normalise(text: str) -> str:
    return text.replace(" ", "").lower()


def normalized_edit_score(target: str, recognised: str) -> float:
    """Flow-GRPO's OCR score ``1 − min(d, L)/L`` on lower-cased, space-free strings (``d = 0`` if target ⊆ text)."""
    target, recognised = _normalise(target), _normalise(recognised)
    if not target:
        raise ValueError("OCR reward: the target text is empty")
    dist = 0 if target in recognised else min(levenshtein(recognised, target), len(target))
    return 1.0 - dist / len(target)


def quoted_text(prompt: str) -> str | None:
    """The first double-quoted span of ``prompt`` (straight or curly quotes), or None."""
    m = _QUOTED.search(prompt)
    return None if m is None else (m.group(1) or m.group(2))


class OcrReward:
    """Text-rendering reward from RapidOCR's bundled PP-OCRv4 models (see module doc).

    Args:
        text_score: drop recognised lines whose confidence is below this (RapidOCR's and PaddleOCR's 0.5).
        det_limit_side_len: the detector resizes the image so its *shorter* side is this long (RapidOCR's 736);
            smaller is faster and fine for large, clean text.
        use_cls: run the 0/180° text-direction classifier (Flow-GRPO: off).
        num_threads: ONNX Runtime intra-op threads (-1: ONNX Runtime's default).
        engine_kwargs: passed to ``rapidocr_onnxruntime.RapidOCR`` (e.g. ``det_use_cuda=True`` with onnxruntime-gpu).
    """

    def __init__(
        self,
        *,
        text_score: float = 0.5,
        det_limit_side_len: int = 736,
        use_cls: bool = False,
        num_threads: int = -1,
        engine_kwargs: dict | None = None,
    ):
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as err:
            raise ImportError(
                "the 'ocr' reward needs RapidOCR with its bundled ONNX models: pip install rapidocr-onnxruntime "
                f"(Python < 3.13; it brings onnxruntime and opencv-python) [{err}]"
            ) from err
        kwargs = dict(text_score=text_score, det_limit_side_len=int(det_limit_side_len), det_limit_type="min",
                      use_cls=use_cls, intra_op_num_threads=num_threads, inter_op_num_threads=1 if num_threads > 0 else -1)
        kwargs.update(engine_kwargs or {})
        self.use_cls = use_cls
        self.engine = RapidOCR(**kwargs)

    def targets(self, prompts, metadata=None) -> list[str]:
        """The text each image should show: ``metadata[i]["text"]`` if present, else the prompt's quoted text."""
        out = []
        for i, prompt in enumerate(prompts):
            meta = metadata[i] if metadata is not None and metadata[i] is not None else {}
            text = meta.get("text") if isinstance(meta, dict) else None
            text = text if text is not None else quoted_text(prompt)
            if not text or not _normalise(text):
                raise ValueError(f"OCR reward: prompt {i} ({prompt!r}) quotes no text and its metadata has no 'text'; "
                                 'write the text to render between double quotes, e.g. \'a sign that says "OPEN"\'')
            out.append(text)
        return out

    def read(self, images) -> list[str]:
        """The recognised text of each image (lines joined in reading order; '' when nothing is found or the image is
        degenerate)."""
        texts = []
        arrays = to_uint8_images(images, reward="ocr")
        for i, (array, flag) in enumerate(zip(arrays, degenerate(arrays))):
            if flag is not None:
                texts.append("")
                continue
            try:
                result, _ = self.engine(np.ascontiguousarray(array[..., ::-1]), use_cls=self.use_cls)  # RapidOCR wants BGR
            except Exception as err:  # never score a failure as 0: say which image
                raise RuntimeError(f"OCR reward: RapidOCR failed on image {i} (shape {array.shape}): {err}") from err
            texts.append("".join(line[1] for line in result) if result else "")
        return texts

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        targets = self.targets(prompts, metadata)
        texts = self.read(images)
        if len(texts) != len(targets):
            raise ValueError(f"OCR reward: {len(texts)} images but {len(targets)} prompts")
        scores = torch.tensor([normalized_edit_score(t, r) for t, r in zip(targets, texts)], dtype=torch.float32)
        exact = torch.tensor([float(_normalise(t) in _normalise(r)) for t, r in zip(targets, texts)], dtype=torch.float32)
        return RewardOutput(scores=scores, components={"ocr": scores.clone(), "ocr_exact": exact})


register("ocr")(OcrReward)
