"""The manual (the pages of docs/ a user reads to do something; measured results are the generated pages of
docs/reports/) stays a manual: short paragraphs, no measured number written by hand, no history of the project,
measured results reached through their report page, and a size a person reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GENERATED = {"config.md"}  # written by scripts/gen_config_docs.py from the schemas
MANUAL = sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in GENERATED)
PAGES = [REPO / "README.md", *MANUAL]
MAX_PARAGRAPH_WORDS = 150
MAX_WORDS = 25_000  # every page of the manual, the generated config reference included


def paragraphs(text: str):
    """(first line number, words) per prose paragraph: consecutive lines outside code fences that are not blank, a
    table row, a heading, an HTML comment or an image; each list item starts its own paragraph."""
    fence, current, start = False, [], 0
    for n, line in enumerate(text.splitlines() + [""], 1):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fence = not fence
            continue
        item = re.match(r"\s*([-*+]|\d+\.)\s", line)
        if current and (fence or item or not stripped or stripped.startswith(("|", "#", "<!--", "!["))):
            yield start, current
            current = []
        if not fence and stripped and not stripped.startswith(("|", "#", "<!--", "![")):
            start = start if current else n
            current += stripped.split()


def test_paragraphs_are_counted_as_a_reader_sees_them():
    text = "# t\n\none two\nthree\n\n- a b\n- c\n\n```\nfour five six\n```\n| x | y |\n"
    assert [(start, len(words)) for start, words in paragraphs(text)] == [(3, 3), (6, 3), (7, 2)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_paragraph_is_a_wall_of_text(page):
    long = [f"{page.name}:{n}: {len(w)} words: {' '.join(w[:12])} ..."
            for n, w in paragraphs(page.read_text("utf-8")) if len(w) > MAX_PARAGRAPH_WORDS]
    assert not long, f"paragraphs over {MAX_PARAGRAPH_WORDS} words (split them, or make a list):\n" + "\n".join(long)


HISTORY = {  # the manual says what is, not how it came to be
    "a commit": r"\bcommit `?[0-9a-f]{7,40}\b",
    "since ...": r"\bsince (commit|the last|an earlier|version)\b",
    "an earlier ...": r"\ban earlier (run|version|commit|session|measurement)\b",
    "a fix story": r"\b(was|were|got) fixed\b",
    "a date": r"\b20\d\d-\d\d-\d\d\b",
}
MEASURED = {  # numbers only a measurement gives: they belong in a report, written from its JSON
    "mean ± spread": r"\d\s*±\s*\.?\d",
    "a speed ratio": r"\d\.\d+\s?×(?!\s*\d)",
}


@pytest.mark.parametrize("page", MANUAL, ids=lambda p: p.name)
def test_the_manual_has_no_history_and_no_hand_written_measurements(page):
    hits = []
    fence = False
    for n, line in enumerate(page.read_text("utf-8").splitlines(), 1):
        fence ^= line.strip().startswith("```")
        for why, pattern in {**HISTORY, **({} if fence else MEASURED)}.items():
            m = re.search(pattern, line)
            if m:
                hits.append(f"{page.name}:{n}: {why}: {m.group(0)!r}")
    assert not hits, "link the report that measured it, and say what is:\n" + "\n".join(hits)


def test_the_manual_reaches_results_through_their_reports():
    """A manual page links the report page of a result (which says how and when it was measured, and whether it
    still holds), not the raw file in docs/results/."""
    hits = [f"{p.name}: {m.group(0)}" for p in MANUAL for m in re.finditer(r"\]\((\.\./)?results/[^)]+\)", p.read_text())]
    assert not hits, "\n".join(hits)


def test_the_manual_is_a_size_a_person_reads():
    words = {p.name: len(p.read_text("utf-8").split()) for p in [*MANUAL, *(REPO / "docs" / g for g in GENERATED)]}
    assert sum(words.values()) <= MAX_WORDS, f"the manual is {sum(words.values()):,} words (at most {MAX_WORDS:,}): " \
        + ", ".join(f"{n} {w:,}" for n, w in sorted(words.items(), key=lambda kv: -kv[1])[:5])
