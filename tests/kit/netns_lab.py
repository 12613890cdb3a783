"""Network namespaces for the network-fault tests (tests/test_netns_faults.py): a
``Lab`` of namespaces, each joined to the root namespace by a veth pair, direct
links between pairs of namespaces, and faults put on a namespace's interfaces with
``tc``. Processes run inside a namespace through ``ip netns exec``.

    root namespace (Redis, router, test client)
      | veth 10.A.1.1 <-> 10.A.1.2          | veth 10.A.2.1 <-> 10.A.2.2
    [ns "prefill"] ---- direct link ---- [ns "decode"]      (/32 routes over the link)

The root namespace does not forward, so two namespaces reach each other only over a
direct link; a fault on that link touches prefill <-> decode traffic and nothing else.

Faults (``Fault``), on the ingress of an interface (so packets are lost on the wire,
not refused by the sender's own stack):
  - loss and partition: a classic-BPF ``tc`` filter (cls_bpf, direct action) that
    drops a random share of packets, every packet, or the TCP packets to one port;
  - delay and jitter: ``tc netem`` on the egress, where the kernel has sch_netem
    (``Lab.has_netem``; many VM kernels lack it: use a shaped link there);
  - a bandwidth cap: ``tc tbf`` on the egress (a slow link, to stretch a transfer).
A shaped link (``link(a, b, shaped=True)``, netns_shaper.py) carries packets through
this process instead of a veth, delayed and dropped in userspace: delay where the
kernel has no netem. ``route_over(link)`` sends a pair's traffic over one of its links.

Owns the names (random per ``Lab``, with this process's pid so a later run removes
what a killed run left), the addresses (a 10.A.0.0/16 no route uses), the processes
it started and their cleanup: ``close()`` kills them, closes the shapers and deletes
every veth and namespace.
Must not know what runs inside the namespaces.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

from splitserve.deploy.launcher import Proc
from .netns_shaper import Shaper, open_tun

NS_PREFIX = "splitserve-test-"  # namespaces are named NS_PREFIX<pid>-<tag>-<label>
TC_ACT_OK, TC_ACT_SHOT = 0, 2  # a direct-action classifier's verdicts
SKF_AD_RANDOM = 0xFFFFF000 + 56  # classic BPF ancillary load: a random u32
SKF_AD_PROTOCOL = 0xFFFFF000  # classic BPF ancillary load: skb->protocol
SKF_NET_OFF = 0xFFF00000  # classic BPF loads relative to the network header
ETH_P_IP, IPPROTO_TCP = 0x0800, 6


class Unavailable(Exception):
    """This machine cannot run the lab (not root, no ``ip``/``tc``, no namespaces)."""


def run(*argv: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def _bytecode(prog: list[tuple[int, int, int, int]]) -> str:
    """tc's ``bytecode`` argument: "N,code jt jf k,..."."""
    return ",".join([str(len(prog))] + [f"{c} {jt} {jf} {k}" for c, jt, jf, k in prog])


def drop_share(share: float) -> str:
    """cBPF: drop a random ``share`` (0..1] of packets."""
    if share >= 1.0:
        return _bytecode([(0x06, 0, 0, TC_ACT_SHOT)])
    threshold = int(share * 0xFFFFFFFF)
    return _bytecode([(0x20, 0, 0, SKF_AD_RANDOM),  # A = random u32
                      (0x35, 1, 0, threshold),  # A >= threshold: keep
                      (0x06, 0, 0, TC_ACT_SHOT), (0x06, 0, 0, TC_ACT_OK)])


def drop_tcp_port(port: int) -> str:
    """cBPF: drop IPv4 TCP packets to ``port`` (headers without IP options)."""
    return _bytecode([(0x20, 0, 0, SKF_AD_PROTOCOL), (0x15, 0, 5, ETH_P_IP),  # not IPv4: keep
                      (0x30, 0, 0, SKF_NET_OFF + 9), (0x15, 0, 3, IPPROTO_TCP),  # not TCP: keep
                      (0x28, 0, 0, SKF_NET_OFF + 22), (0x15, 0, 1, port),  # destination port
                      (0x06, 0, 0, TC_ACT_SHOT), (0x06, 0, 0, TC_ACT_OK)])


@dataclass(frozen=True, slots=True)
class Fault:
    """What an interface does to packets; ``Fault()`` is a healthy link."""
    loss: float = 0.0  # share of incoming packets dropped (1.0: a partition)
    drop_port: int | None = None  # drop incoming TCP packets to this port (a one-service partition)
    delay_ms: float = 0.0  # outgoing delay (netem only)
    jitter_ms: float = 0.0
    rate_kbit: int = 0  # outgoing bandwidth cap (tbf; 0: none), a slow link that stretches a transfer

    def __post_init__(self):
        if self.rate_kbit and (self.delay_ms or self.jitter_ms):
            raise ValueError("Fault: rate_kbit and delay are separate root qdiscs; give one")


class Link(NamedTuple):
    """A direct link: ``a_dev`` in namespace ``a`` faces ``b_dev`` in ``b``."""
    a: Netns
    a_dev: str
    b: Netns
    b_dev: str
    shaper: Shaper | None = None  # a shaped link's packet carrier (None: a veth pair)


@dataclass(slots=True)
class Netns:
    name: str
    label: str
    addr: str  # this namespace's address: its services bind it
    gateway: str  # the root namespace's end of its veth (how it reaches Redis)
    veth: str  # its end of the veth to the root namespace
    root_veth: str  # the root namespace's end

    def cmd(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, *argv: str) -> str:
        return run(*self.cmd(*argv))

    def no_rp_filter(self, conf: str) -> None:
        """Accept packets on ``conf`` (an interface, "all", "default") whatever the route back."""
        self.run("sh", "-c", f"echo 0 > /proc/sys/net/ipv4/conf/{conf}/rp_filter")


@dataclass(slots=True)
class Lab:
    tag: str = field(default_factory=lambda: f"{random.getrandbits(24):06x}")
    subnet: int = 0  # the A of 10.A.x.y: picked by open() among those no route uses
    spaces: list[Netns] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    shapers: list[Shaper] = field(default_factory=list)
    links: int = 0
    has_netem: bool = False
    has_tun: bool = False  # /dev/net/tun works: shaped links can be made

    @staticmethod
    def check() -> None:
        """Raise ``Unavailable`` naming what is missing."""
        if os.geteuid() != 0:
            raise Unavailable("needs root (network namespaces, veth, tc)")
        missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
        if missing:
            raise Unavailable(f"{' and '.join(missing)} not installed (iproute2)")

    def open(self) -> Lab:
        """Check the machine, remove namespaces left by dead test runs, probe netem."""
        self.check()
        remove_stale()
        used = {line.split(".")[1] for line in run("ip", "-4", "route").splitlines() if line.startswith("10.")}
        self.subnet = random.choice([a for a in range(64, 251) if str(a) not in used])
        probe = f"{NS_PREFIX}{os.getpid()}-{self.tag}-probe"
        try:
            run("ip", "netns", "add", probe)
        except RuntimeError as e:
            raise Unavailable(f"cannot create a network namespace: {e}") from None
        try:
            run("ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up")
            try:
                run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
                self.has_netem = True
            except RuntimeError:
                self.has_netem = False
            try:
                run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "clsact")
                run("ip", "netns", "exec", probe, "tc", "filter", "add", "dev", "lo", "ingress", "bpf", "da",
                    "bytecode", drop_share(0.5))
            except RuntimeError as e:
                raise Unavailable(f"tc cannot attach a BPF filter (cls_bpf): {e}") from None
        finally:
            run("ip", "netns", "del", probe)
        try:
            os.close(open_tun(f"s{self.tag}probe"))
            self.has_tun = True
        except OSError:
            self.has_tun = False
        return self

    def add(self, label: str) -> Netns:
        """A namespace with loopback up and a veth to the root namespace."""
        i = len(self.spaces) + 1
        ns = Netns(name=f"{NS_PREFIX}{os.getpid()}-{self.tag}-{label}", label=label,
                   addr=f"10.{self.subnet}.{i}.2", gateway=f"10.{self.subnet}.{i}.1", veth=f"s{self.tag}n{i}",
                   root_veth=f"s{self.tag}r{i}")
        root_end = ns.root_veth
        run("ip", "netns", "add", ns.name)
        self.spaces.append(ns)  # deleted by close() from here on
        run("ip", "link", "add", root_end, "type", "veth", "peer", "name", ns.veth, "netns", ns.name)
        run("ip", "addr", "add", f"{ns.gateway}/24", "dev", root_end)
        run("ip", "link", "set", root_end, "up")
        ns.run("ip", "addr", "add", f"{ns.addr}/24", "dev", ns.veth)
        for dev in ("lo", ns.veth):
            ns.run("ip", "link", "set", dev, "up")
        for key in ("all", "default", ns.veth):  # replies over a link arrive on another interface
            ns.no_rp_filter(key)
        return ns

    def link(self, a: Netns, b: Netns, shaped: bool = False) -> Link:
        """A veth straight from ``a`` to ``b`` (``shaped``: two TUN devices and a Shaper);
        each reaches the other's address over the newest link (``route_over`` switches)."""
        self.links += 1
        a_dev, b_dev = f"s{self.tag}a{self.links}", f"s{self.tag}b{self.links}"
        shaper = None
        if shaped:
            if not self.has_tun:
                raise Unavailable("no /dev/net/tun: a shaped link cannot be made")
            fd_a = open_tun(a_dev)
            try:
                fd_b = open_tun(b_dev)
            except OSError:
                os.close(fd_a)
                raise
            shaper = Shaper(fd_a, fd_b, seed=self.links)
            self.shapers.append(shaper)  # closed by close(): the devices go with it
            run("ip", "link", "set", a_dev, "netns", a.name)
            run("ip", "link", "set", b_dev, "netns", b.name)
        else:
            run("ip", "link", "add", a_dev, "netns", a.name, "type", "veth", "peer", "name", b_dev, "netns", b.name)
        for ns, dev in ((a, a_dev), (b, b_dev)):
            ns.run("ip", "link", "set", dev, "up")
            ns.no_rp_filter(dev)
        link = Link(a, a_dev, b, b_dev, shaper)
        self.route_over(link)
        return link

    def route_over(self, link: Link) -> None:
        """From now on the link's two namespaces reach each other over ``link``."""
        for ns, dev, peer in ((link.a, link.a_dev, link.b), (link.b, link.b_dev, link.a)):
            ns.run("ip", "route", "replace", f"{peer.addr}/32", "dev", dev, "src", ns.addr)

    # ---- faults -------------------------------------------------------------------------
    def set_fault(self, ns: Netns, dev: str, fault: Fault) -> None:
        """Replace whatever ``dev`` (in ``ns``) did to packets with ``fault``."""
        if (fault.delay_ms or fault.jitter_ms) and not self.has_netem:
            raise Unavailable("this kernel has no sch_netem (tc netem): delay cannot be simulated")
        subprocess.run(ns.cmd("tc", "qdisc", "del", "dev", dev, "clsact"), capture_output=True, check=False)
        subprocess.run(ns.cmd("tc", "qdisc", "del", "dev", dev, "root"), capture_output=True, check=False)
        if fault.delay_ms or fault.jitter_ms:
            ns.run("tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{fault.delay_ms}ms",
                   f"{fault.jitter_ms}ms", "distribution", "normal")
        if fault.rate_kbit:  # a queue of up to 30 s at the rate: slow, not lossy
            ns.run("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{fault.rate_kbit}kbit",
                   "burst", "16kb", "latency", "30s")
        programs = ([drop_share(fault.loss)] if fault.loss else []) + \
                   ([drop_tcp_port(fault.drop_port)] if fault.drop_port else [])
        if programs:
            ns.run("tc", "qdisc", "add", "dev", dev, "clsact")
            for prog in programs:
                ns.run("tc", "filter", "add", "dev", dev, "ingress", "bpf", "da", "bytecode", prog)

    def set_link_fault(self, link: Link, fault: Fault) -> None:
        """``fault`` on both ends of ``link`` (both directions)."""
        if link.shaper is not None:
            if fault.drop_port or fault.rate_kbit:
                raise ValueError("a shaped link does delay, jitter and loss only")
            link.shaper.set(fault.delay_ms / 1000, fault.jitter_ms / 1000, fault.loss)
            return
        self.set_fault(link.a, link.a_dev, fault)
        self.set_fault(link.b, link.b_dev, fault)

    # ---- processes ----------------------------------------------------------------------
    def spawn(self, ns: Netns | None, name: str, args: list[str], env: dict[str, str]) -> Proc:
        """``python -m splitserve.cli *args`` inside ``ns`` (None: the root namespace),
        its output pumped into ``Proc.log`` (``Proc.ready`` once it printed READY)."""
        cmd = [sys.executable, "-m", "splitserve.cli", *args]
        p = subprocess.Popen(ns.cmd(*cmd) if ns else cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=dict(env, PYTHONUNBUFFERED="1"), start_new_session=True)
        proc = Proc(name, p, args=list(args))
        threading.Thread(target=proc.pump, daemon=True).start()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        """Kill every process started here, then delete every namespace. Idempotent."""
        for p in self.procs:
            if p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.popen.wait()
        self.procs.clear()
        for shaper in self.shapers:
            shaper.close()
        self.shapers.clear()
        for ns in self.spaces:
            # The root end first: a process elsewhere that copied the mount table while the
            # namespace was named can keep it alive after `ip netns del`, but not its veth.
            subprocess.run(["ip", "link", "del", ns.root_veth], capture_output=True, check=False)
            subprocess.run(["ip", "netns", "del", ns.name], capture_output=True, check=False)
        self.spaces.clear()


def remove_stale() -> list[str]:
    """Delete the test namespaces whose creating process is gone; their names."""
    try:
        names = [line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.strip()]
    except RuntimeError:
        return []
    stale = []
    for name in names:
        pid = name.removeprefix(NS_PREFIX).split("-")[0] if name.startswith(NS_PREFIX) else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            stale.append(name)
    return stale
