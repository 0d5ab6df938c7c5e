"""A Spark standalone cluster of several hosts on one machine: each worker in a network namespace of
its own, with its own address and a link shaped with ``tc``; the driver and the master in this one.

Rehearse a multi-host job on a laptop (root, ``ip`` and ``tc`` from iproute2, Java 17)::

    sudo python -m spark_dl.testing.cluster up --workers 3 --rate-mbit 1000 --delay-ms 1
    # prints the master URL and the session settings; then, e.g.
    #   spark-submit --master spark://10.213.77.1:7077 --conf spark.driver.host=10.213.77.1 train.py
    sudo python -m spark_dl.testing.cluster down --dir /tmp/spark-dl-cluster-XXXX

or from Python, torn down when the block ends::

    with cluster.up(workers=2, rate_mbit=1000) as c:
        spark = c.session()
        HorovodRunner(np=2).run(main)

Each worker also has a second interface listed before its own (``dcy0``, 10.214.N.0/24, reaching
nothing), and its host name resolves to 127.0.1.1 there, as Debian's and Ubuntu's ``/etc/hosts`` make
it: the case where a launcher that trusts the hostname advertises loopback to other hosts. The
cluster's addresses have names in every worker's ``/etc/hosts``, so reverse lookups answer at once.
Every process it starts is recorded by pid (``state.json`` in its log folder) and ended by
``down``; every worker's and the master's log is in that folder. The addresses are private
(10.213.N.0/24) and live only on the bridge this module creates. Links are shaped in both
directions (``netem`` for delay and loss under a ``tbf`` token bucket for the rate), and can be cut,
restored or reshaped while a job runs (:meth:`Cluster.cut`, :meth:`Cluster.restore`).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

START_TIMEOUT_S = 120.0


class ClusterUnavailable(RuntimeError):
    """Why the cluster cannot be made on this machine (not root, no ``ip``/``tc``, no Java)."""


@dataclass
class Worker:
    index: int
    namespace: str
    address: str
    host_device: str  # the veth end on the bridge, in this namespace
    pid: int = 0


@dataclass
class Cluster:
    tag: str
    subnet: int  # the third octet of 10.213.N.0/24
    bridge: str
    driver_host: str  # this namespace's address on the bridge: the master's and the driver's
    master_port: int
    log_dir: str
    rate_mbit: float | None = None
    delay_ms: float | None = None
    loss_pct: float | None = None
    master_pid: int = 0
    workers: list[Worker] = field(default_factory=list)
    cores: int = 1
    memory_mb: int = 1024

    @property
    def master_url(self) -> str:
        return f"spark://{self.driver_host}:{self.master_port}"

    def conf(self) -> dict[str, str]:
        """What a driver in this namespace sets to run on the cluster."""
        return {
            "spark.master": self.master_url,
            "spark.driver.host": self.driver_host,
            "spark.driver.bindAddress": self.driver_host,
            "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
            "spark.pyspark.python": sys.executable,
        }

    def session(self, **conf: str) -> Any:
        """A SparkSession on this cluster (``conf`` on top of :meth:`conf`)."""
        from pyspark.sql import SparkSession

        # PySpark sends the Python functions with the interpreter named here, not by spark.pyspark.python
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = SparkSession.builder.appName(f"spark-dl-cluster-{self.tag}")
        for k, v in {**self.conf(), **conf}.items():
            builder = builder.config(k, v)
        return builder.getOrCreate()

    # -- faults --------------------------------------------------------------------------------
    def cut(self, worker: int) -> None:
        """Take worker ``worker``'s link down (both ends): its host goes silent, its processes live."""
        w = self.workers[worker]
        _sh("ip", "link", "set", w.host_device, "down")
        _sh("ip", "-n", w.namespace, "link", "set", "eth0", "down")

    def restore(self, worker: int) -> None:
        """Bring a cut link back up, shaped as before."""
        w = self.workers[worker]
        _sh("ip", "link", "set", w.host_device, "up")
        _sh("ip", "-n", w.namespace, "link", "set", "eth0", "up")
        _sh("ip", "-n", w.namespace, "route", "replace", "default", "via", self.driver_host)

    def shape(self, worker: int, rate_mbit: float | None = None, delay_ms: float | None = None,
              loss_pct: float | None = None) -> None:
        """Reshape one worker's link (both directions)."""
        w = self.workers[worker]
        _shape(w.host_device, None, rate_mbit, delay_ms, loss_pct)
        _shape("eth0", w.namespace, rate_mbit, delay_ms, loss_pct)

    def kill_worker(self, worker: int) -> list[int]:
        """SIGKILL every process of worker ``worker``'s host (its Worker and executor JVMs, the Python
        workers, the ranks): a host that died. Returns the pids killed."""
        pids = namespace_pids(self.workers[worker].namespace)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def start_worker(self, worker: int) -> None:
        """Start worker ``worker``'s Worker daemon again (after :meth:`kill_worker`: a host back from
        the dead) and wait until it has registered with the master."""
        w = self.workers[worker]
        log = os.path.join(self.log_dir, f"worker{w.index}.log")
        with contextlib.suppress(FileNotFoundError):
            os.replace(log, f"{log}.{int(time.time())}")  # registration is read from the new log
        _start_worker(self, w)
        self.save()
        _wait_for_workers(self, [worker])

    def save(self) -> None:
        with open(os.path.join(self.log_dir, "state.json"), "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, log_dir: str) -> Cluster:
        with open(os.path.join(log_dir, "state.json")) as f:
            state = json.load(f)
        state["workers"] = [Worker(**w) for w in state["workers"]]
        return cls(**state)

    def down(self) -> None:
        """End every process this cluster started (and whatever else runs in its namespaces), then
        remove the namespaces and the bridge. Safe to call twice."""
        for w in self.workers:
            for pid in namespace_pids(w.namespace):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.master_pid:
            _kill_group(self.master_pid)
        for w in self.workers:
            if w.pid:
                _kill_group(w.pid)
            # the host end first: a namespace's devices go only once the kernel has freed it, later
            subprocess.run(["ip", "link", "del", w.host_device], capture_output=True)
            subprocess.run(["ip", "netns", "del", w.namespace], capture_output=True)
            shutil.rmtree(f"/etc/netns/{w.namespace}", ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def check_can_run() -> None:
    """Raise :class:`ClusterUnavailable` saying why a cluster cannot be made here."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("needs root: network namespaces and tc (run with sudo, or as root in CI)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"`{tool}` is missing: install iproute2 (apt-get install iproute2)")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise ClusterUnavailable("no Java: Spark 4 needs Java 17 (apt-get install openjdk-17-jre-headless)")


@contextlib.contextmanager
def running(workers: int = 2, **kwargs: Any) -> Iterator[Cluster]:
    """:func:`up`, then :meth:`Cluster.down` when the block ends, however it ends."""
    c = up(workers, **kwargs)
    try:
        yield c
    finally:
        c.down()


_CLUSTERS = itertools.count()
FIRST_SUBNET, SUBNETS = 100, 150  # clusters take 10.213.100.0/24 to 10.213.249.0/24


def subnets_in_use() -> dict[int, str]:
    """The third octets of the 10.213.N.0/24 subnets an interface here already holds, with the
    interface: a cluster whose owner was killed before ``down()`` leaves its bridge and address."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    used = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[2] == "inet" and fields[3].startswith("10.213."):
            used[int(fields[3].split(".")[2])] = fields[1]
    return used


def _free_subnet(asked: int | None, start: int) -> int:
    """``asked`` if no interface holds it, else the first free one from ``start`` on."""
    used = subnets_in_use()
    if asked is not None:
        if asked in used:
            raise ClusterUnavailable(f"10.213.{asked}.0/24 is already on interface {used[asked]} (a cluster left "
                                     f"behind?): remove it with `ip link del {used[asked]}` or pass another subnet")
        return asked
    for k in range(SUBNETS):
        subnet = FIRST_SUBNET + (start + k) % SUBNETS
        if subnet not in used:
            return subnet
    last = FIRST_SUBNET + SUBNETS - 1
    raise ClusterUnavailable(f"every subnet from 10.213.{FIRST_SUBNET}.0/24 to 10.213.{last}.0/24 is on an interface "
                             "here (clusters left behind?): remove the stale sdlbr* bridges with `ip link del`")


def up(workers: int = 2, *, cores: int = 1, memory_mb: int = 1024, rate_mbit: float | None = None,
       delay_ms: float | None = None, loss_pct: float | None = None, log_dir: str | None = None,
       subnet: int | None = None) -> Cluster:
    """Start a master here and ``workers`` workers, each in its own namespace; wait until every
    worker has registered. Raises :class:`ClusterUnavailable` where it cannot run."""
    check_can_run()
    if not 1 <= workers <= 200:
        raise ValueError(f"workers must be from 1 to 200, got {workers}")
    # unique per cluster: a process may bring up several in turn (a benchmark, one per link)
    n = next(_CLUSTERS)
    tag = f"{os.getpid() % 100000}{n % 10}"
    subnet = _free_subnet(subnet, (os.getpid() + n) % SUBNETS)
    log_dir = log_dir or tempfile.mkdtemp(prefix="spark-dl-cluster-")
    os.makedirs(log_dir, exist_ok=True)
    c = Cluster(tag=tag, subnet=subnet, bridge=f"sdlbr{tag}", driver_host=f"10.213.{subnet}.1",
                master_port=_free_port(), log_dir=log_dir, rate_mbit=rate_mbit, delay_ms=delay_ms,
                loss_pct=loss_pct, cores=cores, memory_mb=memory_mb)
    try:
        _make_network(c, workers)
        c.save()
        c.master_pid = _spark_daemon(
            ["org.apache.spark.deploy.master.Master", "--host", c.driver_host, "--port", str(c.master_port),
             "--webui-port", "0"], os.path.join(log_dir, "master.log"))
        c.save()
        _wait_for_port(c.driver_host, c.master_port, os.path.join(log_dir, "master.log"))
        for w in c.workers:
            _start_worker(c, w)
            c.save()
        _wait_for_workers(c)
        return c
    except BaseException:
        c.down()
        raise


def _start_worker(c: Cluster, w: Worker) -> None:
    w.pid = _spark_daemon(
        ["org.apache.spark.deploy.worker.Worker", "--host", w.address, "--cores", str(c.cores),
         "--memory", f"{c.memory_mb}m", "--webui-port", "0", "--work-dir", os.path.join(c.log_dir, f"work{w.index}"),
         c.master_url], os.path.join(c.log_dir, f"worker{w.index}.log"), namespace=w.namespace)


def _make_network(c: Cluster, workers: int) -> None:
    try:
        _sh("ip", "link", "add", c.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{c.driver_host}/24", "dev", c.bridge)
        _sh("ip", "link", "set", c.bridge, "up")
        for i in range(workers):
            w = Worker(i, f"sdlw{c.tag}-{i}", f"10.213.{c.subnet}.{10 + i}", f"sdl{c.tag}w{i}")
            c.workers.append(w)
            _sh("ip", "netns", "add", w.namespace)
            # a second interface, first in the list and reaching nothing: what a machine with a
            # management or container network has; the ranks must not pick it
            _sh("ip", "-n", w.namespace, "link", "add", "dcy0", "type", "veth", "peer", "name", "dcy1")
            _sh("ip", "-n", w.namespace, "addr", "add", f"10.214.{c.subnet}.{10 + i}/24", "dev", "dcy0")
            _sh("ip", "-n", w.namespace, "link", "set", "dcy0", "up")
            _sh("ip", "link", "add", w.host_device, "type", "veth", "peer", "name", f"sdl{c.tag}p{i}")
            _sh("ip", "link", "set", f"sdl{c.tag}p{i}", "netns", w.namespace)
            _sh("ip", "-n", w.namespace, "link", "set", f"sdl{c.tag}p{i}", "name", "eth0")
            _sh("ip", "-n", w.namespace, "addr", "add", f"{w.address}/24", "dev", "eth0")
            _sh("ip", "-n", w.namespace, "link", "set", "lo", "up")
            _sh("ip", "-n", w.namespace, "link", "set", "eth0", "up")
            _sh("ip", "-n", w.namespace, "route", "add", "default", "via", c.driver_host)
            _sh("ip", "link", "set", w.host_device, "master", c.bridge)
            _sh("ip", "link", "set", w.host_device, "up")
            c.shape(i, c.rate_mbit, c.delay_ms, c.loss_pct)
        _write_hosts(c)
    except subprocess.CalledProcessError as e:
        raise ClusterUnavailable(f"cannot build the cluster's network: {' '.join(e.cmd)}: {e.stderr.strip()}") from None


def _write_hosts(c: Cluster) -> None:
    """Each worker's name service, as a cluster's DNS gives it (``ip netns exec`` puts the files in
    /etc/netns/NS over those in /etc): its hostname resolves to a loopback address, as Debian's and
    Ubuntu's /etc/hosts make it; every address of the cluster has a name, in its IPv4 and its
    IPv4-mapped IPv6 form (how a dual-stack server sees a client); and any other lookup is refused
    at once. Without them a lookup went to this machine's DNS server, which the namespaces cannot
    reach, and waited 10 s: torch's c10d looks up the peer's name on every store connection
    (pytorch#159007), so each rendezvous took 10-20 s longer."""
    names = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{socket.gethostname()}"]
    for address, name in [(c.driver_host, f"sdl{c.tag}-driver")] + [(w.address, w.namespace) for w in c.workers]:
        names += [f"{address}\t{name}", f"::ffff:{address}\t{name}"]
    for w in c.workers:
        os.makedirs(f"/etc/netns/{w.namespace}", exist_ok=True)
        with open(f"/etc/netns/{w.namespace}/hosts", "w") as f:
            f.write("\n".join(names) + "\n")
        with open(f"/etc/netns/{w.namespace}/resolv.conf", "w") as f:
            f.write("nameserver 127.0.0.1\n")  # nothing listens there: a lookup fails at once


def _shape(device: str, namespace: str | None, rate_mbit: float | None, delay_ms: float | None,
           loss_pct: float | None) -> None:
    tc = ["tc", "-n", namespace] if namespace else ["tc"]
    subprocess.run([*tc, "qdisc", "del", "dev", device, "root"], capture_output=True)
    parent = ["root"]
    if delay_ms or loss_pct:
        netem = ["delay", f"{delay_ms or 0}ms"] + (["loss", f"{loss_pct}%"] if loss_pct else [])
        try:
            _sh(*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "netem", *netem, "limit", "100000")
        except subprocess.CalledProcessError as e:
            if "unknown" in (e.stderr or ""):
                raise ClusterUnavailable("this kernel has no netem qdisc (module sch_netem): a link's delay and "
                                         "loss cannot be shaped here, its rate can (leave out delay_ms and "
                                         "loss_pct); spark_dl.testing.lossy.lossy(cluster, worker, pct) loses "
                                         "packets in user space instead") from None
            raise
        parent = ["parent", "1:"]
    if rate_mbit:
        # the burst covers one timer tick at the rate
        _sh(*tc, "qdisc", "add", "dev", device, *parent, "handle", "2:", "tbf", "rate", f"{rate_mbit}mbit",
            "burst", "1mb", "latency", "100ms")


def _spark_daemon(args: list[str], log: str, namespace: str | None = None) -> int:
    """Start ``spark-class ARGS`` in the background (a process group of its own); its pid."""
    import pyspark

    home = os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)
    cmd = [os.path.join(home, "bin", "spark-class"), *args]
    if namespace:
        cmd = ["ip", "netns", "exec", namespace, *cmd]
    env = {**os.environ, "SPARK_HOME": home, "PYSPARK_PYTHON": sys.executable, "SPARK_NO_DAEMONIZE": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc.pid


def _wait_for_port(host: str, port: int, log: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.2)
    raise ClusterUnavailable(f"the Spark master did not listen on {host}:{port} within {START_TIMEOUT_S:.0f} s "
                             f"(see {log})")


def _wait_for_workers(c: Cluster, which: list[int] | None = None) -> None:
    """Until every worker's log (or those of ``which``) says it registered with the master."""
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(range(len(c.workers)) if which is None else which)
    while pending and time.monotonic() < deadline:
        for i in list(pending):
            with contextlib.suppress(OSError), open(os.path.join(c.log_dir, f"worker{i}.log"), errors="replace") as f:
                if "Successfully registered with master" in f.read():
                    pending.discard(i)
        time.sleep(0.2)
    if pending:
        raise ClusterUnavailable(f"workers {sorted(pending)} did not register with the master within "
                                 f"{START_TIMEOUT_S:.0f} s (see {c.log_dir})")


def namespace_pids(namespace: str) -> list[int]:
    """The pids of the processes running in network namespace ``namespace``."""
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _free_port() -> int:
    from spark_dl.task.ports import free_port

    return free_port()


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spark_dl.testing.cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="start a master here and N workers, each in its own network namespace")
    start.add_argument("--workers", type=int, default=2)
    start.add_argument("--cores", type=int, default=1, help="task slots per worker")
    start.add_argument("--memory-mb", type=int, default=1024, help="memory each worker offers its executors")
    start.add_argument("--rate-mbit", type=float, help="each worker's link rate, both directions")
    start.add_argument("--delay-ms", type=float, help="added one-way delay on each worker's link")
    start.add_argument("--loss-pct", type=float, help="packet loss on each worker's link")
    start.add_argument("--dir", help="the log folder (default: a new temporary one)")
    stop = sub.add_parser("down", help="end every process a cluster started and remove its network")
    stop.add_argument("--dir", required=True, help="the log folder `up` printed")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            c = up(args.workers, cores=args.cores, memory_mb=args.memory_mb, rate_mbit=args.rate_mbit,
                   delay_ms=args.delay_ms, loss_pct=args.loss_pct, log_dir=args.dir)
            print(f"master: {c.master_url}")
            for w in c.workers:
                print(f"worker {w.index}: {w.address} (namespace {w.namespace})")
            print("session settings: "
                  + " ".join(f"--conf {k}={v}" for k, v in c.conf().items() if k != "spark.master"))
            print(f"logs: {c.log_dir}")
            print(f"tear down: python -m spark_dl.testing.cluster down --dir {c.log_dir}")
        else:
            Cluster.load(args.dir).down()
            print(f"down: {args.dir}")
    except ClusterUnavailable as e:
        print(f"spark-dl cluster: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
