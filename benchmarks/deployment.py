"""A provisioned federation on loopback against the FLARE simulator: the same job, side by side.

One run measures, on this machine:

* **start-up**: ``fedlabels provision`` (server, 2 hospitals, admin; mutual TLS)
  to every hospital connected, each participant started from its kit as its
  own process tree (``fedlabels.flare.local_federation``);
* **round time**: job ``fedavg_cxr`` (DenseNet121, 64 px), 2 sites, ``--rounds``
  rounds on the same embedded scenario (each hospital holding only its own
  site folder and its share of the cores, as a simulated site), submitted
  with ``job.py --prod``; and the same job in
  ``nvflare simulator`` (``fedlabels simulate``'s ``simulate``). Seconds per
  round are the controller's own (``metrics.jsonl``), round 0 left out (it
  includes the sites' set-up);
* **bytes**: per site per round, what the site's update holds
  (``fedlabels_sent``), and what nvflare's download service moved (the
  ``download tx ... bytes`` lines of the site's job log: the server pulling the
  site's update), against the model's size.

    python benchmarks/deployment.py [--rounds 4] [--cases 64]

Writes ``OUT/deployment.md`` and ``OUT/deployment.json`` (default OUT: benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedlabels.bundle import bundle_path, network
from fedlabels.data.synthetic import generate
from fedlabels.flare.simulator import simulate
from fedlabels.flare.job import JOBS, export
from fedlabels.flare.local_federation import Participant, free_ports, wait_for_sites
from fedlabels.flare.provision import provision

REPO = Path(__file__).resolve().parents[1]
SITES = ("site-1", "site-2")
TX = re.compile(r"download tx \S+ done: status=\w+ .*\(([\d,]+) bytes\)")


def steady_round_seconds(metrics_file: Path) -> list:
    rounds = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return [r["seconds"] for r in rounds if r["round"] > 0]


def run_deployment(tmp: Path, full: Path, rounds: int) -> dict:
    data = {}
    for site in SITES:
        data[site] = tmp / "data" / site
        data[site].mkdir(parents=True)
        shutil.copy(full / "scenario.yaml", data[site])
        shutil.copytree(full / site, data[site] / site)
    t0 = time.time()
    fl_port, admin_port = free_ports(2)
    kits = provision(tmp / "prov", "bench", "localhost", list(SITES), "admin@fedlabels.org", fl_port, admin_port)
    provisioned = time.time() - t0
    parts = [Participant(kits["localhost"]).start()]
    # Each hospital gets its share of this machine's cores, as each simulated site does: the
    # two runs then differ in the transport only (real hospitals each have their own machine).
    threads = str(max(1, (os.cpu_count() or 1) // len(SITES)))
    parts += [Participant(kits[s], env={"FEDLABELS_DATA": str(data[s]), "OMP_NUM_THREADS": threads}).start()
              for s in SITES]
    try:
        wait_for_sites(kits["admin@fedlabels.org"], SITES, timeout=300)
        running = time.time() - t0
        t1 = time.time()
        out = subprocess.run([sys.executable, str(REPO / "nvflare_jobs" / "fedavg_cxr" / "job.py"), "--prod",
                              str(kits["admin@fedlabels.org"]), "-n", "2", "--rounds", str(rounds), "--min-sites", "2"],
                             capture_output=True, text=True, timeout=3600)
        job_seconds = time.time() - t1
        line = [x for x in out.stdout.splitlines() if x.startswith("job ") and "results:" in x][-1]
        job_id, status, result = line.split()[1].rstrip(":"), line.split()[2].rstrip(";"), Path(line.split("results: ")[1])
        if status != "FINISHED:COMPLETED":
            raise RuntimeError(f"deployment job ended {status}: {out.stdout[-2000:]}")
        sent, moved = {}, {}
        for site in SITES:
            records = [json.loads(x) for x in (kits[site] / "fedlabels_sent" / f"{site}.jsonl").read_text().splitlines()]
            sent[site] = [r["array_bytes"] for r in records if r["task"] == "train"]
            moved[site] = [int(n.replace(",", "")) for n in TX.findall((kits[site] / job_id / "log.txt").read_text())]
        return {"provision_s": provisioned, "provision_to_running_s": running, "job_s": job_seconds,
                "round_s": steady_round_seconds(result / "workspace" / "metrics.jsonl"),
                "sent_bytes": sent, "moved_bytes": moved}
    finally:
        for p in parts:
            p.stop()


def run_simulator(tmp: Path, full: Path, rounds: int) -> dict:
    spec = JOBS["fedavg_cxr"].replace(sites=2, rounds=rounds, min_sites=2)
    job = export(spec, tmp / "jobs")
    t0 = time.time()
    run_dir = simulate(job, tmp / "ws", 2, data=full, log=tmp / "sim.log", timeout=3600)
    return {"job_s": time.time() - t0, "round_s": steady_round_seconds(run_dir / "metrics.jsonl")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--cases", type=int, default=64, help="cases per site of the embedded cxr scenario")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    model_bytes = sum(v.numel() * v.element_size()
                      for v in network(bundle_path("cxr_densenet121")).state_dict().values())
    with tempfile.TemporaryDirectory(prefix="fedlabels-deploy-") as tmp:
        tmp = Path(tmp)
        full = generate("cxr", tmp / "full", seed=0, cases=args.cases, test_cases=32, sites=2)
        print("simulator ...", flush=True)
        sim = run_simulator(tmp / "sim", full, args.rounds)
        print(f"  {sim}", flush=True)
        print("loopback deployment ...", flush=True)
        dep = run_deployment(tmp / "dep", full, args.rounds)
        print(f"  {dep}", flush=True)
    mean = statistics.mean
    result = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads", "rounds": args.rounds,
              "cases_per_site": args.cases, "model_bytes": model_bytes, "simulator": sim, "deployment": dep}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "deployment.json").write_text(json.dumps(result, indent=2))
    rows = [
        "| | loopback deployment (mTLS, 3 processes) | simulator |",
        "|---|---|---|",
        f"| seconds per round (rounds 1..{args.rounds - 1}, mean) | {mean(dep['round_s']):.2f} | "
        f"{mean(sim['round_s']):.2f} |",
        f"| ratio | {mean(dep['round_s']) / mean(sim['round_s']):.2f}x | 1.00x |",
        f"| whole job, submit to result downloaded (s) | {dep['job_s']:.1f} | {sim['job_s']:.1f} |",
    ]
    per_site = [
        "| site | update as sent (bytes) | moved by nvflare (bytes per round) | model size | moved / model |",
        "|---|---|---|---|---|",
    ]
    for site in SITES:
        moved = dep["moved_bytes"][site]
        per_site.append(f"| {site} | {mean(dep['sent_bytes'][site]):,.0f} | "
                        f"{mean(moved):,.0f} ({len(moved)} transfers) | {model_bytes:,} | "
                        f"{mean(moved) / model_bytes:.3f} |")
    text = "\n".join([
        "# Loopback deployment against the simulator",
        "",
        f"Job `fedavg_cxr` (DenseNet121, 64 px), 2 sites x {args.cases} cases, {args.rounds} rounds; "
        f"{result['machine']}. Command: `python benchmarks/deployment.py --rounds {args.rounds} --cases {args.cases}`.",
        "",
        f"`fedlabels provision` took {dep['provision_s']:.1f} s; provision to every hospital connected: "
        f"{dep['provision_to_running_s']:.1f} s.",
        "",
        *rows, "", *per_site, "",
    ])
    (out / "deployment.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
