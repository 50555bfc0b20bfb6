"""flowgrpo: GRPO-style reward alignment of flow-matching generators over diffusers pipelines.

``flowgrpo.train(overrides, reward=fn)`` trains from Python (:mod:`flowgrpo.api`); ``python train.py`` from the
command line.
"""

__version__ = "0.1.0"
__all__ = ["compose", "train"]


def __getattr__(name: str):
    """``train`` / ``compose`` on first use: ``import flowgrpo`` stays light (no torch) for the scripts that only read
    a run's files."""
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'flowgrpo' has no attribute {name!r}")
