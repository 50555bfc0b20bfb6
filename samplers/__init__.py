"""Flow-matching samplers with exact log-probabilities. Pure torch: imports nothing else of the project.

Public contracts: :func:`flow_sigmas`, :class:`StepOutput`, :func:`sde_step`, :func:`ode_step`,
:func:`rollout` / :class:`Trajectory`, rows on grids of their own stepped together :func:`ragged_rollout`; the one
streaming sampler :func:`chunked_rollout` / :class:`ChunkedTrajectory` (stateful chunk-by-chunk generation, noise from
per-row generators or given as tensors; Self-Forcing's few-step sampler is its ``cps`` kernel at noise level 1 over
:func:`stream_sigmas` and :func:`stream_sde_mask`, with :func:`stream_noise` to pre-draw a stream's noise); plus
MixGRPO's :class:`SDEWindow` and Flash-GRPO's :func:`flash_plan`.
"""

from .flash import flash_plan, rectification_weights, single_step_mask
from .rollout import SOLVERS, RaggedTrajectory, Trajectory, ragged_rollout, rollout, sde_bounds
from .schedules import flow_sigmas, shift_sigmas, time_shift_exponential
from .solvers import dpm_solver_2m_step
from .streaming import ChunkedTrajectory, chunked_rollout, stream_noise, stream_sde_mask, stream_sigmas
from .steps import KERNELS, StepOutput, kernel_lambda, kernel_std, ode_step, randn, sde_kl, sde_step
from .window import WINDOW_SCHEDULES, SDEWindow, compress_tail

__all__ = [
    "KERNELS", "SOLVERS", "WINDOW_SCHEDULES",
    "StepOutput", "Trajectory", "ChunkedTrajectory", "SDEWindow",
    "flow_sigmas", "shift_sigmas", "time_shift_exponential",
    "sde_step", "ode_step", "kernel_std", "kernel_lambda", "sde_kl", "randn",
    "rollout", "chunked_rollout", "ragged_rollout", "RaggedTrajectory", "sde_bounds", "dpm_solver_2m_step",
    "stream_sigmas", "stream_sde_mask", "stream_noise",
    "compress_tail", "flash_plan", "single_step_mask", "rectification_weights",
]
