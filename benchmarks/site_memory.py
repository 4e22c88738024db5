"""A site process's memory and import time before training: today's import of the site's code beside
the lean one (``fedlabels.flare.lean``: ignite and matplotlib left unimported), side by side in one run.

    python benchmarks/site_memory.py [--repeats 3] [--out benchmarks/results/site_memory.md]

Each measurement is a fresh ``python`` process that imports what a site process imports before its
first task (``fedlabels.flare.client``, which brings torch, MONAI and nvflare's client API) and prints
its peak resident memory (``ru_maxrss``) and the import's wall time; the two variants alternate so that
a busy machine slows both alike. Memory does not depend on load; time does (the ratio is the number).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import json, resource, sys, time
t = time.perf_counter()
if {lean}:
    from fedlabels.flare.lean import skip_unused_imports
    skip_unused_imports()
import fedlabels.flare.client
print(json.dumps({{"seconds": time.perf_counter() - t, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "ignite": "ignite" in sys.modules and sys.modules["ignite"] is not None,
                  "matplotlib": "matplotlib" in sys.modules and sys.modules["matplotlib"] is not None}}))
"""


def measure(lean: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(lean=lean)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "site_memory.md"))
    ap.add_argument("--note", default="", help="what else the machine was doing (written under the table)")
    args = ap.parse_args(argv)
    runs = {"today": [], "lean": []}
    for i in range(args.repeats):
        for name in ("today", "lean"):
            runs[name].append(measure(name == "lean"))
            print(f"[site_memory] {name} {i + 1}/{args.repeats}: {runs[name][-1]}", flush=True)
    rows = []
    for name, got in runs.items():
        mb, s = [g["maxrss_mb"] for g in got], [g["seconds"] for g in got]
        rows.append((name, np.mean(mb), np.std(mb), np.mean(s), np.std(s), got[0]["ignite"], got[0]["matplotlib"]))
    ratio_mb, ratio_s = rows[1][1] / rows[0][1], rows[1][3] / rows[0][3]
    lines = ["# A site process before training: memory and import time", "",
             f"Written by `python benchmarks/site_memory.py --repeats {args.repeats}` on {time.strftime('%Y-%m-%d')}, "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
             "each value the mean ± sd of fresh processes that import `fedlabels.flare.client` (what a site process "
             "imports before its first task), the two variants alternating.", "",
             "| import path | peak resident memory (MB) | import time (s) | ignite imported | matplotlib imported |",
             "|---|---|---|---|---|"]
    for name, mb, mbsd, s, ssd, ign, mpl in rows:
        label = {"today": "as before (`import fedlabels.flare.client`)",
                 "lean": "lean (`fedlabels.flare.lean.skip_unused_imports()` first, as the client script and the "
                         "executor do)"}[name]
        lines.append(f"| {label} | {mb:.0f} ± {mbsd:.0f} | {s:.1f} ± {ssd:.1f} | {'yes' if ign else 'no'} | "
                     f"{'yes' if mpl else 'no'} |")
    lines += ["", f"Lean / as before: memory {ratio_mb:.2f}, import time {ratio_s:.2f} (same machine, same run)."
              + (f" {args.note}" if args.note else ""), ""]
    tmp = Path(args.out).with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
