"""A throwaway bandwidth-limited LAN made of Linux network namespaces (needs root).

Layout, for ``n`` ranks and a name prefix ``obb<pid>``::

    netns obb<pid>-r0  eth0 10.213.0.1/24 --veth--+
    netns obb<pid>-r1  eth0 10.213.0.2/24 --veth--+-- br0 in netns obb<pid>-sw
    ...                                           |
    netns obb<pid>-r3  eth0 10.213.0.4/24 --veth--+

Every veth end carries a ``tbf`` qdisc at the link rate, so each rank has a
full-duplex port of that rate into an ideal switch (the bridge), like a small
Ethernet cluster. The switch lives in its own namespace and no end of any veth is
in the host's namespace, so nothing here touches the host's network, and
deleting the namespaces deletes every interface.

With ``ranks_per_node=k`` (the hierarchical case) each namespace is a *node*
holding k ranks: ``netns obb<pid>-r<node>``, one veth (the node's only, shaped
link to the switch), ranks ``node*k ... node*k+k-1`` all run inside it and share
its address. Their gloo sockets listen on that address (the hosts trick below),
so a connection between two ranks of one node targets the node's own address:
the kernel routes local addresses through ``lo`` (the "local" routing table),
never through eth0. Intra-node traffic therefore stays inside the namespace,
unshaped, and only inter-node traffic crosses the veth, whose counters (eth0
inside the node, p<node> on the switch) then count exactly the inter-node bytes.

Why a per-namespace ``/etc/hosts``: gloo (JAX's CPU collectives) listens on the
address that the machine's hostname resolves to. All namespaces share the
hostname, which resolves to 127.0.0.1, so peers in other namespaces get
"Connection refused". ``ip netns exec NS`` bind-mounts ``/etc/netns/NS/hosts``
over ``/etc/hosts`` for the command it runs; mapping the hostname to the rank's
own address there makes gloo bind and advertise the right address, with no
change to JAX or its private API.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

BASE = "obb"  # every name this module creates starts with BASE + a pid.
SUBNET = "10.213.0"
ETC_NETNS = Path("/etc/netns")
_NAME_RE = re.compile(rf"^{BASE}(\d+)-(sw|r\d+)$")


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, check=check, capture_output=True, text=True)


def unavailable_reason() -> str | None:
  """Why namespaces cannot be used here (None when they can)."""
  if os.geteuid() != 0:
    return "not running as root"
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return f"`{tool}` (iproute2) is not installed"
  probe = f"{BASE}{os.getpid()}-probe"
  try:
    _run(["ip", "netns", "add", probe])
  except (subprocess.CalledProcessError, OSError) as e:
    return f"`ip netns add` failed: {getattr(e, 'stderr', e)}".strip()
  _run(["ip", "netns", "del", probe], check=False)
  return None


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def cleanup_stale() -> list[str]:
  """Deletes namespaces and /etc/netns entries left by runs whose process is gone."""
  removed = []
  listing = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
  names = {line.split()[0] for line in listing if line.strip()}
  if ETC_NETNS.is_dir():
    names |= {p.name for p in ETC_NETNS.iterdir()}
  for name in sorted(names):
    m = _NAME_RE.match(name) or re.match(rf"^{BASE}(\d+)-probe$", name)
    if not m or _pid_alive(int(m.group(1))):
      continue
    _run(["ip", "netns", "del", name], check=False)
    shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    removed.append(name)
  _remove_empty_etc_netns()
  return removed


def _remove_empty_etc_netns():
  try:
    ETC_NETNS.rmdir()  # only succeeds when empty, i.e. nobody else uses it.
  except OSError:
    pass


class Cluster:
  """Namespaces on one bridge with ``rate``-limited links; a context manager.

  ``num_ranks / ranks_per_node`` namespaces ("nodes"); rank r runs in node
  ``r // ranks_per_node``. With the default ``ranks_per_node=1`` every rank has
  its own namespace and link.
  """

  def __init__(self, num_ranks: int, rate: str, ranks_per_node: int = 1):
    if num_ranks % ranks_per_node:
      raise ValueError(f"{num_ranks} ranks do not split into nodes of {ranks_per_node}")
    self.num_ranks = num_ranks
    self.ranks_per_node = ranks_per_node
    self.num_nodes = num_ranks // ranks_per_node
    self.rate = rate
    self.prefix = f"{BASE}{os.getpid()}"
    self.switch = f"{self.prefix}-sw"
    self.namespaces = [f"{self.prefix}-r{k}" for k in range(self.num_nodes)]
    self._created: list[str] = []

  def node_of(self, rank: int) -> int:
    return rank // self.ranks_per_node

  def node_address(self, node: int) -> str:
    return f"{SUBNET}.{node + 1}"

  def node_exec_prefix(self, node: int) -> list[str]:
    return ["ip", "netns", "exec", self.namespaces[node]]

  def address(self, rank: int) -> str:
    return self.node_address(self.node_of(rank))

  def exec_prefix(self, rank: int) -> list[str]:
    return self.node_exec_prefix(self.node_of(rank))

  def __enter__(self) -> "Cluster":
    try:
      self._build()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc):
    self.close()

  def _add_netns(self, name: str):
    _run(["ip", "netns", "add", name])
    self._created.append(name)

  def _build(self):
    hostname = socket.gethostname()
    self._add_netns(self.switch)
    sw = ["ip", "-n", self.switch]
    _run(sw + ["link", "add", "br0", "type", "bridge"])
    _run(sw + ["link", "set", "br0", "up"])
    for node, ns in enumerate(self.namespaces):
      self._add_netns(ns)
      port = f"p{node}"
      # Both ends are created directly inside their namespaces: no interface
      # ever appears in the host namespace.
      _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth",
            "peer", "name", port, "netns", self.switch])
      rk = ["ip", "-n", ns]
      _run(rk + ["addr", "add", f"{self.node_address(node)}/24", "dev", "eth0"])
      _run(rk + ["link", "set", "eth0", "up"])
      _run(rk + ["link", "set", "lo", "up"])
      _run(sw + ["link", "set", port, "master", "br0"])
      _run(sw + ["link", "set", port, "up"])
      # tbf on both ends: rank -> switch and switch -> rank are each limited, as
      # on a full-duplex port. The burst must cover rate * timer granularity.
      for netns, dev in ((ns, "eth0"), (self.switch, port)):
        _run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "tbf",
              "rate", self.rate, "burst", _burst(self.rate), "latency", "50ms"])
      etc = ETC_NETNS / ns
      etc.mkdir(parents=True, exist_ok=True)
      (etc / "hosts").write_text(
          f"127.0.0.1 localhost\n{self.node_address(node)} {hostname}\n")

  def close(self):
    for name in reversed(self._created):
      _run(["ip", "netns", "del", name], check=False)
      shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    self._created.clear()
    _remove_empty_etc_netns()

  def tx_bytes(self, rank: int) -> int:
    """Bytes the eth0 of rank's node has sent (kernel counter)."""
    out = _run(self.exec_prefix(rank) + ["cat", "/sys/class/net/eth0/statistics/tx_bytes"])
    return int(out.stdout)

  def link_counters(self) -> dict:
    """Kernel byte counters of every node's link, read on both ends of its veth."""
    out = {}
    for node in range(self.num_nodes):
      eth = [int(_run(self.node_exec_prefix(node) + [
          "cat", f"/sys/class/net/eth0/statistics/{c}"]).stdout) for c in ("tx_bytes", "rx_bytes")]
      port = [int(_run(["ip", "netns", "exec", self.switch, "cat",
                        f"/sys/class/net/p{node}/statistics/{c}"]).stdout)
              for c in ("tx_bytes", "rx_bytes")]
      out[node] = {"eth0_tx": eth[0], "eth0_rx": eth[1], "port_tx": port[0], "port_rx": port[1]}
    return out


def _burst(rate: str) -> str:
  """tbf bucket size: ~2 ms worth of bytes at the rate, at least 64 KiB."""
  bits = _rate_bits(rate)
  return str(max(64 * 1024, int(bits / 8 * 2e-3)))


def _rate_bits(rate: str) -> float:
  m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
  if not m:
    raise ValueError(f"rate must look like 100mbit, 1gbit, 10gbit; got {rate!r}")
  return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def measure_bandwidth(cluster: Cluster, python: str, nbytes: int = 100 * 2**20,
                      timeout: float = 120.0, nodes: tuple[int, int] = (0, 1)) -> dict:
  """TCP goodput (bytes/s) and small-message round-trip time from node a to node b.

  ``nodes=(k, k)`` measures the path between two ranks of one node (its loopback).
  """
  script = Path(__file__).with_name("_comm_worker.py")
  a, b = nodes
  server = subprocess.Popen(
      cluster.node_exec_prefix(b) + [python, str(script), "tcp-server", str(nbytes)],
      stdout=subprocess.PIPE, text=True)
  try:
    time.sleep(0.5)
    client = _run(cluster.node_exec_prefix(a) + [
        python, str(script), "tcp-client", str(nbytes), cluster.node_address(b)])
    out, _ = server.communicate(timeout=timeout)
  finally:
    if server.poll() is None:
      server.kill()
  return parse_probe(client.stdout + out)


def parse_probe(text: str) -> dict:
  """The ``key=value`` lines the TCP probe (``_comm_worker.py tcp-*``) prints, as floats."""
  result = {}
  for line in text.split("\n"):
    if "=" in line:
      k, v = line.split("=", 1)
      result[k.strip()] = float(v)
  return result
