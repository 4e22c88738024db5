# The job's client script: nvflare runs this file from the job's custom folder.
# All logic lives in the installed package; the bundle sits beside this file.
from pathlib import Path

from fedlabels.flare.lean import skip_unused_imports

skip_unused_imports()  # before MONAI is imported: a site process needs neither ignite nor matplotlib

from fedlabels.flare.client import main  # noqa: E402

main(here=Path(__file__).resolve().parent)
