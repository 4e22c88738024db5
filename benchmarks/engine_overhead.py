"""What the in-process round engine costs over a bare federated loop.

Side by side, in one process and one run, on the same embedded cxr scenario
(4 sites), bundle (``cxr_resnet18``), method (``fedavg``), seed, batch size,
lr and local epochs:

* **engine** -- ``references.federate``: the round engine (``fedlabels.engine``)
  with direct calls: plan, extras, each site's task (``site.train_task``:
  validation of the received model for best-model selection, then the
  client's ``train()``), screening of every update, the server rule's
  aggregation, the finite check, best-model tracking and the round's record;
* **bare** -- the same clients' ``train()`` calls, one site after another, and a
  plain n_k-weighted average (float64, cast back; integer buffers rounded, as
  the server rule does), nothing else;
* **bare + validation** -- ``bare`` plus the validation pass each site runs on
  the model it receives (what ``train_task`` adds), so the engine's own
  machinery can be told apart from the validation it asks for.

Every variant has its own site setups and starts from the same initial
weights; the final global weights of the three are compared (they must be
identical: the same local steps). The three run in one process with their
rounds interleaved (``run_repeat``): the engine hosts and its ``on_round``
callback steps the bare loops, whose time is left out of the engine's rounds;
the order rotates (bare rounds after the engine's in even repeats, before it
in odd ones; the two bare loops swap every round), so a drift of the machine's
speed hits all three alike. Round 0 also builds the engine's clients and is
reported apart; the *steady* rounds 1..R-1 are the headline.

    OMP_NUM_THREADS=1 python benchmarks/engine_overhead.py             # ~5 min
    OMP_NUM_THREADS=1 python benchmarks/engine_overhead.py --quick     # smoke test

Writes ``benchmarks/results/engine_overhead.md`` (``--quick``: prints only,
unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("engine", "bare", "bare + validation")


def plain_average(updates: list) -> dict:
    """sum_k n_k w_k / sum_k n_k per key in float64, cast back (integers rounded)."""
    import numpy as np

    total = float(sum(u.n for u in updates))
    out = {}
    for key in updates[0].weights:
        mean = sum(float(u.n) * np.asarray(u.weights[key], dtype=np.float64) for u in updates) / total
        dtype = np.asarray(updates[0].weights[key]).dtype
        out[key] = (np.rint(mean) if np.issubdtype(dtype, np.integer) else mean).astype(dtype)
    return out


class BareLoop:
    """The same clients stepped one round at a time, with a plain weighted average; optionally the validation pass."""

    def __init__(self, bundle, data, seed: int, batch_size, client_options: dict, validate: bool):
        import torch
        from fedlabels import methods, references
        from fedlabels.methods.base import to_numpy
        from fedlabels.nets import rebuild

        self.setups = references.setups(bundle, data, batch_size=batch_size, seed=seed, method="fedavg")
        m = methods.get("fedavg")
        self.clients = {s: m.make_client(st.net, st.context(), **client_options) for s, st in self.setups.items()}
        torch.manual_seed(seed)
        self.weights = to_numpy(rebuild(next(iter(self.setups.values())).net).state_dict())
        self.validate, self.wall, self.cpu = validate, [], []

    def step(self, rnd: int) -> None:
        from fedlabels.site import evaluate

        t0, c0 = time.perf_counter(), time.process_time()
        updates = []
        for s, client in self.clients.items():
            if self.validate:
                st = self.setups[s]
                client.receive(self.weights)
                evaluate(client.net, st.val_loader, st.task, st.classes, st.device)
            updates.append(client.train(self.weights, rnd))
        self.weights = plain_average(updates)
        self.wall.append(time.perf_counter() - t0)
        self.cpu.append(time.process_time() - c0)


def run_repeat(rep: int, bundle, data, rounds: int, seed: int, batch_size, client_options: dict) -> dict:
    """One federation per variant, their rounds interleaved.

    The engine (``references.federate``) hosts: its ``on_round`` callback steps
    the two bare loops, and the callback's own time is left out of the engine's
    rounds. In even repeats a bare round r runs right after engine round r, in
    odd repeats right before it (bare round r+1 inside the callback of round r);
    the two bare loops swap places every round."""
    from fedlabels import references

    engine_setups = references.setups(bundle, data, batch_size=batch_size, seed=seed, method="fedavg")
    bare = {"bare": BareLoop(bundle, data, seed, batch_size, client_options, validate=False),
            "bare + validation": BareLoop(bundle, data, seed, batch_size, client_options, validate=True)}
    lead = rep % 2 == 1
    loads, eng_wall, eng_cpu = [os.getloadavg()[0]], [], []

    def step_bare(rnd):
        order = list(bare.values()) if rnd % 2 == 0 else list(bare.values())[::-1]
        for loop in order:
            loop.step(rnd)

    if lead:
        step_bare(0)
    mark = {"t": time.perf_counter(), "c": time.process_time()}

    def on_round(record, weights, best):
        eng_wall.append(time.perf_counter() - mark["t"])
        eng_cpu.append(time.process_time() - mark["c"])
        loads.append(os.getloadavg()[0])
        nxt = record["round"] + 1 if lead else record["round"]
        if nxt < rounds:
            step_bare(nxt)
        mark["t"], mark["c"] = time.perf_counter(), time.process_time()

    result = references.federate("fedavg", engine_setups, rounds, seed=seed, log=None, client_options=client_options,
                                 on_round=on_round)
    out = {"engine": {"wall": eng_wall, "cpu": eng_cpu, "weights": result["last"]}}
    for name, loop in bare.items():
        out[name] = {"wall": loop.wall, "cpu": loop.cpu, "weights": loop.weights}
    out["load"] = statistics.mean(loads)
    out["order"] = "bare rounds before the engine's" if lead else "bare rounds after the engine's"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=40, help="cases of the reference cxr site (sites hold 1, 0.6, 1.6, 0.8x)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=None, help="default: the bundle's (16)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (12 cases, 3 rounds, 2 repeats), print only")
    p.add_argument("--out", help="markdown report (default benchmarks/results/engine_overhead.md unless --quick)")
    args = p.parse_args(argv)
    if args.quick:
        args.cases, args.rounds, args.repeats = 12, 3, 2
    out = Path(args.out) if args.out else (None if args.quick else REPO / "benchmarks" / "results" / "engine_overhead.md")

    import numpy as np
    import torch
    from fedlabels.data.synthetic import generate
    from fedlabels.bundle import bundle_path
    from fedlabels.profile import load_scenario

    bundle = bundle_path("cxr_resnet18")
    client_options = {"lr": 1e-3, "epochs": 1}
    load_start = os.getloadavg()
    t_start = time.time()
    reps = []
    with tempfile.TemporaryDirectory(prefix="engine-overhead-") as tmp:
        data = generate("cxr", Path(tmp) / "cxr", seed=0, cases=args.cases, test_cases=4)
        sc = load_scenario(data, with_test=False)
        sizes = {s: (len(d.training), len(d.validation)) for s, d in sc.sites.items()}
        for rep in range(args.repeats):
            r = run_repeat(rep, bundle, data, args.rounds, 0, args.batch_size, client_options)
            reps.append(r)
            for v in VARIANTS:
                print(f"repeat {rep + 1}/{args.repeats} ({r['order']}) {v:18s} rounds (s): "
                      + " ".join(f"{w:.2f}" for w in r[v]["wall"]), flush=True)
    load_end = os.getloadavg()

    ref = reps[0]["engine"]["weights"]
    identical = all(all(np.array_equal(ref[k], r[v]["weights"][k]) for k in ref) for r in reps for v in VARIANTS)

    def steady(v, what):
        return [x for r in reps for x in r[v][what][1:]]

    def paired(v, what):
        """engine / v, round by round (steady rounds), over every repeat."""
        return [e / b for r in reps for e, b in zip(r["engine"][what][1:], r[v][what][1:])]

    summary = {v: {"round0": statistics.mean(r[v]["wall"][0] for r in reps),
                   "wall": statistics.mean(steady(v, "wall")), "median": statistics.median(steady(v, "wall")),
                   "cpu": statistics.mean(steady(v, "cpu"))} for v in VARIANTS}
    ratio = {v: {"wall": summary["engine"]["wall"] / summary[v]["wall"],
                 "cpu": summary["engine"]["cpu"] / summary[v]["cpu"],
                 "paired_median": statistics.median(paired(v, "wall")),
                 "paired_sd": statistics.stdev(paired(v, "wall")) if len(paired(v, "wall")) > 1 else 0.0,
                 "n": len(paired(v, "wall"))} for v in VARIANTS}
    per_repeat = [statistics.mean(r["engine"]["wall"][1:]) / statistics.mean(r["bare"]["wall"][1:]) for r in reps]
    loads = [r["load"] for r in reps]

    cmd = "OMP_NUM_THREADS=%s python benchmarks/engine_overhead.py" % os.environ.get("OMP_NUM_THREADS", "(unset)")
    given = sys.argv[1:] if argv is None else list(argv)
    if given:
        cmd += " " + " ".join(given)
    b, bv = ratio["bare"], ratio["bare + validation"]
    verdict = "met" if b["wall"] <= 1.05 else "not met"
    lines = [
        "# Round engine overhead: `references.federate` vs a bare loop",
        "",
        f"Generated by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M')} ({platform.machine()}, {os.cpu_count()} CPU "
        f"cores, torch {torch.__version__} with {torch.get_num_threads()} thread(s)). Method `fedavg`, bundle "
        f"`cxr_resnet18` (ResNet-18, 64 px), embedded cxr scenario seed 0 with cases={args.cases}: "
        + ", ".join(f"{s} {t} training / {v} validation" for s, (t, v) in sizes.items())
        + f"; batch size {args.batch_size or 'the bundle default (16)'}, lr 0.001, 1 local epoch per round, "
        f"{args.rounds} rounds, {args.repeats} repeats.",
        "",
        "The three federations run in one process with their rounds interleaved: the engine hosts, and its "
        "`on_round` callback steps the two bare loops (the callback's time is left out of the engine's rounds); "
        "in even repeats each bare round runs right after the engine's round of the same number, in odd repeats "
        "right before it, and the two bare loops swap places every round. Slow drifts of the machine's speed "
        "therefore hit all three alike.",
        "",
        f"Load average (1 min): {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end, "
        f"{min(loads):.2f}-{max(loads):.2f} (mean per repeat) while it ran; the benchmark itself keeps one core "
        "busy, so a load well above 1 means other jobs shared the 2 cores.",
        "",
        "*Steady rounds* = rounds 1..R-1 (round 0 also builds the engine's clients and is shown apart). "
        "*Paired* = the median over steady rounds of engine round r / the other loop's round r (same repeat).",
        "",
        "| variant | what it runs per round | round 0 (s) | steady round, wall (s) | median (s) | CPU (s) "
        "| **engine / it, wall** | engine / it, CPU | engine / it, paired median (sd) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    what = {"engine": "`references.federate`: round engine, `train_task` (validation of the received model, then "
                      "`train()`), screening, the server rule's aggregation, records",
            "bare": "the clients' `train()` calls and a plain n_k-weighted average",
            "bare + validation": "`bare` plus the validation pass each site runs on the model it receives"}
    for v in VARIANTS:
        s_, r_ = summary[v], ratio[v]
        lines.append(f"| {v} | {what[v]} | {s_['round0']:.2f} | {s_['wall']:.3f} | {s_['median']:.3f} | "
                     f"{s_['cpu']:.3f} | **{r_['wall']:.3f}x** | {r_['cpu']:.3f}x | "
                     f"{r_['paired_median']:.3f}x ({r_['paired_sd']:.3f}) |")
    lines += [
        "",
        f"**Engine / bare loop, steady round: {b['wall']:.3f}x wall, {b['cpu']:.3f}x CPU, paired median "
        f"{b['paired_median']:.3f}x over {b['n']} round pairs** (goal: within 5%, at most 1.05x: {verdict}). "
        "Per repeat (wall): " + ", ".join(f"{x:.3f}x" for x in per_repeat) + ".",
        "",
        f"Engine / (bare + validation): {bv['wall']:.3f}x wall, {bv['cpu']:.3f}x CPU, paired median "
        f"{bv['paired_median']:.3f}x. The engine's gap to the bare loop is the validation pass every site runs "
        "on the model it receives (best-model selection on site validation data, `site.train_task`), which "
        "the bare loop skips; against a loop that runs the same passes, what remains is the engine's own "
        "machinery (planning, screening every update, aggregation through the server rule, the round record).",
        "",
        f"Final global weights identical in all {len(reps) * len(VARIANTS)} federations (the same local steps): "
        f"{'yes' if identical else 'NO'}.",
        "",
        "Per-round wall seconds (CPU seconds), every federation:",
        "",
    ]
    for i, r in enumerate(reps):
        for v in VARIANTS:
            lines.append(f"- repeat {i + 1} ({r['order']}), {v}: "
                         + ", ".join(f"{w:.2f} ({c:.2f})" for w, c in zip(r[v]["wall"], r[v]["cpu"])))
    lines += ["", f"Total benchmark time {time.time() - t_start:.0f} s.", ""]
    text = "\n".join(lines)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
