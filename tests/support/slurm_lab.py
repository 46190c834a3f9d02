"""A real SLURM cluster on this machine: slurmctld plus one slurmd per network namespace.

Layout (``NET`` is the lab's /24, 10.231.X.0/24 with the first free X)::

    sw        a bridge, no address (the "switch")
    ctl       NET.10, hostname ctl: slurmctld, and the login node (sbatch, squeue, ...)
    nodeN     NET.(10+N), hostname nodeN: slurmd, and so every job process on nodeN

The namespaces are files in the lab's own directory (``unshare --net=FILE``), not
names in /run/netns: other harnesses on the same machine list, delete and unmount
/run/netns, and this lab must survive them (and stay out of their way).

Before anything else a blackhole route for ``NET.0/24`` goes into the root namespace,
so a lab address dialled from outside the lab can never leave the machine; it is the
last thing removed. The daemons run under ``nsenter --net`` with a private mount and
UTS namespace, where the lab's hosts file is bind-mounted on /etc/hosts and the
hostname is set (``ip netns exec`` would remount /sys, and slurmd 22.05 then fails to
find its cgroup mount). munged is the lab's own: its own key and socket, named in
slurm.conf's AuthInfo, so a host munged (or another lab) is never touched.

Every process of the lab carries one environment tag (daemons through
:class:`ProcessSet`, jobs because sbatch exports the submitter's environment);
:meth:`SlurmLab.down` kills by tag and by namespace membership, deletes the
namespaces, the lab directory and the route, and reports what it could not undo.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from elastic_ext.local.processes import (
    TAG_ENV,
    Proc,
    ProcessSet,
    signal_pids,
    tagged_pids,
    wait_until,
)
from elastic_ext.procinfo import pid_alive

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "munged")
NET_BASE = "10.231"        # the lab's /24 is NET_BASE.X: only ever inside the lab's namespaces
NET_CHOICES = range(77, 127)
LAB_GLOB = "eeslurm-*"     # lab directories under /tmp
_ALLOC_LOCK = Path("/tmp/eeslurm.lock")


class LabUnavailable(Exception):
    """This machine cannot host the lab (no root, no network namespaces); the reason says which."""


def _run(cmd: Sequence[str], timeout: float = 60, check: bool = True,
         env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(cmd), check=False, capture_output=True, text=True, timeout=timeout,
                            env=None if env is None else dict(env), stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {result.returncode}:\n"
                           f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result


def check_host() -> None:
    """Raise :class:`LabUnavailable` unless this machine can create network namespaces."""
    if os.geteuid() != 0:
        raise LabUnavailable("the SLURM lab needs root (network namespaces, slurmd, munged)")
    for tool in ("ip", "nsenter", "unshare", "setpriv", "mount", "umount"):
        if shutil.which(tool) is None:
            raise LabUnavailable(f"the SLURM lab needs `{tool}` (iproute2 / util-linux)")
    with tempfile.TemporaryDirectory(prefix="eeslurm-probe-") as d:
        ns = Path(d, "net")
        ns.touch()
        made = _run(["unshare", f"--net={ns}", "true"], check=False)
        if made.returncode != 0:
            raise LabUnavailable(f"cannot create a network namespace here: {made.stderr.strip()}")
        try:
            link = _run(["nsenter", f"--net={ns}", "ip", "link", "add", "br0", "type", "bridge"],
                        check=False)
            if link.returncode != 0:
                raise LabUnavailable("cannot create a bridge in a network namespace: "
                                     f"{link.stderr.strip()}")
        finally:
            _run(["umount", str(ns)], check=False)


def ensure_packages() -> None:
    """Install Debian's slurm and munge if they are missing (apt-get update first)."""
    if all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in BINARIES):
        return
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"slurm/munge are missing and there is no apt-get to install {PACKAGES}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _run(["apt-get", "update", "-qq"], timeout=300, env=env)
    _run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES], timeout=600,
         env=env)


def ns_inode(ns_file: Path) -> int | None:
    try:
        return os.stat(ns_file).st_ino
    except OSError:
        return None


def pids_in_netns(inode: int) -> list[int]:
    """Every process whose network namespace is the one with this nsfs inode."""
    wanted = f"net:[{inode}]"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "net") == wanted:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _is_nsfs_mount(path: Path) -> bool:
    try:
        mounts = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return False
    return any(line.split()[4] == str(path) for line in mounts.splitlines() if " - nsfs " in line)


def _pids_mentioning(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (a lab directory)."""
    needle = text.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _kill_and_wait(pids: set[int], timeout: float = 10) -> list[int]:
    """SIGKILL ``pids``; the ones still alive (not zombies) after ``timeout``."""
    signal_pids(pids, signal.SIGCONT)
    signal_pids(pids, signal.SIGKILL)
    try:
        wait_until(lambda: not any(pid_alive(p) for p in pids), timeout, 0.05, "processes to die")
    except TimeoutError:
        pass
    return sorted(p for p in pids if pid_alive(p))


def _remove_lab_dir(root: Path) -> list[str]:
    """Kill what runs in a lab directory's namespaces, unmount them, drop its route and files."""
    problems: list[str] = []
    ns_dir = root / "ns"
    ns_files = sorted(ns_dir.iterdir()) if ns_dir.is_dir() else []
    pids = set(_pids_mentioning(str(root)))  # munged, which runs in the root namespace
    for f in ns_files:
        inode = ns_inode(f) if _is_nsfs_mount(f) else None
        if inode is not None:
            pids.update(pids_in_netns(inode))
    survivors = _kill_and_wait(pids)
    if survivors:
        problems.append(f"processes survived in the lab's namespaces: {survivors}")
    for f in ns_files:
        if _is_nsfs_mount(f):
            r = _run(["umount", str(f)], check=False)
            if r.returncode != 0:
                problems.append(f"umount {f}: {r.stderr.strip()}")
    if not os.environ.get("ELASTIC_EXT_KEEP_SLURM_LAB"):
        shutil.rmtree(root, ignore_errors=True)
    return problems


class SlurmLab:
    """``up()`` builds the cluster, ``down()`` removes every trace of it; use as a context
    manager."""

    def __init__(self, processes: ProcessSet, nodes: int = 2, slurmd_timeout: int = 10) -> None:
        if not 1 <= nodes <= 9:
            raise ValueError("1 to 9 nodes")
        self.processes = processes
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.slurmd_timeout = slurmd_timeout
        self.tag = f"slurmlab-{uuid.uuid4().hex}"
        self.net = ""
        self.root: Path | None = None
        self._route: str | None = None

    # -- names and addresses
    @property
    def hosts(self) -> list[str]:
        return ["ctl", *self.nodes]

    def ns(self, host: str) -> Path:
        """The file that holds ``host``'s network namespace ("sw" for the switch)."""
        assert self.root is not None
        return self.root / "ns" / host

    def addr(self, host: str) -> str:
        return f"{self.net}.10" if host == "ctl" else f"{self.net}.{10 + int(host[4:])}"

    @property
    def conf(self) -> Path:
        assert self.root is not None
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment of lab clients, and (sbatch exports it) of every job process."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        env.update({"SLURM_CONF": str(self.conf), TAG_ENV: self.tag})
        return env

    # -- lifecycle
    def __enter__(self) -> SlurmLab:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        with open(_ALLOC_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._remove_leftovers()
            route = self._allocate()
            # The safety net goes in first: from here on, no lab address routes off the machine.
            _run(["ip", "route", "add", "blackhole", route])
            self._route = route
        assert self.root is not None
        (self.root / "log").mkdir()
        self._network()
        self._munge()
        self._write_conf()
        self._start_daemons()

    def down(self) -> None:
        """Undo everything, whatever state ``up`` reached; raise at the end if something stayed."""
        problems: list[str] = []
        pids = set(tagged_pids(self.tag))
        for p in self.processes.procs:
            pids.update(p.pids())
        survivors = _kill_and_wait(pids)
        if survivors:
            problems.append(f"lab processes survived: {survivors}")
        for p in self.processes.procs:
            if p.popen.poll() is None:
                try:
                    p.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    problems.append(f"{p.name} did not exit")
        if self.root is not None and self.root.exists():
            problems += _remove_lab_dir(self.root)
        if self._route is not None:  # the route goes last: no lab namespace exists any more
            r = _run(["ip", "route", "del", "blackhole", self._route], check=False)
            if r.returncode != 0:
                problems.append(f"ip route del blackhole {self._route}: {r.stderr.strip()}")
            self._route = None
        if problems:
            raise RuntimeError("SLURM lab teardown: " + "; ".join(problems))

    # -- building
    def _remove_leftovers(self) -> None:
        """Lab directories of killed runs (their owner is gone): namespaces, processes, routes."""
        for root in Path("/tmp").glob(LAB_GLOB):
            if not root.is_dir() or not (root / "owner").exists():
                continue
            try:
                owner = int((root / "owner").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            if pid_alive(owner):
                continue
            route = (root / "route").read_text().strip() if (root / "route").exists() else None
            _remove_lab_dir(root)
            if route:
                _run(["ip", "route", "del", "blackhole", route], check=False)

    def _allocate(self) -> str:
        """A lab directory and the first 10.231.X.0/24 that no route of this machine mentions."""
        routes = _run(["ip", "-4", "route", "show", "table", "all"]).stdout
        used = set(re.findall(rf"\b{re.escape(NET_BASE)}\.(\d+)\.", routes))
        free = [x for x in NET_CHOICES if str(x) not in used]
        if not free:
            raise RuntimeError(f"no free {NET_BASE}.X.0/24 for the SLURM lab")
        self.net = f"{NET_BASE}.{free[0]}"
        self.root = Path(tempfile.mkdtemp(prefix="eeslurm-", dir="/tmp"))
        self.root.chmod(0o755)  # munged (user munge) must reach its own directory below
        (self.root / "owner").write_text(f"{os.getpid()}\n")
        route = f"{self.net}.0/24"
        (self.root / "route").write_text(route + "\n")
        return route

    def _ip(self, host: str, *args: str) -> None:
        _run(["nsenter", f"--net={self.ns(host)}", "ip", *args])

    def _network(self) -> None:
        assert self.root is not None
        (self.root / "ns").mkdir()
        for host in ["sw", *self.hosts]:
            self.ns(host).touch()
            _run(["unshare", f"--net={self.ns(host)}", "true"])
        self._ip("sw", "link", "add", "br0", "type", "bridge")
        self._ip("sw", "link", "set", "br0", "up")
        for host in self.hosts:
            _run(["ip", "link", "add", f"v-{host}", "netns", str(self.ns("sw")), "type", "veth",
                  "peer", "name", "eth0", "netns", str(self.ns(host))])
            self._ip("sw", "link", "set", f"v-{host}", "master", "br0", "up")
            self._ip(host, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            self._ip(host, "link", "set", "eth0", "up")
            self._ip(host, "link", "set", "lo", "up")
        lines = ["127.0.0.1 localhost"] + [f"{self.addr(h)} {h}" for h in self.hosts]
        (self.root / "hosts").write_text("\n".join(lines) + "\n")

    def _munge(self) -> None:
        assert self.root is not None
        munge = pwd.getpwnam("munge")
        d = self.root / "munge"
        d.mkdir()
        d.chmod(0o755)  # munged insists that everyone can reach its socket
        key = d / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        for path in (d, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        self.munge_socket = d / "munge.socket"
        self.processes.spawn("munged", [
            "setpriv", f"--reuid={munge.pw_uid}", f"--regid={munge.pw_gid}", "--clear-groups",
            "munged", "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}",
            f"--log-file={d / 'munged.log'}"], env=self._tagged())
        wait_until(lambda: self._munge_ok(), 15, 0.1, "munged to answer")

    def _munge_ok(self) -> bool:
        p = self.processes.procs[-1]
        if p.popen.poll() is not None:
            raise RuntimeError(f"munged exited: {p.output()[-2000:]}")
        r = _run(["munge", "-n", f"--socket={self.munge_socket}"], check=False)
        return r.returncode == 0

    def _write_conf(self) -> None:
        assert self.root is not None
        r = self.root
        nodes = "".join(f"NodeName={n} NodeAddr={self.addr(n)} CPUs=2 RealMemory=2000 "
                        "State=UNKNOWN\n"
                        for n in self.nodes)
        node_list = ",".join(self.nodes)
        self.conf.write_text(f"""\
ClusterName=eelab
SlurmctldHost=ctl({self.addr('ctl')})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# The lab's own munged. cred_expire: a requeued job may start cred_expire+1 s after it
# ended (default 120 s; 5 is the least slurm accepts).
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout}
MinJobAge=600
KillWait=5
InactiveLimit=0
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# Send the job's --signal (USR2) when it is preempted, GraceTime before TERM/KILL.
SlurmctldParameters=preempt_send_user_signal
{nodes}\
PartitionName=batch Nodes={node_list} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 \
PreemptMode=REQUEUE GraceTime=30
PartitionName=urgent Nodes={node_list} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
""")
        (r / "state").mkdir()
        for n in self.nodes:
            (r / "spool" / n).mkdir(parents=True)

    def _tagged(self) -> dict[str, str]:
        return self.env

    def _daemon(self, host: str, name: str, cmd: Sequence[str]) -> None:
        assert self.root is not None
        inner = (f"mount --bind {self.root / 'hosts'} /etc/hosts && hostname {host} && exec "
                 + " ".join(cmd))
        self.processes.spawn(name, ["nsenter", f"--net={self.ns(host)}", "unshare", "--uts",
                                    "--mount", "--propagation", "private", "sh", "-c", inner],
                             env=self._tagged())

    def _start_daemons(self) -> None:
        self._daemon("ctl", "slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for n in self.nodes:
            self._daemon(n, f"slurmd-{n}", ["slurmd", "-D", "-f", str(self.conf), "-N", n])
        self.wait_nodes(self.nodes, "idle", 60)

    # -- using it
    def in_ns(self, host: str, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run in ``host``'s network namespace (clients; not for daemons)."""
        return ["nsenter", f"--net={self.ns(host)}", *cmd]

    def client(self, *cmd: str, timeout: float = 30, check: bool = True,
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A SLURM client command on the login node (``ctl``)."""
        self._check_daemons()
        return _run(self.in_ns("ctl", cmd), timeout=timeout, check=check, env=env or self.env)

    def _check_daemons(self) -> None:
        for p in self.processes.procs:
            daemon = p.name in ("munged", "slurmctld") or p.name.startswith("slurmd-")
            if daemon and p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n"
                                   f"{p.output()[-3000:]}"
                                   f"\n{self.log(p.name)[-3000:]}")

    def sbatch(self, *args: str, env: Mapping[str, str] | None = None) -> str:
        out = self.client("sbatch", "--parsable", *args, env=env).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, NodeList, ...)."""
        out = self.client("scontrol", "show", "job", "-o", job_id).stdout
        fields: dict[str, str] = {}
        for m in re.finditer(r"(\w[\w:/]*)=(\S*)", out):
            fields.setdefault(m.group(1), m.group(2))
        return fields

    def wait_job(self, job_id: str, predicate: Callable[[dict[str, str]], bool], timeout: float,
                 what: str) -> dict[str, str]:
        last: dict[str, dict[str, str]] = {}

        def check() -> dict[str, str] | None:
            last["job"] = self.job(job_id)
            return last["job"] if predicate(last["job"]) else None
        try:
            return wait_until(check, timeout, 0.25, what)
        except TimeoutError as exc:
            state = {k: last.get("job", {}).get(k)
                     for k in ("JobState", "Reason", "Restarts", "NodeList")}
            raise TimeoutError(f"{exc}; job {job_id}: {state}") from None

    def wait_nodes(self, nodes: Sequence[str], state: str, timeout: float) -> None:
        def check() -> bool:
            out = self.client("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
            states = dict(line.split() for line in out if line.strip())
            return all(states.get(n, "").rstrip("*~#") == state for n in nodes)
        wait_until(check, timeout, 0.25, f"nodes {list(nodes)} {state}")

    def cut_link(self, host: str) -> None:
        """Pull the node's cable: its switch port goes down, the node keeps running."""
        self._ip("sw", "link", "set", f"v-{host}", "down")

    def heal_link(self, host: str) -> None:
        self._ip("sw", "link", "set", f"v-{host}", "up")

    def spawn_in(self, host: str, name: str, cmd: Sequence[str]) -> Proc:
        """A long-running process (an external etcd, say) in ``host``'s namespace, killed at
        ``down``."""
        return self.processes.spawn(name, self.in_ns(host, cmd), env=self._tagged())

    def host_processes(self, host: str) -> dict[int, str]:
        """pid -> comm of the live processes in ``host``'s namespace."""
        found = {}
        inode = ns_inode(self.ns(host))
        for pid in pids_in_netns(inode) if inode is not None else []:
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if pid_alive(pid):
                found[pid] = comm
        return found

    def processes_named(self, host: str, name: str) -> list[int]:
        return [pid for pid, comm in self.host_processes(host).items() if comm == name]

    def log(self, name: str) -> str:
        """A daemon's log file (slurmctld, slurmd-node1, munged)."""
        if self.root is None:
            return ""
        path = (self.root / "munge" / "munged.log" if name == "munged"
                else self.root / "log" / f"{name}.log")
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""



