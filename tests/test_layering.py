"""The project's import arrows go one way: flowgrpo → samplers, flowgrpo → rewards; samplers is pure torch."""

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest


def _modules_after_import(package: str) -> set[str]:
    code = f"import sys, {package}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return {name.split(".")[0] for name in out.split()}


@pytest.mark.parametrize(
    "package,forbidden",
    [
        ("samplers", {"flowgrpo", "rewards", "diffusers", "transformers", "accelerate", "hydra", "peft"}),
        ("rewards", {"flowgrpo", "samplers", "diffusers", "accelerate", "hydra", "peft"}),
    ],
)
def test_package_imports_stay_in_their_layer(package, forbidden):
    loaded = _modules_after_import(package)
    assert package in loaded
    assert not (loaded & forbidden), f"`import {package}` pulled in {sorted(loaded & forbidden)}"


REPO = Path(__file__).resolve().parents[1]


def _code_words(path: Path) -> list[tuple[int, str]]:
    """(line, token) for the names, strings and comments of a Python file."""
    kinds = (tokenize.NAME, tokenize.STRING, tokenize.COMMENT)
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            if tok.type in kinds]


def test_the_loop_the_rollout_engine_and_the_builders_name_no_algorithm():
    options = sorted((p.stem for p in (REPO / "conf" / "algo").glob("*.yaml")), key=len, reverse=True)
    assert {"grpo", "kvpo", "flash_grpo", "grpo_guard"} <= set(options)
    named = re.compile(r"\b(%s)\b" % "|".join(options))  # option names are lower case; "GRPO" is the family
    files = [REPO / "flowgrpo" / "trainer.py", REPO / "flowgrpo" / "rollout.py",
             *sorted((REPO / "flowgrpo" / "builders").glob("*.py"))]
    found = [f"{f.relative_to(REPO)}:{line}: {m.group(0)}" for f in files for line, word in _code_words(f)
             for m in named.finditer(word)]
    assert not found, "an algorithm is named where only the contract should be: " + "; ".join(found)
    assert named.search("x = 'flash_grpo'")  # the check sees a name inside a string


def test_only_the_models_and_the_rollouts_know_a_sample_is_made_in_chunks():
    allowed = {REPO / "flowgrpo" / "rollout.py", REPO / "flowgrpo" / "algorithms" / "kvpo" / "rollout.py"}
    found = [f"{f.relative_to(REPO)}:{line}" for f in sorted((REPO / "flowgrpo").rglob("*.py"))
             if f not in allowed and "models" not in f.relative_to(REPO).parts
             for line, word in _code_words(f) if re.search(r"\bchunked\b", word)]
    assert not found, "a streaming check outside the models and the rollouts: " + ", ".join(found)


def test_the_trainer_stays_the_loop():
    """The loop reads as its phase list; state, resume, guards and evaluation live in their own modules."""
    lines = len((REPO / "flowgrpo" / "trainer.py").read_text().splitlines())
    assert lines <= 550, f"flowgrpo/trainer.py has {lines} lines: move a concern into its own module"
