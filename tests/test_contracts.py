"""The contracts a streaming causal video model will plug into, shown with test doubles: adapter-defined
conditioning carrying model state, chunk-by-chunk stateful generation rescored exactly by an algorithm's update
path (a chunk axis in the plan), per-frame sigmas through an adapter's velocity, and the reference policy reached
through the update context rather than by swapping the adapter's module."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.algorithms import GRPO, Batch, RolloutPlan, UpdateContext
from flowgrpo.algorithms.schedule import select_trained
from samplers import chunked_rollout, flow_sigmas, rollout

CONF = str(Path(__file__).resolve().parents[1] / "conf")
B, C, T, D, L = 4, 3, 5, 2, 3  # samples, chunks, steps per chunk, channels, tokens per chunk


@dataclass
class StreamCond:
    """Conditioning a streaming adapter could define: a text embedding and the running context (a stand-in for a KV
    cache) written after each chunk. Indexable by rows, like ``PromptEmbeds``."""

    text: torch.Tensor      # [B, D]
    context: torch.Tensor   # [B, D]

    def __getitem__(self, rows) -> "StreamCond":
        return StreamCond(self.text[rows], self.context[rows])


class StreamingToy(UpdateContext):
    """``v = θ·x + σ·context + text`` (per channel), and a commit that writes each clean chunk into the context."""

    def __init__(self):
        self.theta = torch.nn.Parameter(torch.tensor([0.3, -0.2]))
        self.params = [self.theta]
        self.updates = 0
        self._ref = False

    def velocity(self, x, sigma, cond):
        theta = torch.zeros_like(self.theta) if self._ref else self.theta
        sigma = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1, 1, 1) if torch.is_tensor(sigma) else sigma
        return theta.view(1, D, 1) * x + sigma * cond.context.unsqueeze(-1) + cond.text.unsqueeze(-1)

    @staticmethod
    def commit(x0, cond):  # a no-grad pass writing the chunk into the state; never in place
        return StreamCond(cond.text, 0.5 * cond.context + x0.mean(-1))

    @contextlib.contextmanager
    def reference(self):
        self._ref = True
        try:
            yield
        finally:
            self._ref = False

    def generator(self, *keys):
        return torch.Generator().manual_seed(sum(keys) + 1)


def streamed_batch(ctx: StreamingToy, sigmas: torch.Tensor) -> Batch:
    g = torch.Generator().manual_seed(0)
    cond = StreamCond(torch.randn(B, D, generator=g), torch.zeros(B, D))
    sde = torch.ones(B, C, T, dtype=torch.bool)
    train = select_trained(sde.flatten(1), 0.4, generator=g).view(B, C, T)  # 6 of the 15 steps of each row
    plan = RolloutPlan(sigmas=sigmas, sde_mask=sde, train_mask=train, solver="euler", kernel="flow_grpo",
                       noise_level=0.7, group_size=2)
    noise = torch.randn(B, C, D, L, generator=g)
    gens = [torch.Generator().manual_seed(100 + b) for b in range(B)]
    with torch.no_grad():
        traj = chunked_rollout(ctx.velocity, ctx.commit, noise, sigmas, sde, cond=cond, generator=gens)
    batch = Batch(prompts=["p"] * B, metadata=None, global_rows=torch.arange(B), cond=cond, plan=plan,
                  latents=traj.latents, log_probs=traj.log_probs, chunk_conds=traj.conds)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return batch, traj


def test_chunked_rollout_records_what_each_chunk_was_denoised_under():
    ctx, sigmas = StreamingToy(), flow_sigmas(T)
    batch, traj = streamed_batch(ctx, sigmas)
    assert traj.latents.shape == (B, C, T + 1, D, L) and traj.log_probs.shape == (B, C, T) and len(traj.conds) == C
    assert batch.plan.num_chunks == C and batch.plan.trained_per_row == 6
    # chunk c was generated under the context written by chunks 0..c-1, and nothing else
    context = torch.zeros(B, D)
    for c in range(C):
        assert torch.equal(traj.conds[c].context, context)
        context = 0.5 * context + traj.latents[:, c, -1].mean(-1)
    # each chunk equals a plain rollout under its own conditioning
    gens = [torch.Generator().manual_seed(100 + b) for b in range(B)]
    for c in range(C):
        alone = rollout(lambda x, s, c=c: ctx.velocity(x, s, traj.conds[c]), traj.latents[:, c, 0], sigmas,
                        torch.ones(T, dtype=torch.bool), generator=gens)
        assert torch.equal(alone.latents, traj.latents[:, c]) and torch.equal(alone.log_probs, traj.log_probs[:, c])


def test_the_update_path_rescores_a_streamed_rollout_exactly():
    """An algorithm's loss (GRPO's PPO-clip with a KL term) on the chunked batch, in micro-batches and a shuffled
    step order as the trainer visits them: every trained transition rescores to its rollout log-prob bit for bit."""
    ctx, sigmas = StreamingToy(), flow_sigmas(T)
    batch, _ = streamed_batch(ctx, sigmas)
    algo = GRPO(sigmas, kl_beta=0.1)
    mask = batch.plan.train_mask.flatten(1)
    steps = torch.stack([row.nonzero().squeeze(1)[torch.randperm(6, generator=torch.Generator().manual_seed(r))]
                         for r, row in enumerate(mask)])
    seen = torch.zeros_like(mask)
    for rows in (torch.tensor([0, 1]), torch.tensor([2, 3])):
        for j in range(steps.shape[1]):
            s = steps[rows, j]
            chunks, _ = batch.plan.chunk_step(s)
            lp = algo.transition_log_prob(ctx, batch, rows, s)
            assert torch.equal(lp, batch.log_probs.flatten(1)[rows, s]), (rows, s)
            loss, info = algo.loss(ctx, batch, rows, s)
            assert info["ratio_min"].item() == 1.0 == info["ratio_max"].item()
            loss.backward()
            seen[rows, s] = True
    assert torch.equal(seen, mask) and ctx.theta.grad is not None and ctx.theta.grad.abs().sum() > 0
    # the recorded state matters: rescoring chunk > 0 under the first chunk's conditioning does not match
    later = [(r, int(f)) for r in range(B) for f in mask[r].nonzero().squeeze(1) if f >= T]
    r, f = later[0]
    wrong = Batch(**{**batch.__dict__, "chunk_conds": [batch.chunk_conds[0]] * C})
    assert not torch.equal(algo.transition_log_prob(ctx, wrong, torch.tensor([r]), torch.tensor([f])),
                           batch.log_probs.flatten(1)[[r], [f]])


def test_per_frame_sigmas_through_the_video_adapter():
    from flowgrpo.models import load_adapter

    wan = load_adapter("wan", "tiny-random:wan")
    cond = wan.encode_prompts(["a red circle", "a blue square"], guidance_scale=2.0)
    x = wan.prepare_noise(2, height=16, width=16, num_frames=9, generator=torch.Generator().manual_seed(0))
    frames = x.shape[2]
    with torch.no_grad():
        shared = wan.velocity(x, torch.tensor([0.7, 0.4]), cond, guidance_scale=2.0)
        per_frame = wan.velocity(x, torch.tensor([[0.7] * frames, [0.4] * frames]), cond, guidance_scale=2.0)
        staggered = torch.tensor([[0.7] * frames, [0.4] * frames])
        staggered[:, -1] = 0.1  # the last frame at another noise level, as a streaming denoiser would have it
        mixed = wan.velocity(x, staggered, cond, guidance_scale=2.0)
    # one level per frame = one level per sample; to float rounding, not bit for bit: the per-token timestep
    # embedding is a matmul of another shape, which some CPUs' kernels round differently (1 ulp seen)
    torch.testing.assert_close(per_frame, shared, rtol=0, atol=1e-5)
    assert (mixed - shared).abs().max() > 1e-2
    with pytest.raises(ValueError, match="frames"):
        wan.velocity(x, torch.rand(2, frames + 1), cond, guidance_scale=2.0)
    sd3 = load_adapter("sd3", "tiny-random:sd3")
    image = sd3.prepare_noise(2, height=32, width=32, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="one sigma per sample"):
        sd3.velocity(image, torch.rand(2, 3), sd3.encode_prompts(["a", "b"]))


def test_the_reference_policy_is_a_context_of_the_update(tmp_path):
    from flowgrpo.trainer import Trainer

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=["model=tiny_sd3", "reward=jpeg_compressibility", "logger=none", "algo=grpo",
                                          "sampler.num_steps=4", "trainer.prompts_per_iteration=2",
                                          "trainer.group_size=2", "trainer.train_batch_size=4",
                                          "trainer.gradient_accumulation_steps=1", f"trainer.output_dir={tmp_path}"])
    trainer = Trainer(cfg, tmp_path)
    with torch.no_grad():  # move the LoRA off its zero-effect init so policy and reference differ
        for p in trainer.params:
            p.add_(0.05)
    batch = trainer.plan(0)
    x = torch.randn(4, *trainer.adapter.prepare_noise(1, height=cfg.model.height, width=cfg.model.width).shape[1:])
    module = trainer.adapter.transformer
    with torch.no_grad():
        live = trainer.policy.velocity(x, 0.5, batch.cond)
        with trainer.policy.reference():
            ref = trainer.policy.velocity(x, 0.5, batch.cond)
            assert trainer.adapter.transformer is module  # nothing was swapped into the adapter
        again = trainer.policy.velocity(x, 0.5, batch.cond)
        trainer.unwrapped.disable_adapters()
        base = trainer.adapter.velocity(x, 0.5, batch.cond, **trainer.model_kw["guidance"])
        trainer.unwrapped.enable_adapters()
    assert torch.equal(live, again) and torch.equal(ref, base) and not torch.allclose(live, ref)


def test_the_shared_toy_context_states_every_member_of_the_update_context():
    """The algorithm tests' double (tests/doubles.py) lists every member the real ``UpdateContext`` has, and
    implements the ones it says it offers: a member added to the interface, or one dropped, fails here until the
    double states it."""
    from doubles import CONTRACT, ToyContext

    real = {n for n in vars(UpdateContext) if not n.startswith("_")} | set(UpdateContext.__annotations__)
    assert set(CONTRACT) == real, (f"UpdateContext has {sorted(real - set(CONTRACT))} the double does not state, and "
                                   f"the double states {sorted(set(CONTRACT) - real)} it no longer has")
    ctx = ToyContext()
    for name, offered in CONTRACT.items():
        if name in UpdateContext.__annotations__:
            assert hasattr(ctx, name) == offered, name
        else:
            assert (getattr(ToyContext, name) is not getattr(UpdateContext, name)) == offered, name
