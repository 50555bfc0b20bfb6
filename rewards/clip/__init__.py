"""CLIP-family learned rewards: PickScore, HPSv2.1, LAION aesthetic, CLIPScore.

Each is ``reward(images, prompts, metadata=None) -> RewardOutput``, batched, ``torch.no_grad``, with ``device=`` /
``dtype=`` / ``batch_size=`` keywords, the reference preprocessing (:mod:`rewards.clip.transforms`), and a
:class:`rewards.MissingWeightsError` naming the hub id / file and the keyword to set when its weights are absent.
transformers and open_clip are imported inside the constructors, so importing this package stays cheap.

Images holding NaN or inf raise ``ValueError`` naming the reward and the samples. Degenerate images (uniform,
noise) are scored by the model like any other: these are the model's judgements, with no "nothing" value to force
(a prompt may even ask for a plain background), unlike the rule-based rewards, which score them 0 (:mod:`rewards.base`).
"""

from .aesthetic import LaionAesthetic  # registers "aesthetic"
from .clipscore import CLIPScore  # registers "clipscore"
from .hpsv2 import HPSv21  # registers "hpsv21"
from .pickscore import PickScore  # registers "pickscore"

__all__ = ["CLIPScore", "HPSv21", "LaionAesthetic", "PickScore"]
