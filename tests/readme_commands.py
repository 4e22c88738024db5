"""The README's commands and how the tests run them (tests/unit/test_readme.py, tests/simulator/test_readme_flare.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

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

