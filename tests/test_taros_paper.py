"""TaRoS as arXiv 2511.19356 (v4, Sec. 4, eqs. 3–9) defines it (``rewards.aggregate.TaRoS``,
``reward.aggregate.name=taros``): the Hoyer index, the per-group softmax weights checked against numbers worked out by
hand, its properties (one component, equal components, a constant component), the threshold calibration, the two
readings offered as options, the config keys and their errors, and the diagnostic every multi-reward run logs (the
correlation of the final advantage with each component's own group advantage, and each component's Hoyer index)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.advantages import RewardAggregator, component_group_stats, group_advantages
from flowgrpo.config import AggregateConfig, ConfigError, validate
from rewards.aggregate import SaturationWeighted, TaRoS, hoyer_sparsity

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def standardised(values: list[float], eps: float = 1e-4) -> torch.Tensor:
    """The group advantage written out: (r − mean)/(population std + eps)."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return torch.tensor([(v - mean) / (std + eps) for v in values])


def aggregate_node(**kw):
    """A ``reward.aggregate`` node as the config builds it."""
    node = OmegaConf.structured(AggregateConfig)
    for key, value in kw.items():
        OmegaConf.update(node, key, value, merge=False)
    return node


# ------------------------------------------------------------------------------------------------ Hoyer index


def test_hoyer_sparsity_by_hand():
    # [3, 4]: ‖r‖₁ = 7, ‖r‖₂ = 5 → (√2 − 7/5)/(√2 − 1)
    # [0, 1, 1, 0]: ‖r‖₁ = 2, ‖r‖₂ = √2 → (2 − √2)/(2 − 1)
    assert float(hoyer_sparsity(torch.tensor([3.0, 4.0]))) == pytest.approx((math.sqrt(2) - 1.4) / (math.sqrt(2) - 1))
    assert float(hoyer_sparsity(torch.tensor([0.0, 1.0, 1.0, 0.0]))) == pytest.approx(2 - math.sqrt(2))
    out = hoyer_sparsity(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.7, 0.7, 0.7, 0.7], [0.0, 0.0, 0.0, 0.0],
                                       [-2.0, 0.0, 0.0, 0.0]]))
    assert out.tolist() == [1.0, 0.0, 0.0, 1.0]  # one-hot: 1; constant: 0; all zero: 0 (defined so); sign-blind
    assert hoyer_sparsity(torch.tensor([[5.0]])).tolist() == [0.0]  # G = 1: no spread to measure
    assert hoyer_sparsity(torch.tensor([[0.1] * 6, [-1.0, 1.0, 1.0, -1.0, 1.0, 1.0]])).tolist() == [0.0, 0.0]  # exact


# ------------------------------------------------------------------------------------------ weights by hand

# One group of G = 4, K = 2 components, fixed τ:
#   r_1 = [1, 0, 0, 0]  mean 0.25, ‖·‖₁ = 1, ‖·‖₂ = 1 → S_H = (2 − 1)/(2 − 1) = 1
#   r_2 = [0, 1, 1, 0]  mean 0.5,  ‖·‖₁ = 2, ‖·‖₂ = √2 → S_H = (2 − √2)/(2 − 1) = 0.585786
R = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
S1, S2 = 1.0, 2 - math.sqrt(2)


def expected_advantage(w1: float) -> torch.Tensor:
    w2 = 1 - w1
    return standardised([w1 * 1, w2 * 1, w2 * 1, 0.0])  # r̃ = w_1 r_1 + w_2 r_2


def test_weights_and_advantage_by_hand_as_printed():
    # τ = 0.5 for both, β = 0.5, the printed sign:
    #   g_1 = h(0.25 − 0.5) + 0.5·(S_1 − S_2) = 0.437824 + 0.207107 = 0.644930
    #   g_2 = h(0.5 − 0.5) + 0.5·(S_2 − 0)   = 0.5      + 0.292893 = 0.792893
    #   w_1 = 1/(1 + e^{g_2 − g_1}) = 1/(1 + e^{0.147963}) = 0.463076
    g1 = sig(-0.25) + 0.5 * (S1 - S2)
    g2 = sig(0.0) + 0.5 * (S2 - 0.0)
    w1 = 1 / (1 + math.exp(g2 - g1))
    assert w1 == pytest.approx(0.463076, abs=1e-6)
    t = TaRoS(["a", "b"], tau={"a": 0.5, "b": 0.5}, beta=0.5, clip=None)
    adv = t(R, group_size=4)
    torch.testing.assert_close(adv, expected_advantage(w1).float())
    d = t.diagnostics()
    assert d["a/weight"] == pytest.approx(w1) and d["b/weight"] == pytest.approx(1 - w1)
    assert d["a/utility"] == pytest.approx(g1) and d["b/utility"] == pytest.approx(g2)
    assert d["a/hoyer"] == pytest.approx(S1) and d["b/hoyer"] == pytest.approx(S2)
    assert d["a/tau"] == 0.5 and d["calibrating"] == 0.0  # every τ fixed: nothing to calibrate


def test_the_other_sign_by_hand():
    # performance_sign = −1: h(τ − mean) — a component past its threshold loses weight
    #   g_1 = h(0.5 − 0.25) + 0.207107 = 0.562177 + 0.207107 = 0.769284;  g_2 = 0.792893 (h(0) as before)
    g1 = sig(0.25) + 0.5 * (S1 - S2)
    g2 = sig(0.0) + 0.5 * S2
    w1 = 1 / (1 + math.exp(g2 - g1))
    assert w1 == pytest.approx(0.494098, abs=1e-6)
    t = TaRoS(["a", "b"], tau={"a": 0.5, "b": 0.5}, beta=0.5, performance_sign=-1, clip=None)
    torch.testing.assert_close(t(R, 4), expected_advantage(w1).float())
    # a high component: as printed it gains weight, with the other sign it loses it
    hi = torch.tensor([[0.9, 0.2], [0.95, 0.6], [0.92, 0.4], [0.97, 0.1]])
    printed = TaRoS(["a", "b"], tau={"a": 0.7, "b": 0.7}, beta=0.0)
    printed(hi, 4)
    other = TaRoS(["a", "b"], tau={"a": 0.7, "b": 0.7}, beta=0.0, performance_sign=-1)
    other(hi, 4)
    assert printed.diagnostics()["a/weight"] > 0.5 > other.diagnostics()["a/weight"]


def test_stage_gates_by_hand():
    # thresholds = "stage_gates": K − 1 = 1 gate, τ_1 = 0.2 on the first component; the first component's term is h(0),
    # the second's is the first's gate h(mean_1 − τ_1) = h(0.05):
    #   g_1 = 0.5 + 0.207107 = 0.707107;  g_2 = h(0.05) + 0.292893 = 0.512497 + 0.292893 = 0.805390
    g1 = 0.5 + 0.5 * (S1 - S2)
    g2 = sig(0.25 - 0.2) + 0.5 * S2
    w1 = 1 / (1 + math.exp(g2 - g1))
    assert w1 == pytest.approx(0.475449, abs=1e-6)
    t = TaRoS(["a", "b"], tau={"a": 0.2}, beta=0.5, thresholds="stage_gates", clip=None)
    torch.testing.assert_close(t(R, 4), expected_advantage(w1).float())
    assert "b/tau" not in t.diagnostics() and t.tau() == {"a": 0.2}
    with pytest.raises(KeyError, match="last component has no gate"):
        TaRoS(["a", "b"], tau={"b": 0.7}, thresholds="stage_gates")
    # passing the gate moves the emphasis to the next stage (as printed)
    lo = TaRoS(["a", "b"], tau={"a": 0.9}, beta=0.0, thresholds="stage_gates")
    hi = TaRoS(["a", "b"], tau={"a": 0.1}, beta=0.0, thresholds="stage_gates")
    lo(R, 4), hi(R, 4)
    assert lo.diagnostics()["b/weight"] < 0.5 < hi.diagnostics()["b/weight"]


# ------------------------------------------------------------------------------------------------ properties


def test_one_component_is_the_plain_group_advantage():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(24, generator=g)
    for kw in ({}, {"beta": 0.5, "performance_sign": -1}, {"thresholds": "stage_gates"}):
        torch.testing.assert_close(TaRoS(["r"], **kw)(r[:, None], 6), group_advantages(r, 6), rtol=0, atol=0)
    torch.testing.assert_close(TaRoS(["r"], global_std=True)(r[:, None], 6), group_advantages(r, 6, global_std=True))
    assert TaRoS(["r"], tau={"r": 0.3}).diagnostics() == {}  # nothing before the first call


def test_equal_components_weigh_alike():
    g = torch.Generator().manual_seed(1)
    r = torch.rand(16, generator=g)
    same = {"a": r, "b": r, "c": r}
    tau = {"a": 0.5, "b": 0.5, "c": 0.5}
    flat = TaRoS(["a", "b", "c"], tau=tau, beta=0.0)
    adv = flat(same, 4)
    assert [flat.diagnostics()[f"{k}/weight"] for k in "abc"] == pytest.approx([1 / 3] * 3)  # β = 0: uniform
    torch.testing.assert_close(adv, group_advantages(r, 4))  # and the advantage is that of the one score
    # β > 0: the sparsity differences cancel between equal components, but the last one's partner is S_H(r_{K+1}) = 0,
    # so it keeps +β·S_H(r): per group w_c/w_a = e^{β S_H}, the others uniform — the advantage is unchanged
    sparse = TaRoS(["a", "b", "c"], tau=tau, beta=0.5)
    torch.testing.assert_close(sparse(same, 4), group_advantages(r, 4), rtol=1e-5, atol=1e-5)
    w, _, hoyer = sparse.weights(r.double().view(4, 4, 1).expand(4, 4, 3))
    torch.testing.assert_close(w[:, 0], w[:, 1])
    torch.testing.assert_close(w[:, 2] / w[:, 0], torch.exp(0.5 * hoyer[:, 2]))


def test_a_constant_component_has_hoyer_zero_and_does_not_change_the_ranking():
    g = torch.Generator().manual_seed(2)
    task, other = torch.rand(24, generator=g), torch.rand(24, generator=g)
    const = torch.full((24,), 0.8)
    t = TaRoS(["task", "const"], tau={"task": 0.5, "const": 0.5})
    adv = t({"task": task, "const": const}, 6)
    assert t.diagnostics()["const/hoyer"] == 0.0
    # the constant only shifts r̃ within each group and the task's weight only scales it: the task's own ranking,
    # and (up to the eps added to the std, which the scale changes) the task's own advantage
    for a, r in zip(adv.view(4, 6), task.view(4, 6)):
        assert torch.equal(a.argsort(), r.argsort())
    exact = TaRoS(["task", "const"], tau={"task": 0.5, "const": 0.5}, eps=0.0)({"task": task, "const": const}, 6)
    torch.testing.assert_close(exact, group_advantages(task, 6, eps=0.0))
    # as the last component it changes nothing but the scale: its partner term S_H(r_{K+1}) = 0 equals its own
    two = TaRoS(["task", "other"], tau={"task": 0.5, "other": 0.5}, eps=0.0)
    three = TaRoS(["task", "other", "const"], tau={"task": 0.5, "other": 0.5, "const": 0.5}, eps=0.0)
    base = two({"task": task, "other": other}, 6)
    with_const = three({"task": task, "other": other, "const": const}, 6)
    torch.testing.assert_close(with_const, base)
    for a, b in zip(base.view(4, 6), with_const.view(4, 6)):
        assert torch.equal(a.argsort(), b.argsort())


# ------------------------------------------------------------------------------------------------ calibration


def test_tau_is_calibrated_from_the_first_iterations_then_frozen():
    t = TaRoS(["a", "b"], tau={"b": 0.6}, calibration_iterations=2, calibration_quantile=0.5)
    # call 1: 3 groups of 2, group means of a = 0.1, 0.5, 0.9 → τ_a = median = 0.5
    a1 = torch.tensor([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    b = torch.tensor([0.1, 0.9, 0.3, 0.5, 0.2, 0.4])
    t({"a": a1, "b": b}, 2)
    assert t.tau() == pytest.approx({"a": 0.5, "b": 0.6}) and t.diagnostics()["calibrating"] == 1.0
    # call 2: means 0.2, 0.3, 0.4; pooled [0.1, 0.2, 0.3, 0.4, 0.5, 0.9] → median (0.3 + 0.4)/2 = 0.35
    a2 = torch.tensor([0.1, 0.3, 0.2, 0.4, 0.3, 0.5])
    state = t.state_dict()  # mid-calibration
    t({"a": a2, "b": b}, 2)
    assert t.tau()["a"] == pytest.approx(0.35) and t.diagnostics()["calibrating"] == 0.0
    # call 3: frozen, whatever the means now
    t({"a": torch.ones(6) * 0.99, "b": b}, 2)
    assert t.tau()["a"] == pytest.approx(0.35) and t.diagnostics()["a/tau"] == pytest.approx(0.35)
    # a resumed instance continues the calibration exactly
    fresh = TaRoS(["a", "b"], tau={"b": 0.6}, calibration_iterations=2)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh({"a": a2, "b": b}, 2), TaRoS(["a", "b"], tau={"a": 0.35, "b": 0.6})(
        {"a": a2, "b": b}, 2))
    assert fresh.tau()["a"] == pytest.approx(0.35) and fresh.state_dict()["num_updates"] == 2
    # another quantile
    q = TaRoS(["a"], calibration_quantile=1.0)
    q(a1[:, None], 2)
    assert q.tau()["a"] == pytest.approx(0.9)
    with pytest.raises(RuntimeError, match="update=False before any update"):
        TaRoS(["a"])(a1[:, None], 2, update=False)
    TaRoS(["a"], tau={"a": 0.5})(a1[:, None], 2, update=False)  # every τ fixed: nothing to wait for


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(KeyError, match="not a component"):
        TaRoS(["a"], tau={"z": 0.5})
    with pytest.raises(ValueError, match="performance_sign"):
        TaRoS(["a"], performance_sign=0)
    with pytest.raises(ValueError, match="thresholds"):
        TaRoS(["a"], thresholds="gates")
    with pytest.raises(ValueError, match="each once"):
        TaRoS(["a", "a"])
    with pytest.raises(KeyError, match=r"\['b'\] were not scored"):
        TaRoS(["a", "b"])({"a": torch.zeros(4)}, 2)
    with pytest.raises(ValueError, match="saturation_weighted"):
        TaRoS(["a"]).load_state_dict(SaturationWeighted({"a": 1.0}).state_dict())


# ------------------------------------------------------------------------------------------------ the trainer's


def test_the_aggregator_ignores_the_weights_says_so_and_follows_the_order():
    g = torch.Generator().manual_seed(3)
    comps = {"a": torch.rand(8, generator=g), "b": torch.rand(8, generator=g), "log": torch.rand(8, generator=g)}
    node = aggregate_node(name="taros", **{"taros.order": ["b", "a"], "taros.tau": {"a": 0.5, "b": 0.4}})
    with pytest.warns(UserWarning, match="ignores the components' weights"):
        agg = RewardAggregator(node, {"a": 1.0, "b": 0.1, "log": 0.0})
    assert agg.components == ["b", "a"]  # the weight-0 component is logged, not trained on
    reference = TaRoS(["b", "a"], tau={"a": 0.5, "b": 0.4})
    torch.testing.assert_close(agg(comps, 4), reference(comps, 4), rtol=0, atol=0)
    # the same run with other weights: the same advantages (the weights do not enter)
    with pytest.warns(UserWarning):
        other = RewardAggregator(node, {"a": 5.0, "b": 1.0, "log": 0.0})
    torch.testing.assert_close(other(comps, 4), agg(comps, 4), rtol=0, atol=0)
    assert set(agg.diagnostics()) >= {"a/weight", "b/weight", "a/hoyer", "a/tau"}
    with pytest.raises(ValueError, match=r"reward\.aggregate\.taros\.order"):
        RewardAggregator(aggregate_node(name="taros", **{"taros.order": ["a"]}), {"a": 1.0, "b": 1.0})
    with pytest.raises(KeyError, match=r"reward\.aggregate\.taros\.tau"):
        RewardAggregator(aggregate_node(name="taros", **{"taros.tau": {"c": 0.5}}), {"a": 1.0, "b": 1.0})
    with pytest.raises(KeyError, match="stage_gates"):
        RewardAggregator(aggregate_node(name="taros", **{"taros.tau": {"b": 0.5}, "taros.thresholds": "stage_gates"}),
                         {"a": 1.0, "b": 1.0})


def test_checkpoints_of_the_old_taros_resume_as_saturation_weighted_only():
    weights = {"a": 1.0, "b": 1.0}
    old = SaturationWeighted(weights)
    old({"a": torch.rand(8), "b": torch.rand(8)}, 4)
    state = {"name": "taros", "taros": old.state_dict()}  # what a checkpoint of the aggregator named 'taros' held
    agg = RewardAggregator(aggregate_node(name="saturation_weighted"), weights)
    agg.load_state_dict(state)
    assert torch.equal(agg.method.sigma_ema, old.sigma_ema)
    with pytest.raises(ValueError, match="now reward.aggregate.name=saturation_weighted"):
        RewardAggregator(aggregate_node(name="taros"), weights).load_state_dict(state)
    new = RewardAggregator(aggregate_node(name="taros"), weights)
    new({"a": torch.rand(8), "b": torch.rand(8)}, 4)
    again = RewardAggregator(aggregate_node(name="taros"), weights)
    again.load_state_dict(new.state_dict())
    assert torch.equal(again.method.tau_calibrated, new.method.tau_calibrated)


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_config_keys_and_their_errors():
    cfg = validate(compose_cfg("reward=multi", "reward.aggregate.name=taros", "reward.aggregate.taros.beta=0.5",
                               "reward.aggregate.taros.performance_sign=-1",
                               "reward.aggregate.taros.thresholds=stage_gates",
                               "reward.aggregate.taros.order=[jpeg_compressibility,geneval]",
                               "+reward.aggregate.taros.tau.jpeg_compressibility=-20"))
    assert cfg.reward.aggregate.taros.beta == 0.5 and list(cfg.reward.aggregate.taros.order)[0] == "jpeg_compressibility"
    for overrides, message in [
        (["reward.aggregate.taros.performance_sign=2"], r"reward\.aggregate\.taros\.performance_sign=2 is not one of"),
        (["reward.aggregate.taros.thresholds=gates"], r"reward\.aggregate\.taros\.thresholds='gates'"),
        (["reward.aggregate.taros.beta=-1"], r"reward\.aggregate\.taros\.beta=-1"),
        # a knob of the other aggregator would be ignored silently: refused, naming it
        (["reward.aggregate.name=taros", "reward.aggregate.tau=0"], r"reward\.aggregate\.tau=0(\.0)? is a knob of "
                                                                     r"reward\.aggregate\.name=saturation_weighted"),
        (["reward.aggregate.name=saturation_weighted", "reward.aggregate.taros.beta=0.5"],
         r"reward\.aggregate\.taros\.beta=0\.5 is read only by reward\.aggregate\.name=taros"),
        (["reward.aggregate.name=sum", "reward.aggregate.taros.order=[geneval]"], r"reward\.aggregate\.taros\.order"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(compose_cfg("reward=multi", *overrides))
    # the published ablations of the project's own aggregator still compose on it
    validate(compose_cfg("experiment=taros_shortcut", "reward.aggregate.tau=0"))
    assert compose_cfg("experiment=taros_shortcut").reward.aggregate.name == "saturation_weighted"


# ------------------------------------------------------------------------------------------------ diagnostic


def test_the_diagnostic_correlation_and_hoyer():
    g = torch.Generator().manual_seed(4)
    r, s = torch.rand(24, generator=g), torch.rand(24, generator=g)
    comps = {"r": r, "s": s, "flat": torch.full((24,), 0.3)}
    stats = component_group_stats(comps, ["r"], 6, advantages=group_advantages(r, 6))
    assert stats["r/adv_corr"] == pytest.approx(1.0, abs=1e-6)  # one component: its own advantage
    assert stats["r/hoyer"] == pytest.approx(float(hoyer_sparsity(r.view(4, 6)).mean()))
    assert "r/adv_corr" not in component_group_stats(comps, ["r"], 6)  # without advantages: the spread stats only
    stats = component_group_stats(comps, ["r", "s", "flat"], 6, advantages=-group_advantages(r, 6))
    assert stats["r/adv_corr"] == pytest.approx(-1.0, abs=1e-6)
    assert -1 < stats["s/adv_corr"] < 1 and math.isnan(stats["flat/adv_corr"]) and stats["flat/hoyer"] == 0.0
    # two components of one group written out: corr of A with (s − mean)
    a = TaRoS(["r", "s"], tau={"r": 0.5, "s": 0.5})(comps, 6).double().view(4, 6)
    sg = s.double().view(4, 6)
    by_hand = []
    for ag, rg in zip(a, sg):
        da, dr = ag - ag.mean(), rg - rg.mean()
        by_hand.append(float((da * dr).sum() / math.sqrt(float((da ** 2).sum() * (dr ** 2).sum()))))
    got = component_group_stats(comps, ["s"], 6, advantages=a.flatten().float())["s/adv_corr"]
    assert got == pytest.approx(sum(by_hand) / 4, abs=1e-5)


BASE = [
    "model=tiny_sd3", "logger=none", "algo=grpo", "sampler=sde", "sampler.num_steps=4", "sampler.eval_num_steps=4",
    "trainer.iterations=2", "trainer.prompts_per_iteration=2", "trainer.group_size=2",
    "trainer.train_batch_size=4", "trainer.gradient_accumulation_steps=1",
    "trainer.eval_before=false", "trainer.eval_every=0", "trainer.eval_num_prompts=2",
    "trainer.eval_samples_per_tag=null", "trainer.gallery_every=0", "trainer.checkpoint_every=0",
]


def test_taros_through_the_trainer_logs_and_resumes_its_calibration(tmp_path):
    """reward=multi with reward.aggregate.name=taros: phase 4 is the paper's TaRoS on the gathered components, its
    weights and the every-run diagnostic are logged, and its calibration state survives a resume."""
    from flowgrpo.trainer import Trainer

    overrides = [*BASE, "reward=multi", "reward.aggregate.name=taros", "reward.aggregate.taros.calibration_iterations=3",
                 "trainer.checkpoint_every=1", "trainer.keep_checkpoints=5"]
    with pytest.warns(UserWarning, match="ignores the components' weights"):
        straight = Trainer(compose_cfg(*overrides, f"trainer.output_dir={tmp_path / 'a'}"), tmp_path / "a")
    reference = TaRoS(["geneval", "jpeg_compressibility"], calibration_iterations=3)
    for _ in range(2):
        scalars = straight.step()
        b = straight._last_batch
        expected = reference({k: b.components[k] for k in reference.names}, group_size=2)
        assert torch.equal(b.global_advantages.cpu(), expected)
        for k in ("geneval", "jpeg_compressibility"):
            assert f"taros/{k}/weight" in scalars and f"groups/{k}/hoyer" in scalars and f"groups/{k}/adv_corr" in scalars
        straight.history.append(scalars)
        straight.save_checkpoint()
    torch.testing.assert_close(straight.aggregator.method.tau_calibrated, reference.tau_calibrated)
    resumed = Trainer(compose_cfg(*overrides, f"trainer.output_dir={tmp_path / 'b'}",
                                  f"trainer.resume={tmp_path / 'a' / 'checkpoints' / 'checkpoint-000001'}"),
                      tmp_path / "b")
    assert resumed.maybe_resume() and resumed.aggregator.method.num_updates == 1
    resumed.step()
    torch.testing.assert_close(resumed.aggregator.method.tau_calibrated, straight.aggregator.method.tau_calibrated)
    assert resumed.aggregator.method.history.shape == straight.aggregator.method.history.shape


def test_every_multi_reward_run_logs_the_diagnostic(tmp_path):
    """With the default aggregator (the weighted sum, no aggregator object) the diagnostic is logged too."""
    from flowgrpo.trainer import Trainer

    trainer = Trainer(compose_cfg(*BASE, "reward=multi", "trainer.iterations=1", f"trainer.output_dir={tmp_path}"),
                      tmp_path)
    scalars = trainer.step()
    assert trainer.aggregator is None
    for k in ("geneval", "jpeg_compressibility"):
        assert 0.0 <= scalars[f"groups/{k}/hoyer"] <= 1.0 and f"groups/{k}/adv_corr" in scalars
