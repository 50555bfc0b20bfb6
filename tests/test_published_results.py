"""Every published number is traceable: each file in docs/results/ has a provenance record (command, commit, day,
world, status); the tables of run results in the README and the docs are generated blocks, what their JSON renders
to; every other number written in a section about measured results is pinned to the JSON number it is rounded from
(tests/data/cited_numbers.json) or the docs say it is not a recorded measurement; and a result of a world whose
preset moved since it was measured is marked stale, in its provenance and wherever the docs cite it."""

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
        # a reference re-recorded with --unchanged (the tripwire changed, not the preset) keeps the fingerprints it
        # was verified to compute as
        assert rec["tripwire"] in (now, *reference[rec["world"]].get("computes_as", [])), (
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
    weights = [{"weights/norm": 2.0}]
    assert tripwire.compare(weights, [{"weights/norm": 2.0 * (1 + 1e-3)}]) == [
        "row 0 (the trained weights): weights/norm = 2.002, reference 2.0 (allowed ±0.0004)"]


def test_tripwire_tolerances_come_from_the_spread_across_cpu_kernels():
    """Each number's tolerance is SPREAD_FACTOR times what other CPU kernels moved it, at least RTOL or ATOL; a
    held-out score after an update is allowed a few samples' verdicts (EVAL_ATOL), one before an update is not."""
    rows = [{"iteration": 0, "eval/reward": 0.5}, {"iteration": 1, "train/loss": 1e-6, "train/grad_norm": 2.0},
            {"iteration": 1, "eval/reward": 0.5}, {"weights/norm": 3.0}]
    other = [{"iteration": 0, "eval/reward": 0.5}, {"iteration": 1, "train/loss": 1.2e-6, "train/grad_norm": 2.0 + 4e-5},
             {"iteration": 1, "eval/reward": 0.5}, {"weights/norm": 3.0}]
    tol = tripwire.tolerances(rows, [other])
    assert tol[0]["eval/reward"] == tripwire.RTOL * 0.5
    assert tol[1]["train/loss"] == pytest.approx(tripwire.SPREAD_FACTOR * 2e-7)  # a difference of near-equal terms
    assert tol[1]["train/grad_norm"] == pytest.approx(tripwire.SPREAD_FACTOR * 4e-5)
    assert tol[2]["eval/reward"] == tripwire.EVAL_ATOL
    assert tol[3]["weights/norm"] == tripwire.RTOL * 3.0
    assert tripwire.compare(rows, other, tol) == []
    moved = json.loads(json.dumps(other))
    moved[1]["train/grad_norm"] = 2.0 * (1 + 1e-3)  # 2e-3 away: five times what the kernels moved it
    assert [p.split(":")[1].split("=")[0].strip() for p in tripwire.compare(rows, moved, tol)] == ["train/grad_norm"]


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


# ------------------------------------------------------------------------------------------ numbers in prose


def test_every_number_in_a_measured_section_is_pinned_to_the_json_it_cites():
    """The rule for numbers written by hand in README.md and docs/*.md (``publish_results.prose_numbers``):

    * A *measured section* (from a heading to the next) is one that links a file under ``results/``, every section
      of docs/results.md and docs/performance.md, and a "Measured here" section with its subsections.
    * In a measured section, every decimal number (digits, a point, digits; a sign and a ``%`` are part of it) is
      covered, except inside generated blocks, HTML comments, code (fenced or inline), link targets and arXiv ids, and
      except a setting: the number right after a Greek-letter hyperparameter, ``a``, ``lr``, ``ratio``, ``CFG`` or
      ``guidance`` (``β 0.04``, ``a = 0.7``, ``CFG 4.5``), after ``×`` (a batch shape), ``≥`` or ``≤`` (a threshold), or one of
      the page's literals in ``publish_results.NOT_RESULTS`` (sizes, versions, clip ranges, the video target).
    * A covered number is checked against the results JSON files its paragraph (list item, or a table's preceding
      paragraph) links, else those its section links. It must be *pinned*: tests/data/cited_numbers.json names, for
      it (page, section, the 48 characters before it with numbers masked), a place in one of those files whose
      number rounds to it at the digits written, sign aside (``publish_results.recorded_numbers``: a value, a number
      in a note, seconds as minutes, or a metric's change from a run's first evaluation).
      ``python scripts/publish_results.py`` writes the pins; it keeps a pin while page and JSON agree and reports a
      number no cited file records.
    * A number no JSON records stays only where the docs say so: a paragraph or list item that says "not a recorded
      measurement" (or "not recorded measurements") is left out, a table too when the paragraph before it says so,
      and a whole section that cites no results file when its first paragraph says so.

    So a number edited by hand fails here (the page no longer says what its pin does), and so does a rerun that
    rewrites a pinned JSON number; tables and derived numbers (means over seeds, differences between arms, ratios)
    are generated blocks, checked by ``test_the_generated_blocks_are_what_their_json_says``."""
    problems = publish.citation_problems()
    assert not problems, "\n".join(problems)


def _awm_page(tmp_path, text: str):
    page = tmp_path / "awm.md"
    page.write_text(text)
    pins = [{**c, "page": str(page)} for c in publish.load_citations() if c["page"] == "docs/awm.md"]
    return page, pins


def test_a_number_edited_by_hand_in_a_method_page_is_caught(tmp_path):
    text = (REPO / "docs" / "awm.md").read_text()
    assert "0.437 → 0.380" in text
    page, pins = _awm_page(tmp_path, text)
    assert pins and publish.citation_problems([page], pins) == []
    page.write_text(text.replace("0.437 → 0.380", "0.437 → 0.381"))
    problems = publish.citation_problems([page], pins)
    assert len(problems) == 1 and "the page says 0.381 where tests/data/cited_numbers.json pins 0.380" in problems[0]


def test_a_rerun_that_moves_a_pinned_json_number_is_caught(tmp_path, monkeypatch):
    page, pins = _awm_page(tmp_path, (REPO / "docs" / "awm.md").read_text())
    pin = next(c for c in pins if c["number"] == "0.380")
    assert pin["file"] == "awm.json" and pin["value"][0] == "at"
    load = publish.load

    def rerun(name):
        data = load(name)
        if name == "awm.json":
            node = data
            for key in pin["value"][1][:-1]:
                node = node[key]
            node[pin["value"][1][-1]] += 0.01
        return data

    monkeypatch.setattr(publish, "load", rerun)
    problems = publish.citation_problems([page], pins)
    assert any("0.380" in p and "is now 0.39" in p for p in problems), problems


def test_the_citation_rule_on_an_example_page(tmp_path):
    recorded = [value for value, _ in publish.recorded_numbers("awm.json")]
    for unrecorded in ("9.871", "8.642", "7.531", "6.421"):
        assert not any(publish.rounds_to(unrecorded, v) for v in recorded)
    page = tmp_path / "example.md"
    page.write_text("""# Example

## Knobs

`algo.kl_beta` is 0.04 and 9.999 here is not checked: this section is not about measured results.

## Measured here

AWM reached 0.406 ± 0.025 strict at 25 ([`awm.json`](results/awm.json)), then 9.871.

Settings are not results: β 0.04, a = 0.7, CFG 4.5, compress ratio 0.4, 8 × 0.5 clips, ≥ 0.35.

A probe gave 8.642 (a single run, not a recorded measurement).

* an item with 7.531
* an item with 6.421, not a recorded measurement

### Why

The numbers of this section are not recorded measurements.

5.555 here is not checked.
""")
    problems = publish.citation_problems([page], [])
    assert len(problems) == 4, problems
    assert "0.406" in problems[0] and "awm.json records it" in problems[0]
    assert "0.025" in problems[1] and "awm.json records it" in problems[1]
    for problem, number in zip(problems[2:], ("9.871", "7.531")):
        assert f": {number} in" in problem and "no results JSON it is checked against records it" in problem


def test_every_listed_non_result_is_in_its_page():
    for page, literals in publish.NOT_RESULTS.items():
        text = " ".join((REPO / "docs" / page).read_text().split())
        assert not [lit for lit in literals if lit not in text], f"docs/{page} no longer has these"


# ------------------------------------------------------------------------------------------ generated blocks


def test_a_generated_block_names_the_files_it_is_written_from_and_says_stale_for_a_stale_one(monkeypatch):
    """A block's opening comment names its results files, so the section holding it cites them (and the stale
    check above applies to it); a block read from a file marked stale says "stale" itself."""
    records = publish.provenance()
    for name, (path, _) in publish.BLOCKS.items():
        text, sources = publish.rendered(name)
        head = re.search(rf"<!-- generated: {name} \((.*?)\) -->", path.read_text()).group(1)
        assert all(f"results/{s}" in head for s in sources), (name, sources, head)
        if any(records.get(s, {}).get("stale") for s in sources):
            assert "stale" in text.lower(), name
    changed = json.loads(json.dumps(records))
    changed["dgpo.json"]["stale"] = "an example change moved its world (abc1234)"
    monkeypatch.setattr(publish, "provenance", lambda: changed)
    text, sources = publish.rendered("dgpo-runs")
    assert sources == {"dgpo.json"}
    assert text.endswith("**Stale:** `dgpo.json`: an example change moved its world (abc1234).")
