"""docs/fixes.md is generated from the fix catalogue and must not drift from it."""

from pathlib import Path

from stepscope.doctor.rules import CATALOGUE, catalogue_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "fixes.md"
REGENERATE = "PYTHONPATH=src python -m stepscope.doctor.rules > docs/fixes.md"


def test_fixes_doc_matches_the_catalogue():
    assert DOC.is_file(), f"docs/fixes.md is missing: generate it with `{REGENERATE}`"
    assert DOC.read_text(encoding="utf-8") == catalogue_markdown(), (
        f"docs/fixes.md is out of date with stepscope/doctor/rules.py: regenerate it with `{REGENERATE}`"
    )


def test_fixes_doc_lists_every_rule_once():
    text = catalogue_markdown()
    for entry in CATALOGUE:
        assert text.count(f"## `{entry.id}`: {entry.title}\n") == 1
        assert f"| `{entry.id}` | {entry.title} | {entry.cost} |" in text
