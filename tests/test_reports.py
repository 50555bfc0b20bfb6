"""The report pages (docs/reports/) are generated whole from docs/results/ by scripts/reports.py: the committed pages
are what it writes, every result belongs to exactly one study, and a page says what its provenance says."""

from __future__ import annotations

import importlib.util
import json
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
