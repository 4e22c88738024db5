"""The results pages (docs/results/*.md) against the results files their tables come from.

A page's tables are generated blocks that ``benchmarks/render_pages.py`` copies from the named
results file and section; a page that differs from its rendering fails here, with the diff. The
renderer itself is checked on a page with a number changed by hand, a results file changed under a
page, and blocks naming a file, section or row that is not there.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_pages", REPO / "benchmarks" / "render_pages.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render = _renderer()
PAGES = render.pages()


def test_every_paper_has_a_results_page_with_generated_tables():
    names = {p.stem for p in PAGES}
    assert {"partial-labels", "fedmlp", "fedmix", "isofed", "engineering"} <= names
    for page in PAGES:
        if page.stem != "index":
            assert render.BLOCK.search(page.read_text()), f"{page.name}: no generated table"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_committed_page_is_what_the_results_files_render(page):
    have = page.read_text()
    want = render.render_page(have)
    assert have == want, ("a table differs from its results file; run python benchmarks/render_pages.py\n"
                          + "".join(render.stale().get(page, "")))


@pytest.mark.parametrize("page", render.method_pages(), ids=lambda p: f"methods/{p.name}")
def test_committed_method_page_is_what_the_code_renders(page):
    """A method page's facts (options and defaults, jobs, plans, presets and sources) are the code's."""
    have = page.read_text()
    if page.stem in render._method_pages().PAGES:
        assert f"<!-- facts: {page.stem} -->" in have, f"{page.name}: no generated facts block"
    assert have == render.render_page(have), ("a method page differs from what the code says; run python "
                                              "benchmarks/render_pages.py\n" + "".join(render.stale().get(page, "")))


def test_every_registered_row_is_on_one_method_page():
    from fedlabels import methods

    facts = render._method_pages()
    listed = [row for rows in facts.PAGES.values() for row in rows]
    assert sorted(listed) == methods.names()  # each once, none missing


def _a_generated_number(text: str):
    """(position, digits) of the first decimal number in a table row of a generated block."""
    for block in render.BLOCK.finditer(text):
        pos = block.start("body")
        for line in block.group("body").splitlines(keepends=True):
            num = re.search(r"\d+\.\d+", line) if line.startswith("|") and not line.startswith("|---") else None
            if num:
                return pos + num.start(), num.group()
            pos += len(line)
    raise AssertionError("no number in a generated block")


def test_a_number_edited_on_a_page_fails_the_check(tmp_path):
    page = next(p for p in PAGES if p.stem == "fedmlp")
    text = page.read_text()
    pos, number = _a_generated_number(text)
    edited = text[:pos] + ("9" if number[0] != "9" else "8") + text[pos + 1:]
    assert edited != text
    root = tmp_path / "results"
    root.mkdir()
    (root / page.name).write_text(edited)
    diffs = render.stale(root=root)
    assert list(diffs) == [root / page.name]
    edited_line = edited.splitlines()[text[:pos].count("\n")]
    assert f"-{edited_line}" in diffs[root / page.name]  # the diff shows the edited line
    assert render.render_page(edited) == text  # rendering puts the file's number back


def test_a_rerun_results_file_changes_the_rendering(tmp_path):
    repo = tmp_path / "repo"
    results = repo / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "t.md").write_text("# Study\n\n## Main\n\n| row | AUROC |\n|---|---|\n| a | 0.71 |\n| b | 0.64 |\n\n"
                                  "### Detail\n\n| row | n |\n|---|---|\n| a | 3 |\n\n## Other\n\n| x |\n|---|\n| 1 |\n")
    page = "intro\n<!-- results: benchmarks/results/t.md § Main -->\n<!-- end results -->\nafter\n"
    out = render.render_page(page, repo)
    assert "| a | 0.71 |" in out and "**Detail**\n\n| row | n |" in out and "| x |" not in out
    assert "*From `benchmarks/results/t.md`, section \"Main\".*" in out
    assert out.startswith("intro\n") and out.endswith("<!-- end results -->\nafter\n")
    (results / "t.md").write_text((results / "t.md").read_text().replace("0.71", "0.73"))
    again = render.render_page(out, repo)
    assert "| a | 0.73 |" in again and "0.71" not in again
    one = render.render_page("<!-- results: benchmarks/results/t.md § Main | table=2 -->\n<!-- end results -->", repo)
    assert "| a | 3 |" in one and "AUROC" not in one
    rows = render.render_page("<!-- results: benchmarks/results/t.md § Main | table=1 | rows=b -->\n"
                              "<!-- end results -->", repo)
    assert "| b | 0.64 |" in rows and "| a |" not in rows


@pytest.mark.parametrize("spec, message", [
    ("benchmarks/results/none.md § Main", "no file"),
    ("benchmarks/results/t.md § Missing", "no section 'Missing'"),
    ("benchmarks/results/t.md § Main | table=3", "table=3, but it has 2"),
    ("benchmarks/results/t.md § Main | rows=zzz", "no row starting with ['zzz']"),
    ("benchmarks/results/t.md § Main | colour=red", "unknown option 'colour'"),
])
def test_a_block_naming_what_is_not_there_stops_the_rendering(tmp_path, spec, message):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "t.md").write_text("## Main\n\n| r | v |\n|---|---|\n| a | 1 |\n\n### Sub\n\n| r |\n|---|\n| b |\n")
    with pytest.raises(render.RenderError, match=re.escape(message)):
        render.render_page(f"<!-- results: {spec} -->\n<!-- end results -->", tmp_path)
