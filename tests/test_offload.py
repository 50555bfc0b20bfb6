"""Host copies of kept conditioning (``flowgrpo.offload``): rows selected across the parts they were offloaded in,
in the order asked, without a second copy of the whole; copies reported to an observer, and none made without one on
the CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowgrpo.offload import HostCopy, observe_host_copies, to_device, to_host


@dataclass
class Rows:
    """A minimal conditioning: rows of one tensor."""

    t: torch.Tensor

    def __len__(self) -> int:
        return len(self.t)

    def __getitem__(self, index) -> "Rows":
        return Rows(self.t[index])

    def map_tensors(self, fn) -> "Rows":
        return Rows(fn(self.t))

    @classmethod
    def cat(cls, items) -> "Rows":
        return cls(torch.cat([i.t for i in items]))


def test_rows_are_selected_across_parts_in_the_order_asked():
    a, b = HostCopy.of(Rows(torch.arange(3.0))), HostCopy.of(Rows(torch.arange(3.0, 7.0)))
    both = HostCopy.cat([a, b])
    assert len(both) == 7 and both.parts[0] is a.parts[0] and both.parts[1] is b.parts[0]  # joined without a copy
    assert both[torch.tensor([5, 0, 1, 6, 2])].to("cpu").t.tolist() == [5, 0, 1, 6, 2]
    assert both[2].to("cpu").t.tolist() == [2] and both[1:5].to("cpu").t.tolist() == [1, 2, 3, 4]
    assert both.to("cpu").t.tolist() == list(range(7))


def test_copies_are_made_and_reported_only_for_an_observer_on_the_cpu():
    t = torch.randn(4)
    assert to_host(t) is t and to_device(t, "cpu") is t and to_host(None) is None
    seen = []
    with observe_host_copies(seen.append):
        kept = HostCopy.of(Rows(t))
        back = kept.to("cpu")
    assert kept.parts[0].t.data_ptr() != t.data_ptr() and back.t.data_ptr() != kept.parts[0].t.data_ptr()
    assert len(seen) == 1 and seen[0] is kept.parts[0].t and torch.equal(back.t, t)
    assert to_host(t) is t  # the observer is gone
