"""What NVIDIA FLARE adds on top of the training itself: time, bytes, memory.

Side by side, in one run, on the same synthetic cxr scenario, bundle
(``cxr_densenet121``, DenseNet121 at 64 px), method (``fedavg_pl``), batch
size, epochs, rounds and sites:

(a) **Time.** The FLARE simulator (``fedlabels.flare.simulator.simulate``, the
    job exported from ``JOBS["fedavg_pl_cxr"]``) against a plain in-process
    loop (``fedlabels.references.federate``: the same client and server rules,
    no FLARE). Per-round times come from the controller's ``metrics.jsonl``
    ("seconds") and from the plain loop's own clock; round 0 is reported apart
    (it includes start-up and caching), the steady rounds are averaged. A FLARE
    site also validates the model it receives every round and the job ends
    with a cross-site validation, so the plain loop runs the same validation
    passes (timed apart): the like-for-like reference is "plain, training +
    validation". The simulator runs with ``-t 1`` (one site at a time, like
    the plain loop; nvflare then starts a fresh worker process for every site
    task) and with ``-t N`` (every site its own long-lived process, run
    concurrently). Every process uses the same number of torch threads.
    The number of cases per site is calibrated so that one plain round takes
    at least ``--target`` seconds.
(b) **Bytes.** What one site sends per round: the update's arrays (sum of
    ``nbytes``) and that update serialized the way FLARE does it (an
    ``FLModel`` turned into a ``Shareable`` by ``FLModelUtils`` and
    ``fobs.dumps``), against ``torch.save`` of the model's state dict; plus
    the loopback traffic counted by the kernel while the simulator ran.
(c) **Memory.** A tiny 8-site, 2-round simulator run (``-t 8``) with the RSS
    and PSS of the whole process tree sampled every 0.2 s, against one plain
    loop process training the same 8 sites.

    python benchmarks/flare_overhead.py            # the real numbers (~10 min on 2 cores)
    python benchmarks/flare_overhead.py --quick    # smoke test, tiny sizes (< 2 min)

Writes ``benchmarks/results/flare_overhead.md`` and ``.json`` (``--quick``
only prints, unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "bundles" / "cxr_densenet121"
JOB = "fedavg_pl_cxr"
MB = 1024 * 1024

# ---------------------------------------------------------------- sampling


class TreeSampler:
    """Samples the process tree under ``root_pid`` (excluded) every ``interval`` s.

    Records the peak total RSS and PSS, each process's peak RSS (named by its
    role: the simulator's server process or a site worker), the CPU seconds the
    tree used, and the load average while it ran.
    """

    def __init__(self, root_pid: int, interval: float = 0.2, pss: bool = True):
        import psutil

        self.psutil, self.root, self.interval = psutil, psutil.Process(root_pid), interval
        self.pss = pss  # PSS reads every process's smaps: costly with dozens of processes
        self.peak_rss = self.peak_pss = 0
        self.peak_sample: list = []
        self.procs: dict = {}  # pid -> {role, rss, cpu}
        self.loads: list = []
        self.samples = 0
        self.series: list = []  # (time, CPU seconds used by the tree so far, of which by site workers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def role(cmdline: list) -> str:
        line = " ".join(cmdline)
        if "simulator_worker" in line:
            m = re.search(r"--client (\S+)", line)
            return f"worker:{m.group(1) if m else '?'}"
        if "nvflare.cli" in line and "simulator" in line:
            return "simulator"
        if "--plain-worker" in line:
            return "plain"
        return "other"

    def _sample(self):
        total_rss = total_pss = 0
        now = []
        for p in self.root.children(recursive=True):
            try:
                with p.oneshot():
                    mem = p.memory_full_info() if self.pss else p.memory_info()
                    cpu = p.cpu_times()
                    info = self.procs.get(p.pid)
                    if info is None:
                        info = self.procs[p.pid] = {"role": self.role(p.cmdline()), "rss": 0, "cpu": 0.0}
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied, self.psutil.ZombieProcess):
                continue
            info["rss"] = max(info["rss"], mem.rss)
            info["cpu"] = cpu.user + cpu.system
            total_rss += mem.rss
            total_pss += getattr(mem, "pss", mem.rss)
            now.append((info["role"], mem.rss))
        self.samples += 1
        self.series.append((time.time(), sum(v["cpu"] for v in self.procs.values()),
                            sum(v["cpu"] for v in self.procs.values() if v["role"].startswith("worker:"))))
        if total_rss > self.peak_rss:
            self.peak_rss, self.peak_sample = total_rss, now
        self.peak_pss = max(self.peak_pss, total_pss)

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            if self.samples % 25 == 1:
                self.loads.append(os.getloadavg()[0])
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def cpu_at(self, t: float, workers_only=False) -> float:
        """CPU seconds the tree (or its site workers) had used by time ``t`` (last sample at or before it)."""
        before = [w if workers_only else c for ts, c, w in self.series if ts <= t]
        return before[-1] if before else 0.0

    def summary(self) -> dict:
        workers = [v["rss"] for v in self.procs.values() if v["role"].startswith("worker:")]
        server_at_peak = [rss for role, rss in self.peak_sample if not role.startswith("worker:")]
        workers_at_peak = [rss for role, rss in self.peak_sample if role.startswith("worker:")]
        return {
            "samples": self.samples,
            "peak_total_rss": self.peak_rss,
            "peak_total_pss": self.peak_pss,
            "processes_at_peak": len(self.peak_sample),
            "roles_at_peak": sorted(r for r, _ in self.peak_sample),
            "server_side_rss_at_peak": sum(server_at_peak) if server_at_peak else None,
            "workers_rss_at_peak": workers_at_peak,
            "worker_processes": len(workers),
            "worker_peak_rss_mean": statistics.mean(workers) if workers else None,
            "worker_peak_rss_max": max(workers) if workers else None,
            "cpu_seconds": sum(v["cpu"] for v in self.procs.values()),
            "load_mean": statistics.mean(self.loads) if self.loads else None,
        }


def loopback_bytes() -> int | None:
    import psutil

    nic = psutil.net_io_counters(pernic=True).get("lo")
    return None if nic is None else nic.bytes_sent


def loadavg() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


# ---------------------------------------------------------------- plain loop (a subprocess)


def plain_worker(config_path: str) -> int:
    """``references.federate`` plus the validation passes a FLARE site runs; writes timings as JSON."""
    t_start = time.time()
    cfg = json.loads(Path(config_path).read_text())
    import torch

    from fedlabels import methods
    from fedlabels.site import evaluate
    from fedlabels.references import federate, setups

    t_imported = time.time()
    site_setups = setups(cfg["bundle"], cfg["data"], sites=cfg.get("sites"), batch_size=cfg.get("batch_size"), seed=0)
    t_setup = time.time()
    stamps, cpu_stamps = [], []

    def stamp(record, weights, best):
        stamps.append(time.time())
        cpu_stamps.append(time.process_time())

    c_setup = time.process_time()
    federate(cfg["method"], site_setups, cfg["rounds"], seed=0, log=None, on_round=stamp, client_options=cfg["options"])
    t_trained = time.time()
    rounds = [b - a for a, b in zip([t_setup] + stamps[:-1], stamps)]
    rounds_cpu = [b - a for a, b in zip([c_setup] + cpu_stamps[:-1], cpu_stamps)]

    def validate_all():
        t0, c0 = time.time(), time.process_time()
        for st in site_setups.values():
            evaluate(st.net, st.val_loader, st.task, st.classes)
        return time.time() - t0, time.process_time() - c0

    # A FLARE site validates the received model before training (every round), then the
    # controller's cross-site validation runs once more at the end.
    val_runs = [validate_all() for _ in range(cfg["rounds"])]
    val, val_cpu = [v[0] for v in val_runs], [v[1] for v in val_runs]
    final_val = validate_all()[0]
    out = {
        "torch_threads": torch.get_num_threads(),
        "import_s": t_imported - t_start,
        "setup_s": t_setup - t_imported,
        "train_rounds_s": rounds,
        "val_round_s": val,
        "train_rounds_cpu_s": rounds_cpu,
        "val_round_cpu_s": val_cpu,
        "final_val_s": final_val,
        "train_total_s": t_trained - t_setup,
        "cases": {s: {"train": len(st.site.training), "val": len(st.site.validation)} for s, st in site_setups.items()},
        "batch_size": next(iter(site_setups.values())).train_loader.batch_size,
    }
    if cfg.get("measure_bytes"):
        out["bytes"] = measure_bytes(cfg, site_setups, methods)
    Path(cfg["out"]).write_text(json.dumps(out, indent=1))
    return 0


def measure_bytes(cfg, site_setups, methods) -> dict:
    """Sizes of what one site sends per round, of the global model each site receives, and of the model file."""
    import io

    import numpy as np
    import torch
    from nvflare.apis.utils.decomposers import flare_decomposers
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.decomposers import common_decomposers
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils
    from nvflare.fuel.utils import fobs

    from fedlabels.methods.base import ABSTAIN, EXTRAS, N, RESUME, to_numpy

    flare_decomposers.register()
    common_decomposers.register()
    name, st = next(iter(site_setups.items()))
    method = methods.get(cfg["method"])
    # One options dict in the benchmark's config: each rule takes the options it names.
    client_names, server_names = method.client_option_names(), method.server_option_names()
    unknown = sorted(set(cfg["options"]) - client_names - server_names)
    if unknown:
        raise ValueError(f"method {cfg['method']!r} has no client or server option(s) {unknown}")
    client_opts = {k: v for k, v in cfg["options"].items() if k in client_names}
    server_opts = {k: v for k, v in cfg["options"].items() if k in server_names}
    client = method.make_client(st.net, st.context(), **client_opts)
    # What client.py sends after train(): the client rule's update (state dict minus local keys) + metrics + meta.
    update = client.make_update(len(st.site.training), {"train_loss": 0.5})
    metrics = {**update.metrics, "val_auroc": 0.5, **{f"val_auroc/{c}": 0.5 for c in st.classes}}
    meta = {**update.meta, N: update.n, ABSTAIN: update.abstain, EXTRAS: update.extras,
            "NUM_STEPS_CURRENT_ROUND": update.n}
    sent = FLModelUtils.to_shareable(FLModel(params=update.weights, params_type=ParamsType.FULL, metrics=metrics, meta=meta))
    server = method.make_server(**server_opts)
    server.setup({s: x.site.summary() for s, x in site_setups.items()})
    step = server.plan(1, list(site_setups))[0]
    glob = to_numpy(st.net.state_dict())
    # What the controller sends each site (controller.py ``_send``).
    received = FLModelUtils.to_shareable(FLModel(params=glob, params_type=ParamsType.FULL, current_round=1, total_rounds=cfg["rounds"],
                                                 meta={EXTRAS: server.extras(1, step), RESUME: []}))
    buf = io.BytesIO()
    torch.save(st.net.state_dict(), buf)
    state = st.net.state_dict()
    return {
        "state_dict_tensors": len(state),
        "parameters": sum(p.numel() for p in st.net.parameters()),
        "torch_save": buf.getbuffer().nbytes,
        "update_arrays": len(update.weights),
        "update_nbytes": int(sum(np.asarray(v).nbytes for v in update.weights.values())),
        "update_fobs": len(fobs.dumps(sent)),
        "global_fobs": len(fobs.dumps(received)),
        "local_keys_kept": len(state) - len(update.weights),
    }


def run_plain(work: Path, data: Path, rounds: int, sites, options: dict, measure_bytes_=False, tag="plain") -> dict:
    cfg = {"bundle": str(BUNDLE), "data": str(data), "method": "fedavg_pl", "options": options, "rounds": rounds,
           "sites": sites, "batch_size": None, "out": str(work / f"{tag}.json"), "measure_bytes": measure_bytes_}
    cfg_path = work / f"{tag}-config.json"
    cfg_path.write_text(json.dumps(cfg))
    log = work / f"{tag}.log"
    t0 = time.time()
    with TreeSampler(os.getpid()) as sampler, open(log, "w") as out:
        proc = subprocess.run([sys.executable, __file__, "--plain-worker", str(cfg_path)], stdout=out, stderr=subprocess.STDOUT,
                              env=os.environ.copy())
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"plain loop failed (exit {proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    res = json.loads((work / f"{tag}.json").read_text())
    res["wall_s"] = wall
    res["memory"] = sampler.summary()
    return res


# ---------------------------------------------------------------- FLARE simulator


SETUP_LINE = re.compile(r"\[site-\d+\] \S+ on .*: \d+ training cases")
CLIENT_LINE = re.compile(r"\[(site-\d+)\] round (\d+): n=\d+ .*\(([\d.]+)s\)")


def run_flare(work: Path, data: Path, rounds: int, sites: int, threads: int, tag: str, job: str = JOB,
              sampler_options: dict | None = None, **changes) -> dict:
    from fedlabels.flare.simulator import simulate
    from fedlabels.flare.job import JOBS, export

    spec = JOBS[job].replace(name=f"{job}_{tag}", rounds=rounds, sites=sites, **changes)
    job_dir = export(spec, work / "jobs")
    ws, log = work / f"ws-{tag}", work / f"{tag}.log"
    lo0 = loopback_bytes()
    t0 = time.time()
    with TreeSampler(os.getpid(), **(sampler_options or {})) as sampler:
        run_dir = simulate(job_dir, ws, sites, data=data, threads=threads, log=log)
    wall = time.time() - t0
    lo1 = loopback_bytes()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ends = round_ends(ws / "server" / "log.txt")
    rounds_cpu, rounds_worker_cpu = [], []
    for r in sorted(records, key=lambda r: r["round"]):
        end = ends.get(r["round"])
        rounds_cpu.append(None if end is None else sampler.cpu_at(end) - sampler.cpu_at(end - r["seconds"]))
        rounds_worker_cpu.append(None if end is None else sampler.cpu_at(end, True) - sampler.cpu_at(end - r["seconds"], True))
    # Each site prints its own compute time per round (validation of the received model + training).
    site_s: dict = {}
    text = log.read_text(errors="replace")
    for site, rnd, secs in CLIENT_LINE.findall(text):
        site_s.setdefault(int(rnd), {})[site] = float(secs)
    return {
        "threads": threads,
        "sites": sites,
        "rounds_s": [r["seconds"] for r in sorted(records, key=lambda r: r["round"])],
        "rounds_cpu_s": rounds_cpu,
        "site_setups": len(SETUP_LINE.findall(text)),
        "rounds_worker_cpu_s": rounds_worker_cpu,
        "site_compute_s": [sum(site_s.get(r, {}).values()) for r in range(rounds)],
        "site_compute_max_s": [max(site_s.get(r, {}).values(), default=0.0) for r in range(rounds)],
        "wall_s": wall,
        "started": t0,
        "ws": str(ws),
        "loopback_bytes": None if lo0 is None else lo1 - lo0,
        "memory": sampler.summary(),
        "log": str(log),
        "transfers": transfers(ws),
    }


ROUND_END = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .* round (\d+) done in [\d.]+s", re.M)


def round_ends(server_log: Path) -> dict:
    """Wall-clock time at which the controller logged the end of each round."""
    ends = {}
    for stamp, ms, rnd in ROUND_END.findall(server_log.read_text(errors="replace")):
        ends[int(rnd)] = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
    return ends


UPLOAD_LINE = re.compile(r"\[server\] download tx \S+ done: status=(\w+) .*\(([\d,]+) bytes\)")
DOWNLOAD_LINE = re.compile(r"\[client\] download ref=\S+ done: .*\(([\d,]+) bytes\)")


def transfers(ws: Path) -> dict:
    """Byte counts nvflare's download service logs at each site (arrays over 2 MiB travel through it).

    In a site's log, ``[server] download tx ... (N bytes)`` is the server fetching that site's
    update (an upload) and ``[client] download ref=... (N bytes)`` the site fetching a global model.
    """
    out = {}
    for log in sorted(ws.glob("site-*/log.txt")):
        text = log.read_text(errors="replace")
        out[log.parent.name] = {
            "up": [int(n.replace(",", "")) for status, n in UPLOAD_LINE.findall(text)],
            "down": [int(n.replace(",", "")) for n in DOWNLOAD_LINE.findall(text)],
        }
    return out


# ---------------------------------------------------------------- data


def make_data(out: Path, cases: int, size: int, sites: int = 4) -> Path:
    """The synthetic cxr scenario (4 sites); with ``sites=8`` sites 5-8 are copies of sites 1-4."""
    import yaml

    from fedlabels.data.synthetic import generate

    root = generate("cxr", out, seed=0, cases=cases, test_cases=8, size=size)
    if sites > 4:
        meta = yaml.safe_load((root / "scenario.yaml").read_text())
        for k in range(5, sites + 1):
            src, dst = root / f"site-{(k - 1) % 4 + 1}", root / f"site-{k}"
            shutil.copytree(src, dst)
            prof = yaml.safe_load((dst / "profile.yaml").read_text())
            prof["site"] = dst.name
            (dst / "profile.yaml").write_text(yaml.safe_dump(prof, sort_keys=False))
            meta["sites"].append(dst.name)
        (root / "scenario.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return root


# ---------------------------------------------------------------- report


def steady(values: list) -> float | None:
    return statistics.mean(values[1:]) if len(values) > 1 else None


def fmt(v, spec=".1f", unit=""):
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def ratio(a, b):
    return None if a is None or not b else a / b


def report(res: dict) -> str:
    p, cfg = res["plain"], res["config"]
    rounds, n_sites = cfg["rounds"], cfg["sites"]
    plain_train = p["train_rounds_s"]
    val_mean = statistics.mean(p["val_round_s"])
    plain_tv = [t + v for t, v in zip(plain_train, p["val_round_s"])]
    ref_steady, ref_train = steady(plain_tv), steady(plain_train)
    cpu_train = p["train_rounds_cpu_s"]
    cpu_tv = [t + v for t, v in zip(cpu_train, p["val_round_cpu_s"])]
    ref_cpu, ref_cpu_train = steady(cpu_tv), steady(cpu_train)
    cases = p["cases"]["site-1"]
    cal = res.get("calibration")
    lines = [
        "# FLARE overhead: simulator vs plain in-process loop",
        "",
        f"Generated by `{res['command']}` on {res['date']}. Method `fedavg_pl`, bundle `cxr_densenet121` "
        f"(DenseNet121, 64 px input), synthetic cxr scenario with {cfg['cases']} cases per site "
        f"({cases['train']} training / {cases['val']} validation at site-1), batch {p['batch_size']}, "
        f"{cfg['options']['epochs']} epoch per round, lr {cfg['options']['lr']}, {rounds} rounds, {n_sites} sites. "
        f"Every process runs torch with {cfg['torch_threads']} thread(s) (`OMP_NUM_THREADS`); "
        + (f"cases per site were calibrated to about {cfg['target']:.0f} s per plain round (a calibration run on "
           f"{cal.get('measured_on_sites', cal['sites'])} sites at {cal['cases']} cases/site, scaled to {cal['sites']} sites, took "
           f"{cal['round_s']:.1f} s per round; the machine's load changes between runs, hence the spread)." if cal
           else "cases per site were set by hand."),
        "",
        "## (a) Time per round",
        "",
        f"*Steady round* = mean over rounds 1..{rounds - 1}; round 0 includes process start-up, imports and dataset caching "
        "and is shown apart. *CPU-s* = CPU seconds used by the whole process tree in that time (plain: the process's own "
        "clock; FLARE: every server and site process, sampled every 0.2 s, between the controller's round boundaries): on a "
        "machine shared with other jobs the CPU a run *gets* varies, the CPU it *uses* much less, so the CPU ratio is the "
        "steadier measure of the work FLARE adds. *Site compute* = sum of the per-round times the sites report themselves "
        "(validation of the received model + local training). Ratios are against the plain loop with the same validation "
        "passes (like for like) and, in brackets, against training only.",
        "",
        "| run | what it is | round 0 (s) | steady round (s) | **steady ratio vs plain** | CPU-s per steady round | "
        "CPU ratio vs plain | site compute per steady round (s) | total wall (s) | wall ratio vs plain | CPU-s, whole run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    plain_wall = p["wall_s"]
    lines.append(f"| plain, training only | `references.federate`: the {n_sites} sites train one after another in one process "
                 f"| {plain_train[0]:.1f} | {fmt(ref_train)} | ({fmt(ratio(ref_train, ref_steady), '.2f', 'x')}) | {fmt(ref_cpu_train)} "
                 f"| ({fmt(ratio(ref_cpu_train, ref_cpu), '.2f', 'x')}) | {fmt(ref_train)} | n/a | n/a | n/a |")
    lines.append(f"| **plain, training + validation** | the same, plus each round the validation pass a FLARE site runs on the "
                 f"received model ({val_mean:.1f} s per round for all sites) and one final cross-site validation "
                 f"| {plain_tv[0]:.1f} | **{fmt(ref_steady)}** | 1.00x (1.00x) | {fmt(ref_cpu)} | 1.00x (1.00x) | {fmt(ref_steady)} "
                 f"| {plain_wall:.1f} | 1.00x | {p['memory']['cpu_seconds']:.0f} |")
    for key in ("flare_t1", "flare_tn"):
        f = res.get(key)
        if not f:
            continue
        what = ("FLARE simulator `-t 1`: sites one at a time, as in the plain loop; nvflare starts a new worker process "
                "for every site task, so each site re-imports, rebuilds its network and re-caches its data every round"
                if f["threads"] == 1 else
                f"FLARE simulator `-t {f['threads']}`: each site its own long-lived worker process, all {f['sites']} "
                f"running concurrently on {os.cpu_count()} cores")
        st, sc = steady(f["rounds_s"]), steady(f["site_compute_s"])
        cpu = steady(f["rounds_cpu_s"]) if None not in f["rounds_cpu_s"] else None
        lines.append(f"| FLARE sim `-t {f['threads']}` | {what} | {f['rounds_s'][0]:.1f} | **{fmt(st)}** | "
                     f"**{fmt(ratio(st, ref_steady), '.2f', 'x')}** ({fmt(ratio(st, ref_train), '.2f', 'x')}) | {fmt(cpu)} | "
                     f"{fmt(ratio(cpu, ref_cpu), '.2f', 'x')} ({fmt(ratio(cpu, ref_cpu_train), '.2f', 'x')}) | {fmt(sc)} | "
                     f"{f['wall_s']:.1f} | {fmt(ratio(f['wall_s'], plain_wall), '.2f', 'x')} | {f['memory']['cpu_seconds']:.0f} |")
    lines += [
        "",
        "Per round: plain training " + ", ".join(f"{v:.1f}" for v in plain_train)
        + " s (CPU " + ", ".join(f"{v:.1f}" for v in cpu_train) + "); plain validation "
        + ", ".join(f"{v:.1f}" for v in p["val_round_s"]) + " s (CPU " + ", ".join(f"{v:.1f}" for v in p["val_round_cpu_s"])
        + f"); plain start-up: imports {p['import_s']:.1f} s, data caching and networks {p['setup_s']:.1f} s; final validation "
        f"{p['final_val_s']:.1f} s.",
    ]
    for key in ("flare_t1", "flare_tn"):
        f = res.get(key)
        if f:
            lines.append(f"FLARE `-t {f['threads']}`: controller seconds " + ", ".join(f"{v:.1f}" for v in f["rounds_s"])
                         + " (CPU " + ", ".join(fmt(v) for v in f["rounds_cpu_s"])
                         + (", of which site worker processes " + ", ".join(fmt(v) for v in f["rounds_worker_cpu_s"])
                            if f.get("rounds_worker_cpu_s") else "") + "); site compute "
                         + ", ".join(f"{v:.1f}" for v in f["site_compute_s"]) + " (slowest site "
                         + ", ".join(f"{v:.1f}" for v in f["site_compute_max_s"]) + ")"
                         + (f"; load average during the run {f['memory']['load_mean']:.2f}" if f["memory"]["load_mean"] is not None else "") + ".")
    verdicts = []
    for key in ("flare_t1", "flare_tn"):
        f = res.get(key)
        if not f:
            continue
        w = ratio(steady(f["rounds_s"]), ref_steady)
        c = ratio(steady(f["rounds_cpu_s"]), ref_cpu) if None not in f["rounds_cpu_s"] else None
        verdict = f"`-t {f['threads']}` {fmt(w, '.2f', 'x')} wall ({'met' if w is not None and w <= 1.15 else 'not met'})"
        verdict += f", {fmt(c, '.2f', 'x')} CPU ({'met' if c is not None and c <= 1.15 else 'not met'})"
        verdicts.append(verdict)
    if verdicts:
        lines += ["", "**Goal: a steady round at most 1.15x the plain loop's.** " + "; ".join(verdicts) + "."]
    t1 = res.get("flare_t1")
    if t1:
        lines.append(f"Under `-t 1` the sites were set up {t1.get('site_setups', '?')} times for {rounds} rounds "
                     f"({n_sites} sites x ({rounds} training tasks + 1 validation task), plus end-of-run): with fewer threads than "
                     "sites the simulator runs every site task in a new `simulator_worker` process, so each site pays the "
                     "imports, the network build and the dataset caching again, and its optimizer state (Adam moments) "
                     "starts anew every round -- unlike the plain loop, `-t N` and a real deployment, where a site's "
                     "process lives for the whole job.")
    tn = res.get("flare_tn")
    if tn:
        lines.append(f"`-t {tn['threads']}` runs the sites in parallel processes, so its wall time per round can be below the "
                     "plain loop's (which trains one site at a time on one core); the CPU-s column shows the work it adds.")
    if p["memory"]["load_mean"] is not None:
        lines.append(f"Load average during the plain run: {p['memory']['load_mean']:.2f}.")
    if ref_steady is not None and ref_steady < 20:
        lines.append(f"**Note:** the plain steady round took {ref_steady:.1f} s, under the 20 s this benchmark aims at "
                     "(the machine's load changed after calibration, or `--cases`/`--quick` was given).")

    b = p.get("bytes")
    if b:
        t1 = res.get("flare_t1") or res.get("flare_tn")
        ts = b["torch_save"]
        lines += [
            "",
            "## (b) Bytes per site per round",
            "",
            f"DenseNet121 classifier: {b['parameters']:,} parameters, {b['state_dict_tensors']} state-dict entries "
            f"(parameters and BatchNorm buffers). `fedavg_pl` keeps nothing local ({b['local_keys_kept']} keys withheld), so "
            "a site uploads the whole state dict every round and downloads the global model once per round.",
            "",
            "| what | bytes | MiB | vs `torch.save` of the model |",
            "|---|---|---|---|",
            f"| model file: `torch.save(net.state_dict())` | {ts:,} | {ts / MB:.2f} | 1.000x |",
            f"| update a site sends: sum of the arrays' `nbytes` ({b['update_arrays']} numpy arrays) | {b['update_nbytes']:,} | "
            f"{b['update_nbytes'] / MB:.2f} | {b['update_nbytes'] / ts:.3f}x |",
            f"| **update a site sends, serialized as FLARE does** (`FLModel` -> `Shareable` -> `fobs.dumps`, with metrics and "
            f"label-summary meta) | **{b['update_fobs']:,}** | **{b['update_fobs'] / MB:.2f}** | **{b['update_fobs'] / ts:.3f}x** |",
            f"| global model a site receives per round, serialized (`fobs.dumps`) | {b['global_fobs']:,} | {b['global_fobs'] / MB:.2f} | "
            f"{b['global_fobs'] / ts:.3f}x |",
        ]
        for f in [x for x in (res.get("flare_t1"), res.get("flare_tn")) if x and x.get("transfers")][:1]:
            ups = [n for t in f["transfers"].values() for n in t["up"]]
            downs = [n for t in f["transfers"].values() for n in t["down"]]
            if ups:
                up = statistics.mean(ups)
                lines.append(f"| update a site sent, as counted by nvflare's download service in the `-t {f['threads']}` run "
                             f"(mean of {len(ups)} uploads, site logs) | {up:,.0f} | {up / MB:.2f} | {up / ts:.3f}x |")
            if downs:
                down = statistics.mean(downs)
                lines.append(f"| global model a site fetched, same count (mean of {len(downs)} downloads incl. the final "
                             f"validation's) | {down:,.0f} | {down / MB:.2f} | {down / ts:.3f}x |")
        if t1 and t1.get("loopback_bytes") is not None:
            # tasks: rounds x sites train tasks (model down + update up) + sites validate tasks (model down + metrics up)
            expect = n_sites * rounds * (b["update_fobs"] + b["global_fobs"]) + n_sites * b["global_fobs"]
            lines.append(f"| loopback bytes the kernel counted while the `-t {t1['threads']}` simulator ran (whole machine, "
                         f"all traffic) | {t1['loopback_bytes']:,} | {t1['loopback_bytes'] / MB:.1f} | {t1['loopback_bytes'] / expect:.2f}x "
                         f"of the {expect / MB:.1f} MiB the serialized sizes predict for {n_sites} sites x {rounds} rounds + final "
                         "validation |")
        lines += [
            "",
            "nvflare 2.9 moves numpy arrays over 2 MiB through its download service (the receiver pulls them in chunks) "
            "and logs each transfer's size at INFO; the serialized sizes above are computed without a cell "
            "(arrays inlined), the logged ones are what actually crossed. A site also downloads the global model once "
            "per round, so its traffic per round is about twice the model size.",
        ]

    m, mp = res.get("mem_flare"), res.get("mem_plain")
    if m and mp:
        mm, pm = m["memory"], mp["memory"]
        ns = m["sites"]
        lines += [
            "",
            f"## (c) Peak memory, {ns} sites",
            "",
            f"A {m['rounds']}-round run on {ns} sites with {res['config']['mem_cases']} cases per site"
            + (f" (sites 5-{ns} copy sites 1-{ns - 4})" if ns > 4 else "") + ". RSS/PSS of every process in the tree sampled every 0.2 s "
            f"({mm['samples']} samples for FLARE); RSS counts shared library pages once per process, PSS splits them.",
            "",
            "| run | processes at peak | peak total RSS (MiB) | peak total PSS (MiB) | server side at the peak (MiB RSS) | "
            "per site (MiB) | ratio vs plain (RSS) |",
            "|---|---|---|---|---|---|---|",
            f"| plain loop, one process, {ns} sites | {pm['processes_at_peak']} | {pm['peak_total_rss'] / MB:.0f} | "
            f"{pm['peak_total_pss'] / MB:.0f} | n/a | {pm['peak_total_rss'] / MB / ns:.0f} (total / {ns}) | 1.00x |",
            f"| FLARE simulator `-t {m['threads']}` | {mm['processes_at_peak']} | **{mm['peak_total_rss'] / MB:.0f}** | "
            f"{mm['peak_total_pss'] / MB:.0f} | {fmt(mm['server_side_rss_at_peak'] and mm['server_side_rss_at_peak'] / MB, '.0f')} | "
            f"{fmt(mm['worker_peak_rss_mean'] and mm['worker_peak_rss_mean'] / MB, '.0f')} (mean peak of the "
            f"{mm['worker_processes']} worker processes; total / {ns} = {mm['peak_total_rss'] / MB / ns:.0f}) | "
            f"**{mm['peak_total_rss'] / pm['peak_total_rss']:.2f}x** |",
            "",
            f"Wall time of these runs: plain {mp['wall_s']:.0f} s, FLARE {m['wall_s']:.0f} s.",
        ]
    lines += [
        "",
        "## Machine",
        "",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, no GPU, torch {res['versions']['torch']}, "
        f"nvflare {res['versions']['nvflare']}, MONAI {res['versions']['monai']}, Python {platform.python_version()}.",
        f"Load average (1, 5, 15 min) before / after: {res['load_before']} / {res['load_after']} (this "
        "benchmark's own processes count; anything above that is other work on the machine, which makes absolute "
        "times noisy); the runs are back to back, not interleaved.",
        f"Total benchmark time: {res['elapsed_s']:.0f} s.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 12 cases/site, 2 sites, 2 rounds, no -t 1 run (a fresh process per site task is slow), "
                         "(c) read from the -t 2 run; prints the table, writes files only with --out")
    ap.add_argument("--cases", type=int, help="cases per site (default: calibrated to --target seconds per plain round)")
    ap.add_argument("--target", type=float, default=28.0, help="seconds per plain round the calibration aims at (>= 20)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of (a) (default 3; --quick 2)")
    ap.add_argument("--size", type=int, default=64, help="synthetic image size (the bundle resizes to 64 px)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch threads per process, FLARE workers and plain loop alike (default 1: 2 shared cores)")
    ap.add_argument("--no-tn", action="store_true", help="skip the concurrent -t N simulator run")
    ap.add_argument("--no-t1", action="store_true", help="skip the -t 1 simulator run")
    ap.add_argument("--mem-sites", type=int, default=None,
                    help="sites of (c) (default 8; --quick: the -t N run's sites, reported as (c) without another run)")
    ap.add_argument("--mem-cases", type=int, default=None, help="cases per site of (c) (default 16)")
    ap.add_argument("--keep", help="keep workspaces and logs in this folder (default: a temporary folder, removed)")
    ap.add_argument("--out", help="markdown output (default benchmarks/results/flare_overhead.md)")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the markdown from a results JSON of an earlier run")
    ap.add_argument("--plain-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plain_worker:
        return plain_worker(args.plain_worker)
    if args.render:
        text = report(json.loads(Path(args.render).read_text()))
        out = Path(args.out) if args.out else Path(args.render).with_suffix(".md")
        out.write_text(text)
        print(text + f"\nwritten to {out}")
        return 0

    # Same thread count in every process: the plain worker and every FLARE process inherit this.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.torch_threads)
    quick = args.quick
    rounds = args.rounds or (2 if quick else 3)
    sites = 2 if quick else 4
    mem_cases = args.mem_cases or (8 if quick else 16)
    mem_rounds = 1 if quick else 2
    options = {"lr": 1e-3, "epochs": 1}
    out = Path(args.out) if args.out else None if quick else REPO / "benchmarks" / "results" / "flare_overhead.md"

    import monai
    import nvflare
    import torch

    res = {"command": "python benchmarks/flare_overhead.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "load_before": loadavg(),
           "versions": {"torch": torch.__version__, "nvflare": nvflare.__version__, "monai": monai.__version__}}
    t_all = time.time()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fedlabels-flare-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    site_names = [f"site-{i + 1}" for i in range(sites)]
    try:
        cases = args.cases
        if cases is None and not quick:
            # Two sites for two rounds, scaled to all sites: round 1 (warm) sets the cases per site.
            cal_cases, cal_sites = 40, site_names[:2]
            print(f"[calibrate] plain loop, {len(cal_sites)} sites, {cal_cases} cases/site, 2 rounds ...", flush=True)
            cal = run_plain(work, make_data(work / "data-cal", cal_cases, args.size), 2, cal_sites, options, tag="calibrate")
            round_s = (cal["train_rounds_s"][1] + cal["val_round_s"][1]) * sites / len(cal_sites)
            cases = min(1200, max(cal_cases, math.ceil(cal_cases * args.target / round_s)))
            res["calibration"] = {"cases": cal_cases, "sites": sites, "round_s": round_s, "chosen_cases": cases,
                                  "measured_on_sites": len(cal_sites)}
            print(f"[calibrate] about {round_s:.1f} s per {sites}-site round at {cal_cases} cases/site -> {cases} cases/site", flush=True)
        cases = cases or 12
        res["config"] = {"cases": cases, "size": args.size, "rounds": rounds, "sites": sites, "options": options,
                         "torch_threads": args.torch_threads, "target": args.target, "calibrated": args.cases is None and not quick,
                         "mem_sites": args.mem_sites or (sites if quick else 8), "mem_cases": mem_cases, "mem_rounds": mem_rounds}
        print(f"[data] cxr scenario, {cases} cases/site ...", flush=True)
        data = make_data(work / "data", cases, args.size)

        print(f"[plain] references.federate, {sites} sites x {rounds} rounds ...", flush=True)
        res["plain"] = run_plain(work, data, rounds, site_names, options, measure_bytes_=True)
        print(f"[plain] rounds {[round(v, 1) for v in res['plain']['train_rounds_s']]} s, validation "
              f"{[round(v, 1) for v in res['plain']['val_round_s']]} s, wall {res['plain']['wall_s']:.0f} s", flush=True)

        if not (args.no_t1 or quick):
            print(f"[flare -t 1] simulator, {sites} sites x {rounds} rounds ...", flush=True)
            res["flare_t1"] = run_flare(work, data, rounds, sites, 1, "t1")
            print(f"[flare -t 1] rounds {[round(v, 1) for v in res['flare_t1']['rounds_s']]} s, wall {res['flare_t1']['wall_s']:.0f} s",
                  flush=True)

        if not args.no_tn:
            print(f"[flare -t {sites}] simulator, {sites} sites x {rounds} rounds ...", flush=True)
            res["flare_tn"] = run_flare(work, data, rounds, sites, sites, f"t{sites}")
            print(f"[flare -t {sites}] rounds {[round(v, 1) for v in res['flare_tn']['rounds_s']]} s, wall {res['flare_tn']['wall_s']:.0f} s",
                  flush=True)

        ns = args.mem_sites or (sites if quick else 8)
        if quick and ns == sites and "flare_tn" in res:
            # The -t N run above already is a memory run on these sites: report it.
            res["mem_plain"], res["mem_flare"] = res["plain"], dict(res["flare_tn"], rounds=rounds)
            res["config"].update(mem_sites=ns, mem_cases=cases, mem_rounds=rounds)
        else:
            print(f"[memory] {ns}-site scenario, {mem_cases} cases/site; plain loop then simulator -t {ns} ...", flush=True)
            mem_data = make_data(work / "data-mem", mem_cases, args.size, sites=ns)
            mem_names = [f"site-{i + 1}" for i in range(ns)]
            res["mem_plain"] = run_plain(work, mem_data, mem_rounds, mem_names, options, tag="mem-plain")
            res["mem_flare"] = run_flare(work, mem_data, mem_rounds, ns, ns, f"mem{ns}")
            res["mem_flare"]["rounds"] = mem_rounds
        print(f"[memory] peak RSS plain {res['mem_plain']['memory']['peak_total_rss'] / MB:.0f} MiB, "
              f"FLARE {res['mem_flare']['memory']['peak_total_rss'] / MB:.0f} MiB", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    res["elapsed_s"] = time.time() - t_all
    res["load_after"] = loadavg()
    text = report(res)
    print("\n" + text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"written to {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
