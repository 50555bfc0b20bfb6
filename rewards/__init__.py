"""Reward models usable on their own: ``from rewards import load``. Never imports ``flowgrpo``."""

from .base import RewardOutput, available, load, register
from ._loading import MissingWeightsError  # raised by learned rewards whose weights are absent
from .clip import CLIPScore, HPSv21, LaionAesthetic, PickScore  # registers "clipscore", "hpsv21", "aesthetic", "pickscore"
from .image_reward import ImageReward  # registers "imagereward"
from .geneval import GenEval, VideoGenEval, geneval_prefixes, geneval_summary  # registers "geneval", "video_geneval"
from .jpeg import JpegCompressibility  # registers "jpeg_compressibility", "jpeg_incompressibility"
from .multi import MultiReward  # registers "multi"
from .ocr import OcrReward  # registers "ocr"
from .remote import RemoteReward  # registers "remote"
from .video import VideoClipScore, VideoConsistency, VideoFlicker, VideoMotion  # registers "video_*"

__all__ = [
    "CLIPScore", "GenEval", "HPSv21", "ImageReward", "JpegCompressibility", "LaionAesthetic", "MissingWeightsError",
    "MultiReward", "OcrReward", "PickScore", "RemoteReward", "RewardOutput", "VideoClipScore", "VideoConsistency",
    "VideoFlicker", "VideoGenEval", "VideoMotion", "available", "geneval_prefixes", "geneval_summary", "load", "register",
]
from .streams import LongVideoReward  # registers "long_video": streams with prompt switches

__all__ += ["LongVideoReward"]
from .segments import SegmentReward  # registers "segments": any clip reward per segment of a stream

__all__ += ["SegmentReward"]
from .custom import RewardFunction, from_target, wrap  # registers "custom": your own reward, by import path

__all__ += ["RewardFunction", "from_target", "wrap"]
