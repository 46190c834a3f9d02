"""deploy/slurm on a real SLURM cluster built on this machine (tests/support/slurm_lab.py).

slurmctld and one slurmd per network namespace, the lab's own munged; the shipped
batch scripts are submitted as they are, with settings in the environment:

1. a 2-node job trains to ``done`` through etcd-ext on the one-member etcd the job starts on
   its first node, and stops it at the end;
2. preemption: a job on the preemptible partition (``--signal=USR2@120 --requeue``) is
   preempted by an urgent job: USR2 -> snapshot -> requeue (same job id, same run id,
   external etcd) -> resume from that step -> ``done``;
3. a job killed without notice (every agent SIGKILLed) and requeued resumes under the same
   run id from the last periodic snapshot;
4. a 3-node job (a lab of its own) starts a 3-member etcd on its three nodes; node 1, whose
   member leads etcd, is lost (link down, the job's processes there killed), and nodes 2
   and 3 train on at world size 2 to ``done``.

Not here, because a faster test proves it: a node's link cut in a 2-node job (4. loses a
node's link and trains on, with more at stake: an etcd member); a requeued job's fresh
restart budget (the requeue rule, decided by ``policy.decide`` and tested with the old
allocation's state in every shape in ``tests/test_restart_budget.py``; 3. is the requeue
itself on SLURM).

The wrapper's own checks (``--nnodes`` against the step) are in
tests/test_deploy_slurm_scripts.py, which needs no lab.

Needs root and network namespaces (skipped with the reason otherwise); installs slurm and
munge with apt-get when they are missing.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_ext.jsonlines import read_json_lines
from elastic_ext.local.processes import ProcessSet, environ_of, signal_pids, wait_until
from elastic_ext.procinfo import pid_alive
from tests.support.slurm_lab import LabUnavailable, SlurmLab, check_host, ensure_packages

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
SLURM_DIR = REPO / "deploy" / "slurm"
TRAIN = ("--model-size", "tiny", "--global-batch-size", "16", "--seed", "5", "--step-delay", "0.05")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED")


def built_lab(tmp_path_factory: pytest.TempPathFactory, nodes: int) -> Iterator[SlurmLab]:
    """A SLURM lab of ``nodes`` nodes, torn down with every process it started."""
    try:
        check_host()
    except LabUnavailable as exc:
        pytest.skip(str(exc))
    ensure_packages()
    processes = ProcessSet(tmp_path_factory.mktemp(f"slurm-lab{nodes}") / "logs")
    try:
        with SlurmLab(processes, nodes=nodes) as the_lab:
            yield the_lab
    finally:
        processes.cleanup()


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmLab]:
    yield from built_lab(tmp_path_factory, nodes=2)


@pytest.fixture
def job_dir(lab: SlurmLab, tmp_path: Path) -> Iterator[Path]:
    lab.wait_nodes(lab.nodes, "idle", 60)  # a previous test may have left node2 recovering
    yield tmp_path
    # nothing of this test's jobs may outlive it
    for job_id in lab.client("squeue", "-h", "-o", "%i").stdout.split():
        lab.client("scancel", job_id, check=False)


def job_env(lab: SlurmLab, job_dir: Path, **extra: str) -> dict[str, str]:
    env = lab.env
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env.pop("OMP_NUM_THREADS", None)  # torchrun-node.sh computes it
    env["ELASTIC_EXT_SNAPSHOT_DIR"] = str(job_dir / "snapshots")
    # the nodes' scratch (TMPDIR), where the job's etcd members keep their data
    (job_dir / "scratch").mkdir(exist_ok=True)
    env["TMPDIR"] = str(job_dir / "scratch")
    env["TRAINER_LOG_LEVEL"] = "INFO"
    env.update(extra)
    return env


def submit(lab: SlurmLab, job_dir: Path, script: str, env: dict[str, str], *trainer_args: str,
           sbatch_args: tuple[str, ...] = (), nodes: int = 2) -> str:
    return lab.sbatch(f"--nodes={nodes}", "--time=5", f"--chdir={job_dir}",
                      f"--output={job_dir}/job-%j.out", *sbatch_args, str(SLURM_DIR / script),
                      *TRAIN, *trainer_args, env=env)


def output(job_dir: Path, job_id: str) -> str:
    try:
        return (job_dir / f"job-{job_id}.out").read_text(errors="replace")
    except FileNotFoundError:
        return "(no job output)"


def metrics(job_dir: Path) -> list[dict[str, Any]]:
    return read_json_lines(job_dir / "snapshots" / "metrics.jsonl")


def rdzv_conf(job_dir: Path, extra: str = "") -> str:
    """ELASTIC_EXT_RDZV_CONF for a job whose agents append their rendezvous events (``joined``
    carries the generation, ``restarts`` and ``max_restarts``) to one file in ``job_dir``."""
    return f"events_file={job_dir / 'events.jsonl'}" + (f",{extra}" if extra else "")


def joined(job_dir: Path) -> list[dict[str, Any]]:
    """Every agent's ``joined`` events, oldest first."""
    try:
        evs = read_json_lines(job_dir / "events.jsonl")
    except FileNotFoundError:
        return []
    return sorted((e for e in evs if e["event"] == "joined"), key=lambda e: e["time"])


def by_generation(evs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``joined`` events grouped by generation, the generations in the order they began."""
    out: dict[str, list[dict[str, Any]]] = {}
    for e in evs:
        out.setdefault(e["generation"], []).append(e)
    return out


def key_events(evs: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["event"], e["step"], e["world_size"], e.get("resumed_from")) for e in evs
            if e["event"] in ("start", "preempted", "done")]


def explain(lab: SlurmLab, job_dir: Path, job_id: str) -> str:
    """What to print when a check fails: the job's state, its output, its metrics, slurmctld's
    log."""
    try:
        state = lab.job(job_id)
    except Exception as exc:  # noqa: BLE001 - the cluster itself may be what broke
        state = {"error": str(exc)}
    state_keys = ("JobState", "Reason", "ExitCode", "Restarts", "NodeList")
    return (f"\njob {job_id}: { {k: state.get(k) for k in state_keys} }"
            f"\nmetrics: {key_events(metrics(job_dir))}\n----- job output -----\n"
            f"{output(job_dir, job_id)[-8000:]}"
            f"\n----- slurmctld log -----\n{lab.log('slurmctld')[-3000:]}")


def wait_metric(lab: SlurmLab, job_dir: Path, job_id: str, predicate: Any, timeout: float,
                what: str) -> None:
    def check() -> bool:
        if any(predicate(e) for e in metrics(job_dir)):
            return True
        if lab.job(job_id).get("JobState") in ENDED:
            raise AssertionError(f"job ended before {what}" + explain(lab, job_dir, job_id))
        return False
    try:
        wait_until(check, timeout, 0.2, what)
    except TimeoutError as exc:
        raise AssertionError(str(exc) + explain(lab, job_dir, job_id)) from None


def wait_end(lab: SlurmLab, job_dir: Path, job_id: str, timeout: float) -> dict[str, str]:
    try:
        return lab.wait_job(job_id, lambda j: j.get("JobState") in ENDED, timeout,
                            f"job {job_id} to end")
    except TimeoutError as exc:
        raise AssertionError(str(exc) + explain(lab, job_dir, job_id)) from None


@pytest.fixture
def external_etcd(lab: SlurmLab, job_dir: Path) -> Iterator[str]:
    """An etcd outside the allocation (on the login node, ``ctl``) for one test; its address."""
    ctl = lab.addr("ctl")
    proc = lab.spawn_in("ctl", "etcd-external", [
        "etcd", "--name", "external", "--data-dir", str(job_dir / "etcd"), "--logger", "zap",
        "--log-level", "warn", "--listen-client-urls", f"http://{ctl}:2379",
        "--advertise-client-urls", f"http://{ctl}:2379", "--listen-peer-urls", "http://127.0.0.1:2380",
        "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
        "--initial-cluster", "external=http://127.0.0.1:2380"])
    try:
        assert run_keys(lab, ctl, "none") == 0 and proc.popen.poll() is None, proc.output()[-3000:]
        yield ctl
    finally:
        proc.kill()
        proc.popen.wait(timeout=10)


_COUNT_KEYS = """
import base64, json, sys, urllib.request
prefix = sys.argv[2].encode()
end = prefix[:-1] + bytes([prefix[-1] + 1])
body = json.dumps({"key": base64.b64encode(prefix).decode(),
                   "range_end": base64.b64encode(end).decode(),
                   "count_only": True}).encode()
request = urllib.request.Request(sys.argv[1] + "/v3/kv/range", body)
for _ in range(50):
    try:
        with urllib.request.urlopen(request, timeout=2) as r:
            print(json.load(r).get("count", 0))
            break
    except OSError:
        import time; time.sleep(0.2)
else:
    sys.exit("etcd did not answer")
"""


def run_keys(lab: SlurmLab, etcd_addr: str, run_id: str) -> int:
    """How many keys etcd-ext holds for ``run_id`` (asked from the login node, inside the lab)."""
    out = lab.client(sys.executable, "-c", _COUNT_KEYS, f"http://{etcd_addr}:2379",
                     f"/elastic-ext/{run_id}/", timeout=30).stdout
    return int(out.strip() or 0)


def training_steps(e: dict[str, Any], world_size: int, step: int) -> bool:
    return e["event"] == "step" and e["world_size"] == world_size and e["step"] >= step


@pytest.mark.timeout(240)
def test_two_node_job_trains_to_done_with_etcd_on_its_first_node(lab: SlurmLab,
                                                                  job_dir: Path) -> None:
    started = time.monotonic()
    job_id = submit(lab, job_dir, "elastic.sbatch", job_env(lab, job_dir), "--steps", "40",
                    "--snapshot-every", "20")
    job = wait_end(lab, job_dir, job_id, 180)
    why = explain(lab, job_dir, job_id)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0"), why

    evs = metrics(job_dir)
    done = [e for e in evs if e["event"] == "done"]
    assert [(e["step"], e["world_size"]) for e in done] == [(40, 2)], why
    assert not [e for e in evs if e["event"] == "preempted" and e.get("signal") == "SIGUSR2"], why

    out = output(job_dir, job_id)
    node1, node2 = lab.addr("node1"), lab.addr("node2")
    # the job's own etcd, on the first node's address; torchrun's --local-addr is each node's own
    assert re.search(rf"rendezvous: etcd-ext at {re.escape(node1)}:\d+, run id {job_id}\b",
                     out), why
    assert "etcd-ext: etcd 3." in out, why
    assert re.search(rf"\[torchrun-node node1 [\d:]+\] local address {re.escape(node1)}, "
                     "OMP_NUM_THREADS=2", out), why
    assert re.search(rf"\[torchrun-node node2 [\d:]+\] local address {re.escape(node2)}, "
                     "OMP_NUM_THREADS=2", out), why
    # elastic.sbatch's --nnodes=MIN:MAX fits the step's agents, as the wrapper counts them
    assert out.count(", --nnodes=1:2 for 2 agents (SLURM_STEP_NUM_TASKS)") == 2, why
    assert "trainer's last event: done" in out, why
    # below three nodes the job's etcd is one member, on the first node; the batch script
    # stopped it at the end (USR1, passed on by srun) and its data went with it
    assert f"etcd: 1 member(s) on node1, token elastic-ext-{job_id}-0" in out, why
    assert re.search(r"\[etcd-member node1 [\d:]+\] stopping on SIGUSR1", out), why
    wait_until(lambda: not lab.processes_named("node1", "etcd"), 30, 0.2, "the job's etcd to exit")
    assert etcd_data_dirs(job_dir / "scratch", job_id) == [], why
    print(f"2-node job: {time.monotonic() - started:.1f}s")


@pytest.mark.timeout(300)
def test_preempted_job_snapshots_requeues_itself_and_resumes(lab: SlurmLab, job_dir: Path,
                                                              external_etcd: str) -> None:
    started = time.monotonic()
    ctl = external_etcd
    env = job_env(lab, job_dir, ELASTIC_EXT_ETCD_ENDPOINTS=f"{ctl}:2379",
                  ELASTIC_EXT_RDZV_CONF=rdzv_conf(job_dir))
    job_id = submit(lab, job_dir, "preemptible.sbatch", env, "--steps", "120",
                    "--snapshot-every", "50", sbatch_args=("--partition=batch",))
    wait_metric(lab, job_dir, job_id, lambda e: training_steps(e, 2, 10), 120, "2-node training")

    urgent = lab.sbatch("--partition=urgent", "--nodes=2", "--exclusive",
                        f"--output={job_dir}/urgent-%j.out",
                        "--wrap", "echo urgent job on $(hostname)", env=lab.env)
    job = wait_end(lab, job_dir, job_id, 200)
    why = explain(lab, job_dir, job_id)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), why
    assert lab.job(urgent)["JobState"] == "COMPLETED", why

    evs = metrics(job_dir)
    preempted = [e for e in evs if e["event"] == "preempted"]
    assert len(preempted) == 1 and preempted[0].get("signal") == "SIGUSR2", why
    at = preempted[0]["step"]
    assert 10 <= at < 120, why
    # the snapshot of that very step was durable before the job left
    before = evs[:evs.index(preempted[0])]
    assert any(e["event"] == "snapshot" and e["step"] == at for e in before), why
    starts = [e for e in evs if e["event"] == "start"]
    after = evs[evs.index(preempted[0]):]
    resumed = [e for e in after if e["event"] == "start"]
    assert resumed and resumed[0]["resumed_from"] == at and resumed[0]["world_size"] == 2, why
    assert starts[0]["resumed_from"] is None, why
    done = [e for e in evs if e["event"] == "done"]
    assert [(e["step"], e["world_size"]) for e in done] == [(120, 2)], why

    out = output(job_dir, job_id)
    # torchrun survived the USR2 (a dead torchrun shows as this srun error)
    assert "User defined signal 2" not in out, why
    assert f"preempted after a snapshot: requeueing job {job_id}" in out, why
    # both runs rendezvoused under the same run id through the external etcd
    assert out.count(f"rendezvous: etcd-ext at {ctl}:2379, run id {job_id}") == 2, why
    assert re.search(rf"local address {re.escape(lab.addr('node1'))}, OMP_NUM_THREADS=\d+, "
                     rf"restart 1 of job {job_id}", out), why
    # the requeue rule: the requeued job's agents are new and start a new generation with a
    # fresh restart budget (here the preempted agents left cleanly and took the run's keys)
    gens = by_generation(joined(job_dir))
    assert len(gens) == 2, f"generations: { {g: len(e) for g, e in gens.items()} }" + why
    old, new = gens.values()
    assert not {e["node"] for e in old} & {e["node"] for e in new}, why
    assert [(e["restarts"], e["max_restarts"]) for e in new] == [(0, 3)] * len(new), new
    assert len({e["node"] for e in new}) == 2, new
    print(f"preemption cycle: preempted at step {at}; {time.monotonic() - started:.1f}s")


@pytest.mark.timeout(300)
def test_a_job_killed_without_notice_resumes_under_the_same_run_id(lab: SlurmLab, job_dir: Path,
                                                                   external_etcd: str) -> None:
    """No snapshot on the way out, no clean leave: the requeued job finds the old generation's
    keys in the external etcd, sees every node of it dead, starts a new one under the same
    run id (the job id) and resumes from the last periodic snapshot."""
    started = time.monotonic()
    ctl = external_etcd
    env = job_env(lab, job_dir, ELASTIC_EXT_ETCD_ENDPOINTS=f"{ctl}:2379")
    job_id = submit(lab, job_dir, "elastic.sbatch", env, "--steps", "80", "--snapshot-every", "10",
                    sbatch_args=("--requeue", "--open-mode=append"))
    wait_metric(lab, job_dir, job_id, lambda e: training_steps(e, 2, 12), 120, "2-node training")
    # SIGKILL every torchrun agent and worker of the job at once, as a power cut would
    # (`scancel --signal=KILL` is a plain cancel: TERM first, and the agents leave cleanly).
    doomed = [pid for node in lab.nodes for pid, comm in lab.host_processes(node).items()
              if comm == "pt_elastic" or comm.startswith("python")]  # torchrun renames itself
    assert len(doomed) >= 4, f"expected 2 agents and 2 workers, found {doomed}"
    signal_pids(doomed, signal.SIGKILL)
    first = wait_end(lab, job_dir, job_id, 60)
    why = explain(lab, job_dir, job_id)
    assert first["JobState"] == "FAILED", why
    killed_at = max(e["step"] for e in metrics(job_dir) if e["event"] == "step")
    assert not [e for e in metrics(job_dir) if e["event"] in ("preempted", "done")], why
    assert run_keys(lab, ctl, job_id) > 0, "the killed agents left no state behind" + why

    lab.client("scontrol", "requeue", job_id)
    job = lab.wait_job(job_id, lambda j: j.get("Restarts") == "1" and j.get("JobState") in ENDED,
                       150, f"requeued job {job_id} to end")
    why = explain(lab, job_dir, job_id)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), why
    evs = metrics(job_dir)
    starts = [e for e in evs if e["event"] == "start"]
    resumed = starts[-1]["resumed_from"]
    assert resumed is not None and resumed % 10 == 0 and 10 <= resumed <= killed_at, why
    assert [(e["step"], e["world_size"]) for e in evs if e["event"] == "done"] == [(80, 2)], why
    out = output(job_dir, job_id)
    assert out.count(f"rendezvous: etcd-ext at {ctl}:2379, run id {job_id}") == 2, why
    assert run_keys(lab, ctl, job_id) == 0, "the finished job left its keys" + why
    print(f"killed at step {killed_at}, resumed from {resumed}; {time.monotonic() - started:.1f}s")


@pytest.fixture
def lab3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmLab]:
    """A 3-node lab of its own (the module's has 2): the job that starts a 3-member etcd."""
    yield from built_lab(tmp_path_factory, nodes=3)


_ETCD_LEADER = """
import json, sys, time, urllib.request
urls, wanted = sys.argv[1].split(","), sys.argv[2]
def post(url, path, body=None):
    request = urllib.request.Request(url + path, json.dumps(body or {}).encode())
    with urllib.request.urlopen(request, timeout=3) as r:
        return json.load(r)
names = {m["ID"]: m["name"] for m in post(urls[0], "/v3/cluster/member/list")["members"]}
target = next(i for i, name in names.items() if name == wanted)
for _ in range(100):
    statuses = {u: post(u, "/v3/maintenance/status") for u in urls}
    leaders = {s["leader"] for s in statuses.values()}
    if leaders == {target}:
        print(json.dumps(sorted(names.values())))
        break
    at = [u for u, s in statuses.items() if s["header"]["member_id"] in leaders]
    if len(leaders) == 1 and at:
        try:
            post(at[0], "/v3/maintenance/transfer-leadership", {"targetID": target})
        except OSError:
            pass
    time.sleep(0.1)
else:
    sys.exit(f"{wanted} did not become the etcd leader: {statuses}")
"""


def make_etcd_leader(lab: SlurmLab, endpoints: str, node: str) -> list[str]:
    """Move the leadership of the job's etcd to ``node``'s member (asked from the login
    node, inside the lab); the names of the members."""
    urls = ",".join(f"http://{e}" for e in endpoints.split(","))
    out = lab.client(sys.executable, "-c", _ETCD_LEADER, urls, node, timeout=60).stdout
    return list(json.loads(out))


def job_step_processes(lab: SlurmLab, node: str, job_id: str) -> dict[int, str]:
    """pid -> comm of every process of the job's steps on ``node``: the tasks srun started
    there and whatever they started (a task's environment names its job and step). Not the
    batch script nor its sruns (no step), nor slurmd and slurmstepd (no job)."""
    found = {}
    for pid, comm in lab.host_processes(node).items():
        env = environ_of(pid)
        if env.get("SLURM_JOB_ID") == job_id and "SLURM_STEP_ID" in env:
            found[pid] = comm
    return found


def etcd_data_dirs(scratch: Path, job_id: str) -> list[str]:
    """The etcd members' data directories left in the node-local scratch, by node."""
    return sorted(p.name.split(".")[0] for p in scratch.glob(f"elastic-ext-etcd-{job_id}-*"))


@pytest.mark.timeout(480)
def test_a_three_node_job_trains_on_to_done_when_the_first_etcd_members_node_is_lost(
        lab3: SlurmLab, tmp_path: Path) -> None:
    """The recipe starts a 3-member etcd on the first three nodes of a 3-node allocation
    (``--nnodes=2:3``). Node 1's member is made the etcd leader; then node 1 is lost: its
    link goes down (nothing of it answers: etcd's leader, its torchrun agent, its worker,
    and SLURM's batch script and sruns) and every process of the job's steps there is
    SIGKILLed (its etcd member, etcd-member.sh, the torchrun agent, the agent's warm-start
    server and the worker), so none of them comes back when the link does. Nodes 2 and 3
    elect a new etcd leader and train on at world size 2 to ``done``. SLURM takes node 1
    out of the job (``--no-kill``) but cannot end the job: its batch script was on node 1
    (deploy/slurm/README.md says so), so the test cancels it, and the members on nodes 2
    and 3 stop and remove their data."""
    lab, job_dir = lab3, tmp_path
    started = time.monotonic()
    env = job_env(lab, job_dir, ELASTIC_EXT_MIN_NODES="2")
    scratch = Path(env["TMPDIR"])
    job_id = submit(lab, job_dir, "elastic.sbatch", env, "--steps", "200",
                    "--snapshot-every", "20", nodes=3)
    wait_metric(lab, job_dir, job_id, lambda e: training_steps(e, 3, 10), 180, "3-node training")
    out = output(job_dir, job_id)
    why = explain(lab, job_dir, job_id)
    found = re.search(rf"rendezvous: etcd-ext at (\S+), run id {job_id}\n", out)
    assert found, why
    endpoints = found.group(1)
    port = endpoints.split(",")[0].rsplit(":", 1)[1]
    # every member on its own node's address, and torchrun told all of them
    assert endpoints == ",".join(f"{lab.addr(n)}:{port}" for n in lab.nodes), why
    assert f"etcd: 3 member(s) on node1 node2 node3, token elastic-ext-{job_id}-0" in out, why
    assert etcd_data_dirs(scratch, job_id) == [f"elastic-ext-etcd-{job_id}-{n}"
                                               for n in lab.nodes], why
    assert make_etcd_leader(lab, endpoints, "node1") == lab.nodes

    victims = job_step_processes(lab, "node1", job_id)
    workers = [pid for pid in victims if "RANK" in environ_of(pid)]
    assert {"etcd", "etcd-member.sh", "pt_elastic"} <= set(victims.values()) and workers, \
        f"node1's job processes: {victims}"
    try:
        lab.cut_link("node1")  # first: the others see silence, not refused connections
        signal_pids(victims, signal.SIGKILL)
        wait_until(lambda: not any(pid_alive(p) for p in victims), 10, 0.05,
                   "node1's job processes to die")
        killed_at = time.time()  # no step of world size 3 can complete from here on
        killed_step = max(e["step"] for e in metrics(job_dir) if e["event"] == "step")

        wait_metric(lab, job_dir, job_id, lambda e: e["event"] == "start"
                    and e["world_size"] == 2 and e["time"] > killed_at, 120,
                    "nodes 2 and 3 to go on at world size 2")
        wait_metric(lab, job_dir, job_id, lambda e: e["event"] == "done", 180, "done")
        lab.wait_job(job_id, lambda j: j.get("NodeList") == "node[2-3]", 60,
                     "SLURM to take node1 out of the job")
        lab.client("scancel", job_id)
        wait_until(lambda: not any(lab.processes_named(n, "etcd") for n in lab.nodes), 30, 0.2,
                   "the members on nodes 2 and 3 to stop")
        wait_until(lambda: etcd_data_dirs(scratch, job_id)
                   == [f"elastic-ext-etcd-{job_id}-node1"], 30, 0.2,
                   "the members on nodes 2 and 3 to remove their data (node1's was killed)")
    finally:
        lab.heal_link("node1")
    job = wait_end(lab, job_dir, job_id, 120)
    why = explain(lab, job_dir, job_id)
    assert job["JobState"] == "CANCELLED", why

    evs = metrics(job_dir)
    after = [e for e in evs if e["time"] > killed_at]
    resumed = next(e for e in after if e["event"] == "start" and e["world_size"] == 2)
    restore = next(e for e in evs[evs.index(resumed):] if e["event"] == "restore")
    # the survivors resumed from the step they were on, kept in node memory (one more if
    # the kill came in the step-boundary collective, after the update), not from disk
    assert restore["source"] in ("local", "peer"), why
    assert killed_step <= resumed["resumed_from"] <= killed_step + 1, why
    assert not [e for e in after if e["event"] == "step" and e["world_size"] != 2], why
    assert [(e["step"], e["world_size"]) for e in evs if e["event"] == "done"] == [(200, 2)], why
    lab.wait_nodes(lab.nodes, "idle", 120)  # ReturnToService=2: node1 is back once it answers
    print(f"3-node job: node1 (etcd leader) lost at step {killed_step}; nodes 2 and 3 resumed "
          f"at world size 2 from {resumed['resumed_from']} ({restore['source']}) and reached "
          f"done; {time.monotonic() - started:.1f}s")
