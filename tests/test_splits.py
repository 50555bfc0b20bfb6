"""Validation and test sets: training, probes and sweeps read the validation set (``data.val_file``, the validation
noise stream); only the reporting command, ``scripts/paired_eval.py --split test``, reads the test set
(``data.test_file``, a noise stream of its own) — so a number chosen on one set is reported on the other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
READER = "scripts/paired_eval.py"  # the one reader of the test set
DEFINED = {"flowgrpo/seeding.py", "flowgrpo/evaluation.py"}  # where the test noise stream is defined and exported
WRITER = "scripts/make_prompts.py"  # writes the worlds' prompt files, the test sets among them


def reaches_test_set(source: str) -> list[str]:
    """Code (not text) that reaches the test set: the name ``TEST_STREAM``, an attribute ``test_file``, or a
    ``"test"`` / ``"test_file"`` argument (``build_prompts(data, "test")``, ``data["test_file"]``)."""
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "TEST_STREAM" or \
                isinstance(node, ast.alias) and node.name == "TEST_STREAM":
            hits.append(f"{getattr(node, 'lineno', '?')}: TEST_STREAM")
        elif isinstance(node, ast.Attribute) and node.attr == "test_file":
            hits.append(f"{node.lineno}: .test_file")
        elif isinstance(node, ast.Constant) and node.value == "test_file" and id(node) not in docstrings:
            hits.append(f"{node.lineno}: 'test_file'")
        elif isinstance(node, ast.Call) or isinstance(node, ast.Subscript):
            args = node.args if isinstance(node, ast.Call) else [node.slice]
            hits += [f"{node.lineno}: 'test'" for a in args if isinstance(a, ast.Constant) and a.value == "test"]
    return hits


def test_the_detector_sees_each_way_of_reaching_the_test_set():
    assert len(reaches_test_set('from flowgrpo.evaluation import TEST_STREAM\nx = TEST_STREAM\n')) == 2
    assert reaches_test_set('build_prompts(cfg.data, "test")\n') and reaches_test_set('p = cfg.data.test_file\n')
    assert reaches_test_set('p = cfg.data["test_file"]\n') and reaches_test_set('k = ("data", "test_file")\n')
    assert not reaches_test_set('"""Reads build_prompts(data, "test") nowhere."""\nbuild_prompts(cfg.data, "val")\n')


def test_nothing_but_the_reporting_command_reads_the_test_set():
    files = [p for d in ("flowgrpo", "rewards", "samplers", "scripts") for p in sorted((REPO / d).rglob("*.py"))]
    files += [REPO / "train.py"]
    assert len(files) > 50
    readers = {str(p.relative_to(REPO)): hits for p in files
               if (hits := reaches_test_set(p.read_text(encoding="utf-8")))}
    assert READER in readers, "scripts/paired_eval.py --split test reads the test set"
    others = {f: h for f, h in readers.items() if f not in (READER, WRITER, *DEFINED)}
    assert not others, f"only {READER} may read the test set (data.test_file, TEST_STREAM): {others}"


def test_the_test_noise_is_not_the_validation_noise():
    from flowgrpo.evaluation import EVAL_STREAM, TEST_STREAM, eval_generator

    assert EVAL_STREAM != TEST_STREAM
    val = torch.randn(64, generator=eval_generator(0, 3, 1))
    assert torch.equal(val, torch.randn(64, generator=eval_generator(0, 3, 1, EVAL_STREAM)))
    assert not torch.allclose(val, torch.randn(64, generator=eval_generator(0, 3, 1, TEST_STREAM)))


@pytest.mark.parametrize("data", ["motion_streams", "one_object_streams"])
def test_a_streams_test_set_shares_no_prompt_sequence_with_training_or_validation(data):
    from hydra import compose, initialize_config_dir

    from flowgrpo.builders import build_prompts
    from flowgrpo.world import sequence_key

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"data={data}"])
    sets = {split: build_prompts(cfg.data, split) for split in ("train", "val", "test")}
    keys = {split: {sequence_key(m) for m in s.metadata} for split, s in sets.items()}
    assert len(keys["test"]) == len(sets["test"]) == 100
    assert not keys["test"] & keys["train"] and not keys["test"] & keys["val"]
