"""The algorithm registry: what the config schemas (:mod:`flowgrpo.config`) and the algorithms
(:mod:`flowgrpo.algorithms`) both read, so that neither imports the other for it.

An algorithm registers itself when its class is defined (``Algorithm.__init_subclass__`` calls
:func:`register_algorithm`): its class under ``algo.name`` in :data:`ALGORITHMS`, and its schema in Hydra's
ConfigStore as ``algo/base_<name>`` (what ``conf/algo/<name>.yaml``'s defaults list extends). The config reads
:data:`ALGORITHMS` to validate an ``algo`` node; :func:`load_algorithms` imports the algorithm package by its name
(every module in it registers what it defines), which is how ``import flowgrpo.config`` alone is enough for Hydra to
compose any ``algo=`` option.

>>> from flowgrpo.registry import load_algorithms
>>> "grpo" in load_algorithms()
True
"""

from __future__ import annotations

import importlib

from hydra.core.config_store import ConfigStore

__all__ = ["ALGORITHMS", "TEMPORAL_FACTORS", "register_algorithm", "load_algorithms"]

#: name → Algorithm subclass, filled by :func:`register_algorithm`.
ALGORITHMS: dict[str, type] = {}

#: ``model.family`` → pixel frames per latent frame after the first of its VAE (Wan 2.1 and 2.2 compress time 4x):
#: what a config is checked against before a pipeline loads (``flowgrpo.config``), and the adapters' class default
#: (``WanAdapter.temporal_factor``; a loaded adapter answers with its own VAE's ``scale_factor_temporal``).
TEMPORAL_FACTORS: dict[str, int] = {"wan": 4, "causal_wan": 4}

#: the package whose modules define the algorithms (imported by name: it imports this module, not the other way)
_ALGORITHM_PACKAGE = "flowgrpo.algorithms"


def register_algorithm(cls: type) -> type:
    """Register ``cls`` (an Algorithm subclass with a ``name`` and a ``config_class``) under ``cls.name``, and store
    its schema as ``algo/base_<name>`` in Hydra's ConfigStore (again when a class is redefined)."""
    ALGORITHMS[cls.name] = cls
    ConfigStore.instance().store(group="algo", name=f"base_{cls.name}", node=cls.config_class)
    return cls


def load_algorithms() -> dict[str, type]:
    """:data:`ALGORITHMS` with every algorithm of the package registered (imports it once)."""
    importlib.import_module(_ALGORITHM_PACKAGE)
    return ALGORITHMS
