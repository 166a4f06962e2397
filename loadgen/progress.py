"""Live view of an open-loop replay: rolling counters and a tqdm progress bar.

Owns: `LiveStats` (sent, in flight, completed, 429s, errors; send rate over the last 5 s;
TTFT p99 and schedule drift p99 over the last 60 s) and `ProgressBar` (elapsed / total schedule
with those figures as a postfix, or a plain line every 10 s when stderr is no terminal, plus a
loud warning whenever the client falls behind its own schedule, because then the offered load is
lower than the trace's).

The live drift is the event loop's lateness at launch (the full on-the-wire drift of each request
is in the results). Nothing here sleeps or does I/O except writing to stderr.
Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

RATE_WINDOW_S = 5.0
LATENCY_WINDOW_S = 60.0
# Above this p99 drift the client, not the server, shapes the offered load: say so.
DRIFT_WARN_S = 0.050
WARN_EVERY_S = 10.0
LOG_EVERY_S = 10.0


def _p99(window: deque[tuple[float, float]]) -> float | None:
    if not window:
        return None
    return float(np.percentile(np.fromiter((v for _, v in window), float, len(window)), 99))


def _trim(window: deque[tuple[float, float]], since: float) -> None:
    while window and window[0][0] < since:
        window.popleft()


@dataclass
class LiveStats:
    """Counters since the start and rolling windows; `now` is seconds since the run start."""

    sent: int = 0
    completed: int = 0
    rejected: int = 0
    errors: int = 0
    incomplete: int = 0
    _send_t: deque[float] = field(default_factory=deque)
    _ttft: deque[tuple[float, float]] = field(default_factory=deque)
    _drift: deque[tuple[float, float]] = field(default_factory=deque)

    @property
    def in_flight(self) -> int:
        return self.sent - self.completed - self.rejected - self.errors - self.incomplete

    def on_sent(self, now: float, drift_s: float) -> None:
        self.sent += 1
        self._send_t.append(now)
        self._drift.append((now, drift_s))

    def on_done(self, now: float, status: str, ttft_s: float | None) -> None:
        if status == "ok":
            self.completed += 1
        elif status == "rejected":
            self.rejected += 1
        elif status == "error":
            self.errors += 1
        else:
            self.incomplete += 1
        if ttft_s is not None and ttft_s == ttft_s:
            self._ttft.append((now, ttft_s))

    def snapshot(self, now: float) -> dict[str, float | int | None]:
        while self._send_t and self._send_t[0] < now - RATE_WINDOW_S:
            self._send_t.popleft()
        _trim(self._ttft, now - LATENCY_WINDOW_S)
        _trim(self._drift, now - LATENCY_WINDOW_S)
        span = min(RATE_WINDOW_S, max(now, 1e-3))
        return {"send_rps": len(self._send_t) / span, "in_flight": self.in_flight, "ok": self.completed,
                "r429": self.rejected, "err": self.errors, "ttft_p99_s": _p99(self._ttft),
                "drift_p99_s": _p99(self._drift)}


def _fmt_s(value: float | int | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 10 else f"{value:.1f}s"


class ProgressBar:
    """elapsed/total seconds of the schedule, with the live figures; disabled writes nothing."""

    def __init__(self, total_s: float, *, enabled: bool = True, desc: str = "replay",
                 interactive: bool | None = None) -> None:
        self.enabled = enabled
        # Not a terminal (CI, a log file): a plain line every LOG_EVERY_S instead of redraws.
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.total_s = total_s
        self.desc = desc
        self._last_warn = -WARN_EVERY_S
        self._last_log = -LOG_EVERY_S
        self._bar = tqdm(total=round(total_s, 1), desc=desc, unit="s", disable=not (enabled and self.interactive),
                         file=sys.stderr, dynamic_ncols=True,
                         bar_format="{desc} {n:.0f}/{total:.0f}s |{bar}| {postfix}")

    def update(self, elapsed_s: float, snap: dict[str, float | int | None]) -> None:
        line = (f"send {snap['send_rps']:.1f}/s inflight {snap['in_flight']} ok {snap['ok']} 429 {snap['r429']} "
                f"err {snap['err']} ttft_p99(60s) {_fmt_s(snap['ttft_p99_s'])} "
                f"drift_p99 {_fmt_s(snap['drift_p99_s'])}")
        if self.enabled and self.interactive:
            self._bar.n = round(min(elapsed_s, self._bar.total or elapsed_s), 1)
            self._bar.set_postfix_str(line, refresh=True)
        elif self.enabled and elapsed_s - self._last_log >= LOG_EVERY_S:
            self._last_log = elapsed_s
            print(f"{self.desc} {min(elapsed_s, self.total_s):.0f}/{self.total_s:.0f}s {line}", file=sys.stderr)
        # The warning is printed with or without the bar: drift must never pass unnoticed.
        drift = snap["drift_p99_s"]
        if drift is not None and drift > DRIFT_WARN_S and elapsed_s - self._last_warn >= WARN_EVERY_S:
            self._last_warn = elapsed_s
            self.warn(f"CLIENT BEHIND SCHEDULE: send drift p99 {drift * 1000:.0f} ms over the last "
                      f"{LATENCY_WINDOW_S:.0f} s; the offered load is below the trace's (the client, not the "
                      "server, is the bottleneck)")

    def warn(self, message: str) -> None:
        if self.enabled and self.interactive:
            self._bar.write(f"WARNING: {message}", file=sys.stderr)
        else:
            print(f"WARNING: {message}", file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
