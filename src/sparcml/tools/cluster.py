"""An emulated cluster on one machine: network namespaces, a bridge, rate-shaped links.

``sparcml cluster -P 8 --rate 1gbit -- python train.py`` (root needed):

1. creates a namespace per host (``<prefix>h<i>``) and one for the switch
   (``<prefix>sw``) holding a Linux bridge;
2. joins each host to the bridge with a veth pair, addresses ``10.213.0.<i+1>/24``
   on the host side (the only addresses it uses, all inside its own namespaces);
3. shapes every link in both directions with ``tc tbf`` at ``rate`` (host egress on
   the host's ``eth0``, host ingress on the switch's port toward it): a
   full-duplex link of ``rate`` per host, as in a cluster with a non-blocking
   switch;
4. runs the command once per rank, ``ranks_per_node`` ranks per host (default
   one): ``RANK`` (host ``h``'s local rank ``l`` is ``h * ranks_per_node + l``),
   ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK=h`` (the
   node rank, as torchrun sets it), ``MASTER_ADDR=10.213.0.1``, ``MASTER_PORT`` and
   ``GLOO_SOCKET_IFNAME=eth0`` set, so ``torch.distributed.init_process_group``
   with the env:// method connects the ranks; output is prefixed ``[rank i]`` and
   also written to ``<log-dir>/rank<i>.log``;
5. when the ranks have exited, reads every link's counters and every host's TCP
   counters before the teardown (:meth:`Cluster.link_counters`): bytes the shaped
   links sent, packets their queues dropped, segments TCP retransmitted and how
   many of those the receivers already had (DSACKs: reordered, not lost); printed
   as one line on stderr and written to ``<log-dir>/links.txt``. A drop or a
   retransmission timeout is the link's doing, not the job's: a reader of the
   job's timings should know;
6. always tears everything down (deleting a namespace deletes its links): after
   success, failure, a timeout, Ctrl-C or SIGTERM.

**Nodes with several ranks** (``sparcml cluster --nodes 2 --ranks-per-node 4``): a
host's ranks share its one shaped NIC, and reach each other over the host
namespace's own addresses (the kernel's loopback path), unshaped: the fast
link inside a node and the slow NIC between nodes of a multi-GPU cluster
(:mod:`sparcml.comm.topology` finds the nodes from ``GROUP_RANK``).

Bandwidth is real (the kernel's token bucket). This kernel has no ``netem``, so
latency and loss are not emulated by the links; where an experiment needs them,
sparcml's own transport adds them (documented per benchmark).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = [
    "Cluster",
    "ClusterError",
    "LinkCounters",
    "LinkShape",
    "cleanup",
    "link_options",
    "link_shape",
    "parse_rate",
    "run_on_cluster",
]

SUBNET = "10.213.0"

_RATE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(bit|kbit|mbit|gbit|tbit)$")
_UNIT = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}

#: The token bucket of a fast link: 256 KB, so that large transfers reach the rate
#: (64 KB throttled 1 Gbit/s here).
BURST = "256kb"
#: Links slower than this are **serialised**. ``tbf`` sends a full bucket at once
#: where a real link serialises every byte, and a bucket refills while the link
#: idles: 256 KB are 21 ms of a 100 Mbit/s link, and a training step's 93 KB crossed
#: it in 0.47 ms after an idle moment (7.42 ms at the rate). A small bucket alone
#: throttles large transfers while the veth's segmentation offloads hand ``tbf``
#: packets of up to 64 KB (a 64 KB bucket: 4 MB in 597 ms against 336 ms at the
#: rate), so a serialised link also turns TSO, GSO and GRO off on both of its ends
#: (``ethtool -K``): MTU-sized packets through a bucket of :data:`SERIAL_BUCKET_S`
#: of the link. Measured with plain TCP at 100 Mbit/s: 93 KB after idle 7.22 ms,
#: 4 MB 362.73 ms (the TCP/IP headers' 4.5% and the acknowledgements over the
#: rate); at 400 Mbit/s and 1 Gbit/s the packets' CPU cost TCP retransmissions on
#: this 2-core machine (4 MB at 1 Gbit/s 46.28 ms against 36.23 with the offloads),
#: so faster links keep :data:`BURST` and the offloads (their 256 KB are 2 ms of
#: 1 Gbit/s). docs/cluster.md, "The token bucket's burst".
SERIALISE_BELOW_BPS = 2.5e8
#: A serialised link's bucket: this much of its time, at least :data:`SMALLEST_BUCKET`.
SERIAL_BUCKET_S = 0.00125
#: tbf drops a packet larger than its bucket: two full Ethernet frames at least.
SMALLEST_BUCKET = 4096
#: The veth offloads a serialised link turns off, on both ends (``ethtool -K``).
OFFLOADS = ("tso", "gso", "gro")


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """How every link of a cluster is shaped: ``tc qdisc add ... tbf`` options, and
    whether both ends of the link turn their segmentation offloads off
    (:data:`OFFLOADS`; a serialised link, :data:`SERIALISE_BELOW_BPS`)."""

    tbf: tuple[str, ...]
    serialised: bool

    def describe(self) -> str:
        """One line for a job's log: the bucket, and serialised or not."""
        burst = self.tbf[self.tbf.index("burst") + 1]
        if self.serialised:
            return f"bucket {burst}, offloads off (serialised: MTU-sized packets at the rate)"
        return f"bucket {burst}, offloads on"


def parse_rate(text: str) -> float:
    """A link rate in tc's syntax (``100mbit``, ``1gbit``, ``2.5gbit``) in bits per second.

    Raises:
        ValueError: anything else (tc's ``bps`` means bytes per second: not accepted,
            to avoid an 8x mistake).
    """
    m = _RATE.match(text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(
            f"not a link rate: {text!r} (a positive number and bit, kbit, mbit, gbit or tbit, "
            "e.g. 100mbit, 1gbit)"
        )
    return float(m.group(1)) * _UNIT[m.group(2)]


def link_options(rate: str) -> LinkShape:
    """:func:`link_shape` of a link of ``rate`` as this process's environment asks:
    ``$SPARCML_CLUSTER_BURST`` (tc's syntax) sets the bucket and keeps the offloads
    (the links of results made before slow links were serialised:
    ``SPARCML_CLUSTER_BURST=256kb``); ``SPARCML_CLUSTER_SERIALISE=1`` (or ``0``)
    turns the offloads off (or keeps them) at any rate. Raises ``ValueError`` for a
    rate or bucket tc would not read."""
    serialise = os.environ.get("SPARCML_CLUSTER_SERIALISE", "")
    if serialise not in ("", "0", "1"):
        raise ValueError(f"SPARCML_CLUSTER_SERIALISE is 0 or 1, got {serialise!r}")
    return link_shape(
        rate,
        os.environ.get("SPARCML_CLUSTER_BURST") or None,
        None if serialise == "" else serialise == "1",
    )


def link_shape(rate: str, burst: str | None = None, serialise: bool | None = None) -> LinkShape:
    """The shape of a link of ``rate``: links slower than
    :data:`SERIALISE_BELOW_BPS` are serialised, unless ``burst`` names a bucket
    (then that bucket, offloads on: an experiment's choice). ``serialise`` (an
    experiment's, ``$SPARCML_CLUSTER_SERIALISE``) turns the offloads off or keeps
    them whatever the rate, with ``burst`` or the rate's bucket.

    Example:
        >>> link_shape("1gbit")
        LinkShape(tbf=('rate', '1gbit', 'burst', '256kb', 'latency', '100ms'), serialised=False)
        >>> link_shape("100mbit")
        LinkShape(tbf=('rate', '100mbit', 'burst', '15625b', 'latency', '100ms'), serialised=True)
        >>> link_shape("100mbit", "256kb").serialised
        False
    """
    bps = parse_rate(rate)
    if burst is not None:
        m = re.match(r"^([0-9]+)(b|kb|mb)?$", burst.strip().lower())
        if not m or int(m.group(1)) == 0:
            raise ValueError(f"not a burst in bytes: {burst!r} (e.g. 256kb, 65536b)")
    slow = bps < SERIALISE_BELOW_BPS
    if serialise is None:
        serialise = slow and burst is None
    if burst is None:
        burst = f"{max(SMALLEST_BUCKET, round(bps / 8 * SERIAL_BUCKET_S))}b" if slow else BURST
    return LinkShape(("rate", rate, "burst", burst, "latency", "100ms"), serialise)


class ClusterError(RuntimeError):
    """Setting up the emulated cluster failed (not root, no ``ip``/``tc``, ...)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(f"`tc {' '.join(args)}` in {ns} failed: {done.stderr.strip()}")


def _offloads_off(ns: str, dev: str) -> None:
    argv = ["ip", "netns", "exec", ns, "ethtool", "-K", dev]
    for feature in OFFLOADS:
        argv += [feature, "off"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(
            f"turning {dev}'s offloads off in {ns} failed ({done.stderr.strip()}): a "
            "serialised link needs them off; SPARCML_CLUSTER_BURST=256kb gives a plain "
            "token bucket (small messages then cross an idle link at once)"
        )


_QDISC = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)")
# a host's TCP counters: /proc/net/snmp ("Tcp:") and /proc/net/netstat ("TcpExt:")
_TCP = {"RetransSegs": "retransmitted", "TCPTimeouts": "timeouts", "TCPDSACKRecv": "dsacks"}


@dataclasses.dataclass
class LinkCounters:
    """What the links and the hosts' TCP stacks did during a job, summed over the
    cluster: bytes and packets the hosts sent (their NICs' shaped queues, ``tc
    tbf``), packets dropped by the queues of both directions of every NIC, TCP
    segments retransmitted, retransmission timeouts, and DSACKs received (a
    retransmitted segment the receiver already had: reordering or a late
    acknowledgement, not a loss)."""

    sent_bytes: int = 0
    sent_packets: int = 0
    dropped: int = 0
    retransmitted: int = 0
    timeouts: int = 0
    dsacks: int = 0

    def add_qdisc(self, text: str, sent: bool = True) -> None:
        """Add the counters of ``tc -s qdisc show dev X``'s output (its drops only
        with ``sent=False``: a queue the bytes already passed once)."""
        for nbytes, packets, dropped, _ in _QDISC.findall(text):
            if sent:
                self.sent_bytes += int(nbytes)
                self.sent_packets += int(packets)
            self.dropped += int(dropped)

    def add_tcp(self, text: str) -> None:
        """Add the TCP counters of a host's ``/proc/net/snmp`` or ``/proc/net/netstat``
        (pairs of lines: the names, then the values, under one prefix)."""
        lines = [line.split() for line in text.splitlines()]
        for names, values in zip(lines[::2], lines[1::2], strict=False):
            if names and names[0] in ("Tcp:", "TcpExt:") and names[0] == values[0]:
                for name, value in zip(names[1:], values[1:], strict=False):
                    if name in _TCP:
                        setattr(self, _TCP[name], getattr(self, _TCP[name]) + int(value))

    def summary(self) -> str:
        return (
            f"hosts sent {self.sent_bytes / 1e9:.3f} GB in {self.sent_packets:,} packets, "
            f"the links dropped {self.dropped:,}; TCP retransmitted "
            f"{self.retransmitted:,} segments ({self.timeouts:,} timeouts, "
            f"{self.dsacks:,} DSACKs: segments the receiver already had)"
        )


def _namespaces() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def cleanup(prefix: str = "spcl") -> list[str]:
    """Delete every namespace whose name starts with ``prefix`` (leftovers of a killed run)."""
    gone = []
    for ns in _namespaces():
        if ns.startswith(prefix):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            gone.append(ns)
    return gone


class Cluster:
    """``hosts`` namespaces on a bridge with links shaped to ``rate`` (tc syntax: 1gbit).

    Use as a context manager; :meth:`down` is idempotent.
    """

    def __init__(self, hosts: int, rate: str = "1gbit", prefix: str | None = None) -> None:
        if hosts < 1 or hosts > 250:
            raise ValueError(f"hosts must be in [1, 250], got {hosts}")
        if os.geteuid() != 0:
            raise ClusterError("sparcml cluster needs root (network namespaces and tc)")
        self.hosts = hosts
        self.rate = rate
        self.shape = link_options(rate)
        if self.shape.serialised and shutil.which("ethtool") is None:
            raise ClusterError(
                f"a link of {rate} is serialised (slower than "
                f"{SERIALISE_BELOW_BPS / 1e6:g} Mbit/s: segmentation offloads off), "
                "which needs ethtool: install it (apt install ethtool), or set "
                "SPARCML_CLUSTER_BURST=256kb for a plain token bucket (small messages "
                "then cross an idle link at once)"
            )
        self.prefix = prefix or f"spcl{os.getpid() % 100000}"
        self.created: list[str] = []

    def host(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def up(self) -> Cluster:
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        self.created.append(sw)
        _ip("-n", sw, "link", "add", "name", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i in range(self.hosts):
            h = self.host(i)
            _ip("netns", "add", h)
            self.created.append(h)
            _ip("-n", h, "link", "set", "lo", "up")
            _ip(
                "-n",
                h,
                "link",
                "add",
                "name",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                f"p{i}",
                "netns",
                sw,
            )
            _ip("-n", h, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", h, "link", "set", "eth0", "up")
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", sw, "link", "set", f"p{i}", "up")
            for ns, dev in ((h, "eth0"), (sw, f"p{i}")):
                if self.shape.serialised:
                    _offloads_off(ns, dev)
                _tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", *self.shape.tbf)

    def link_counters(self) -> LinkCounters:
        """The counters of every shaped link and every host's TCP stack so far (a
        namespace's counters start at zero with it)."""
        out = LinkCounters()

        def read(ns: str, *argv: str) -> str:
            run = ["ip", "netns", "exec", ns, *argv]
            return subprocess.run(run, capture_output=True, text=True).stdout

        for i in range(self.hosts):
            out.add_qdisc(read(self.host(i), "tc", "-s", "qdisc", "show", "dev", "eth0"))
            # the switch's port toward the host: the same bytes again, its own drops
            out.add_qdisc(read(self.switch, "tc", "-s", "qdisc", "show", "dev", f"p{i}"), False)
            out.add_tcp(read(self.host(i), "cat", "/proc/net/snmp", "/proc/net/netstat"))
        return out

    def down(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def popen(self, i: int, argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            ["ip", "netns", "exec", self.host(i), "env", *(f"{k}={v}" for k, v in env.items()),
             *argv],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so teardown runs in both cases."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_on_cluster(
    hosts: int,
    argv: Sequence[str],
    rate: str = "1gbit",
    port: int = 29500,
    timeout: float | None = None,
    log_dir: str | Path | None = None,
    echo: bool = True,
    ranks_per_node: int = 1,
) -> int:
    """Run ``argv`` ``ranks_per_node`` times per host of a fresh emulated cluster (one
    process per rank); returns the worst exit code.

    Every rank's output is echoed with a ``[rank i]`` prefix and kept in
    ``log_dir/rank<i>.log``. On a failing rank the others are stopped; a timeout
    stops all (exit code 124). The links' and TCP's counters of the whole job
    (:class:`LinkCounters`) go to stderr (with ``echo``) and ``log_dir/links.txt``.
    The cluster is always torn down.
    """
    if not argv:
        raise ValueError("give the command to run on every host (after --)")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
    world = hosts * ranks_per_node
    logs = Path(log_dir) if log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    with _signals_raise(), Cluster(hosts, rate) as cluster:
        base = {
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": cluster.address(0),
            "MASTER_PORT": str(port),
            "LOCAL_WORLD_SIZE": str(ranks_per_node),
            "GLOO_SOCKET_IFNAME": "eth0",
            "SPARCML_CLUSTER_RATE": rate,
            "SPARCML_CLUSTER_LINK": cluster.shape.describe(),
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            "HOME": os.environ.get("HOME", "/root"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        for key in ("SPARCML_CALIBRATION", "SPARCML_DATA", "THP_MEM_ALLOC_ENABLE",
                    "SPARCML_RANKS_PER_NODE", "SPARCML_AUTO", "SPARCML_MALLOC",
                    "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                    "GLIBC_TUNABLES"):  # fmt: skip
            if key in os.environ:
                base[key] = os.environ[key]
        procs = []
        for i in range(world):
            host, local = divmod(i, ranks_per_node)
            env = {**base, "RANK": str(i), "LOCAL_RANK": str(local), "GROUP_RANK": str(host),
                   "SPARCML_HOST_ADDR": cluster.address(host)}  # fmt: skip
            procs.append(cluster.popen(host, argv, env))
        files = [open(logs / f"rank{i}.log", "wb") if logs else None for i in range(world)]  # noqa: SIM115
        sel = selectors.DefaultSelector()
        for i, p in enumerate(procs):
            assert p.stdout is not None
            os.set_blocking(p.stdout.fileno(), False)
            sel.register(p.stdout, selectors.EVENT_READ, i)
        deadline = time.monotonic() + timeout if timeout else None
        pending = [b""] * world
        code = 0
        try:
            open_streams = world
            while open_streams:
                if deadline and time.monotonic() > deadline:
                    code = 124
                    print(f"sparcml cluster: timed out after {timeout:g}s", file=sys.stderr)
                    break
                for key, _ in sel.select(timeout=0.2):
                    i = key.data
                    chunk = key.fileobj.read(65536)  # type: ignore[union-attr]
                    if not chunk:
                        sel.unregister(key.fileobj)
                        open_streams -= 1
                        continue
                    if files[i]:
                        files[i].write(chunk)  # type: ignore[union-attr]
                    pending[i] += chunk
                    *lines, pending[i] = pending[i].split(b"\n")
                    if echo:
                        for line in lines:
                            print(f"[rank {i}] {line.decode(errors='replace')}", flush=True)
                failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
                if failed and code == 0:
                    code = failed[0]
                    # a failed rank leaves the others waiting: give them a moment, then stop
                    grace = time.monotonic() + 10
                    while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                        time.sleep(0.1)
                    break
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            for f in files:
                if f:
                    f.close()
        if echo:
            for i, rest in enumerate(pending):
                if rest:
                    print(f"[rank {i}] {rest.decode(errors='replace')}", flush=True)
        counters = cluster.link_counters()
        links = f"{rate} links, {cluster.shape.describe()}; {counters.summary()}"
        if echo:
            print(f"sparcml cluster: {links}", file=sys.stderr, flush=True)
        if logs:
            (logs / "links.txt").write_text(links + "\n")
        codes = [p.returncode for p in procs]
        if code == 0:
            code = next((c for c in codes if c), 0)
        return code
