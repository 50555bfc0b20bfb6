"""Flow-OPD against its defining identities: the per-step reward is minus the exact Gaussian KL to the teacher
(torch.distributions agrees); a student equal to its teacher gets no advantage; the gradient with the reward detached
is the policy gradient, attached it gains −kl_scale·∇KL; routing (alternate, by metadata); teachers from an earlier
run's checkpoint and the cold start, in the trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.algorithms import ALGORITHMS, Batch
from flowgrpo.algorithms.flow_opd import FlowOPD
from samplers import flow_sigmas, ragged_rollout, sde_step
from doubles import Cond, ToyContext  # tests/doubles.py

CONF = str(Path(__file__).resolve().parents[1] / "conf")
SIGMAS = flow_sigmas(10)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rolled(algo: FlowOPD, ctx: ToyContext, metadata=None) -> Batch:
    plan = algo.plan(2, 2, generator=gen(4))
    noise = torch.randn(4, 3, 2, 2, generator=gen(5))
    with torch.no_grad():
        traj = ragged_rollout(lambda x, s, rows: ctx.velocity(x, s, None), noise, [plan.sigmas] * 4,
                              list(plan.sde_mask), kernel=plan.kernel, noise_level=plan.noise_level,
                              generator=[gen(10 + r) for r in range(4)])
    batch = Batch(prompts=["p"] * 4, metadata=metadata, global_rows=torch.arange(4), cond=Cond(), plan=plan,
                  latents=traj.latents, log_probs=traj.log_probs)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return batch


def first_steps(batch):
    return batch.plan.train_mask.to(torch.uint8).argmax(1)


def test_reward_is_minus_the_exact_gaussian_kl_and_zero_when_the_student_is_the_teacher(tmp_path):
    teacher = torch.tensor([0.3, -0.2, 0.1])
    ctx = ToyContext(stored={"t": teacher})
    algo = FlowOPD(SIGMAS, teachers={"t": "t"}, mar_beta=0.0, cold_start=False, kl_reward="exact")
    batch = rolled(algo, ctx)
    rows, steps = torch.arange(4), first_steps(batch)
    loss, info = algo.loss(ctx, batch, rows, steps)
    x = batch.latents[rows, steps]
    s, s_next = SIGMAS[steps], SIGMAS[steps + 1]
    with torch.no_grad():
        mine = sde_step(ctx.velocity(x, None, None), x, s, s_next)
        theirs = sde_step(teacher.view(1, -1, 1, 1) + 0.5 * x, x, s, s_next)
    normal = torch.distributions.Normal
    std = mine.std.view(-1, 1, 1, 1).expand_as(x)
    kl = torch.distributions.kl_divergence(normal(mine.mean, std), normal(theirs.mean, std)).flatten(1).sum(1) / 12
    assert info["teacher_kl"].item() == pytest.approx(kl.mean().item(), rel=1e-4)
    assert info["policy_loss"].item() == pytest.approx(kl.clamp(max=5).mean().item(), rel=1e-4)  # −A·ρ, ρ = 1
    # the student is the teacher: no advantage, no loss, with either reward
    ctx.stored["me"] = ctx.theta.detach().clone()
    batch.plan.info["teacher"] = "me"
    for reward in ("exact", "sampled"):
        same = FlowOPD(SIGMAS, teachers={"me": "me"}, mar_beta=0.0, cold_start=False, kl_reward=reward)
        loss, info = same.loss(ctx, batch, rows, steps)
        assert info["teacher_kl"].item() == 0 and loss.item() == 0


def test_detaching_the_reward_leaves_the_policy_gradient_and_attaching_adds_the_kl_pull():
    teacher = torch.tensor([0.3, -0.2, 0.1])
    grads = {}
    for detach in (True, False):
        ctx = ToyContext(stored={"t": teacher})
        algo = FlowOPD(SIGMAS, teachers={"t": "t"}, mar_beta=0.0, cold_start=False, kl_reward="exact",
                       detach_kl=detach)
        batch = rolled(algo, ctx)
        rows, steps = torch.arange(4), first_steps(batch)
        loss, info = algo.loss(ctx, batch, rows, steps)
        loss.backward()
        grads[detach] = ctx.theta.grad.clone()
    # by hand at θ_old (ρ = 1): −mean(A·∇log π) and the KL's gradient
    ctx = ToyContext(stored={"t": teacher})
    x = batch.latents[rows, steps]
    s, s_next = SIGMAS[steps], SIGMAS[steps + 1]
    out = sde_step(ctx.velocity(x, None, None), x, s, s_next, prev_sample=batch.latents[rows, steps + 1])
    from samplers import sde_kl

    kl = sde_kl(ctx.velocity(x, None, None), teacher.view(1, -1, 1, 1) + 0.5 * x, s, s_next) / 12
    A = (-kl.detach()).clamp(-5, 5)
    (g_pg,) = torch.autograd.grad(-(A * out.log_prob / 12).mean(), ctx.theta, retain_graph=True)
    (g_kl,) = torch.autograd.grad(kl.mean(), ctx.theta)
    torch.testing.assert_close(grads[True], g_pg, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(grads[False], g_pg + g_kl, rtol=1e-4, atol=1e-7)  # −kl_scale·∇KL, kl_scale = −1


def _one_state_many_steps(algo: FlowOPD, ctx: ToyContext, n: int):
    """``n`` rows in the same state ``x`` at the first trained step, each with its own step ``x' ~ π_θ(·|x)``
    (the old policy is the current one: ρ = 1)."""
    plan = algo.plan(n // 2, 2, generator=gen(4))
    k = int(plan.train_mask[0].to(torch.uint8).argmax())
    x = torch.randn(1, 3, 2, 2, generator=gen(6)).expand(n, -1, -1, -1)
    latents = torch.zeros(n, plan.sigmas.shape[0], 3, 2, 2)
    log_probs = torch.zeros(n, plan.sigmas.shape[0] - 1)
    with torch.no_grad():
        out = sde_step(ctx.velocity(x, None, None), x, SIGMAS[k], SIGMAS[k + 1], generator=gen(7))
    latents[:, k], latents[:, k + 1], log_probs[:, k] = x, out.prev_sample, out.log_prob
    batch = Batch(prompts=["p"] * n, metadata=None, global_rows=torch.arange(n), cond=Cond(), plan=plan,
                  latents=latents, log_probs=log_probs)
    batch.advantages = torch.zeros(n)
    return batch, torch.arange(n), torch.full((n,), k)


def test_the_sampled_reward_has_the_kl_gradient_in_expectation_and_the_detached_exact_kl_has_none():
    """The defining identity of the dense reward: over steps x' ~ π_θ(·|x), the detached log-ratio's policy
    gradient is ∇KL (the exact KL's direct pull), while the detached closed-form KL — a function of x alone — gives
    none."""
    teacher = torch.tensor([0.3, -0.2, 0.1])
    n = 20000
    grads = {}
    for reward, detach in (("sampled", True), ("exact", True), ("exact", False)):
        ctx = ToyContext(stored={"t": teacher})
        algo = FlowOPD(SIGMAS, teachers={"t": "t"}, mar_beta=0.0, cold_start=False, kl_reward=reward,
                       detach_kl=detach, adv_clip=1e6)
        batch, rows, steps = _one_state_many_steps(algo, ctx, n)
        loss, info = algo.loss(ctx, batch, rows, steps)
        loss.backward()
        grads[reward, detach] = ctx.theta.grad.clone()
    pull = grads["exact", False] - grads["exact", True]  # ∇KL: the attached KL minus its policy-gradient part
    assert pull.norm() > 0
    torch.testing.assert_close(grads["sampled", True], pull, rtol=0.05, atol=0.05 * pull.norm().item())
    assert grads["exact", True].norm() < 0.05 * pull.norm()  # zero up to Monte Carlo noise
    # the sampled reward averages to the KL itself
    ctx = ToyContext(stored={"t": teacher})
    algo = FlowOPD(SIGMAS, teachers={"t": "t"}, mar_beta=0.0, cold_start=False, adv_clip=1e6)
    batch, rows, steps = _one_state_many_steps(algo, ctx, n)
    x = batch.latents[rows, steps]
    with torch.no_grad():
        mine = sde_step(ctx.velocity(x, None, None), x, SIGMAS[steps], SIGMAS[steps + 1],
                        prev_sample=batch.latents[rows, steps + 1])
        theirs = sde_step(teacher.view(1, -1, 1, 1) + 0.5 * x, x, SIGMAS[steps], SIGMAS[steps + 1],
                          prev_sample=batch.latents[rows, steps + 1])
        _, info = algo.loss(ctx, batch, rows, steps)
    assert (mine.log_prob - theirs.log_prob).mean().item() == pytest.approx(info["teacher_kl"].item() * 12, rel=0.05)


def test_an_attached_sampled_reward_is_refused_naming_both_keys():
    from flowgrpo.config import ConfigError

    with pytest.raises(ConfigError, match=r"algo\.detach_kl=false .*algo\.kl_reward=exact"):
        FlowOPD(SIGMAS, teachers={"t": "t"}, detach_kl=False)
    assert FlowOPD(SIGMAS, teachers={"t": "t"}).cfg.kl_reward == "sampled"


def test_routing_alternates_per_iteration_or_follows_the_metadata():
    algo = FlowOPD(SIGMAS, teachers={"a": "a", "b": "b"}, schedule=["a", "a", "b"])
    assert [algo.plan(1, 2, generator=gen(0)).info["teacher"] for _ in range(4)] == ["a", "a", "b", "a"]
    fresh = FlowOPD(SIGMAS, teachers={"a": "a", "b": "b"})
    fresh.load_state_dict(algo.state_dict())
    assert fresh.plan(1, 2).info["teacher"] == "a" and fresh.schedule == ["a", "b"]  # position 4 of a, a, b
    meta = FlowOPD(SIGMAS, teachers={"a": "a", "b": "b"}, routing="metadata")
    ctx = ToyContext(stored={"a": torch.zeros(3), "b": torch.ones(3)})
    batch = rolled(meta, ctx, metadata=[{"task": t} for t in "abba"])
    assert meta.teacher_of(batch, torch.arange(4)) == ["a", "b", "b", "a"]
    batch.metadata[2] = {"task": "c"}
    with pytest.raises(KeyError, match="\\['c'\\]"):
        meta.teacher_of(batch, torch.arange(4))
    with pytest.raises(ValueError, match="algo.schedule"):
        FlowOPD(SIGMAS, teachers={"a": "a"}, schedule=["z"])


def test_without_teachers_the_run_stops_naming_the_key(tmp_path):
    from flowgrpo.config import validate

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=["algo=flow_opd"])
        missing = compose("train", overrides=["algo=flow_opd", f"+algo.teachers.a={tmp_path / 'none'}"])
    with pytest.raises(Exception, match="algo.teachers is empty"):
        validate(cfg)
    with pytest.raises(Exception, match="algo.teachers.a=.*no such run"):
        validate(missing)


BASE = ["model=tiny_sd3", "reward=jpeg_compressibility", "logger=none", "sampler.num_steps=4",
        "sampler.eval_num_steps=2", "trainer.iterations=1", "trainer.prompts_per_iteration=2",
        "trainer.group_size=2", "trainer.train_batch_size=4", "trainer.gradient_accumulation_steps=1",
        "trainer.eval_before=false", "trainer.eval_every=0", "trainer.eval_num_prompts=1",
        "trainer.eval_samples_per_tag=null", "trainer.gallery_every=0", "trainer.lr=3e-2"]


def test_teachers_come_from_an_earlier_run_and_the_cold_start_makes_the_student_their_average(tmp_path):
    from flowgrpo.trainer import Trainer

    def make(out, *extra):
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose("train", overrides=[*BASE, f"trainer.output_dir={out}", *extra])
        return Trainer(cfg, out)

    teacher = make(tmp_path / "teacher", "algo=grpo", "sampler=sde")  # stage 1: one reward
    teacher.fit()
    taught = [p.detach().clone() for p in teacher.params]
    opd = ["algo=flow_opd", f"+algo.teachers.jpeg={tmp_path / 'teacher'}", "algo.timestep_fraction=0.5"]
    student = make(tmp_path / "cold", *opd)
    assert isinstance(student.algorithm, ALGORITHMS["flow_opd"])
    student.fit()
    # cold start from one teacher: the rollout and the first update's student are the teacher (KL exactly 0)
    assert student.history[0]["train/teacher_kl"] == 0.0 and "train/mar_kl" in student.history[0]
    warm = make(tmp_path / "warm", *opd, "algo.cold_start=false")
    before = [p.detach().clone() for p in warm.params]
    warm.fit()
    assert warm.history[0]["train/teacher_kl"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, taught))
    assert any(not torch.equal(b, p) for b, p in zip(before, warm.params))
