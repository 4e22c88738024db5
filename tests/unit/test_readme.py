"""Every command of the README runs, as written, in the order a reader runs them.

The README's shell blocks are read here, not copied: each command is run with ``bash`` in a
fresh folder (with the repository's ``nvflare_jobs`` beside it, as in a clone). The researcher
path and provisioning run in the fast lane; the FLARE simulator runs and the clinical bundle
made from one of them run under the ``simulator`` marker. ``make demo`` and ``make test`` are the
entry points themselves (CI runs ``.ci/run``, which calls ``make test``); the test checks that
they are Makefile targets. A command in the README that no test here runs fails the coverage test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

# The entry points (run by a person or by CI, not by a test).
ENTRY_POINTS = {"make demo", "make test"}
# The commands that need the FLARE simulator, and the export and inference that need its run.
SIMULATOR = ("python nvflare_jobs/", "nvflare simulator", "fedlabels export", "python -m monai.bundle")


def commands(text: str) -> list:
    """The commands of the ```bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(re.sub(r"\s+", " ", line))
    return out


def _program(cmd: str) -> str:
    """The command without leading environment assignments (``VAR=value cmd ...``)."""
    return re.sub(r"^(\w+=\S+\s+)+", "", cmd)


def needs_simulator(cmd: str) -> bool:
    return _program(cmd).startswith(SIMULATOR)


def _env() -> dict:
    bindir = str(Path(sys.executable).parent)  # fedlabels, nvflare and python of this environment
    return dict(os.environ, OMP_NUM_THREADS="1", PATH=os.pathsep.join([bindir, os.environ.get("PATH", "")]),
                PYTHONPATH=os.pathsep.join([str(REPO / "custom"), os.environ.get("PYTHONPATH", "")]))


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "reader"
    work.mkdir()
    (work / "nvflare_jobs").symlink_to(REPO / "nvflare_jobs")
    return work


def run(cmd: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"README command failed: {cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


CMDS = commands(README.read_text())


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


@pytest.mark.simulator
def test_flare_and_clinical_paths_run_as_written(tmp_path):
    work = _workdir(tmp_path)
    # the scenario the FLARE commands point at is the researcher path's
    synth = next(c for c in CMDS if _program(c).startswith("fedlabels synth"))
    run(synth, work, timeout=300)
    flare = [c for c in CMDS if needs_simulator(c)]
    assert len(flare) == 5, flare
    job_py, write_job, nvsim, export, infer = flare
    run(job_py, work, timeout=900)
    run_dir = work / re.search(r"--run (\S+)", export).group(1)
    assert (run_dir / "app_server" / "best_FL_global_model.pt").is_file()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == int(re.search(r"--rounds (\d+)", job_py).group(1))
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))  # the TensorBoard logs the README names
    run(write_job, work, timeout=300)  # job.py --out: nvflare 2.9 takes --export for itself
    job_dir = work / re.search(r"nvflare simulator (\S+)", nvsim).group(1)
    assert json.loads((job_dir / "app" / "config" / "config_fed_server.json").read_text()
                      )["workflows"][0]["args"]["num_rounds"] == int(re.search(r"--rounds (\d+)", write_job).group(1))
    run(nvsim, work, timeout=900)
    ws = work / re.search(r"-w (\S+)", nvsim).group(1)
    assert (ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt").is_file()
    out = run(export, work, timeout=600).stdout
    assert "exported bundle" in out and "decision thresholds" in out
    run(infer, work, timeout=600)
    predictions = work / re.search(r"--output_dir (\S+)", infer).group(1) / "predictions.csv"
    images = work / re.search(r"--dataset_dir (\S+)", infer).group(1)
    assert len(predictions.read_text().splitlines()) == 1 + len(list(images.iterdir()))
