"""A network-namespace lab for multi-host tests: N "machines" on one Ethernet segment.

Layout (all names carry the prefix ``csa-<pid>-`` so parallel runs and other suites never clash)::

    csa-<pid>-sw<L>           a switch namespace holding bridge br0 (multicast snooping off)
      ├── p0 ══ veth ══ eth0  in csa-<pid>-<k>     10.77.X.1/24, lo up, route 224.0.0.0/4
      ├── p1 ══ veth ══ eth0  in csa-<pid>-<k+1>   10.77.X.2/24
      └── …

The bridge lives in its own namespace, so the host's firewall (br_netfilter, docker rules)
never sees the traffic and nothing but these namespaces can reach it. X is derived from the
pid and a lab counter. Interfaces inside are named ``eth0`` (address selection skips names
like ``veth*`` as virtual).

Use from tests through the ``netns_lab`` fixture (tests/multihost/conftest.py)::

    lab = netns_lab(3)                                     # three namespaces, up and linked
    proc = lab.spawn(0, ["-m", "some.module", "--flag"])   # python3 inside namespace 0
    event = await proc.wait_for(lambda e: e.get("event") == "ready", timeout=10)
    proc.kill()                                            # SIGKILL, like a pulled plug

Processes get their own COLIBRI_SWARM_CONFIG_DIR / COLIBRI_SWARM_CACHE_DIR under the test's
tmp dir, and this machine's compiled kernels (NUMBA_CACHE_DIR). Each prints one JSON object per
line on stdout; :class:`NsProcess` parses them.
Everything is removed on :meth:`NetnsLab.close` (the fixture calls it, also after failures),
and namespaces left by a killed earlier run of a dead pid are removed at setup.
Needs root and iproute2.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swarm.compute.quant import _numba_cache_dir
from swarm.peer.status import pid_alive

PREFIX = "csa"
REPO_ROOT = Path(__file__).resolve().parents[2]
_lab_numbers = itertools.count()
_ns_numbers = itertools.count()


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise RuntimeError with ip's message when it fails and ``check``."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def remove_stale_namespaces() -> None:
    """Delete ``csa-<pid>-*`` namespaces whose pid is no longer running (left by a killed run)."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}-(\d+)-\w+", name)
        if m and not pid_alive(int(m.group(1))):
            ip("netns", "del", name, check=False)


class NsProcess:
    """A process inside a namespace whose stdout is JSON lines; stderr goes to ``log_path``."""

    def __init__(self, popen: subprocess.Popen[str], namespace: str, log_path: Path,
                 config_dir: Path | None = None) -> None:
        self.popen = popen
        self.namespace = namespace
        self.log_path = log_path
        self.config_dir = config_dir  # where a `join` writes status.json
        self.events: list[dict[str, Any]] = []  # every JSON line seen so far, in order
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            try:
                obj = json.loads(line)
            except ValueError:
                obj = {"event": "non-json", "line": line.rstrip()}
            if not isinstance(obj, dict):
                obj = {"event": "non-json", "line": line.rstrip()}
            obj.setdefault("t", time.monotonic())
            self._lines.put(obj)
        self._lines.put(None)

    def poll(self) -> bool:
        """Move the lines read so far into ``events``; False once stdout has ended."""
        alive = True
        while True:
            try:
                obj = self._lines.get_nowait()
            except queue.Empty:
                return alive
            if obj is None:
                alive = False
                self._lines.put(None)
                return alive
            self.events.append(obj)

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float,
                       since: int = 0) -> dict[str, Any]:
        """The first event at index ≥ ``since`` satisfying ``predicate``; waits up to ``timeout`` s.

        Raises AssertionError with the process's stderr tail when it ends or the time runs out.
        """
        deadline = time.monotonic() + timeout
        while True:
            alive = self.poll()
            for event in self.events[since:]:
                if predicate(event):
                    return event
            if not alive:
                raise AssertionError(f"process in {self.namespace} exited ({self.popen.poll()}) before the "
                                     f"expected event; stderr:\n{self.stderr_tail()}")
            if time.monotonic() >= deadline:
                raise AssertionError(f"no expected event from {self.namespace} within {timeout:g} s; "
                                     f"last events: {self.events[-3:]}; stderr:\n{self.stderr_tail()}")
            await asyncio.sleep(0.05)

    def stderr_tail(self, chars: int = 3000, *, noise: tuple[str, ...] = (" INFO aioice.",)) -> str:
        """The last ``chars`` characters of the process's log, without lines holding any of
        ``noise`` (ICE's per-candidate chatter would push the swarm's own lines out)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines(keepends=True)
        except OSError:
            return ""
        return "".join(line for line in lines if not any(n in line for n in noise))[-chars:]

    def log_size(self) -> int:
        """Bytes in the process's log so far."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int, chars: int) -> str:
        """What the process logged after byte ``offset``, at most its first ``chars`` characters."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")[:chars]
        except OSError:
            return ""

    def dump_stacks(self) -> None:
        """SIGUSR1 to a live `join`: it prints every thread's stack to its log and runs on (other
        processes are left alone: SIGUSR1 would end them)."""
        if self.popen.poll() is None and "join" in self.popen.args:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGUSR1)

    def diagnosis(self) -> str:
        """One line: alive or the exit status, the scheduler state (T = stopped), the age of the
        last log line and of status.json, and what that status says."""
        now = time.time()
        code = self.popen.poll()
        if code is not None:
            state = f"exited {code}"
        else:
            try:
                state = "state " + Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                state = "state ?"
        with contextlib.suppress(OSError):
            state += f", last log line {now - self.log_path.stat().st_mtime:.1f} s ago"
        status = "no status.json"
        if self.config_dir is not None:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                doc = json.loads((self.config_dir / "status.json").read_text())
                placement = doc.get("placement") or {}
                linked = sorted(p["peer_id"][:6] for p in doc.get("peers", []) if p.get("linked"))
                status = (f"status {now - doc['updated']:.1f} s old: {doc.get('peer_id', '?')[:6]} {doc.get('role')} "
                          f"term {placement.get('term')} coordinator {str(placement.get('coordinator'))[:6]} "
                          f"signaling {str(doc.get('signaling_host'))[:6]} linked {linked}")
        return f"{self.namespace} pid {self.popen.pid}: {state}; {status}"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (default SIGKILL) and reap it."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


MOUNT_MEMORY_CGROUP = ("mount -t tmpfs cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/memory"
                       " && mount -t cgroup -o memory memory /sys/fs/cgroup/memory")


class MemoryCgroup:
    """A cgroup v1 memory group ``/sys/fs/cgroup/memory/csa-<pid>-<name>`` capped at ``limit``
    bytes, for :meth:`NetnsLab.spawn`; :meth:`close` removes it once its processes are gone."""

    ROOT = Path("/sys/fs/cgroup/memory")

    def __init__(self, name: str, limit: int) -> None:
        self.path = self.ROOT / f"{PREFIX}-{os.getpid()}-{name}"
        if not (self.ROOT / "cgroup.procs").exists():
            raise RuntimeError(f"no cgroup v1 memory controller at {self.ROOT} (needed to cap a peer's memory)")
        self.path.mkdir()
        self.write("memory.limit_in_bytes", limit)

    def write(self, name: str, value: int) -> None:
        (self.path / name).write_text(str(value))

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    def stats(self) -> dict[str, int]:
        """Peak usage, hits of the limit and OOM kills (memory.max_usage_in_bytes, failcnt,
        oom_control's oom_kill), in bytes and counts."""
        oom = dict(line.split() for line in self.read("memory.oom_control").splitlines())
        return {"limit": int(self.read("memory.limit_in_bytes")), "max_usage": int(self.read("memory.max_usage_in_bytes")),
                "failcnt": int(self.read("memory.failcnt")), "oom_kill": int(oom.get("oom_kill", 0)),
                "under_oom": int(oom.get("under_oom", 0))}

    def close(self) -> None:
        for _ in range(100):  # a killed process leaves its group a moment after it is reaped
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def remove_stale_cgroups() -> None:
    """Delete ``csa-<pid>-*`` memory groups of runs that are no longer alive."""
    with contextlib.suppress(OSError):
        for d in MemoryCgroup.ROOT.glob(f"{PREFIX}-*-*"):
            m = re.fullmatch(rf"{PREFIX}-(\d+)-.+", d.name)
            if m and not pid_alive(int(m.group(1))):
                with contextlib.suppress(OSError):
                    d.rmdir()


class NetnsLab:
    """N namespaces joined by a bridge; see the module docstring."""

    def __init__(self, n: int, workdir: Path) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"a lab holds 1..200 namespaces, not {n}")
        pid = os.getpid()
        lab = next(_lab_numbers)
        self.n = n
        self.workdir = workdir
        self.switch = f"{PREFIX}-{pid}-sw{lab}"
        self.namespaces = [f"{PREFIX}-{pid}-{next(_ns_numbers)}" for _ in range(n)]
        self.subnet_octet = (pid * 7 + lab) % 250 + 1
        self.addresses = [f"10.77.{self.subnet_octet}.{i + 1}" for i in range(n)]
        self.processes: list[NsProcess] = []
        self._created: list[str] = []

    def setup(self) -> NetnsLab:
        remove_stale_namespaces()
        try:
            self._add_ns(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for i, (ns, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
                self._add_ns(ns)
                ip("-n", self.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
                ip("-n", self.switch, "link", "set", f"p{i}", "up")
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "multicast", "on")
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        ip("netns", "add", name)
        self._created.append(name)

    def env(self, i: int) -> dict[str, str]:
        """Environment for a process in namespace ``i``: its own config/cache dirs, repo importable."""
        home = self.workdir / f"ns{i}"
        env = dict(os.environ)
        env.update({
            "COLIBRI_SWARM_CONFIG_DIR": str(home / "config"),
            "COLIBRI_SWARM_CACHE_DIR": str(home / "cache"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
            # Each namespace models a one-core machine: the peers of a test share this machine's
            # cores, and threads of one peer would only contend with the others'.
            "COLIBRI_SWARM_THREADS": "1",
            # The compiled kernels as this machine cached them, as a peer finds its own after its
            # first run: compiling takes each new cache dir a minute of CPU (and ~250 MB of LLVM's
            # memory), which no test here measures.
            "NUMBA_CACHE_DIR": env.get("NUMBA_CACHE_DIR") or _numba_cache_dir(),
        })
        return env

    def spawn(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None,
              cgroup: MemoryCgroup | None = None) -> NsProcess:
        """Start ``python3 ARGV`` inside namespace ``i`` in its own process group; with ``cgroup``,
        inside that memory cgroup from its first instruction (a shell joins it, then execs), and
        with the cgroup v1 memory hierarchy mounted at /sys/fs/cgroup/memory as in a container
        (``ip netns exec`` mounts a fresh /sys without it)."""
        log_path = self.workdir / f"ns{i}-{len(self.processes)}.stderr"
        stderr = open(log_path, "w")  # noqa: SIM115 - the child owns it after fork
        command = ["ip", "netns", "exec", self.namespaces[i], sys.executable, *argv]
        environ = {**self.env(i), **(env or {})}
        if cgroup is not None:
            command = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup.path / "cgroup.procs"),
                       *command[:4], "sh", "-c", MOUNT_MEMORY_CGROUP + ' && exec "$@"', "sh", *command[4:]]
        popen = subprocess.Popen(
            command,
            stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO_ROOT,
            env=environ, start_new_session=True,
        )
        stderr.close()
        config_dir = environ.get("COLIBRI_SWARM_CONFIG_DIR")
        proc = NsProcess(popen, self.namespaces[i], log_path, Path(config_dir) if config_dir else None)
        self.processes.append(proc)
        return proc

    def exec(self, i: int, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run a command inside namespace ``i`` and wait for it (for checks like ``ip addr``)."""
        return subprocess.run(["ip", "netns", "exec", self.namespaces[i], *argv],
                              capture_output=True, text=True, timeout=60)

    # -- faults ---------------------------------------------------------------------------------

    def stop(self, i: int) -> None:
        """SIGSTOP every process running in namespace ``i``: a stalled machine (sockets stay
        open, nothing answers)."""
        self._signal_ns(i, signal.SIGSTOP)

    def cont(self, i: int) -> None:
        """SIGCONT the processes of namespace ``i`` after :meth:`stop`."""
        self._signal_ns(i, signal.SIGCONT)

    def _signal_ns(self, i: int, sig: int) -> None:
        for proc in self.processes:
            if proc.namespace == self.namespaces[i] and proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, sig)

    def link_down(self, i: int) -> None:
        """Take namespace ``i``'s interface down (its side of the cable): no packet in or out."""
        ip("-n", self.namespaces[i], "link", "set", "eth0", "down")

    def link_up(self, i: int) -> None:
        """Bring namespace ``i``'s interface back (address and multicast route restored)."""
        ns = self.namespaces[i]
        ip("-n", ns, "link", "set", "eth0", "up")
        # Taking a link down drops its routes; the multicast route is ours, so restore it.
        ip("-n", ns, "route", "replace", "224.0.0.0/4", "dev", "eth0")

    def mcast_block(self, blocked: bool = True) -> None:
        """Stop (or resume) the bridge flooding multicast to its ports: mDNS between namespaces
        goes, unicast stays (a guest Wi-Fi that isolates multicast)."""
        for i in range(self.n):
            ip("-n", self.switch, "link", "set", f"p{i}", "type", "bridge_slave", "mcast_flood",
               "off" if blocked else "on")

    def close(self) -> None:
        """Kill every process this lab started and delete its namespaces (veths and bridge go with them)."""
        for proc in self.processes:
            proc.kill()
        self.processes.clear()
        for name in reversed(self._created):
            ip("netns", "del", name, check=False)
        self._created.clear()
