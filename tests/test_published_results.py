"""Every published number is traceable: each file in docs/results/ has a provenance record (command, commit, day,
world, status), the README's results and the results page's headline tables are what their JSON renders to, and a
result of a world whose preset moved since it was measured is marked stale."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


publish = load_script("publish_results")
tripwire = load_script("tripwire")


def test_every_results_file_has_a_provenance_record_and_every_record_a_file():
    records = publish.provenance()
    files = {p.name for p in publish.RESULTS.iterdir() if p.is_file() and p.name != publish.PROVENANCE.name}
    assert not files - set(records), f"results without a provenance record: {sorted(files - set(records))}"
    assert not set(records) - files, f"provenance records of missing files: {sorted(set(records) - files)}"
    for name, rec in records.items():
        assert set(rec) == set(publish.FIELDS), f"{name}: fields {sorted(rec)}, want {sorted(publish.FIELDS)}"
        assert rec["command"].strip(), f"{name}: no command"
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", rec["measured"]), f"{name}: measured {rec['measured']!r}"
        assert rec["world"] in (*publish.WORLDS, None), f"{name}: world {rec['world']!r}"
        assert rec["stale"] is None or len(rec["stale"]) > 20, f"{name}: a stale mark says why"


def test_every_provenance_commit_is_in_this_history():
    commits = {rec["commit"] for rec in publish.provenance().values()}
    for commit in sorted(commits):
        found = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO, capture_output=True)
        assert found.returncode == 0, f"provenance commit {commit} is not an ancestor of HEAD"


def test_results_of_a_world_whose_preset_moved_since_are_marked_stale():
    """A current (not stale) result of a world was measured while that world's preset computed what its tripwire
    reference records now; a re-recorded reference leaves every result not measured again needing a stale mark."""
    reference = tripwire.load_reference()
    for name, rec in publish.provenance().items():
        if rec["world"] is None or rec["stale"]:
            continue
        now = reference[rec["world"]]["fingerprint"]
        assert rec["tripwire"] == now, (
            f"{name} ({rec['world']} world) was measured under tripwire {rec['tripwire']}, the preset is now {now}: "
            "measure it again, or mark it stale in docs/results/provenance.json saying which change moved it")


def test_the_generated_blocks_are_what_their_json_says():
    assert publish.check() == []


def test_a_readme_number_edited_by_hand_is_caught(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    text = (REPO / "README.md").read_text()
    body = publish.blocks_in(text)["readme-results"]
    number = re.search(r"\d\.\d{3}", body).group(0)
    edited = f"{float(number) + 0.01:.3f}"
    readme.write_text(text.replace(body, body.replace(number, edited, 1)))
    monkeypatch.setitem(publish.BLOCKS, "readme-results", (readme, publish.readme_results))
    assert publish.check() == [f"{readme}: readme-results"]
    assert publish.main(["--check"]) == 1
    readme.write_text(publish.render(readme))  # what `publish_results.py` does: the published number is back
    assert publish.check() == []
    assert number in publish.blocks_in(readme.read_text())["readme-results"]


@pytest.mark.parametrize("page, heading", [("README.md", "## Results"), ("docs/index.md", "## Headline results")])
def test_the_headline_results_sections_are_all_generated(page, heading):
    """No number in the README's results section or the documentation home page's headline stands outside its
    generated block."""
    text = (REPO / page).read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    assert publish._BLOCK.search(section), f"{page}: no generated block under {heading!r}"
    outside = publish._BLOCK.sub("", section)
    assert not re.search(r"\d+\.\d+", outside), f"{page}: numbers outside the generated block: {outside!r}"


def test_a_headline_from_a_stale_file_says_so(monkeypatch):
    records = json.loads(json.dumps(publish.provenance()))
    records["multireward.json"]["stale"] = "the reward it measured changed in abc1234 (an example)"
    monkeypatch.setattr(publish, "provenance", lambda: records)
    assert "**stale**: the reward it measured changed in abc1234" in publish.readme_results()


@pytest.mark.parametrize("bad", [{"a": 1.0}, {"a": 1.0, "b": 2.0}])
def test_tripwire_compare_names_what_moved(bad):
    ref = [{"iteration": 1, "a": 1.0, "b": float("nan")}]
    assert tripwire.compare(ref, [{"iteration": 1, "a": 1.0, "b": float("nan")}]) == []
    assert tripwire.compare(ref, [{"iteration": 1, "a": 1.0 + 1e-9, "b": float("nan")}]) == []
    problems = tripwire.compare(ref, [{"iteration": 1, **bad}])
    assert problems and all("iteration 1" in p for p in problems)
    assert tripwire.fingerprint(ref) == tripwire.fingerprint([{"iteration": 1, "a": 1.0 + 1e-12, "b": float("nan")}])
    assert tripwire.fingerprint(ref) != tripwire.fingerprint([{"iteration": 1, "a": 1.001, "b": float("nan")}])


def test_a_docs_section_that_cites_a_stale_result_says_it_is_stale():
    """Marking a result stale in the provenance is not enough: every section of the docs that links it (by its
    file name under results/) says "stale", so a reader of that page knows."""
    records = publish.provenance()
    missing = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for section in re.split(r"\n(?=#{1,3} )", page.read_text()):
            cited = {name for name in re.findall(r"results/([\w.\-]+)", section) if name in records}
            stale = sorted(name for name in cited if records[name]["stale"])
            if stale and "stale" not in section.lower():
                missing.append(f"{page.name} / {section.splitlines()[0][:60]!r}: {stale}")
    assert not missing, "sections citing stale results without saying so:\n  " + "\n  ".join(missing)
