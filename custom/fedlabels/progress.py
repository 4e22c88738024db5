"""Progress of the long commands (``bench``, ``prepare``, ``import``, ``simulate``) with the time left.

On a terminal a bar is redrawn in place on the last line:

```text
[bench] ########------------ 4/10 cells  02:31 elapsed, about 03:46 left  fedavg seed 1
```

Elsewhere (a log file, CI, a pipe) each step is one line, so a log reads top to bottom:

```text
[bench] 4/10 cells, 02:31 elapsed, about 03:46 left: fedavg seed 1
```

Every message of these commands goes through :func:`say`, which clears the bar before
printing and redraws it after, so log lines and the bar never overwrite each other.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Callable, TextIO

# The bar currently drawn on the terminal (one at a time: the commands run one long loop each).
_active: "Progress | None" = None


def say(msg: str) -> None:
    """Print one message line (stdout), keeping a progress bar, if one is drawn, below it."""
    bar = _active
    if bar is not None and bar.tty:
        bar._clear()
    print(msg, flush=True)
    if bar is not None and bar.tty:
        bar._draw()


def number(value, digits: int = 4) -> str:
    """A metric or loss as a log line shows it: rounded to ``digits`` decimals (``0.3333``, not
    ``0.33333333333333337``); ``n/a`` for None, NaN or anything not a number. Files keep full precision."""
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "n/a" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}" if math.isfinite(value) else "n/a" if math.isnan(value) else str(value)


def clock(seconds: float) -> str:
    """``MM:SS``, or ``H:MM:SS`` from an hour on."""
    s = int(round(max(0.0, seconds)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


class Progress:
    """``total`` steps of ``what`` (e.g. ``cells``, ``rounds``, ``images written``).

    ``step(label)`` marks a step done. The time left is the mean time of the steps counted so
    far times the steps left; ``counted=False`` (a step skipped because it was already done)
    advances the count without entering the mean. ``tty``: draw a bar (default: when the
    output is a terminal and messages go to the terminal, i.e. ``say_fn`` is :func:`say`).
    Without a terminal, ``every`` steps print one line (default: every step when there are
    at most 50, else about every 5 %), and the last step always does.
    """

    def __init__(self, total: int, what: str, prefix: str = "", say_fn: Callable | None = None,
                 tty: bool | None = None, stream: TextIO | None = None, every: int | None = None):
        self.total, self.what, self.prefix = max(0, int(total)), what, prefix
        self.say = say_fn or say
        self.stream = stream or sys.stdout
        if tty is None:
            tty = self.say is say and _isatty(self.stream)
        self.tty = tty
        self.every = every or (1 if self.total <= 50 else max(1, self.total // 20))
        self.count = self.counted = 0
        self.t0 = self.timed = time.monotonic()
        self.spent = 0.0  # seconds of the counted steps
        self.label = ""
        self.drawn = 0.0
        global _active
        if self.tty:
            _active = self
            self._draw()

    # ---------------------------------------------------------------- estimates
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float | None:
        """Seconds left (``None`` before the first counted step)."""
        if not self.counted:
            return None
        return self.spent / self.counted * max(0, self.total - self.count)

    def status(self) -> str:
        left = self.left()
        when = f"{clock(self.elapsed())} elapsed" + ("" if left is None else f", about {clock(left)} left")
        return f"{self.count}/{self.total} {self.what}, {when}"

    # ---------------------------------------------------------------- steps
    def step(self, label: str = "", n: int = 1, counted: bool = True) -> None:
        now = time.monotonic()
        before = self.count
        self.count = min(self.total, self.count + n) if self.total else self.count + n
        if counted:
            self.counted += n
            self.spent += now - self.timed
        self.timed = now
        self.label = label
        if self.tty:
            # redrawn at most ten times a second: a step per image can be thousands a second
            if self.count >= self.total or now - self.drawn >= 0.1:
                self._draw()
            if self.count >= self.total:
                self.close()
        elif self.count // self.every != before // self.every or self.count >= self.total:
            self.say(f"{self.prefix}{self.status()}" + (f": {label}" if label else ""))

    def doing(self, label: str) -> None:
        """Name the step now running on the bar (a terminal only: elsewhere the command's own
        log line says it)."""
        self.label = label
        if self.tty:
            self._draw()

    def close(self) -> None:
        """End the bar's line (the bar stays on screen as it was last drawn)."""
        global _active
        if self.tty and _active is self:
            self.stream.write("\n")
            self.stream.flush()
            _active = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- the bar
    def _line(self) -> str:
        width = shutil.get_terminal_size((100, 24)).columns
        frac = self.count / self.total if self.total else 1.0
        cells = 20
        done = int(frac * cells)
        left = self.left()
        text = (f"{self.prefix}{'#' * done}{'-' * (cells - done)} {self.count}/{self.total} {self.what}  "
                f"{clock(self.elapsed())} elapsed" + ("" if left is None else f", about {clock(left)} left")
                + (f"  {self.label}" if self.label else ""))
        return text[: max(10, width - 1)]

    def _clear(self) -> None:
        self.stream.write("\r\x1b[K")
        self.stream.flush()

    def _draw(self) -> None:
        self.drawn = time.monotonic()
        self.stream.write("\r\x1b[K" + self._line())
        self.stream.flush()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class RoundFollower:
    """Follows a run's ``metrics.jsonl`` (one JSON line per finished round, rewritten whole by
    the server each round) from a background thread and reports each round as it ends: one
    line per site with its metrics, then the round's mean key metric, and a progress step.

    The reader only reads what the run writes anyway, so the simulator, the controller and a
    provisioned server need no change to be followed. ``first``: the first round this run
    trains (a resumed run starts later); rounds before it are not reported.
    """

    def __init__(self, path, rounds: int, first: int = 0, poll: float = 1.0, say_fn: Callable | None = None,
                 tty: bool | None = None):
        import threading

        self.path, self.rounds, self.first, self.poll = path, rounds, first, poll
        self.say = say_fn or say
        self.reported: set = set()
        self._tty = tty
        self.bar: Progress | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fedlabels-rounds", daemon=True)

    def start(self) -> "RoundFollower":
        self.bar = Progress(self.rounds - self.first, "rounds", prefix="[simulate] ", say_fn=self.say, tty=self._tty)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following; report what the file holds by now (the last round may land just before)."""
        self._stop.set()
        self._thread.join()
        self.check()
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll):
            self.check()

    def records(self) -> list:
        import json
        import os

        if not os.path.isfile(self.path):
            return []
        out = []
        with open(self.path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:  # a line being written by a writer that is not atomic
                    break
        return out

    def check(self) -> None:
        """Report every finished round not reported yet, in round order."""
        import math

        new = sorted((r for r in self.records() if r.get("round", -1) >= self.first
                      and r["round"] not in self.reported), key=lambda r: r["round"])
        for rec in new:
            rnd = rec["round"]
            self.reported.add(rnd)
            for site, m in sorted(rec.get("sites", {}).items()):
                # per-class values ("val_auroc/effusion") stay in the file: one readable line per site
                vals = " ".join(f"{k}={v:.4f}" for k, v in m.items()
                                if "/" not in k and isinstance(v, float) and math.isfinite(v))
                self.say(f"round {rnd} {site}: n={m.get('n')} {vals}".rstrip())
            key = next((k for k in rec if k.startswith("mean_val_")), None)
            mean = rec.get(key) if key else None
            extra = "".join(f"; {what} {sorted(rec[what]) if isinstance(rec[what], (list, dict)) else rec[what]}"
                            for what in ("dropped", "abstained") if rec.get(what))
            shown = "n/a" if mean is None else f"{mean:.4f}"
            self.say(f"round {rnd} done" + (f" in {rec['seconds']:.1f}s" if "seconds" in rec else "")
                     + (f"; {key} of the received model = {shown}" if key else "") + extra)
            if self.bar is not None:
                self.bar.step(f"round {rnd}")
