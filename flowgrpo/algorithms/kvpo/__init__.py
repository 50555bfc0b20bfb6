r"""KVPO (``algo=kvpo``, :class:`KVPO`) and its building blocks.

KVPO (arXiv 2605.14278, "KVPO: ODE-Native GRPO for Autoregressive Video Alignment via KV Semantic Exploration";
official code github.com/Richard-Zhang-AI/KVPO, ``models/longlive/trainer/kvpo.py`` and
``models/longlive/pipeline/diversity_sampling.py``) is GRPO for streaming video models that explores through the
*context* instead of the noise. A stream is generated up to a fork block; from there ``G`` branches continue with
the same noise, each attending, during ``P`` consecutive routed blocks, to its own selection of older cached frames
instead of the newest ones. One more run from the fork, the *unrouted run* (the reference branch), keeps the
normal sink + window context and is the baseline of the advantages. Nothing is sampled from a Gaussian policy;
the policy is a distribution over the ``G`` branches, scored by how well the model reproduces each branch's own
denoising trajectory under the normal context.

The package, one module per concern (each reads alone; the names below are importable from here):

* :mod:`.routing` — the routing geometry: where a stream forks, which older frames each branch attends
  (:func:`plan_routing`, :class:`RoutingPlan`) and the routes a causal Wan takes (:func:`route_fn`, ...);
* :mod:`.objective` — the TVE branch policy, reference-relative advantages and the clipped loss on the branch
  simplex (:func:`tve_scores`, :func:`fuse_advantages`, :func:`kvpo_loss`);
* :mod:`.rollout` — the branched streams the algorithm samples (:class:`BranchedRollout`);
* :mod:`.algorithm` — the algorithm itself (:class:`KVPOConfig`, :class:`KVPO`);
* :mod:`.awm` — the ablation ``algo=kvpo_awm`` (:class:`KVPOAWM`): the same branches trained by streaming AWM's
  update instead of the TVE objective.
"""

from .algorithm import KVPO, BranchingConfig, KVPOConfig
from .awm import KVPOAWM, KVPOAWMConfig
from .objective import (branch_log_policy, fuse_advantages, kvpo_loss, reference_relative_advantage,
                        reference_relative_advantages, tve_scores)
from .rollout import BranchedRollout
from .routing import (Route, RoutingPlan, batched_route_fn, plan_routing, route_fn, stacked_route_fn,
                      unrouted_positions)

__all__ = ["RoutingPlan", "plan_routing", "route_fn", "batched_route_fn", "stacked_route_fn", "unrouted_positions",
           "tve_scores", "branch_log_policy", "reference_relative_advantage", "reference_relative_advantages",
           "fuse_advantages", "kvpo_loss", "BranchedRollout", "BranchingConfig", "KVPOConfig", "KVPO", "KVPOAWMConfig",
           "KVPOAWM", "Route"]
