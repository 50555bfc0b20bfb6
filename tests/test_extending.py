"""The worked new-algorithm example of ``docs/extending.md``, built from the page as written: it registers, composes
as ``algo=weighted_fm``, trains on the tiny model, and gets a reference policy exactly when it declares one."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

import flowgrpo.config  # noqa: F401  (registers the schemas)
from flowgrpo.registry import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
MODULE = "flowgrpo_docs_weighted_fm"  # the page's block, imported under this name for the test

BASE = [
    "model=tiny_sd3", "reward=jpeg_compressibility", "logger=none", "sampler=sde",
    "sampler.num_steps=4", "sampler.eval_num_steps=4",
    "trainer.iterations=2", "trainer.prompts_per_iteration=2", "trainer.group_size=2",
    "trainer.train_batch_size=4", "trainer.gradient_accumulation_steps=1",
    "trainer.eval_before=false", "trainer.eval_every=0", "trainer.eval_at_end=false",
    "trainer.gallery_every=0", "trainer.checkpoint_every=0", "trainer.lr=3e-2",
]


def example_source() -> str:
    """The python block of the worked example in docs/extending.md."""
    page = (ROOT / "docs" / "extending.md").read_text()
    section = page.split("### Worked example", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def weighted_fm():
    """The example's module, imported from the page; its registration is undone after the test (the registry and
    the option-file tests see only the package's algorithms)."""
    module = types.ModuleType(MODULE)
    sys.modules[MODULE] = module
    try:
        exec(compile(example_source(), "docs/extending.md", "exec"), module.__dict__)
        yield module
    finally:
        sys.modules.pop(MODULE, None)
        ALGORITHMS.pop("weighted_fm", None)
        ConfigStore.instance().repo["algo"].pop("base_weighted_fm.yaml", None)


def make_trainer(out, module, *overrides, **algo):
    from flowgrpo.trainer import Trainer

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[*BASE, f"trainer.output_dir={out}", *overrides])
    # what conf/algo/weighted_fm.yaml would compose: the stored schema, the name, the knobs given
    node = OmegaConf.merge(OmegaConf.structured(module.WeightedFMConfig), {"name": "weighted_fm", **algo})
    OmegaConf.set_struct(cfg, False)
    cfg.algo = node
    OmegaConf.set_struct(cfg, True)
    return Trainer(cfg, out)


def test_the_example_registers_and_declares_its_needs(weighted_fm):
    cls = ALGORITHMS["weighted_fm"]
    assert cls is weighted_fm.WeightedFM
    assert "base_weighted_fm.yaml" in ConfigStore.instance().repo["algo"]
    plain = cls.declare_needs(weighted_fm.WeightedFMConfig(name="weighted_fm"))
    assert not plain.reference and not plain.training_guidance and not plain.record_means
    assert cls.declare_needs(weighted_fm.WeightedFMConfig(name="weighted_fm", kl_beta=0.1)).reference


@pytest.mark.usefixtures("one_thread")
def test_the_example_trains_and_its_reference_exists_only_when_declared(tmp_path, weighted_fm):
    trainer = make_trainer(tmp_path / "full", weighted_fm, "model.finetune=full")
    # full fine-tuning without the KL term: no frozen copy, and a call to the reference would be refused
    assert trainer.ref_copy is None and not trainer.algorithm.needs.reference
    with pytest.raises(RuntimeError, match="without declaring it needs a reference"):
        with trainer.policy.reference():
            pass
    before = [p.detach().clone() for p in trainer.params]
    summary = trainer.fit()
    assert summary["iterations"] == 2 and summary["updates"] == 2 * trainer.batch.updates_per_iteration
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in trainer.history)
    assert all(r["train/weight_mean"] > 0 for r in trainer.history)
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, trainer.params))  # the weights moved

    # with the KL term it declares the reference: a frozen copy for full fine-tuning, and the KL is logged
    kl = make_trainer(tmp_path / "kl", weighted_fm, "model.finetune=full", "trainer.iterations=1", kl_beta=0.1)
    assert kl.algorithm.needs.reference and kl.ref_copy is not None
    kl.fit()
    assert kl.history[-1]["train/kl"] >= 0
