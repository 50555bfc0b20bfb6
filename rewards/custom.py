"""Your own reward, without editing this package: a plain function (or a class) from your own module.

A reward function has the shape of TRL's: it takes a batch and returns one number per sample::

    def redness(images, prompts, metadata):   # images: float [B, 3, H, W] in [0, 1] (videos: [B, T, 3, H, W])
        return (images[:, 0] - images[:, 1:].mean(1)).clamp(min=0).flatten(1).mean(1)   # Tensor [B]

It may return a ``list[float]``, a tensor / array ``[B]`` or a :class:`~rewards.RewardOutput` (its ``components``
are then logged beside the score). :func:`wrap` makes it a reward of this package's contract
(:class:`RewardFunction`), which checks what goes in and what comes out:

- in: float pixels finite and in [0, 1] (:func:`rewards.images.check_pixels`, the rule of every reward); an empty
  batch is answered with an empty result without calling the function;
- out: one finite number per sample, else a ``ValueError`` naming the function (``my_rewards:redness returned 3
  scores for a batch of 4 samples ...``). A reward raises; it never returns a made-up score.

By import path, ``package.module:name`` (or ``package.module.name``): :func:`from_target` imports it and, for a
class, instantiates it with the keyword arguments given (``reward.kwargs`` in training); a function gets them as
keywords on every call. ``rewards.load("custom", target="my_rewards:redness")`` is the registry's form, and a
``multi`` reward takes ``{"target": "my_rewards:redness", "weight": 0.5}`` (or, from Python, ``{"reward": fn}``) as
a component. A path that does not import fails at once, naming the module or attribute (with the closest names).

>>> import torch
>>> r = wrap(lambda images, prompts, metadata: images.mean(dim=(1, 2, 3)), name="brightness")
>>> r(torch.full((2, 3, 8, 8), 0.25), ["a", "b"]).scores
tensor([0.2500, 0.2500])
>>> wrap(lambda images, prompts, metadata: [1.0], name="one")(torch.zeros(2, 3, 8, 8), ["a", "b"])
Traceback (most recent call last):
...
ValueError: one returned 1 scores for a batch of 2 samples; return a list of floats, a tensor / array [B] or a rewards.RewardOutput with one score per sample
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import pkgutil
import sys
from typing import Any, Callable, Mapping

import numpy as np
import torch

from .base import RewardOutput, register
from .images import check_pixels

__all__ = ["RewardFunction", "from_target", "import_target", "short_name", "target_label", "wrap"]

#: what a reward function may return, for the errors
RETURNS = "a list of floats, a tensor / array [B] or a rewards.RewardOutput"


def target_label(obj: Any) -> str:
    """``module:qualified.name`` of a function or class (of an instance: its class's, with ``()``): how a config and
    the run's log name a reward given as a Python object."""
    if isinstance(obj, RewardFunction):
        return obj.label
    if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj) or inspect.isbuiltin(obj):
        return f"{getattr(obj, '__module__', None) or '?'}:{getattr(obj, '__qualname__', None) or obj.__name__}"
    cls = type(obj)
    return f"{cls.__module__}:{cls.__qualname__}()"


def short_name(obj_or_label: Any) -> str:
    """The last name of a label (``my_rewards:Redness()`` → ``Redness``; of an object, its :func:`target_label`'s):
    a component's default prefix in a ``multi`` reward."""
    label = obj_or_label if isinstance(obj_or_label, str) else target_label(obj_or_label)
    return label.rpartition(":")[2].removesuffix("()").rpartition(".")[2] or label


def _close(word: str, names, n: int = 3) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``names``, or ``""``."""
    found = difflib.get_close_matches(word, sorted(set(names)), n=n, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(f) for f in found)}?)" if found else ""


def _split(path: str, key: str) -> tuple[str, str]:
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{key}={path!r}: give your reward's import path, package.module:name (e.g. "
                         f"my_rewards:redness)")
    path = path.strip()
    module, sep, attr = path.partition(":")
    if not sep:  # the dotted form, as Hydra's _target_ writes it
        module, _, attr = path.rpartition(".")
    if not module or not attr or ":" in attr:
        raise ValueError(f"{key}={path!r} is not an import path: write package.module:name (e.g. my_rewards:redness "
                         f"for the function redness of my_rewards.py)")
    return module, attr


def import_target(path: str, key: str = "target") -> Any:
    """The object an import path names, ``package.module:name`` or ``package.module.name`` (``name`` may be dotted:
    ``module:Class.method``).

    Raises:
        ImportError: the module (or a package on its way) does not import, naming it, the closest module names and
            where Python looked; an error raised while importing it is passed on, naming the module.
        AttributeError: the module has no such attribute, naming the closest ones.
    """
    module_name, attr = _split(path, key)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or module_name
        if module_name != missing and not module_name.startswith(missing + "."):  # a dependency of that module
            raise ImportError(f"{key}={path!r}: importing {module_name!r} failed: {err}") from err
        parent, _, leaf = missing.rpartition(".")
        try:
            where = importlib.import_module(parent).__path__ if parent else None
            names = [m.name for m in pkgutil.iter_modules(where)]
        except (ImportError, AttributeError):
            names = []
        cwd = os.getcwd()
        hint = "" if cwd in sys.path or "" in sys.path else (
            f"; the working directory {cwd} is not searched by `python train.py`: run it with PYTHONPATH=. (or the "
            "folder holding your module), or install your package (pip install -e)")
        raise ImportError(f"{key}={path!r}: no module named {missing!r}{_close(leaf, names)}{hint}") from err
    except Exception as err:  # the module exists but raised while importing: its own error, named
        raise ImportError(f"{key}={path!r}: importing {module_name!r} raised {type(err).__name__}: {err}") from err
    obj = module
    for depth, part in enumerate(attr.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            owner = module_name if depth == 0 else f"{module_name}:{'.'.join(attr.split('.')[:depth])}"
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise AttributeError(f"{key}={path!r}: {owner!r} has no attribute {part!r}{_close(part, names)}; it "
                                 f"has {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}") from None
    return obj


def _batch_size(images) -> int | None:
    try:
        return len(images)
    except TypeError:
        return None


class RewardFunction:
    """A callable with the signature ``fn(images, prompts, metadata, **kwargs)`` as a reward of the package's
    contract: ``reward(images, prompts, metadata=None) -> RewardOutput`` (module doc: what it checks).

    Attributes of the wrapped object (``weights``, ``check_metadata``, ``modality``, ``describe``, ...) are the
    reward's: a trainer sees a wrapped multi-component reward's weights and a reward's metadata schema.

    Args:
        fn: the function, or a reward object (any callable).
        name: how errors and logs name it (default: ``label``).
        label: its import path or ``module:qualname`` (default: :func:`target_label` of ``fn``).
        kwargs: keyword arguments passed on every call (a function's settings, ``reward.kwargs``).
    """

    modality = "any"  # scores what it is given: the trainer cannot tell images from videos for it

    def __init__(self, fn: Callable, *, name: str | None = None, label: str | None = None,
                 kwargs: Mapping[str, Any] | None = None):
        if not callable(fn):
            raise TypeError(f"{label or name or fn!r} is not callable: a reward is a function fn(images, prompts, "
                            f"metadata) or an object with such a __call__ (got {type(fn).__name__})")
        self.fn = fn
        self.label = label or target_label(fn)
        self.name = name or self.label
        self.kwargs = dict(kwargs or {})
        self._check_signature()

    def _check_signature(self) -> None:
        """Fail now, not at the first batch, when ``fn`` cannot take ``(images, prompts, metadata)`` and the kwargs."""
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):  # some builtins and C callables have none: checked at the first call
            return
        try:
            signature.bind(None, None, None, **self.kwargs)
        except TypeError as err:
            given = f" and the keywords {sorted(self.kwargs)}" if self.kwargs else ""
            raise TypeError(f"{self.name} cannot be called as fn(images, prompts, metadata){given}: {err} (its "
                            f"signature is {self.fn.__name__ if hasattr(self.fn, '__name__') else ''}{signature})") \
                from None

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr in ("fn", "kwargs", "label", "name"):
            raise AttributeError(attr)
        return getattr(self.fn, attr)

    def describe(self) -> str:
        """The wrapped reward's own line when it has one, else its name and where it comes from."""
        own = getattr(self.fn, "describe", None)
        if callable(own):
            return own()
        if not inspect.isroutine(self.fn) and type(self.fn).__repr__ is not object.__repr__:
            return repr(self.fn)  # a reward object's own account of itself: MultiReward(geneval×1, redness×0.5)
        return self.name if self.name == self.label else f"{self.name} ({self.label})"

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        check_pixels(images, self.name)
        n = _batch_size(images)
        if n == 0:
            return RewardOutput(torch.zeros(0))
        return self.check(self.fn(images, prompts, metadata, **self.kwargs), n)

    def check(self, out: Any, n: int | None) -> RewardOutput:
        """``out`` (what the function returned for a batch of ``n``) as a :class:`~rewards.RewardOutput`, or a
        ``ValueError`` / ``TypeError`` naming the function."""
        components: dict[str, torch.Tensor] = {}
        if isinstance(out, RewardOutput):
            scores, components = out.scores, dict(out.components)
        elif isinstance(out, torch.Tensor):
            scores = out.detach()
        elif isinstance(out, np.ndarray) or isinstance(out, (list, tuple)):
            values = list(np.asarray(out, dtype=object).ravel()) if isinstance(out, np.ndarray) else list(out)
            odd = [i for i, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, (int, float, np.number))
                   and not (isinstance(v, torch.Tensor) and v.numel() == 1)]
            if odd:
                raise TypeError(f"{self.name} returned a non-number at rows {odd[:8]} ({values[odd[0]]!r}); return "
                                f"{RETURNS}, one finite number per sample")
            scores = torch.tensor([float(v) for v in values], dtype=torch.float32)
            if isinstance(out, np.ndarray):
                scores = scores.reshape(out.shape)
        else:
            raise TypeError(f"{self.name} returned {type(out).__name__}; return {RETURNS}, one number per sample")
        scores = scores.to(torch.float32)
        if scores.ndim != 1 or (n is not None and scores.shape[0] != n):
            got = f"{scores.shape[0]} scores" if scores.ndim == 1 else f"scores of shape {tuple(scores.shape)}"
            raise ValueError(f"{self.name} returned {got} for a batch of {n} samples; return {RETURNS} with one "
                             "score per sample")
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"{self.name} returned {float(scores[bad[0]])} at rows {bad[:8]}: a reward returns a "
                             "finite score for every sample, or raises (a made-up or missing score would be trained on)")
        return RewardOutput(scores, components)

    def __repr__(self) -> str:
        return f"RewardFunction({self.label}{', ' + str(self.kwargs) if self.kwargs else ''})"


def wrap(fn: Callable, name: str | None = None, **kwargs) -> RewardFunction:
    """``fn(images, prompts, metadata)`` as a reward of the package's contract (:class:`RewardFunction`); ``kwargs``
    are passed to it on every call. A reward already wrapped is returned as it is (with no new kwargs)."""
    if isinstance(fn, RewardFunction) and name is None and not kwargs:
        return fn
    return RewardFunction(fn, name=name, kwargs=kwargs)


def from_target(target: str | Callable, kwargs: Mapping[str, Any] | None = None, *, key: str = "target",
                kwargs_key: str = "kwargs", name: str | None = None) -> RewardFunction:
    """The reward ``target`` names: an import path (:func:`import_target`) or the object itself. A class is
    instantiated with ``kwargs``; a function, or an object that is already a reward, gets ``kwargs`` on every call.
    ``key`` / ``kwargs_key`` are the config keys the errors name (``reward.target``, ``reward.kwargs``)."""
    kwargs = dict(kwargs or {})
    obj = import_target(target, key) if isinstance(target, str) else target
    label = target if isinstance(target, str) else target_label(target)
    if isinstance(obj, RewardFunction):
        return obj if not kwargs else RewardFunction(obj.fn, name=name or obj.name, label=obj.label,
                                                     kwargs={**obj.kwargs, **kwargs})
    if inspect.isclass(obj):
        try:
            obj = obj(**kwargs)
        except TypeError as err:
            raise TypeError(f"{kwargs_key}={kwargs!r} rejected by {label} (a class, built with them): {err}") from err
        kwargs = {}
    elif not callable(obj):
        raise TypeError(f"{key}={label!r} is a {type(obj).__name__}, not a reward: name a function fn(images, "
                        "prompts, metadata) or a class whose instances are one")
    try:
        return RewardFunction(obj, name=name, label=label, kwargs=kwargs)
    except TypeError as err:
        given = f" with {kwargs_key}={kwargs!r}" if kwargs else ""
        raise TypeError(f"{key}={label!r}{given}: {err}") from None


def _custom(target: str, **kwargs) -> RewardFunction:
    """``rewards.load("custom", target="my_rewards:redness", **kwargs)``: the reward ``target`` names."""
    return from_target(target, kwargs)


_custom.modality = "any"  # what the trainer's reward ↔ model check reads: a custom reward scores what it is given
register("custom")(_custom)
