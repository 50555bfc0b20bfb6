"""The Hydra config tree: every option of every group composes, validates and instantiates; the schemas reject
unknown keys and wrong types naming the key; train.py runs end to end on the tiny twin.

Real hub models are never loaded: their configs are validated and their loaders must fail fast and clearly
offline, naming ``model.pretrained``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import rewards
from flowgrpo.algorithms import ALGORITHMS, build_algorithm
from flowgrpo.builders import (REPO_ROOT, Sampler, batch_plan, build_adapter, build_logger, build_prompts, build_reward,
                            build_sampler, model_kwargs)
from flowgrpo.config import GROUP_SCHEMAS, ConfigError, algo_schema, steps_line, validate

CONF = REPO_ROOT / "conf"
GROUPS = list(GROUP_SCHEMAS)  # model sampler algo reward data logger trainer
PRESETS = ["experiment", "debug"]
TINY_MODELS = ["tiny_sd3", "tiny_flux", "tiny_wan"]
# Streaming models (model.family=causal_wan): sampled by python -m flowgrpo.stream, refused by the trainer; loaded
# through tiny twins in tests/test_stream_presets.py.
STREAM_MODELS = ["causal_wan_shapes", "causal_wan_shapes_4step", "longlive_wan", "self_forcing_wan"]
#: what a streaming model trains with (the other options of these groups train models that denoise whole clips)
STREAMING = ["algo=stream_grpo", "sampler=stream", "reward=long_video", "data=motion_streams"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# Every sampler serves every clip/image algorithm (the algorithm decides which steps are SDE); the streaming sampler and
# algorithm need a streaming model.
# Rewards with learned weights (never on CI machines): building them must fail fast, naming the kwarg to set.
NEEDS_WEIGHTS = {"pickscore", "hpsv21", "aesthetic", "clipscore", "imagereward", "video_clip", "video_consistency"}
PARTNERS: dict[tuple[str, str], list[str]] = {
    ("sampler", "stream"): ["model=causal_wan_shapes", "algo=stream_grpo"],
    ("algo", "stream_grpo"): ["model=causal_wan_shapes"],
    ("algo", "kvpo"): ["model=causal_wan_shapes"],
    ("algo", "kvpo_awm"): ["model=causal_wan_shapes"],
    ("algo", "stream_awm"): ["model=causal_wan_shapes"],
    ("algo", "flow_opd"): ["+algo.teachers.t=conf"],  # it distils earlier runs (any existing path validates)
    ("experiment", "flow_opd_shapes"): ["algo.teachers.geneval=conf", "algo.teachers.jpeg=conf"],
    ("reward", "custom"): ["reward.target=rewards.examples:redness"],  # the user's reward: no default
}
# Keys left for the user to fill (``???``) by design.
EXPECTED_MISSING = {
    ("data", "text_prompts"): {"data.train_file"},
    ("data", "geneval"): {"data.train_file", "data.val_file"},
    ("experiment", "flow_grpo_sd35m_geneval"): {"data.train_file", "data.val_file"},
    ("experiment", "flow_grpo_wan21_1_3b"): {"data.train_file"},  # the user's prompt list
    ("experiment", "flow_grpo_wan22_5b"): {"data.train_file"},
    ("model", "self_forcing_wan"): {"model.stream.checkpoint"},  # the user's checkpoint files
    ("model", "longlive_wan"): {"model.stream.checkpoint", "model.stream.lora_checkpoint"},
    ("experiment", "kvpo_longlive"): {"model.stream.checkpoint", "model.stream.lora_checkpoint", "data.train_file"},
    ("experiment", "flow_grpo_sd35l_geneval"): {"data.train_file", "data.val_file"},
    ("experiment", "dance_grpo_flux_hps"): {"data.train_file"},
    ("experiment", "stream_grpo_self_forcing"): {"model.stream.checkpoint", "data.train_file"},
    ("experiment", "stream_awm_self_forcing"): {"model.stream.checkpoint", "data.train_file"},
}

ALL_OPTIONS = [(g, o) for g in GROUPS + PRESETS for o in options(g)]


@pytest.fixture(scope="module")
def hydra_compose():
    """``compose(overrides)`` against conf/train.yaml (Hydra initialised per call: nothing global outlives it)."""

    def run(overrides=(), **kwargs):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("train", overrides=list(overrides), **kwargs)

    return run


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")
    jsonl = d / "train.jsonl"
    records = [
        {"tag": "single_object", "prompt": "a photo of a red circle", "include": [{"class": "circle", "count": 1}]},
        {"tag": "counting", "prompt": "a photo of three squares", "include": [{"class": "square", "count": 3}]},
        {"tag": "position", "prompt": "a photo of a circle left of a square",
         "include": [{"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}]},
    ]
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    text = d / "prompts.txt"
    text.write_text("# a comment\na cat\n\na dog on a skateboard\n")
    return {"jsonl": jsonl, "text": text, "records": records}


# ----------------------------------------------------------------------------------------- compose


def test_tree_has_the_groups_of_design(hydra_compose):
    for group in GROUPS + PRESETS + ["accelerate"]:
        assert options(group), f"conf/{group}/ is empty"
    cfg = hydra_compose(return_hydra_config=True)
    choices = cfg.hydra.runtime.choices
    for group in GROUPS:
        assert choices[group] in options(group)
    assert set(options("model")) >= {"tiny_sd3", "tiny_flux", "tiny_wan", "sd3_shapes", "sd35_medium",
                                     "sd35_large", "flux_dev", "wan21_1_3b"}
    assert set(options("sampler")) >= {"sde", "dance", "cps", "mix_sde", "mix_sde_flash"}
    assert set(options("algo")) >= {"grpo", "mix_grpo", "flash_grpo"}
    assert set(options("logger")) >= {"wandb", "none"}
    assert {cfg.model.family for cfg in [hydra_compose([f"model={m}"]) for m in TINY_MODELS]} == {"sd3", "flux", "wan"}


@pytest.mark.parametrize("group,option", ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_every_option_composes_and_validates(hydra_compose, group, option):
    cfg = hydra_compose([f"{group}={option}", *PARTNERS.get((group, option), [])])
    if group == "model" and option in STREAM_MODELS:  # a valid model, which the default algorithm cannot train
        validate(cfg.model)
        with pytest.raises(ConfigError, match="is a streaming model .*algo=stream_grpo.*python -m flowgrpo.stream"):
            validate(cfg)
        cfg = hydra_compose([f"{group}={option}", *STREAMING])
    validate(cfg)
    for g, schema in GROUP_SCHEMAS.items():  # every group node is typed by its schema (the algorithm's own)
        expected = algo_schema(cfg.algo.name) if g == "algo" else schema
        assert OmegaConf.get_type(cfg[g]) is expected, g
    assert set(OmegaConf.missing_keys(cfg)) == EXPECTED_MISSING.get((group, option), set())


KEY = re.compile(r"\b(?:model|sampler|algo|reward|data|logger|trainer)(?:\.[a-z_0-9.]+|=)")


def test_every_model_sampler_algorithm_is_valid_or_refused_naming_the_key(hydra_compose):
    """Every ``model=M sampler=S algo=A`` of the option files either validates or is refused by
    :func:`~flowgrpo.config.validate` with a :class:`ConfigError` each of whose reasons names a key to change
    (``sampler.noise_level=...``, ``algo=...``): never a KeyError, an interpolation error or a silent pass that a
    run would trip over later. Composition and validation only (each option composed once, the triples assembled
    from them; a sample of triples is checked against Hydra's own composition)."""
    import itertools

    def node(option_group, option):
        extra = PARTNERS.get(("algo", option), []) if option_group == "algo" and option == "flow_opd" else []
        return hydra_compose([f"{option_group}={option}", *extra])[option_group]

    nodes = {g: {o: node(g, o) for o in options(g)} for g in ("model", "sampler", "algo")}

    def assembled(m, s, a):  # the other groups are the defaults, validated whole by the sample below
        return OmegaConf.create({"model": nodes["model"][m], "sampler": nodes["sampler"][s], "algo": nodes["algo"][a]})

    def verdict(cfg):
        try:
            validate(cfg)
            return "valid"
        except ConfigError as err:
            reasons = str(err).splitlines()[1:]
            assert reasons and all(KEY.search(r) for r in reasons), f"a reason names no key: {reasons}"
            return "\n".join(reasons)

    triples = list(itertools.product(*(options(g) for g in ("model", "sampler", "algo"))))
    verdicts = {t: verdict(assembled(*t)) for t in triples}
    # the assembly is the composition: a triple per option of each group, composed by Hydra
    for i in range(max(len(options(g)) for g in ("model", "sampler", "algo"))):
        m, s, a = (options(g)[i % len(options(g))] for g in ("model", "sampler", "algo"))
        composed = hydra_compose([f"model={m}", f"sampler={s}", f"algo={a}",
                                  *(PARTNERS[("algo", a)] if a == "flow_opd" else [])])
        assert verdict(composed) == verdicts[(m, s, a)], (m, s, a)
    # what the pairing rules say, spelled out for the cases that must hold whatever else changes
    for (m, s, a), v in verdicts.items():
        streaming_model, streaming_algo = m in STREAM_MODELS, ALGORITHMS[a].streaming
        if streaming_model != streaming_algo:
            assert v != "valid" and ("streaming" in v), (m, s, a, v)
        if s == "stream" and not streaming_model:
            assert "sampler=stream is a streaming model's" in v, (m, s, a, v)
        if streaming_model and streaming_algo and s != "stream":
            assert v != "valid" and "sampler." in v, (m, s, a, v)
    assert verdicts[("causal_wan_shapes", "stream", "stream_grpo")] == "valid"
    assert verdicts[("sd3_shapes", "dance", "grpo")] == "valid"
    assert "sampler.noise_level=0.7" in verdicts[("causal_wan_shapes", "cps", "stream_grpo")]


def test_presets_override_the_groups(hydra_compose):
    cfg = hydra_compose(["experiment=mix_grpo_shapes"])  # group choices and values both come from the preset
    assert (cfg.model.pretrained, cfg.sampler.num_steps, cfg.algo.name) == ("assets/tiny-sd3-shapes", 10, "mix_grpo")
    cfg = hydra_compose(["experiment=mix_grpo_shapes", "debug=default"])  # debug is applied last and wins
    assert (cfg.model.pretrained, cfg.sampler.num_steps, cfg.trainer.iterations) == ("tiny-random:sd3", 4, 2)
    cfg = hydra_compose(["experiment=mix_grpo_shapes", "sampler.num_steps=12"])  # the command line wins over all
    assert cfg.sampler.num_steps == 12


def test_geneval_with_mix_sde_composes(hydra_compose):
    cfg = validate(hydra_compose(["reward=geneval", "sampler=mix_sde"]))
    assert cfg.reward.name == "geneval" and cfg.reward.kwargs.detector == "shapes"
    assert cfg.sampler.kernel == "flow_grpo" and cfg.algo.name == "mix_grpo"


def test_config_files_start_with_their_command_and_comment_every_knob():
    for path in sorted(CONF.rglob("*.yaml")):
        lines = path.read_text(encoding="utf-8").splitlines()
        head = [line for line in lines[:3] if line.startswith("#") and "@package" not in line]
        assert head and any(c in head[0] for c in ("python train.py", "accelerate launch", "On every node",
                                                   "python -m flowgrpo.stream --preset")), \
            f"{path.relative_to(REPO_ROOT)} must open with the command that uses it"
        if path.parent.name == "accelerate":
            continue  # plain accelerate files, not Hydra nodes
        in_defaults, block = False, None  # block: the indent of a key whose value is a block scalar (| or >)
        for n, line in enumerate(lines, 1):
            stripped = line.strip()
            indent = len(line) - len(line.lstrip())
            if block is not None and (not stripped or indent > block):
                continue  # the text of a block scalar (the --help template), not knobs
            block = None
            if not stripped or stripped.startswith("#"):
                continue
            if line.startswith("defaults:"):
                in_defaults = True
                continue
            if in_defaults and stripped.startswith("- "):
                continue
            in_defaults = False
            key, sep, value = stripped.partition(":")
            if stripped.startswith("- ") or not sep or not value.split("#")[0].strip():
                continue  # list items and parent keys
            assert "#" in value, f"{path.relative_to(REPO_ROOT)}:{n}: knob {key!r} has no why-comment"
            if value.split("#")[0].strip() in ("|", "|-", "|+", ">", ">-", ">+"):
                block = indent


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)],
                         ids=[f"{g}={o}" for g in GROUPS for o in options(g)])
def test_option_files_state_only_what_differs_from_their_schema(group, option):
    """The schema field is the one source of a default: an option file that restated it would drift from it."""
    import yaml

    data = yaml.safe_load((CONF / group / f"{option}.yaml").read_text()) or {}
    schema = algo_schema(data["name"]) if group == "algo" else GROUP_SCHEMAS[group]
    ref = OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)  # "${model.num_steps}" as written

    def restated(node, ref, prefix=""):
        for key, value in node.items():
            if key in ("defaults", "name") or key not in ref or ref[key] == "???":
                continue
            if isinstance(value, dict) and isinstance(ref[key], dict):
                yield from restated(value, ref[key], f"{prefix}{key}.")
            elif ref[key] == value:
                yield f"{prefix}{key}"

    assert not list(restated(data, ref)), f"conf/{group}/{option}.yaml restates its schema's defaults"


def test_accelerate_presets_are_plain_accelerate_configs():
    from accelerate.commands.config.config_args import load_config_from_file

    kinds = {p.stem: load_config_from_file(str(p)).distributed_type.value for p in (CONF / "accelerate").glob("*.yaml")}
    assert kinds == {"multi_gpu": "MULTI_GPU", "fsdp": "FSDP", "deepspeed_zero2": "DEEPSPEED",
                     "multi_node": "MULTI_GPU"}


# ------------------------------------------------------------------------------ schema rejections


@pytest.mark.parametrize("override,key", [
    ("model.foo=1", "model.foo"),
    ("trainer.batch=3", "trainer.batch"),
    ("sampler.window.sise=3", "sampler.window.sise"),
])
def test_unknown_key_fails_naming_the_key(hydra_compose, override, key):
    with pytest.raises(ConfigCompositionException, match=key.replace(".", r"\.")):
        hydra_compose([override])


def test_appended_unknown_key_fails_validation(hydra_compose):
    cfg = hydra_compose(["+model.foo=1"])  # "+" bypasses the struct flag; validate does not
    with pytest.raises(ConfigError, match=r"model\.foo: unknown key"):
        validate(cfg)
    with pytest.raises(ConfigError, match=r"bar: unknown top-level key"):
        validate(hydra_compose(["+bar=1"]))


@pytest.mark.parametrize("override,key", [
    ("trainer.group_size=abc", "trainer.group_size"),
    ("model.height=tall", "model.height"),
    ("algo.window.size=x", "algo.window.size"),
    ("algo.global_std=maybe", "algo.global_std"),
])
def test_wrong_type_fails_naming_the_key(hydra_compose, override, key):
    with pytest.raises(ConfigCompositionException) as info:
        hydra_compose([override])
    chain = f"{info.value} {info.value.__cause__}"
    assert key in chain and ("could not be converted" in chain or "is not a valid" in chain), chain


def test_typo_and_wrong_type_inside_a_yaml_file_name_the_key(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "model" / "typo.yaml").write_text("defaults:\n  - base_model\n  - _self_\nfamly: sd3\n")
    (conf / "trainer" / "bad.yaml").write_text("defaults:\n  - base_trainer\n  - _self_\ngroup_size: many\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(ConfigCompositionException, match=r"model\.famly"):
            compose("train", overrides=["model=typo"])
        with pytest.raises(ConfigCompositionException, match=r"trainer\.group_size"):
            compose("train", overrides=["trainer=bad"])


@pytest.mark.parametrize("overrides,message", [
    (["sampler.kernel=foo"], r"sampler\.kernel='foo' is not one of flow_grpo, dance, cps"),
    (["model.attention=flash"], r"model\.attention='flash' is not one of sdpa, xformers"),
    (["model.torch_dtype=fp8"], r"model\.torch_dtype"),
    (["model.vae_dtype=fp8"], r"model\.vae_dtype='fp8' is not one of None, float32, bfloat16, float16"),
    (["algo.window.schedule=zigzag"], r"algo\.window\.schedule"),
    (["trainer.group_size=1"], r"trainer\.group_size=1 must be >= 2"),
    (["algo.clip_range=0"], r"algo\.clip_range=0\.0 must be > 0"),
    (["algo.window.size=30"], r"algo\.window\.size=30 exceeds sampler\.num_steps=10"),
    (["algo=flash_grpo", "algo.max_step=11"], r"algo\.max_step=11 exceeds sampler\.num_steps=10"),
    (["algo=grpo", "algo.timestep_fraction=0"], r"algo\.timestep_fraction=0"),
    (["algo=grpo", "algo.name=nope"], r"algo\.name='nope' is not one of .*grpo"),
    (["model=tiny_sd3", "model.family=flux"], r"model\.pretrained='tiny-random:sd3' does not match model\.family='flux'"),
    (["model=tiny_wan", "model.num_frames=null"], r"model\.num_frames must be set"),
    (["sampler.solver=rk4"], r"sampler\.solver='rk4' is not one of euler"),
    (["trainer.adam_betas=[0.9]"], r"trainer\.adam_betas"),
])
def test_choices_ranges_and_cross_checks_name_the_key(hydra_compose, overrides, message):
    cfg = hydra_compose(overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_validate_a_group_node_alone(hydra_compose):
    cfg = hydra_compose(["sampler.kernel=foo"])
    with pytest.raises(ConfigError, match=r"sampler\.kernel"):
        validate(cfg.sampler)
    with pytest.raises(ConfigError, match=r"sampler\.kernel"):
        build_sampler(cfg.sampler)


# ----------------------------------------------------------------------------------- instantiate


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_models_instantiate_and_sample(hydra_compose, name):
    from samplers import rollout

    cfg = hydra_compose([f"model={name}", "sampler.eval_num_steps=2"])
    adapter = build_adapter(cfg.model)
    assert adapter.family == cfg.model.family
    sampler = build_sampler(cfg.sampler, adapter=adapter, model=cfg.model)
    mk = model_kwargs(cfg.model)
    with torch.no_grad():
        cond = adapter.encode_prompts(["a red circle", "two squares"], mk["negative_prompt"], **mk["guidance"])
        noise = adapter.prepare_noise(2, generator=torch.Generator().manual_seed(0), **mk["size"])
        traj = rollout(lambda x, s: adapter.velocity(x, s, cond, **mk["guidance"]), noise, sampler.eval_sigmas,
                       torch.zeros(2, dtype=torch.bool))
        pixels = adapter.decode(traj.final)
    size = (3, cfg.model.height, cfg.model.width)
    expected = (2, cfg.model.num_frames, *size) if cfg.model.num_frames else (2, *size)
    assert tuple(pixels.shape) == expected and torch.isfinite(pixels).all()


@pytest.mark.filterwarnings("ignore:The `local_dir_use_symlinks` argument is deprecated")
@pytest.mark.parametrize("name", sorted(set(options("model")) - set(TINY_MODELS) - set(STREAM_MODELS)))
def test_real_models_validate_and_fail_clearly_offline(hydra_compose, name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = validate(hydra_compose([f"model={name}"]))
    assert cfg.model.lora.target_modules, "every model names its LoRA target modules"
    if name == "sd3_shapes":  # the embedded assets ship in assets/: they must load offline
        adapter = build_adapter(cfg.model)
        assert adapter.family == "sd3" and adapter.pipe.text_encoder_3 is None
        return
    if name == "wan_shapes":
        adapter = build_adapter(cfg.model)
        assert adapter.family == "wan" and type(adapter.pipe).__name__ == "WanPipeline"
        return
    with pytest.raises((OSError, FileNotFoundError), match=r"model\.pretrained"):
        build_adapter(cfg.model)


@pytest.mark.parametrize("name", options("sampler"))
def test_every_sampler_instantiates_and_drives_a_rollout(hydra_compose, name):
    """Every sampler with the default algorithm: schedules, and the algorithm's plan rolled out with its kernel."""
    from samplers import rollout

    if name == "stream":  # a streaming model's own sampler: refused on the default image model, naming the keys
        with pytest.raises(ConfigError, match=r"sampler=stream is a streaming model's .*model\.family='sd3'"):
            validate(hydra_compose([f"sampler={name}"]))
    cfg = validate(hydra_compose([f"sampler={name}", *PARTNERS.get(("sampler", name), [])]))
    sampler = build_sampler(cfg.sampler)
    assert isinstance(sampler, Sampler)
    T = cfg.sampler.num_steps
    assert sampler.sigmas.shape == (T + 1,) and sampler.eval_sigmas.shape == (cfg.sampler.eval_num_steps + 1,)
    assert sampler.sigmas[0] == 1 and sampler.sigmas[-1] == 0 and (sampler.sigmas.diff() < 0).all()
    assert (sampler.kernel, sampler.solver) == (cfg.sampler.kernel, cfg.sampler.solver)
    if name == "stream":  # its block-by-block rollout: tests/test_stream_training.py
        return
    plan = build_algorithm(cfg.algo, cfg.sampler, sampler.sigmas).plan(1, 2)
    noise = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    traj = rollout(lambda x, s: noise - 0.0 * x, noise, plan.sigmas, plan.sde_mask, kernel=plan.kernel,
                   noise_level=plan.noise_level, solver=plan.solver, generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(traj.final).all()
    assert bool((traj.log_probs != 0).any()) == bool(plan.sde_mask.any()) and plan.sde_mask.any()


def test_sampler_uses_the_model_schedule_unless_shift_is_set(hydra_compose):
    from samplers import flow_sigmas

    cfg = hydra_compose(["model=tiny_flux", "sampler.num_steps=6"])
    adapter = build_adapter(cfg.model)
    own = build_sampler(cfg.sampler, adapter=adapter, model=cfg.model)
    expected = adapter.sigmas(6, height=cfg.model.height, width=cfg.model.width)
    assert torch.equal(own.sigmas, expected.float().cpu())
    cfg.sampler.shift = 2.0
    assert torch.equal(build_sampler(cfg.sampler, adapter=adapter, model=cfg.model).sigmas, flow_sigmas(6, 2.0))


def test_reward_configs_match_the_registry_and_instantiate(hydra_compose):
    configured = {name: hydra_compose([f"reward={name}", *PARTNERS.get(("reward", name), [])]).reward
                  for name in options("reward")}
    names = {node.name for node in configured.values()}
    registered = set(rewards.available())
    assert "geneval" in registered, "rewards.load('geneval') must be registered"
    assert names == registered, f"reward configs {sorted(names)} vs registered rewards {sorted(registered)}"
    for option, node in configured.items():
        if node.name in NEEDS_WEIGHTS:  # learned rewards: no weights on this machine, so a clear error at build
            with pytest.raises(rewards.MissingWeightsError) as err:
                build_reward(node)
            assert f"reward.kwargs.{err.value.kwarg}" in str(err.value), option
            continue
        reward = build_reward(node)
        assert callable(reward), option


def test_reward_errors_name_the_key(hydra_compose):
    cfg = hydra_compose(["reward.name=no_such_reward"])
    with pytest.raises(KeyError, match=r"reward\.name='no_such_reward'"):
        build_reward(cfg.reward)
    cfg = hydra_compose(["+reward.kwargs.no_such_kwarg=1"])
    with pytest.raises(TypeError, match=r"reward\.kwargs"):
        build_reward(cfg.reward)
    cfg = hydra_compose(["reward=custom"])  # no target: the user's reward, never a shipped example in its place
    with pytest.raises(ConfigError, match=r"reward\.target is not set: set reward\.target=package\.module:function"):
        validate(cfg)
    with pytest.raises(ValueError, match=r"reward\.target is not set: set reward\.target=package\.module:function"):
        build_reward(cfg.reward)


def test_data_configs_instantiate(hydra_compose, prompt_files):
    # The shipped prompt sets when present; a missing file is an error naming the key.
    cfg = hydra_compose(["data=geneval_shapes"])
    if (REPO_ROOT / cfg.data.train_file).is_file():
        train = build_prompts(cfg.data, "train")
        assert len(train) and len(train.metadata) == len(train) and "include" in train.metadata[0]
        assert len(build_prompts(cfg.data, "val"))
    else:
        with pytest.raises(FileNotFoundError, match=r"data\.train_file"):
            build_prompts(cfg.data, "train")

    cfg = hydra_compose(["data=geneval_shapes", f"data.train_file={prompt_files['jsonl']}", "data.val_file=null",
                         "data.max_prompts=2"])
    train = build_prompts(cfg.data)
    assert train.prompts == [r["prompt"] for r in prompt_files["records"][:2]]
    assert train.metadata == prompt_files["records"][:2]
    assert build_prompts(cfg.data, "val") is None
    cfg = hydra_compose(["data=geneval_shapes", f"data.train_file={prompt_files['jsonl']}", f"data.val_file={prompt_files['jsonl']}",
                         "data.train_tags=[position,single_object]"])
    assert build_prompts(cfg.data).metadata == [prompt_files["records"][0], prompt_files["records"][2]]  # file order
    assert len(build_prompts(cfg.data, "val")) == 3  # held-out prompts are never filtered
    for tags, message in (("[counting,colors]", r"data\.train_tags=\['counting', 'colors'\]: no prompt has tag\(s\) \['colors'\]; "
                                                r"the tags of .* are \['counting', 'position', 'single_object'\]"),
                          ("[]", r"data\.train_tags=\[\]: no tags given")):
        cfg = hydra_compose(["data=geneval_shapes", f"data.train_file={prompt_files['jsonl']}", f"data.train_tags={tags}"])
        with pytest.raises(ValueError, match=message):
            build_prompts(cfg.data)
    cfg = hydra_compose(["data=text_prompts", f"data.train_file={prompt_files['text']}", "data.train_tags=[counting]"])
    with pytest.raises(ValueError, match=r"data\.train_tags=\['counting'\] needs a 'tag' field"):
        build_prompts(cfg.data)

    cfg = hydra_compose(["data=text_prompts"])
    with pytest.raises(ValueError, match=r"data\.train_file is not set"):
        build_prompts(cfg.data)
    cfg = hydra_compose(["data=text_prompts", f"data.train_file={prompt_files['text']}"])
    text = build_prompts(cfg.data)
    assert text.prompts == ["a cat", "a dog on a skateboard"] and text.metadata is None
    cfg = hydra_compose(["data=text_prompts", "data.train_file=nowhere/prompts.txt"])
    with pytest.raises(FileNotFoundError, match=r"data\.train_file='nowhere/prompts\.txt'"):
        build_prompts(cfg.data)


@pytest.mark.parametrize("name", options("logger"))
def test_loggers_instantiate(hydra_compose, name, tmp_path, monkeypatch):
    import importlib.util

    from flowgrpo.builders.logger import TRACKERS

    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = hydra_compose([f"logger={name}"])
    if name in TRACKERS and importlib.util.find_spec(TRACKERS[name][0]) is None:  # an optional package, absent
        with pytest.raises(ImportError, match=rf"pip install {TRACKERS[name][1]}"):
            build_logger(cfg.logger, output_dir=tmp_path, config={"a": 1})
        return
    logger = build_logger(cfg.logger, output_dir=tmp_path, config={"a": 1})
    logger.log({"reward": 0.5}, step=0)
    logger.finish()
    assert logger.name == name and logger.history == [(0, {"reward": 0.5})]


# ------------------------------------------------------------------------------------ batch plan


def _trained(cfg) -> int:
    return build_algorithm(cfg.algo, cfg.sampler, build_sampler(cfg.sampler).sigmas).trained_steps()[0]


def test_batch_plan_arithmetic_and_banner(hydra_compose):
    cfg = hydra_compose(["model=tiny_sd3", "sampler=mix_sde", "trainer.prompts_per_iteration=8", "trainer.group_size=4",
                         "trainer.train_batch_size=8", "trainer.gradient_accumulation_steps=2", "trainer.inner_epochs=2"])
    algo = build_algorithm(cfg.algo, cfg.sampler, build_sampler(cfg.sampler).sigmas)
    plan = batch_plan(cfg, num_processes=2, trained_steps=algo.trained_steps())
    assert (plan.rollouts, plan.rollouts_per_process, plan.train_micro_batch) == (32, 16, 4)
    assert plan.trained_steps == algo.window.size == 4  # MixGRPO's 4 of 25
    assert plan.backward_per_update == 8 and plan.updates_per_iteration == 2 * 32 // 16
    banner = plan.banner()
    for text in ["8 prompts × 4 samples = 32 rollouts/iteration over 2 processes → 16 per process",
                 "4 trained steps each (a window of 4 SDE steps)", "2 accumulation steps",
                 "4 optimizer updates per iteration"]:
        assert text in banner, banner
    assert batch_plan(cfg).trained_steps == 0  # before the algorithm exists: divisibility only

    assert _trained(hydra_compose(["algo=flash_grpo"])) == 1
    assert _trained(hydra_compose(["algo=grpo"])) == 10  # plain Flow-GRPO: every step of the asset's 10
    assert _trained(hydra_compose(["experiment=flow_grpo_shapes"])) == 3  # the tuned recipe: the 3 noisiest
    assert _trained(hydra_compose(["sampler=cps", "algo=grpo"])) == 9
    assert _trained(hydra_compose(["model=tiny_sd3", "sampler=dance", "algo=grpo", "algo.timestep_fraction=0.6"])) == 9  # 16 × 0.6
    assert _trained(hydra_compose(["sampler=dance", "algo=grpo", "algo.timestep_fraction=0.6"])) == 9  # its 16 here too
    assert _trained(hydra_compose(["experiment=dance_grpo_shapes"])) == 6  # the recipe states the asset's 10 steps
    assert _trained(hydra_compose([])) == 2  # the default MixGRPO: a window of 2 of 10


@pytest.mark.parametrize("overrides,processes,knob", [
    (["trainer.prompts_per_iteration=3", "trainer.group_size=3"], 2, "trainer.prompts_per_iteration"),
    (["trainer.rollout_batch_size=5"], 1, "trainer.rollout_batch_size"),
    (["trainer.train_batch_size=3"], 2, "trainer.train_batch_size"),
    (["trainer.gradient_accumulation_steps=3"], 1, "trainer.gradient_accumulation_steps"),
])
def test_batch_plan_asserts_divisibility_naming_the_knob(hydra_compose, overrides, processes, knob):
    with pytest.raises(ValueError, match=knob.replace(".", r"\.")):
        batch_plan(hydra_compose(overrides), num_processes=processes)


# ------------------------------------------------------------------------------------- train.py


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               HYDRA_FULL_ERROR="1", PYTHONPATH=str(REPO_ROOT))
    return env


def test_train_py_rejects_a_bad_override_naming_the_key(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "train.py"), "trainer.group_size=abc", "--cfg", "job"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "trainer.group_size" in proc.stderr + proc.stdout


def test_cfg_job_checks_what_it_prints(tmp_path):
    """``--cfg job`` prints the config without running: it must not print a refused config as if it were valid."""
    def cfg_job(*overrides):
        return subprocess.run([sys.executable, str(REPO_ROOT / "train.py"), "--cfg", "job", *overrides], cwd=tmp_path,
                              env=_env(), capture_output=True, text=True, timeout=120)

    refused = cfg_job("algo=stream_grpo", "model=causal_wan_shapes", "sampler=cps")
    assert refused.returncode == 1 and "algo:" in refused.stdout  # the config, then the verdict
    assert "REFUSED" in refused.stderr and "sampler.noise_level=0.7" in refused.stderr
    valid = cfg_job("algo=grpo")
    assert valid.returncode == 0 and "# valid" in valid.stderr and "name: grpo" in valid.stdout
    assert not list(tmp_path.iterdir())  # nothing run, no run dir


def test_train_py_end_to_end_on_the_tiny_twin(tmp_path, monkeypatch, capsys):
    """``python train.py ...`` in-process: runpy runs the script as __main__ (its own @hydra.main, run dir and
    all) without a second 5-s import of torch + diffusers in a subprocess."""
    import json
    import runpy

    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # run from elsewhere: outputs must land in the Hydra run dir, not the cwd
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", [
        "train.py", "model=tiny_sd3", "reward=jpeg_compressibility", "sampler=mix_sde", "sampler.num_steps=4",
        "sampler.eval_num_steps=3", "algo.window.size=2", "trainer.iterations=2", "trainer.eval_num_prompts=2", "trainer.eval_samples_per_tag=null",
        "trainer.prompts_per_iteration=2", "trainer.group_size=2", "trainer.train_batch_size=2",
        "trainer.gradient_accumulation_steps=1", "trainer.gallery_every=1", f"hydra.run.dir={run_dir}",
        "hydra/job_logging=none", "hydra/hydra_logging=none",  # no log handlers left pointing into tmp_path
    ])
    from hydra.core.global_hydra import GlobalHydra

    try:
        runpy.run_path(str(REPO_ROOT / "train.py"), run_name="__main__")
    finally:
        GlobalHydra.instance().clear()  # leave no Hydra state behind for other tests
    out = capsys.readouterr().out
    assert "2 prompts × 2 samples = 4 rollouts/iteration over 1 process" in out
    assert "done: 2 iterations, 4 optimizer updates" in out  # 4 rollouts / (2 per micro-batch × 1) × 2 iterations
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["eval_first"]["iteration"] == 0
    assert summary["eval_last"]["iteration"] == 2 and "eval/jpeg_kb" in summary["eval_last"]
    assert (run_dir / "curves.png").is_file() and (run_dir / "metrics.jsonl").is_file()
    ckpt = run_dir / "checkpoints" / "checkpoint-000002"
    assert (ckpt / "state.pt").is_file() and (ckpt / "lora").is_dir()
    assert sorted(p.name for p in (run_dir / "gallery" / "train").glob("*.parquet")) == [
        "step-000001.parquet", "step-000002.parquet"]
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert saved.model.pretrained == "tiny-random:sd3" and saved.sampler.eval_num_steps == 3
    assert saved.data.train_file == "assets/prompts/shapes_train.jsonl"  # found under the repo root from any cwd
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert not (tmp_path / "outputs").exists()


def test_tag_balanced_prompt_pools():
    from flowgrpo.builders import PromptSet, prompt_pools

    meta = [{"tag": "a"}, {"tag": "b"}, {"tag": "a"}, {"tag": "c"}]
    ps = PromptSet(["p0", "p1", "p2", "p3"], meta, "mem")
    assert prompt_pools(ps, "uniform") == [[0, 1, 2, 3]]
    assert prompt_pools(ps, "tag_balanced") == [[0, 2], [1], [3]]
    with pytest.raises(ValueError, match="data.sampling=tag_balanced"):
        prompt_pools(PromptSet(["x"], None, "list.txt"), "tag_balanced")


def test_the_default_is_the_embedded_world_and_models_bring_their_own_defaults(hydra_compose):
    cfg = validate(hydra_compose())
    assert (cfg.model.pretrained, cfg.reward.name, cfg.data.name) == ("assets/tiny-sd3-shapes", "geneval", "geneval_shapes")
    # a sampler option that states no steps runs the model's grid (the embedded model: 10 and 10) ...
    assert (cfg.sampler.num_steps, cfg.sampler.eval_num_steps) == (10, 10)
    assert (cfg.model.num_steps, cfg.model.eval_num_steps) == (10, 10)
    assert OmegaConf.to_container(cfg.sampler)["num_steps"] == "${model.num_steps}"  # shown as such by --cfg job
    assert steps_line(cfg).count("the model's grid") == 2
    real = hydra_compose(["model=sd35_medium"]).sampler
    assert (real.num_steps, real.eval_num_steps) == (10, 40)
    assert hydra_compose(["model=causal_wan_shapes_4step"]).sampler.num_steps == 4  # a streaming model's block steps
    # ... and the command line and presets still win
    assert hydra_compose(["sampler.num_steps=25"]).sampler.num_steps == 25
    assert "stated" in steps_line(hydra_compose(["sampler.num_steps=25"]))
    assert hydra_compose(["model.num_steps=12"]).sampler.num_steps == 12
    assert hydra_compose(["experiment=mix_grpo_shapes", "debug=default"]).sampler.num_steps == 4
    real = hydra_compose(["model=sd35_medium", "sampler=mix_sde"])
    assert real.sampler.num_steps == 25 and _trained(real) == 4


@pytest.mark.parametrize("model", ["sd3_shapes", "wan_shapes", "tiny_sd3", "sd35_medium"])
def test_a_sampler_option_runs_the_steps_its_file_states_on_every_model(hydra_compose, model):
    """``sampler=dance`` is 16 steps and ``sampler=mix_sde`` 25 on the embedded models too: nothing applied after
    the group choices rewrites them (the embedded world's recipes state their 10-step grid in their own files)."""
    for option in options("sampler"):
        stated = OmegaConf.load(CONF / "sampler" / f"{option}.yaml")
        cfg = hydra_compose([f"model={model}", f"sampler={option}"])
        for key in ("num_steps", "eval_num_steps"):
            if option == "stream":
                continue  # a streaming model's sampler (refused on this model: test_every_model_sampler_algorithm...)
            expected = stated[key] if key in stated else cfg.model[key]
            assert cfg.sampler[key] == expected, (option, key)
    assert hydra_compose([f"model={model}", "algo=dance_grpo"]).sampler.num_steps == 16  # its sampler=dance, as stated


def test_model_defaults_set_no_key_that_a_group_option_sets():
    """``conf/model_defaults/<model>.yaml`` is applied after the group choices: a key it shared with a group option
    would rewrite that option's value behind the user's back (it once set ``sampler.num_steps`` over
    ``sampler=dance``)."""
    set_by_options = {f"{group}.{key}" for group in GROUPS for option in options(group)
                      for key in _stated(OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml")))}
    set_by_options |= {f"sampler.{key}" for key in _stated(OmegaConf.to_container(OmegaConf.structured(
        GROUP_SCHEMAS["sampler"])))}  # and every sampler key, so that a later option cannot clash either
    files = sorted((CONF / "model_defaults").glob("*.yaml"))
    for path in files:
        assert path.stem in options("model"), path
        keys = set(_stated(OmegaConf.to_container(OmegaConf.load(path))))
        assert keys and not keys & set_by_options, (path.name, sorted(keys & set_by_options))


def test_an_explicit_choice_is_never_rewritten(hydra_compose):
    """No hidden per-(model, method) defaults: ``algo=X`` gives X's schema defaults on every model, and tuned recipes
    are named ``experiment=`` presets."""
    def knobs(*overrides):
        a = hydra_compose(list(overrides)).algo
        return a.kl_beta, a.timestep_fraction, a.timestep_selection

    assert knobs("algo=grpo") == (0.04, 1.0, "random") == knobs("algo=grpo", "model=sd35_medium")
    assert knobs("algo=grpo", "sampler=dance") == (0.04, 1.0, "random")
    assert knobs("experiment=flow_grpo_shapes") == (0.04, 0.3, "first")  # the tuned recipe, by name
    assert knobs("experiment=flow_grpo_shapes", "algo.timestep_fraction=1")[1] == 1.0  # the command line wins
    assert knobs() == (0.0, 1.0, "random")  # the default MixGRPO run
    assert not (CONF / "method_defaults").exists()


@pytest.mark.parametrize("option", sorted(ALGORITHMS))
def test_a_recipe_runs_every_algorithm_at_that_algorithms_defaults(hydra_compose, option):
    """``experiment=video_shapes algo=X``: the recipe's world (model, reward, data, budget) with X at its own
    defaults, but for the knobs measured on this world for Flow-GRPO (conf/experiment_algo/video_shapes/grpo.yaml: its
    3 noisiest steps on 4 prompts), which apply only to ``algo=grpo``, and for AWM's, the recipe's own algorithm (no
    KL to the base, conf/experiment_algo/video_shapes/awm.yaml)."""
    world = ["experiment=video_shapes", f"algo={option}"]
    if ALGORITHMS[option].streaming:  # a streaming algorithm needs a streaming model: a clear error, not a key error
        with pytest.raises(ConfigError, match="streaming"):
            validate(hydra_compose(world))
        return
    cfg = hydra_compose(world + (["+algo.teachers.t=conf"] if option == "flow_opd" else []))
    validate(cfg)
    assert (cfg.model.pretrained, cfg.reward.name, cfg.trainer.prompts_per_iteration) == (
        "assets/tiny-wan-shapes", "video_geneval", 4 if option == "grpo" else 8)
    own = hydra_compose(["experiment=video_shapes"]).algo
    assert OmegaConf.to_container(own) == {**OmegaConf.to_container(hydra_compose(["algo=awm"]).algo), "kl_beta": 0.0}
    if option == "awm":
        assert OmegaConf.to_container(cfg.algo) == OmegaConf.to_container(own)
    elif option == "grpo":
        assert (cfg.algo.timestep_fraction, cfg.algo.timestep_selection) == (0.3, "first")
    else:
        defaults = hydra_compose([f"algo={option}"] + (["+algo.teachers.t=conf"] if option == "flow_opd" else [])).algo
        assert OmegaConf.to_container(cfg.algo) == OmegaConf.to_container(defaults)
    # the command line still wins over the recipe's knobs
    assert hydra_compose(["experiment=video_shapes", "algo=grpo", "algo.timestep_fraction=0.5"]).algo.timestep_fraction == 0.5
    mine = hydra_compose(["experiment=video_shapes", "trainer.prompts_per_iteration=4", "algo.kl_beta=0.001"])
    assert (mine.trainer.prompts_per_iteration, mine.algo.kl_beta) == (4, 0.001)


def _stated(node, prefix=""):
    """``{dotted key: value}`` of what a config file writes (its defaults list aside)."""
    out = {}
    for key, value in node.items():
        if key == "defaults":
            continue
        if isinstance(value, dict):
            out.update(_stated(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


PRESET_FILES = ([("experiment", e, [f"experiment={e}"]) for e in options("experiment")]
                + [("debug", d, [f"debug={d}"]) for d in options("debug")]
                + [("experiment_algo", f"{p.parent.name}/{p.stem}", [f"experiment={p.parent.name}", f"algo={p.stem}"])
                   for p in sorted((CONF / "experiment_algo").glob("*/*.yaml"))])


@pytest.mark.parametrize("group,name,overrides", PRESET_FILES, ids=[f"{g}={n}" for g, n, _ in PRESET_FILES])
def test_a_preset_file_shows_the_values_its_run_uses(hydra_compose, group, name, overrides):
    """Every value a preset file writes is the value of the run it names (``python train.py experiment=E``, or
    ``experiment=E algo=A`` for ``experiment_algo/E/A.yaml``): nothing applied later replaces it unseen (the video
    recipe once showed 4 prompts per iteration while its own algorithm's file ran 8)."""
    stated = _stated(OmegaConf.to_container(OmegaConf.load(CONF / group / f"{name}.yaml")))
    cfg = hydra_compose(overrides)
    assert stated
    for key, value in stated.items():
        if value == "???" or isinstance(value, str) and value.startswith("${"):
            continue  # left for the user / an interpolation, resolved in the run
        got = OmegaConf.select(cfg, key)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        assert got == value, f"conf/{group}/{name}.yaml writes {key}={value!r}, but its run uses {got!r}"


def test_help_is_a_quick_start_and_the_groups_a_user_chooses(hydra_compose, tmp_path):
    """``python train.py --help``: runnable commands, every choosable group with every option (from conf/, so a new
    option file shows up) and the chosen one, and where every key is documented; not the typed ``base_*`` schemas,
    the groups applied automatically (model_defaults, experiment_algo) or accelerate's configs, which are not
    groups; short enough to read."""
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "train.py"), "--help", "algo=grpo"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert len(out.splitlines()) <= 50 and "docs/config.md" in out and "python train.py experiment=" in out
    listing = out.split("Groups (")[1].split("\n\n")[0].splitlines()[1:]
    groups: dict[str, tuple[str, set[str]]] = {}
    for line in listing:
        if not line.startswith("   "):  # "  group [chosen]: a, b," (continued on indented lines)
            name, rest = line.strip().split(" ", 1)
            chosen, names = rest.split("]: ", 1)
            groups[name] = (chosen.lstrip("["), set())
        else:
            names = line.strip()
        groups[name][1].update(n.strip() for n in names.split(",") if n.strip())
    assert list(groups) == [*GROUPS, *PRESETS]
    for group, (chosen, names) in groups.items():
        assert names == set(options(group)), group
        assert not any(n.startswith("base_") for n in names)
    assert groups["algo"][0] == "grpo" and groups["model"][0] == "sd3_shapes" and groups["experiment"][0] == "none"
    for hidden in ("accelerate", "model_defaults", "experiment_algo", "base_"):
        assert hidden not in "\n".join(listing), hidden
    for line in out.splitlines():  # every quick-start command composes and validates
        if line.startswith("  python train.py "):
            args = line.split("#")[0].split()[2:]
            validate(hydra_compose([a for a in args if not a.startswith("--") and a != "job"]))
