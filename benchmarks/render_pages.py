"""Render the documentation's generated blocks: the results pages (docs/results/*.md) from the results
files, and the facts of each method page (docs/methods/*.md) from the code (benchmarks/method_pages.py).

A results page holds prose and generated blocks. A generated block names a results file
under benchmarks/results/ and a section (a heading) of it::

    <!-- results: benchmarks/results/fedmlp/TABLE.md § Each site annotates 1 of the 8 classes (--missing 7) -->
    ... written by this script ...
    <!-- end results -->

optionally followed by ``| table=2`` (only the section's second table; default: every table
of the section, its sub-sections included) and ``| rows=FedAvg;Surgical`` (only the rows whose
first cell starts with one of these). The script copies those tables from the file as they
are, and names the file and section under them, so a number on a page is the number in its
file. Numbers are never typed into a block by hand: ``--check`` (and tests/unit/test_results_pages.py)
fails when a committed page differs from what this script renders.

    python benchmarks/render_pages.py           rewrite the pages' generated blocks
    python benchmarks/render_pages.py --check   exit 1, with a diff, when a page is out of date
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = REPO / "docs" / "results"
METHOD_PAGES = REPO / "docs" / "methods"

FACTS = re.compile(r"(?P<open><!-- facts: (?P<page>[\w-]+) -->\n)(?P<body>.*?)(?P<close><!-- end facts -->)", re.S)
BLOCK = re.compile(r"(?P<open><!-- results: (?P<spec>.*?) -->\n)(?P<body>.*?)(?P<close><!-- end results -->)", re.S)
HEADING = re.compile(r"^(#+)\s+(.*?)\s*$")


class RenderError(ValueError):
    """A block names a file, section, table or row that is not there."""


def parse_spec(spec: str) -> dict:
    """``FILE § SECTION [| table=N] [| rows=a;b]`` -> its parts."""
    parts = [p.strip() for p in spec.split("|")]
    where = parts[0]
    if "§" not in where:
        raise RenderError(f"block {spec!r}: expected 'FILE § SECTION'")
    path, section = (s.strip() for s in where.split("§", 1))
    out = {"path": path, "section": section, "table": None, "rows": None}
    for opt in parts[1:]:
        key, _, value = opt.partition("=")
        key = key.strip()
        if key == "table":
            out["table"] = int(value)
        elif key == "rows":
            out["rows"] = [r.strip() for r in value.split(";") if r.strip()]
        else:
            raise RenderError(f"block {spec!r}: unknown option {key!r} (table=N, rows=a;b)")
    return out


def section_lines(text: str, section: str, path: str) -> list:
    """The lines under the heading ``section`` up to the next heading of the same or a higher level."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = HEADING.match(line)
        if m and m.group(2) == section:
            level = len(m.group(1))
            body = []
            for nxt in lines[i + 1:]:
                h = HEADING.match(nxt)
                if h and len(h.group(1)) <= level:
                    break
                body.append(nxt)
            return body
    heads = [HEADING.match(x).group(2) for x in lines if HEADING.match(x)]
    raise RenderError(f"{path}: no section {section!r}; sections: {heads}")


def tables(lines: list) -> list:
    """Each markdown table (consecutive lines starting with '|') as (its sub-heading or None, its lines)."""
    found, cur, heading = [], [], None
    for line in lines + [""]:
        if line.lstrip().startswith("|"):
            cur.append(line.strip())
            continue
        if cur:
            found.append((heading, cur))
            cur, heading = [], None  # a heading names the first table under it
        m = HEADING.match(line)
        if m:
            heading = m.group(2)
    return found


def render_block(spec: str, repo: Path = REPO) -> str:
    s = parse_spec(spec)
    path = repo / s["path"]
    if not path.is_file():
        raise RenderError(f"block {spec!r}: no file {s['path']}")
    found = tables(section_lines(path.read_text(), s["section"], s["path"]))
    if not found:
        raise RenderError(f"{s['path']} § {s['section']}: no table in this section")
    if s["table"] is not None:
        if not 1 <= s["table"] <= len(found):
            raise RenderError(f"{s['path']} § {s['section']}: table={s['table']}, but it has {len(found)}")
        found = [found[s["table"] - 1]]
    if s["rows"]:
        kept = []
        for heading, table in found:
            head, rule, rows = table[0], table[1], table[2:]
            rows = [r for r in rows if any(_first_cell(r).startswith(p) for p in s["rows"])]
            kept.append((heading, [head, rule] + rows))
        missing = [p for p in s["rows"] if not any(_first_cell(r).startswith(p) for _, t in kept for r in t[2:])]
        if missing:
            raise RenderError(f"{s['path']} § {s['section']}: no row starting with {missing}")
        found = kept
    where = f"*From `{s['path']}`, section \"{s['section']}\"" + (f", table {s['table']}" if s["table"] else "") + \
            (", selected rows" if s["rows"] else "") + ".*"
    # a table under a sub-heading of the section keeps it as its caption
    parts = [(f"**{heading}**\n\n" if heading else "") + "\n".join(t) for heading, t in found]
    return "\n\n".join(parts) + "\n\n" + where + "\n"


def _first_cell(row: str) -> str:
    return row.strip().strip("|").split("|", 1)[0].strip()


def render_page(text: str, repo: Path = REPO) -> str:
    """The page with every generated block written from its results file, and its method facts."""
    text = BLOCK.sub(lambda m: m.group("open") + render_block(m.group("spec"), repo) + m.group("close"), text)
    if FACTS.search(text):
        facts = _method_pages().render_facts
        text = FACTS.sub(lambda m: m.group("open") + facts(m.group("page")) + m.group("close"), text)
    return text


def _method_pages():
    """benchmarks/method_pages.py, beside this script (loaded by path: benchmarks/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("method_pages", Path(__file__).with_name("method_pages.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages(root: Path = PAGES) -> list:
    return sorted(root.glob("*.md"))


def method_pages() -> list:
    return sorted(METHOD_PAGES.glob("*.md"))


def stale(root: Path | None = None, repo: Path = REPO) -> dict:
    """{page: unified diff} of every page (of ``root``, default: the results and the method pages) that
    differs from its rendering."""
    out = {}
    for page in (pages(root) if root else pages() + method_pages()):
        have = page.read_text()
        want = render_page(have, repo)
        if have != want:
            rel = page.relative_to(repo) if page.is_relative_to(repo) else page
            out[page] = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                                     f"{rel} (committed)", f"{rel} (rendered from the results files)"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 when a page is out of date")
    args = p.parse_args(argv)
    try:
        diffs = stale()
    except (RenderError, ValueError) as e:
        print(f"render_pages: {e}", file=sys.stderr)
        return 2
    if args.check:
        for diff in diffs.values():
            sys.stdout.write(diff)
        if diffs:
            print(f"render_pages: {len(diffs)} page(s) differ from their results files; "
                  "run python benchmarks/render_pages.py", file=sys.stderr)
        return 1 if diffs else 0
    for page in pages() + method_pages():
        text = page.read_text()
        new = render_page(text)
        if new != text:
            page.write_text(new)
            print(f"rendered {page.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
