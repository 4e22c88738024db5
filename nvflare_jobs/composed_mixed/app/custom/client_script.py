# The job's client script: nvflare runs this file from the job's custom folder.
# All logic lives in the installed package; the bundle sits beside this file.
from pathlib import Path

from fedlabels.flare.client import main

main(here=Path(__file__).resolve().parent)
