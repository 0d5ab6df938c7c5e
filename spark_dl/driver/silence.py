"""Tasks and ranks that stop talking: what the driver's wait loop checks while an attempt runs.

A host that goes silent sends no close (its link cut, its machine frozen or powered off), and a
rank stopped with SIGSTOP keeps its link open: only missing heartbeats tell. Every barrier task and
the driver exchange heartbeats; every rank reports its progress once a second
(:mod:`spark_dl.rank.progress`); every byte received counts as a word. ``SPARK_DL_SILENCE_TIMEOUT``
bounds each silence.
"""
from __future__ import annotations

import time

from spark_dl import protocol
from spark_dl.driver.monitor import Failure, JobMonitor
from spark_dl.errors import env_number

SILENCE_TIMEOUT_S = 30.0


def silence_timeout() -> float:
    """How long a task may stay silent before the attempt fails naming its host (``SPARK_DL_SILENCE_TIMEOUT``,
    seconds; 0 turns the bound off)."""
    return env_number(protocol.SILENCE_ENV, SILENCE_TIMEOUT_S, unit=" seconds")


def silent(monitor: JobMonitor, limit: float) -> Failure | None:
    """The failure to report for the first task or rank not heard from for ``limit`` seconds, or for
    tasks that never came while the others of their barrier stage did; None if there is none."""
    return silent_task(monitor, limit) or silent_rank(monitor, limit) or late_tasks(monitor, limit)


def silent_task(monitor: JobMonitor, limit: float) -> Failure | None:
    """A task not heard from for ``limit`` seconds: its host down, frozen or cut off the network."""
    now = time.monotonic()
    with monitor.lock:
        for partition, conn in monitor.task_conns.items():
            if conn.info.get("closed") or now - conn.heard <= limit:
                continue
            conn.info["silent"] = True  # it will not close its link: nobody waits for that
            ranks = [r for r in monitor.task_ranks.get(partition, []) if r not in monitor.exits]
            why = (f"went silent: it has sent nothing for {limit:g} s (the host is down, frozen or cut off the "
                   f"network). {protocol.SILENCE_ENV} sets this bound.")
            if ranks:  # RankFailed says "rank R on HOST failed: ..."
                return Failure(ranks[0], f"its barrier task {why}", observed=True)
            return Failure(None, f"barrier task {partition} on {conn.info.get('host', '?')} {why}", observed=True)
    return None


def silent_rank(monitor: JobMonitor, limit: float) -> Failure | None:
    """A rank not heard from for ``limit`` seconds while its task is alive: stopped or frozen."""
    if monitor.stalls is None:
        return None
    now = time.monotonic()
    done = monitor.done_ranks()
    with monitor.lock:  # a rank whose task has gone quiet too is on a silent host: silent_task says so
        quiet = {r for p, ranks in monitor.task_ranks.items() for r in ranks
                 if p in monitor.task_conns and now - monitor.task_conns[p].heard > limit / 2}
    for conn in monitor.stalls.connections():
        rank = conn.info.get("rank")
        if (conn.info.get("role") == "rank" and rank not in done and rank not in quiet
                and not conn.info.get("closed") and now - conn.heard > limit):
            return Failure(rank, f"went silent: it has sent nothing for {limit:g} s while its task is alive (the "
                           f"process is stopped, e.g. SIGSTOP, or frozen). {protocol.SILENCE_ENV} sets this bound.",
                           observed=True)
    return None


def late_tasks(monitor: JobMonitor, limit: float) -> Failure | None:
    """Tasks that never reached the driver ``limit`` seconds after others did: a barrier stage
    launches all its tasks at once, so the missing ones cannot reach the driver (their host cut off
    during the start, a firewall) or their executors are stuck."""
    with monitor.lock:
        if not monitor.task_conns or len(monitor.task_conns) >= monitor.num_tasks:
            return None
        first = min(c.info.get("connected", c.heard) for c in monitor.task_conns.values())
        if time.monotonic() - first <= limit:
            return None
        missing = sorted(set(range(monitor.num_tasks)) - set(monitor.task_conns))
        hosts = sorted({str(c.info.get("host", "?")) for c in monitor.task_conns.values()})
    return Failure(None, f"barrier task(s) {', '.join(map(str, missing))} never reached the driver, {limit:g} s "
                   f"after the tasks on {', '.join(hosts)} did: their hosts cannot reach the driver (the network "
                   f"cut during the start, a firewall) or their executors are stuck. {protocol.SILENCE_ENV} sets "
                   "this bound.", observed=True)
