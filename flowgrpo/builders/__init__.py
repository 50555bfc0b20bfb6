"""Turn composed config nodes (``conf/``, schemas in :mod:`flowgrpo.config`) into the objects a run uses, one module
per job:

- :mod:`~flowgrpo.builders.model` — the model adapter (:func:`build_adapter`), its call keywords (:func:`model_kwargs`);
- :mod:`~flowgrpo.builders.sampler` — the schedules, kernel and solver (:func:`build_sampler`);
- :mod:`~flowgrpo.builders.reward` — the reward (:func:`build_reward`) and a multi-component reward's aggregator
  (:func:`build_aggregator`);
- :mod:`~flowgrpo.builders.prompts` — the prompt sets (:func:`build_prompts`, :func:`prompt_pools`);
- :mod:`~flowgrpo.builders.checks` — the checks that need no weights (:func:`preflight`, :func:`check_config`);
- :mod:`~flowgrpo.builders.logger` — scalar logging (:func:`build_logger`);
- :mod:`~flowgrpo.builders.batch` — the batch arithmetic (:func:`batch_plan`).

Where relative paths point is :mod:`flowgrpo.paths`' rule (:data:`REPO_ROOT`, :func:`resolve_path`), shared with
the model loaders.

>>> from flowgrpo.builders import build_adapter, build_sampler, build_reward, build_prompts, batch_plan
>>> adapter = build_adapter(cfg.model)                       # doctest: +SKIP
>>> sampler = build_sampler(cfg.sampler, adapter=adapter, model=cfg.model)  # doctest: +SKIP
>>> print(batch_plan(cfg, num_processes=2).banner())        # doctest: +SKIP

Every builder validates its node first (:func:`flowgrpo.config.validate`), and every error names the config
key to change (``data.train_file``, ``model.pretrained``, ``trainer.train_batch_size``, ...).
"""

from ..paths import REPO_ROOT, resolve_path
from .batch import BatchPlan, batch_plan
from .logger import RunLogger, build_logger
from .model import build_adapter, model_kwargs
from .checks import (MIN_FREE_BYTES, Preflight, check_config, check_output_dir, check_prompt_metadata,
                        check_reward_model, check_sizes, check_stream_prompts, checkpoint_bytes, checked_prompts,
                        preflight, reward_modality, size_multiples)
from .prompts import PromptSet, build_prompts, prompt_pools, tag_rows
from .reward import build_aggregator, build_reward
from .sampler import Sampler, build_sampler

__all__ = [
    "REPO_ROOT",
    "resolve_path",
    "build_adapter",
    "Sampler",
    "build_sampler",
    "build_reward",
    "build_aggregator",
    "PromptSet",
    "prompt_pools",
    "build_prompts",
    "RunLogger",
    "build_logger",
    "BatchPlan",
    "batch_plan",
    "model_kwargs",
    "reward_modality",
    "check_reward_model",
    "check_prompt_metadata",
    "checkpoint_bytes",
    "check_output_dir",
    "Preflight",
    "preflight",
    "checked_prompts",
    "MIN_FREE_BYTES",
    "check_config",
    "check_sizes",
    "check_stream_prompts",
    "size_multiples",
    "tag_rows",
]
