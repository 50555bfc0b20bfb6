"""The project's import arrows go one way: flowgrpo → samplers, flowgrpo → rewards; samplers is pure torch."""

import subprocess
import sys

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
