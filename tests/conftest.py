"""Test-wide settings: offline, no W&B, few threads (see PITFALLS.md)."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
_wandb_tmp = tempfile.mkdtemp(prefix="flowgrpo-wandb-")
for _var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR"):
    os.environ.setdefault(_var, _wandb_tmp)

import torch  # noqa: E402

torch.set_num_threads(2)
