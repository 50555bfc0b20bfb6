"""The report pages (docs/reports/) are generated whole from docs/results/ by scripts/reports.py: the committed pages
are what it writes, every result belongs to exactly one study, and a page says what its provenance says. Each file in
docs/results/ has a provenance record (command, commit, day, world, status), a result of a world whose preset moved
since is marked stale, and the README's results block is what its JSON says."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"


@pytest.fixture(scope="module")
def reports():
    spec = importlib.util.spec_from_file_location("reports", REPO / "scripts" / "reports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages(reports):
    return reports.render_all()


def test_the_committed_reports_are_what_the_generator_writes(pages):
    on_disk = {p.name for p in (REPO / "docs" / "reports").glob("*.md")}
    differ = [n for n in pages if n not in on_disk or (REPO / "docs" / "reports" / n).read_text("utf-8") != pages[n]]
    assert not differ and on_disk == set(pages), (
        f"docs/reports/ is not what the generator writes ({', '.join(differ + sorted(on_disk - set(pages)))}): "
        "run python scripts/reports.py")


def test_every_result_belongs_to_exactly_one_study(reports):
    owners = {p.stem: [s.slug for s in reports.STUDIES if p.stem in s.members]
              for p in RESULTS.glob("*.json") if p.name != "provenance.json"}
    wrong = {stem: slugs for stem, slugs in owners.items() if len(slugs) != 1}
    assert not wrong, f"each JSON in docs/results/ belongs in exactly one study of scripts/reports.py: {wrong}"


def test_every_figure_is_on_a_page(pages):
    text = "\n".join(pages.values())
    missing = [p.name for p in RESULTS.glob("*.png") if f"](../results/{p.name})" not in text]
    assert not missing, f"figures no report shows: {missing}"


def test_a_stale_record_shows_on_its_page_and_in_the_index(reports, pages):
    prov = json.loads((RESULTS / "provenance.json").read_text("utf-8"))
    assert prov["awm.json"]["stale"] is None and "Stale" not in pages["awm.md"]
    prov["awm.json"] = {**prov["awm.json"], "stale": "the shapes detector changed after this was measured"}
    stale = reports.render_all(prov)
    assert "Stale: these numbers no longer hold" in stale["awm.md"]
    assert "the shapes detector changed after this was measured" in stale["awm.md"]
    assert "Status: **stale**" in stale["awm.md"]
    assert "| [AWM](awm.md) |" in stale["index.md"] and "| stale |" in stale["index.md"].split("[AWM]")[1].split("\n")[0]


def test_a_listed_file_that_is_absent_is_said_to_be(reports, monkeypatch):
    monkeypatch.setattr(reports, "STUDIES", [reports.Study("awm", "AWM", "AWM", ["awm", "awm_on_another_cpu"])])
    page = reports.render_all()["awm.md"]
    assert "`awm_on_another_cpu.json` has not been measured yet" in page
    assert "Status: **current (1 listed file absent)**" in page


def test_the_tables_read_the_numbers_from_the_json(pages):
    """The arms of a compare-presets file: each arm's final held-out score, mean ± std over seeds, and its gain."""
    data = json.loads((RESULTS / "dgpo.json").read_text("utf-8"))
    for arm, a in data["arms"].items():
        final, gain = a["eval/strict"]["final"], a["eval/strict"]["gain"]["mean"]
        assert f"{final['mean']:.3f} ± {final['std']:.3f} ({gain:+.3f})" in pages["dgpo.md"], arm


def test_check_names_a_page_that_differs(reports, pages, tmp_path, monkeypatch, capsys):
    for name, text in pages.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    for figure in (REPO / "docs" / "reports").glob("*.png"):  # a study's own figure, which its page shows
        (tmp_path / figure.name).write_bytes(figure.read_bytes())
    monkeypatch.setattr(reports, "REPORTS", tmp_path)
    assert reports.main(["--check"]) == 0
    (tmp_path / "dgpo.md").write_text(pages["dgpo.md"].replace("0.", "9."), encoding="utf-8")
    (tmp_path / "old-study.md").write_text("# gone\n", encoding="utf-8")
    assert reports.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "docs/reports/dgpo.md differs" in out and "docs/reports/old-study.md" in out and "awm.md" not in out


def test_every_report_is_in_the_nav(pages):
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text("utf-8"))["nav"]
    section = next(entry["Reports"] for entry in nav if isinstance(entry, dict) and "Reports" in entry)
    listed = [next(iter(e.values())) for e in section]
    assert sorted(listed) == sorted(f"reports/{name}" for name in pages), "mkdocs.yml's Reports section: " + \
        ", ".join(sorted(set(f"reports/{n}" for n in pages) ^ set(listed)))


# ------------------------------------------------------------------------------------------ provenance


def test_every_results_file_has_a_provenance_record_and_every_record_a_file(reports):
    records = reports.headline.provenance()
    files = {p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "provenance.json"}
    assert not files - set(records), f"results without a provenance record: {sorted(files - set(records))}"
    assert not set(records) - files, f"provenance records of missing files: {sorted(set(records) - files)}"
    for name, rec in records.items():
        assert set(rec) == set(reports.headline.FIELDS), f"{name}: fields {sorted(rec)}"
        assert rec["command"].strip(), f"{name}: no command"
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", rec["measured"]), f"{name}: measured {rec['measured']!r}"
        assert rec["world"] in (*reports.headline.WORLDS, None), f"{name}: world {rec['world']!r}"
        assert rec["stale"] is None or len(rec["stale"]) > 20, f"{name}: a stale mark says why"


def test_every_provenance_commit_is_in_this_history(reports):
    for commit in sorted({rec["commit"] for rec in reports.headline.provenance().values()}):
        found = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO, capture_output=True)
        assert found.returncode == 0, f"provenance commit {commit} is not an ancestor of HEAD"


def test_results_of_a_world_whose_preset_moved_since_are_marked_stale(reports):
    """A current (not stale) result of a world was measured while that world's preset computed what its tripwire
    reference records now; a re-recorded reference leaves every result not measured again needing a stale mark."""
    reference = json.loads((REPO / "tests" / "data" / "tripwire.json").read_text("utf-8"))
    for name, rec in reports.headline.provenance().items():
        if rec["world"] is None or rec["stale"]:
            continue
        # a reference re-recorded with --unchanged (the tripwire changed, not the preset) keeps the fingerprints it
        # was verified to compute as
        now = reference[rec["world"]]
        assert rec["tripwire"] in (now["fingerprint"], *now.get("computes_as", [])), (
            f"{name} ({rec['world']} world) was measured under tripwire {rec['tripwire']}, the preset is now "
            f"{now['fingerprint']}: measure it again, or mark it stale in docs/results/provenance.json saying why")


# ------------------------------------------------------------------------------------------ the README block


def test_the_readme_results_block_is_what_its_json_says(reports):
    assert reports.headline.check() == []


def test_a_readme_number_edited_by_hand_is_caught(reports, tmp_path, monkeypatch):
    text = (REPO / "README.md").read_text("utf-8")
    block = text[text.index(reports.headline.START):text.index(reports.headline.END)]
    number = re.search(r"\d\.\d{3}", block).group(0)
    readme = tmp_path / "README.md"
    readme.write_text(text.replace(block, block.replace(number, f"{float(number) + 0.01:.3f}", 1)), "utf-8")
    monkeypatch.setattr(reports.headline, "README", readme)
    assert reports.headline.check() == ["README.md's results block differs from what python scripts/reports.py writes"]
    readme.write_text(reports.headline.readme(readme.read_text("utf-8")), "utf-8")  # what the generator does
    assert reports.headline.check() == [] and readme.read_text("utf-8") == text


def test_no_number_in_the_readme_results_section_stands_outside_its_block(reports):
    text = (REPO / "README.md").read_text("utf-8")
    section = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    start, end = section.index(reports.headline.START), section.index(reports.headline.END)
    outside = section[:start] + section[end:]
    assert not re.search(r"\d+\.\d+", outside), f"README: numbers outside the generated block: {outside!r}"


def test_a_headline_row_from_a_stale_file_says_so(reports):
    records = json.loads(json.dumps(reports.headline.provenance()))
    assert "Stale" not in reports.headline.block(records)
    records["video_runs_evals.json"]["stale"] = "the video reward changed after this was measured (an example)"
    row = next(line for line in reports.headline.block(records).splitlines() if "video (AWM)" in line)
    assert "**Stale:** the video reward changed after this was measured" in row
