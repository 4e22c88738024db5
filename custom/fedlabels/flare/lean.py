"""What a site process leaves unimported.

A site trains with MONAI's transforms and networks and nothing else of MONAI, but ``import monai``
imports every MONAI submodule, and two of them pull in large packages a site never uses: the ignite
training engine (``monai.utils.enums`` imports it whenever it is installed, and with it
``torch.distributed``) and matplotlib. Marking them absent before MONAI is imported makes MONAI's
``optional_import`` see them as not installed, as on a site that never installed them: about 80 MB
less resident memory and a third less import time per site process
(``benchmarks/site_memory.py``, ``benchmarks/results/site_memory.md``).

Only a process that is a site and nothing else calls this (the job's client script, before it imports
fedlabels): the bundle's own training workflow (``monai.bundle run``) and ``fedlabels bench`` reports
use both packages.
"""

from __future__ import annotations

import sys

UNUSED = ("ignite", "matplotlib")


def skip_unused_imports() -> list:
    """Mark ``UNUSED`` packages absent for this process unless something already imported them; returns
    the names marked."""
    marked = [name for name in UNUSED if name not in sys.modules]
    for name in marked:
        sys.modules[name] = None  # ``import name`` now raises ImportError, which optional_import expects
    return marked
