"""The stall inspector: ranks waiting in a collective for a rank that never joins it, named.

Every rank reports once a second where it is (:mod:`spark_dl.rank.progress`): each process
group's sequence number (collectives launched), seconds since it last moved, and the collective
and call site its main thread is in. A rank *waits* when its main thread is inside a collective
or it has launched more collectives on a group than another rank has. When a waiting rank has
not moved for ``warning`` seconds while another rank is not waiting, the driver warns once,
naming the waiting ranks, the ones they wait for and both call sites; after ``timeout`` seconds
the attempt fails with :class:`~spark_dl.errors.RankStalled`, carrying every rank's stack. Ranks
that all compute (a long step, a slow first batch) or all sit in the same collective from the
same line (a large transfer over a slow link) are never stalled.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from spark_dl import protocol
from spark_dl.errors import LaunchRefused, in_range

STALL_WARNING_S = 60.0  # Horovod's default
STALL_TIMEOUT_S = 300.0
STACKS_WAIT_S = 3.0  # how long the driver waits for the ranks' stacks
SHOWN = 8  # ranks named in one message; the rest counted


class Default:
    """The type of :data:`DEFAULT`: an option left to the environment or spark-dl's default."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = Default()


def stall_settings(warning: Any, timeout: Any,
                   env: Mapping[str, str] | None = None) -> tuple[float | None, float | None]:
    """``(warning, timeout)`` in seconds (None: off) from the runner's options; an option left at
    :data:`DEFAULT` comes from Horovod's variables (in ``env=``, else the driver's environment),
    else 60 s and 300 s. ``HOROVOD_STALL_CHECK_DISABLE=1`` turns both off."""
    sources = [dict(env or {}), os.environ]

    def lookup(name: str) -> str | None:
        for source in sources:
            value = (source.get(name) or "").strip()
            if value:
                return value
        return None

    disabled = lookup(protocol.STALL_DISABLE_ENV)
    off = disabled is not None and disabled.lower() not in ("0", "false", "no")

    def pick(value: Any, name: str, env_name: str, default: float) -> float | None:
        if not isinstance(value, Default):
            if value is None:
                return None
            if not in_range(value, low=0, low_open=True):
                raise LaunchRefused(f"{name} must be a number of seconds > 0 or None (off), got {value!r}: e.g. "
                                    f"{name}={default:g}")
            return float(value)
        if off:
            return None
        raw = lookup(env_name)
        if raw is None:
            return default
        try:
            number = float(raw)
        except ValueError:
            number = None
        if not in_range(number, low=0):
            raise LaunchRefused(f"{env_name}={raw!r} is not a number of seconds >= 0 (0 turns it off): set one or "
                                f"unset it for the default, {default:g}")
        return number or None

    return (pick(warning, "stall_warning", protocol.STALL_WARNING_ENV, STALL_WARNING_S),
            pick(timeout, "stall_timeout", protocol.STALL_TIMEOUT_ENV, STALL_TIMEOUT_S))


@dataclass(frozen=True)
class Stall:
    """A stall past its time-out: who waits, for whom, and what to say."""

    waiting: tuple[int, ...]
    culprits: tuple[int, ...]  # the ranks the others wait for (empty: every rank waits, in different collectives)
    summary: str
    seconds: float


def _ranks(ranks: list[int], hosts: Mapping[int, str]) -> str:
    named = [f"{r} ({hosts.get(r, '?')})" for r in ranks[:SHOWN]]
    more = f" and {len(ranks) - SHOWN} more" if len(ranks) > SHOWN else ""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(named) + more


class StallInspector:
    """Compares the ranks' progress reports (fed by the control server's threads)."""

    def __init__(self, world_size: int, warning: float | None, timeout: float | None,
                 warn: Callable[[str], None]) -> None:
        self.world_size = world_size
        self.warning = warning
        self.timeout = timeout
        self._warn = warn
        self._lock = threading.Condition()
        self._reports: dict[int, tuple[float, protocol.Progress]] = {}
        self._warned: tuple | None = None
        self._answers: dict[int, dict[int, str]] = {}
        self._ids = itertools.count(1)
        self.connections: Callable[[], list[Any]] = list  # the ranks' links (set by the controller)

    # -- input -----------------------------------------------------------------------------------
    def on_progress(self, rank: int, report: protocol.Progress) -> None:
        with self._lock:
            self._reports[rank] = (time.monotonic(), report)

    def on_stacks(self, rank: int, answer: dict) -> None:
        with self._lock:
            box = self._answers.get(answer.get("id"))
            if box is not None:
                box[rank] = answer.get("text", "")
                self._lock.notify_all()

    # -- the rule --------------------------------------------------------------------------------
    def check(self, done: set[int], hosts: Mapping[int, str]) -> Stall | None:
        """Warn once about a stall past ``warning``; return it once past ``timeout``. ``done``: the
        ranks that have returned, failed or exited."""
        if self.warning is None and self.timeout is None:
            return None
        now = time.monotonic()
        with self._lock:
            reports = dict(self._reports)
        active = [r for r in sorted(reports) if r not in done]
        if not active:
            return None
        age = {r: reports[r][1]["age"] + now - reports[r][0] for r in reports}
        seq = {r: reports[r][1]["seq"] for r in reports}

        def ahead(r: int) -> bool:
            return any(g in seq[o] and n > seq[o][g] for g, n in seq[r].items() for o in reports if o != r)

        waiting = [r for r in active if reports[r][1]["op"] or ahead(r)]
        bound = min(x for x in (self.warning, self.timeout) if x is not None)
        stuck = [r for r in waiting if age[r] >= bound]
        if not stuck:
            self._warned = None
            return None
        culprits = [r for r in range(self.world_size) if r not in waiting]
        if not culprits and not self._mismatched(stuck, reports, seq):
            self._warned = None  # every rank in the same collective from the same line: a slow one
            return None
        seconds = max(age[r] for r in stuck)
        summary = self._describe(stuck, culprits, reports, done, hosts, seconds)
        key = tuple(culprits)  # one warning per stall, however many ranks join the wait
        if self.warning is not None and self._warned != key and seconds >= self.warning:
            self._warned = key
            limit = (f"the attempt fails if it lasts {self.timeout:g} s (stall_timeout; "
                     f"{protocol.STALL_TIMEOUT_ENV})" if self.timeout is not None else "stall_timeout is off")
            self._warn(f"[spark-dl] stalled: {summary}; {limit}. HorovodRunner.stacks() shows every rank's stack.")
        if self.timeout is not None and seconds >= self.timeout:
            return Stall(tuple(stuck), tuple(culprits), summary, seconds)
        return None

    @staticmethod
    def _mismatched(stuck: list[int], reports: dict, seq: dict) -> bool:
        where = {(reports[r][1]["op"], reports[r][1]["site"]) for r in stuck}
        shared = set.intersection(*(set(seq[r]) for r in stuck)) if stuck else set()
        return len(where) > 1 or any(len({seq[r][g] for r in stuck}) > 1 for g in shared)

    @staticmethod
    def _describe(stuck: list[int], culprits: list[int], reports: dict, done: set[int],
                  hosts: Mapping[int, str], seconds: float) -> str:
        def at(r: int) -> str:
            p = reports[r][1] if r in reports else None
            if p is None:
                return "has not reported"
            if r in done:
                return "has already returned from main or exited"
            if p["op"]:
                return f"is in {p['op']}" + (f" at {p['site']}" if p["site"] else "")
            return f"is at {p['site']}" if p["site"] else "is running outside any collective"

        ops = {(reports[r][1]["op"], reports[r][1]["site"]) for r in stuck}
        if not culprits:
            each = "; ".join(f"rank {r} {at(r)}" for r in stuck[:SHOWN])
            return (f"every rank has waited {seconds:.0f} s in a collective, and not the same one: {each}. The ranks "
                    "issued different collectives (one skipped or added one, or their order differs)")
        op, site = sorted(ops, key=str)[0]
        inside = f"in {op or 'a collective'}" + (f" at {site}" if site else "")
        behind = "; ".join(f"rank {r} {at(r)}" for r in culprits[:SHOWN])
        return (f"{_ranks(stuck, hosts)} {'has' if len(stuck) == 1 else 'have'} waited {seconds:.0f} s {inside} "
                f"for {_ranks(culprits, hosts)}, which {'has' if len(culprits) == 1 else 'have'} not joined it: "
                f"{behind}")

    # -- stacks ----------------------------------------------------------------------------------
    def ask_stacks(self, wait: float = STACKS_WAIT_S, ranks: list[int] | None = None) -> dict[int, str]:
        """Every connected rank's threads' stacks (a rank that does not answer within ``wait``
        seconds, stopped or frozen, is said to be so)."""
        asked: dict[int, Any] = {}
        for conn in self.connections():
            r = conn.info.get("rank")
            if conn.info.get("role") == "rank" and not conn.info.get("closed") and (ranks is None or r in ranks):
                asked[r] = conn
        request = next(self._ids)
        with self._lock:
            self._answers[request] = box = {}
        for r, conn in asked.items():
            try:
                conn.send(protocol.STACKS, {"id": request})
            except OSError:
                box[r] = "(its link to the driver is closed)\n"
        deadline = time.monotonic() + wait
        with self._lock:
            while len(box) < len(asked) and time.monotonic() < deadline:
                self._lock.wait(deadline - time.monotonic())
            self._answers.pop(request, None)
            out = dict(box)
        for r in asked:
            out.setdefault(r, f"(no answer within {wait:g} s: the process is stopped, frozen or cut off)\n")
        return dict(sorted(out.items()))


def format_stacks(stacks: Mapping[int, str], hosts: Mapping[int, str]) -> str:
    """Each rank's stacks for an error message: its own threads, spark-dl's reporting threads left out."""
    parts = []
    for r, text in stacks.items():
        blocks = [b for b in text.strip("\n").split("\n\n") if "[spark-dl-" not in b.split("\n", 1)[0]]
        parts.append(f"--- rank {r} on {hosts.get(r, '?')} ---\n" + "\n\n".join(blocks))
    return "\n".join(parts)


def run_timeout_message(limit: float, monitor: Any) -> str:
    """Why the attempt was stopped, with each rank's last output line (``monitor``: the
    :class:`~spark_dl.driver.monitor.JobMonitor` that holds them): where a hang sits."""
    lines = [f"the run exceeded run_timeout={limit:g} s and every rank was stopped (a hung collective, a rank "
             "waiting for one that is stuck, or a run that needs more time: raise run_timeout). "
             "Last line of each rank:"]
    with monitor.lock:
        tails = {r: t[-1] if t else "" for r, t in monitor.tails.items()}
    for r in range(monitor.world_size):
        lines.append(f"  {tails.get(r) or f'[{r}] (no output)'}")
    return "\n".join(lines)
