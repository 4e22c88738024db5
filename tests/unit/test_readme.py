"""Every command of the README runs, as written, in the order a reader runs them.

The README's shell blocks are read here, not copied: each command is run with ``bash`` in a
fresh folder (with the repository's ``nvflare_jobs`` beside it, as in a clone). The researcher
path and provisioning run here; the FLARE simulator runs and the clinical bundle made from one
of them in tests/simulator/test_readme_flare.py (the commands are read by tests/readme_commands.py). ``make demo`` and ``make test`` are the
entry points themselves (CI runs ``.ci/run``, which calls ``make test``); the test checks that
they are Makefile targets. A command in the README that no test here runs fails the coverage test.
"""

from __future__ import annotations

import re

from readme_commands import CMDS, README, REPO, _program, _workdir, needs_simulator, run



# The entry points (run by a person or by CI, not by a test).
ENTRY_POINTS = {"make demo", "make test"}


def test_the_readme_is_short_and_every_command_has_a_runner():
    assert len(README.read_text().splitlines()) <= 260
    assert CMDS, "no command found in the README"
    for cmd in CMDS:
        prog = _program(cmd)
        assert (cmd in ENTRY_POINTS or needs_simulator(cmd)
                or prog.startswith(("fedlabels synth", "fedlabels validate", "fedlabels bench", "fedlabels methods",
                                    "fedlabels provision"))), f"no test runs this README command: {cmd}"
    makefile = (REPO / "Makefile").read_text()
    for cmd in ENTRY_POINTS & set(CMDS):
        assert re.search(rf"^{cmd.split()[1]}:", makefile, re.M), cmd
    # the FLARE job is led by job.py, nvflare's own (deprecated) command is the alternative
    flare = [c for c in CMDS if _program(c).startswith(("python nvflare_jobs/", "nvflare simulator"))]
    assert _program(flare[0]).startswith("python nvflare_jobs/") and "--sim" in flare[0]
    assert any(_program(c).startswith("nvflare simulator") for c in flare)


def test_the_readme_links_to_pages_that_exist():
    """The README is read on GitHub, outside the documentation site's own link check."""
    targets = re.findall(r"\]\(([^)#\s]+)(#[^)\s]*)?\)", README.read_text())
    assert targets
    for path, anchor in targets:
        if not path.startswith("http"):
            page = REPO / path
            assert page.is_file(), path
            if anchor:  # mkdocs' anchor of a heading: lower case, punctuation dropped, spaces as dashes
                slugs = {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h.strip().lower()))
                         for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}
                assert anchor[1:] in slugs, (path, anchor)


def test_researcher_path_and_provisioning_run_as_written(tmp_path):
    work = _workdir(tmp_path)
    fast = [c for c in CMDS if c not in ENTRY_POINTS and not needs_simulator(c)]
    assert [_program(c).split()[1] for c in fast] == ["synth", "validate", "bench", "methods", "provision"]
    outputs = {_program(c).split()[1]: run(c, work, timeout=900).stdout for c in fast}
    assert "site-1" in outputs["validate"]
    bench_out = re.search(r"--out (\S+)", fast[2]).group(1)
    table = (work / bench_out / "results.md").read_text()
    assert "auroc -- pooled test split" in table and "surgical · last" in table and "local:site-1" in table
    assert "surgical" in outputs["methods"]
    kits = re.search(r"--out (\S+)", fast[4]).group(1)
    for name in ("fl.example.org", "hospital-a", "hospital-b", "admin@example.org"):
        assert list((work / kits).rglob(f"{name}/startup")), name
