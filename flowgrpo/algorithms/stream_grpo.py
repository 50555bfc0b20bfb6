r"""Streaming GRPO: group-relative policy gradient on a streaming video model's own re-noise steps.

A streaming model (a causal Wan generating block by block, ``flowgrpo.models.StreamAdapter``) denoises each block in
``S`` steps over ``[σ_0, …, σ_{S−1}, 0]``; between steps it re-noises its clean prediction,
``x_{j+1} ~ N((1 − σ_{j+1})·x̂₀, σ_{j+1}²·I)``. Those transitions are Gaussian with a mean that depends on the
model, so their log-density under new weights is exact (CM-GRPO, arXiv 2605.15190, makes this observation for
consistency models; the ``cps`` kernel at noise level 1 is the same transition, ``samplers.sde_step``). Streaming
GRPO samples ``G`` streams per prompt sequence with the model's own sampler, scores each whole stream, and applies
the GRPO family's PPO-clip update (:class:`~flowgrpo.algorithms.PolicyGradient`) to a random subset of the stored
re-noise transitions of every block: each is rescored under the very context it was sampled with (the cache the
blocks before it wrote, kept per block by the rollout), so with unchanged weights the ratio is exactly 1.

The plan has a chunk axis, one chunk per block: ``sde_mask[n, k, j]`` is True for the ``S − 1`` re-noise steps of
block ``k`` (the final step into σ = 0 returns ``x̂₀`` and has no density); ``algo.timestep_fraction`` of those
``K·(S − 1)`` transitions are trained per stream, a uniform subset drawn per stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..knobs import knob
from .policy_gradient import PolicyGradient, PolicyGradientConfig
from .schedule import select_trained, trained_step_count

__all__ = ["StreamGRPOConfig", "StreamGRPO"]


@dataclass
class StreamGRPOConfig(PolicyGradientConfig):
    """``algo=stream_grpo``."""

    timestep_fraction: float = knob(0.1, gt=0, le=1)  # share of a stream's K·(S-1) re-noise transitions trained
    kl_beta: float = knob(0.0, ge=0)  # weight of the closed-form Gaussian KL to the reference (LoRA disabled)


class StreamGRPO(PolicyGradient):
    """Streaming GRPO (see the module docstring).

    Args:
        base_sigmas: ``[S+1]`` a block's schedule (``StreamAdapter.sigmas``: the model's few-step list, then 0).
        chunks: ``K``, the blocks of a stream.
        **kwargs: the sampler's kernel (``cps``) / noise level / solver and fields of :class:`StreamGRPOConfig`.
    """

    name = "stream_grpo"
    config_class = StreamGRPOConfig
    streaming = True

    @classmethod
    def check_config(cls, algo_cfg, sampler_cfg) -> list[str]:
        if sampler_cfg.kernel != "cps":
            return [f"algo=stream_grpo scores the streaming sampler's re-noise steps, the cps kernel: "
                    f"sampler.kernel={sampler_cfg.kernel!r} must be 'cps' (sampler=stream)"]
        return []

    def _sde_steps(self) -> torch.Tensor:
        """Bool ``[S]``: the re-noise steps of a block (every step into σ > 0)."""
        return self.base_sigmas[1:] > 0

    def plan(self, num_prompts: int, group_size: int, *, generator: torch.Generator | None = None):
        rows = self._check_batch(num_prompts, group_size)
        K, S = self.num_chunks, self.num_steps
        sde = self._sde_steps().expand(rows, K, S).clone()
        train = select_trained(sde.view(rows, K * S), self.cfg.timestep_fraction, selection="random",
                               generator=generator).view(rows, K, S)
        return self._make_plan(self.base_sigmas, sde, train, group_size)

    def trained_steps(self) -> tuple[int, str]:
        n = self.num_chunks * int(self._sde_steps().sum())
        k = trained_step_count(n, self.cfg.timestep_fraction)
        return k, (f"algo=stream_grpo: {k} of the {n} re-noise transitions of a stream ({self.num_chunks} blocks × "
                   f"{int(self._sde_steps().sum())}; algo.timestep_fraction={self.cfg.timestep_fraction:g}, random)")

    def describe(self) -> str:
        return (f"stream_grpo (streaming GRPO): {self.num_chunks} blocks × {self.num_steps} steps, "
                f"{self._kernel_text()} on the re-noise steps, trains {self.trained_steps()[0]} transitions per "
                f"stream; {self._adv_text()}")
