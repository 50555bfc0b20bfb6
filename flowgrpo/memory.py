"""Bytes of live tensors, by category, and their peak: :class:`MemoryTracker`, a ``TorchDispatchMode``.

What the planner (:mod:`flowgrpo.planner`) counts when it runs a whole iteration on fake tensors, and what the
trainer's memory check (:mod:`flowgrpo.guards`) counts when it measures one forward of its own model: one tracker for
both, so the running loop does not import the planner. :func:`module_scope` names the module running at the peak and
labels new storages as activations inside a model's forward.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CATEGORIES", "MemoryTracker", "module_scope"]

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "other")


def _real():
    """Real tensors inside fake mode (:func:`flowgrpo.planner.fake_mode`), for the few small values code reads back
    (schedules, plans)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


class MemoryTracker(TorchDispatchMode):
    """Bytes of live tensor storages, by category, and their peak.

    Every op's outputs are registered by storage (views share one), with a weak reference whose callback forgets
    the storage when it is freed. A storage's category is the tracker's :attr:`label` when it appears (``other`` by
    default; the planner sets ``activations`` inside model forwards and backward, ``optimizer`` while optimizer state
    is created); tensors made before tracking (parameters, buffers) are registered with :meth:`track`; a gradient
    moves to ``gradients`` when autograd accumulates it (``register_post_accumulate_grad_hook`` on trained parameters
    only). The split at the highest total is kept (:attr:`peak_split`), with the module running then
    (:attr:`peak_where`). A storage made in host memory (label ``host``) or moved there (:meth:`to_host`): what
    ``trainer.offload_kept_context`` offloads) is counted in :attr:`host` (its peak: :attr:`host_peak`), not the GPU's.
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, list] = {}  # storage key -> [nbytes, category]
        self._refs: dict[int, weakref.ref] = {}
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.current = 0
        self.peak = 0
        self.peak_split = dict(self.by_category)
        self.peak_where = ""
        self.label = "other"
        self.where: list[str] = []
        self._hooks: list = []
        self.host = self.host_peak = 0

    # -- registration
    def _key(self, t: torch.Tensor):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None, None
        return storage._cdata, storage

    def track(self, t: torch.Tensor, category: str | None = None) -> None:
        """Count ``t``'s storage (once) under ``category`` (default: the current label)."""
        if not isinstance(t, torch.Tensor):
            return
        key, storage = self._key(t)
        if key is None or key in self.live:
            return
        nbytes = int(storage.nbytes())
        category = category or self.label
        self.live[key] = [nbytes, category, (tuple(t.shape), str(t.dtype), self.where[-1] if self.where else "")]
        self._refs[key] = weakref.ref(storage, functools.partial(self._free, key))
        if category == "host":  # made in host memory (labelled("host")): not the GPU's
            self.host += nbytes
            self.host_peak = max(self.host_peak, self.host)
            return
        self.by_category[category] += nbytes
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
            self.peak_split = dict(self.by_category)
            self.peak_where = self.where[-1] if self.where else self.label
            if self.debug:
                self.peak_tensors = sorted(self.live.values(), key=lambda e: -e[0])[:12]

    def retag(self, t: torch.Tensor, category: str) -> None:
        """Move ``t``'s storage to ``category`` (registering it if new)."""
        key, _ = self._key(t)
        if key is None:
            return
        if key not in self.live:
            self.track(t, category)
            return
        entry = self.live[key]
        self.by_category[entry[1]] -= entry[0]
        self.by_category[category] += entry[0]
        entry[1] = category

    def to_host(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage in host memory, not the GPU's (``flowgrpo.offload``'s observer in a plan)."""
        key, _ = self._key(t)
        if key is None:
            return
        if key not in self.live:
            self.track(t)
        entry = self.live[key]
        if entry[1] == "host":
            return
        self.by_category[entry[1]] -= entry[0]
        self.current -= entry[0]
        entry[1] = "host"
        self.host += entry[0]
        self.host_peak = max(self.host_peak, self.host)

    def track_module(self, module: torch.nn.Module, category: str = "weights") -> None:
        for t in list(module.parameters()) + list(module.buffers()):
            self.track(t, category)

    def watch_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Count each trained parameter's ``.grad`` as ``gradients`` once autograd has accumulated it."""
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(lambda p: self.retag(p.grad, "gradients")))

    def _free(self, key, _ref=None) -> None:
        entry = self.live.pop(key, None)
        self._refs.pop(key, None)
        if entry is None:
            return
        if entry[1] == "host":
            self.host -= entry[0]
        else:
            self.by_category[entry[1]] -= entry[0]
            self.current -= entry[0]

    # -- phases
    @contextlib.contextmanager
    def labelled(self, category: str) -> Iterator[None]:
        saved, self.label = self.label, category
        try:
            yield
        finally:
            self.label = saved

    def reset_peak(self) -> None:
        self.peak = self.current
        self.host_peak = self.host
        self.peak_split = dict(self.by_category)
        self.peak_where = ""

    #: Under fake tensors, an op none of whose inputs is fake and whose outputs have at most this many elements runs
    #: on real tensors: the bookkeeping the run's code reads back (row indices, plans, step counts) keeps working.
    small_real: int | None = None
    debug = False  # keep the largest storages alive at the peak (``peak_tensors``), slowly

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.small_real is None:
            out = func(*args, **kwargs)
        else:
            from torch._subclasses.fake_tensor import FakeTensor

            inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
                # a value read back from a fake tensor (a loss term logged as a float): it has none; 0 stands in,
                # and the tiny-size tests check that no shape or cost of a plan depended on one
                return False if args[0].dtype == torch.bool else 0
            if func is torch.ops.aten.equal.default and any(isinstance(a, FakeTensor) for a in inputs):
                # a check that two tensors hold the same values (rows that share a leader's noise): fake ones hold
                # none, so the check holds, as it does in the run being planned
                return True
            if any(isinstance(a, FakeTensor) for a in inputs):
                if func in _INDEX_OPS and len(args) > 1:  # a real boolean mask: its indices are known, use them
                    args = (args[0], _mask_indices(args[1]), *args[2:])
                out = func(*args, **kwargs)
            else:  # a factory, or only real inputs (bookkeeping): real when small (see _real_unless_large)
                out = self._real_unless_large(func, args, kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def _real_unless_large(self, func, args, kwargs):
        """An op none of whose inputs is fake (a factory, or bookkeeping on real tensors): run real if its result is
        small (code may read it back: row indices, a frame mask's widths, a random plan), fake if it is large: a
        result that big is only computed with, never read, and made real it would take real memory (a streaming
        frame mask expanded to a real-size run's tokens is 65,520² elements).

        The op runs real once at most. Its shape comes first from a run on fake copies of its inputs, which touches
        no real tensor (an in-place op is not applied twice) and draws from no real generator (a random plan is the
        real run's); an op whose shape depends on the data (``nonzero``, ``.item()``) has no such run and runs real.
        Inside :func:`_real` there is no fake mode: the op runs real, once."""
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

        fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
        if fake is None:
            return func(*args, **kwargs)
        fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, fake.from_tensor, (args, kwargs))
        try:
            out = func(*fake_args, **fake_kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            out = None
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if out is None or all(t.numel() <= self.small_real for t in outs):
            with _real():
                out = func(*args, **kwargs)
        return out


_INDEX_OPS = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
              torch.ops.aten._unsafe_index_put.default}


def _mask_indices(indices):
    """``indices`` of an ``aten.index`` call with every real boolean mask replaced by its integer indices (a mask
    over k dimensions becomes k index tensors), so that fake tensors indexed by it get a known shape."""
    from torch._subclasses.fake_tensor import FakeTensor

    out = []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool and not isinstance(index, FakeTensor):
            with _real():
                out.extend(index.nonzero(as_tuple=True))
        else:
            out.append(index)
    return out


@contextlib.contextmanager
def module_scope(tracker: MemoryTracker, names: dict[int, str]) -> Iterator[None]:
    """While a module named in ``names`` (every submodule of the run's components) runs, :attr:`MemoryTracker.where`
    names it and new storages are ``activations`` (a component's entry point may be another method than
    ``forward``, e.g. ``vae.decode``: its submodules' hooks still fire)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    depth = [0]

    def pre(module, _args):
        name = names.get(id(module))
        if name is None:
            return
        tracker.where.append(name)
        depth[0] += 1
        tracker.label = "activations"

    def post(module, _args, _out):
        if id(module) not in names:
            return
        if tracker.where:
            tracker.where.pop()
        depth[0] -= 1
        if depth[0] == 0:
            tracker.label = "other"

    inner_apply = torch.nn.Module._apply

    def _apply(self, fn, recurse=True):  # a cast or layout change of a component (the VAE to channels-last on its
        out = inner_apply(self, fn, recurse)  # first decode) makes new weights: count them as weights
        if id(self) in names:
            for t in list(self.parameters()) + list(self.buffers()):
                tracker.retag(t, "weights")
        return out

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    torch.nn.Module._apply = _apply
    try:
        yield
    finally:
        torch.nn.Module._apply = inner_apply
        for h in handles:
            h.remove()
