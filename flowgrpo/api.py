"""Train from Python: ``flowgrpo.train(overrides, reward=fn)`` runs what ``python train.py`` runs and returns the run's
summary.

>>> import flowgrpo
>>> def redness(images, prompts, metadata):              # images: float [B, 3, H, W] in [0, 1]
...     r, g, b = images.unbind(-3)
...     return (r - (g + b) / 2).clamp(min=0).flatten(1).mean(1)   # one score per sample
>>> summary = flowgrpo.train(["data=text_prompts", "data.train_file=prompts.txt", "trainer.iterations=2"],
...                          reward=redness)           # doctest: +SKIP
>>> summary["iterations"], summary["output_dir"]      # doctest: +SKIP
(2, 'outputs/2025-01-01/12-00-00')

The overrides are ``train.py``'s command line (``group=option``, ``key=value``), composed onto ``conf/train.yaml``
the same way and checked the same way. ``reward=`` is your reward as a Python object -- a function
``fn(images, prompts, metadata)``, a reward object or class (``rewards.MultiReward([...])`` to combine it with
others) -- or an import path (``"my_rewards:redness"``); the run's config records it as ``reward=custom
reward.target=<module:name>`` (``rewards.custom``).
"""

from __future__ import annotations

import copy
import itertools
import time
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Any, Callable, Sequence

from omegaconf import DictConfig

__all__ = ["compose", "train"]

CONF = Path(__file__).resolve().parents[1] / "conf"


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The config ``python train.py *overrides`` composes (``conf/train.yaml``, schemas registered), not yet
    checked (:func:`flowgrpo.config.validate` checks it; :func:`train` does)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from .config import register_configs  # noqa: F401  (importing it registers the schemas)

    if isinstance(overrides, str):
        raise TypeError(f"overrides must be a list of strings, e.g. [{overrides!r}], not one string")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("train", overrides=list(overrides))


def _chosen_reward(overrides: Sequence[str]) -> str | None:
    """The reward option (or name) an override list chooses, if any."""
    for item in overrides:
        key, sep, value = str(item).lstrip("+~").partition("=")
        if sep and key in ("reward", "reward.name"):
            return value
    return None


def _new_run_dir() -> Path:
    """``train.py``'s default run dir, ``outputs/DATE/TIME`` under the working directory, made here so that it is this
    call's alone: a call in the same second as another (in this process or any other) gets ``TIME_2``, ``TIME_3``..."""
    stamp = Path("outputs") / time.strftime("%Y-%m-%d/%H-%M-%S")
    stamp.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = stamp if n == 1 else stamp.with_name(f"{stamp.name}_{n}")
        try:
            path.mkdir()  # atomic: whoever makes it has it
            return path
        except FileExistsError:
            continue


def _discard_if_unused(path: Path) -> None:
    """After a call that failed: remove the run dir :func:`_new_run_dir` made when no run was written into it (the
    run's own set-up failure may have removed it already), and its empty parents up to the working directory."""
    from .runlog import discard_run_dir, holds_nothing, remove_empty_dirs

    path = path.resolve()
    if path.is_dir():
        if holds_nothing(path):
            discard_run_dir(path)
    elif path.parent.is_dir():
        with suppress(OSError):
            remove_empty_dirs(path.parent)


def train(config: Sequence[str] | DictConfig | None = None, *, reward: Callable | str | None = None) -> dict[str, Any]:
    """Train and return the run's summary (``summary.json``'s content: iterations, updates, the first and last
    evaluation, the checkpoint, ``output_dir``).

    Args:
        config: ``train.py``'s command line as a list (``["model=sd3_shapes", "trainer.iterations=2"]``), or a config
            :func:`compose` made (and you changed); None: the defaults. Without ``trainer.output_dir`` the run goes to
            ``outputs/DATE/TIME`` under the working directory, as ``train.py``'s, and each call gets its own
            (``outputs/DATE/TIME_2`` when a call in the same second has that dir); with it, to that dir.
        reward: your reward, in place of the config's: a function ``fn(images, prompts, metadata)`` returning one
            number per sample (a list, a tensor ``[B]`` or a ``rewards.RewardOutput``), a reward object, a class
            (built with ``reward.kwargs``), or an import path ``"package.module:name"``. Combine it with others with
            ``rewards.MultiReward([{"name": "geneval", "weight": 1.0}, {"reward": fn, "weight": 0.5}])``. None: the
            config's reward.

    Raises:
        ValueError: the config chooses another reward (``reward=multi``) and ``reward=`` is given too.
    """
    from .builders.reward import given_reward
    from .cli import main as run

    if isinstance(config, DictConfig):
        cfg = copy.deepcopy(config)
    else:
        overrides = list(config or ())
        chosen = _chosen_reward(overrides)
        if reward is not None and chosen not in (None, "custom"):
            raise ValueError(f"reward= is given and the overrides choose reward={chosen}: pass one of them (to train "
                             f"on both, reward=rewards.MultiReward([{{'name': {chosen!r}}}, {{'reward': your_fn}}]))")
        cfg = compose(overrides + (["reward=custom"] if reward is not None and chosen is None else []))
    if reward is not None:
        if cfg.reward.name != "custom":  # the config's reward and its settings give way to yours
            cfg.reward.kwargs = {}
        cfg.reward.name = "custom"
    made = None
    if cfg.trainer.output_dir is None:  # train.py's default: Hydra's run dir under the working directory
        made = _new_run_dir()
        cfg.trainer.output_dir = str(made)
    given = nullcontext(reward) if reward is None or isinstance(reward, str) else given_reward(reward)
    try:
        with given as target:
            if target is not None:
                cfg.reward.target = target
            return run(cfg)
    except BaseException:
        if made is not None:
            _discard_if_unused(made)
        raise
