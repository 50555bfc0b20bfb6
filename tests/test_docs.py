"""The documentation stays true to the code: every schema field is documented where it is defined, the generated
config reference (docs/config.md) is current, the site builds with ``mkdocs build --strict`` with no broken link,
and no code, config or doc points at files, trackers or terms that are not part of this repository."""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", REPO / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------ config reference


def test_every_schema_field_has_a_doc():
    missing = _generator().undocumented()
    assert not missing, (
        "schema fields without a doc — write a comment after the field in its dataclass (it becomes the field's "
        "row in docs/config.md), then run python scripts/gen_config_docs.py:\n  " + "\n  ".join(missing))


def test_the_config_reference_is_generated_and_current():
    expected = _generator().render()
    path = REPO / "docs" / "config.md"
    actual = path.read_text(encoding="utf-8") if path.exists() else ""
    if actual != expected:
        diff = list(difflib.unified_diff(actual.splitlines(), expected.splitlines(), "docs/config.md",
                                         "regenerated", lineterm="", n=1))
        pytest.fail("docs/config.md is stale: run python scripts/gen_config_docs.py\n" + "\n".join(diff[:60]))


# ------------------------------------------------------------------------------------------ the site

#: mkdocs reports links to a missing heading of a page at INFO level; these lines fail the test too.
_BROKEN_FRAGMENT = re.compile(r"does not contain an|there is no such")


def test_the_docs_build_with_mkdocs_strict(tmp_path):
    for module, package in (("mkdocs", "mkdocs"), ("material", "mkdocs-material")):
        if importlib.util.find_spec(module) is None:
            pytest.fail(f"the documentation test needs the {package!r} package, which is not installed: "
                        f"pip install -e \".[test]\" (or pip install {package})")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    broken = [line for line in log.splitlines() if _BROKEN_FRAGMENT.search(line)]
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)
    assert (tmp_path / "site" / "index.html").exists()


# ------------------------------------------------------------------------------------------ self-contained text

_SUFFIXES = {".py", ".yaml", ".yml", ".md", ".toml"}
_SKIP_DIRS = {".git", "outputs", "multirun", "wandb", "site", "build", "__pycache__", ".pytest_cache", ".venv", "venv",
              "node_modules"}
# Written so that this file does not match itself.
_NOTES = ("DESIGN", "MATH", "PITFALLS", "STYLE", "ALGORITHMS", "STREAMING")
_FORBIDDEN = {
    "names a notes file that is not part of the repository": re.compile(
        r"\b(?:" + "|".join(_NOTES) + r")\." + "md" + r"\b", re.IGNORECASE),
    "cites an issue-tracker number": re.compile(r"\biss" + r"ues?\s*(?:#\s*)?\d+", re.IGNORECASE),
    "uses a word the documentation does not use": re.compile(r"\banch" + r"ors?\b", re.IGNORECASE),
}


def _text_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (git), else a walk that skips run outputs and caches."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, check=True, timeout=60).stdout.decode()
        paths = [REPO / p for p in out.split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        paths = []
        for root, dirs, files in os.walk(REPO):
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
            paths += [Path(root) / f for f in files]
    return sorted(p for p in paths if p.suffix in _SUFFIXES and p.is_file())  # not docs/results/*.json|png: data


def test_code_configs_and_docs_are_self_contained():
    files = _text_files()
    assert any(p.name == "README.md" for p in files) and any(p.suffix == ".py" for p in files)
    hits = []
    for path in files:
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for why, pattern in _FORBIDDEN.items():
                m = pattern.search(line)
                if m:
                    hits.append(f"{path.relative_to(REPO)}:{n}: {why}: {m.group(0)!r}")
    assert not hits, "\n".join(hits)


_NUMBERS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                         "fourteen fifteen sixteen".split())}


@pytest.mark.parametrize("path,clip,streaming", [
    ("docs/index.md", r"runs (\w+) algorithms", r"and (\w+) more on streaming"),
    ("README.md", r"(\w+) algorithms that run with any", r"(\w+) algorithms for streaming"),
])
def test_the_algorithm_counts_in_the_overviews_are_the_registrys(path, clip, streaming):
    """The overviews count the registered algorithms in words: a new algorithm must move the count."""
    from flowgrpo.algorithms import ALGORITHMS

    text = " ".join((REPO / path).read_text().split())
    n_streaming = sum(a.streaming for a in ALGORITHMS.values())
    for pattern, expected in ((clip, len(ALGORITHMS) - n_streaming), (streaming, n_streaming)):
        m = re.search(pattern, text)
        assert m and _NUMBERS.get(m.group(1).lower()) == expected, (path, pattern, m and m.group(1), expected)


def test_every_test_the_docs_cite_exists():
    """A page that says "shown by tests/x.py::test_y" names a test that is there (renaming a test moves the page)."""
    cited = {}
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for m in re.finditer(r"(tests/[\w/]+\.py)::(\w+)", page.read_text(encoding="utf-8")):
            cited.setdefault(m.groups(), page.relative_to(REPO))
    assert len(cited) > 50  # the reliability page alone cites more
    missing = [f"{page}: {f}::{name}" for (f, name), page in sorted(cited.items())
               if not (REPO / f).exists() or not re.search(rf"^\s*def {name}\b", (REPO / f).read_text(), re.M)]
    assert not missing, "pages cite tests that do not exist:\n" + "\n".join(missing)
