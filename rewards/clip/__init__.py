"""CLIP-family learned rewards: PickScore, HPSv2.1, LAION aesthetic, CLIPScore.

Each is ``reward(images, prompts, metadata=None) -> RewardOutput``, batched, ``torch.no_grad``, with ``device=`` /
``dtype=`` / ``batch_size=`` keywords, the reference preprocessing (:mod:`rewards.clip.transforms`), and a
:class:`rewards.MissingWeightsError` naming the hub id / file and the keyword to set when its weights are absent.
transformers and open_clip are imported inside the constructors, so importing this package stays cheap.
"""

from .aesthetic import LaionAesthetic  # registers "aesthetic"
from .clipscore import CLIPScore  # registers "clipscore"
from .hpsv2 import HPSv21  # registers "hpsv21"
from .pickscore import PickScore  # registers "pickscore"

__all__ = ["CLIPScore", "HPSv21", "LaionAesthetic", "PickScore"]
