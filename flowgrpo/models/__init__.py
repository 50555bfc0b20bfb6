"""Model adapters: diffusers flow-matching pipelines seen as encode → noise → velocity → decode.

>>> from flowgrpo.models import load_adapter
>>> adapter = load_adapter("sd3", "tiny-random:sd3")
"""

from .base import FlowAdapter, PromptEmbeds
from .causal_wan import CacheState, CausalWan
from .flux import FluxAdapter
from .load import load_adapter
from .sd3 import SD3Adapter
from .stream_adapter import StreamAdapter, StreamCond
from .stream_load import load_stream_pipeline
from .stream_pipeline import StreamConfig, StreamingWanPipeline
from .tiny import build_tiny_pipeline
from .wan import WanAdapter
from .wan_checkpoints import (build_streaming_wan_transformer, load_streaming_wan_state_dict,
                              load_streaming_wan_transformer, merge_lora)

__all__ = [
    "CacheState",
    "CausalWan",
    "FlowAdapter",
    "FluxAdapter",
    "PromptEmbeds",
    "SD3Adapter",
    "StreamAdapter",
    "StreamCond",
    "StreamConfig",
    "StreamingWanPipeline",
    "WanAdapter",
    "build_streaming_wan_transformer",
    "build_tiny_pipeline",
    "load_adapter",
    "load_stream_pipeline",
    "load_streaming_wan_state_dict",
    "load_streaming_wan_transformer",
    "merge_lora",
]
