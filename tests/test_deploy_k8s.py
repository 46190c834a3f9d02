"""deploy/k8s: every manifest parses, validates against the Kubernetes schema, and wires
the workload together (torchrun with etcd-ext and --nnodes=MIN:MAX, the rendezvous
endpoint on the etcd Service's members, the snapshot volume, ...).

No cluster here: kubernetes-validate checks each object against the OpenAPI schema of
the Kubernetes release it names (strictly: unknown fields fail), and the rest is read
from the objects themselves. Container arguments go through torchrun's and the
trainer's own argument parsers with Kubernetes' $(VAR) expansion applied.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from torch.distributed.run import get_args_parser

from trainer.cli import build_parser

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
# The oldest release the manifests promise (Job successPolicy and backoffLimitPerIndex are
# GA in 1.33) and the newest schema the validator ships.
KUBERNETES_VERSIONS = ("1.33.0", kubernetes_validate.latest_version())


def load(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path.name} has no objects"
    return docs


def objects() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in load(p)]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in objects()
             if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def expand(text: str, env: dict[str, dict[str, Any]], runtime: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: literal values, or ``runtime`` for downward-API values."""
    def value(m: re.Match[str]) -> str:
        name = m.group(1)
        assert name in env, f"$({name}) is used but not defined in the container's env"
        entry = env[name]
        return expand(entry["value"], env, runtime) if "value" in entry else runtime[name]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, text)


def test_the_manifests_are_there() -> None:
    assert {p.name for p in MANIFESTS} >= {"etcd.yaml", "trainer.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_each_object_validates_against_the_kubernetes_schema(path: Path, version: str) -> None:
    for doc in load(path):
        assert {"apiVersion", "kind", "metadata"} <= doc.keys() and doc["metadata"].get("name"), doc
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_what_a_cluster_would() -> None:
    """A strict schema check, not a rubber stamp: a misspelt field and a wrong type fail."""
    job = one("Job")
    typo = copy.deepcopy(job)
    typo["spec"]["template"]["spec"]["containers"][0]["comand"] = ["torchrun"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, KUBERNETES_VERSIONS[0], strict=True)
    wrong = copy.deepcopy(job)
    wrong["spec"]["parallelism"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES_VERSIONS[0], strict=True)


def test_etcd_is_three_members_behind_a_headless_service() -> None:
    sts = one("StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()

    headless = one("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    # members find each other before ready
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= labels.items()
    assert {p["port"] for p in headless["spec"]["ports"]} == {2379, 2380}
    client = one("Service", "etcd-client")
    assert client["spec"]["selector"].items() <= labels.items()

    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = env_of(container)
    runtime = {"POD_NAME": "etcd-1", "POD_NAMESPACE": "ml"}
    cluster = expand(env["ETCD_INITIAL_CLUSTER"]["value"], env, runtime)
    svc = headless["metadata"]["name"]
    assert cluster.split(",") == [f"etcd-{i}=http://etcd-{i}.{svc}.ml.svc:2380" for i in range(3)]
    assert expand(env["ETCD_NAME"]["value"], env, runtime) == "etcd-1"
    assert expand(env["ETCD_INITIAL_ADVERTISE_PEER_URLS"]["value"], env, runtime) == f"http://etcd-1.{svc}.ml.svc:2380"
    assert expand(env["ETCD_ADVERTISE_CLIENT_URLS"]["value"], env, runtime) == f"http://etcd-1.{svc}.ml.svc:2379"
    # etcd's version: 3.4 or 3.5, the ones etcd-ext supports (README: Versions)
    assert re.search(r":v?3\.[45]\.\d+", container["image"]), container["image"]
    # data on a volume of its own, mounted where ETCD_DATA_DIR points
    claim = sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim] == env["ETCD_DATA_DIR"]["value"]

    pdb = one("PodDisruptionBudget", "etcd")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1


def trainer_parts() -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    job = one("Job")
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    return job, container, env_of(container)


def test_the_trainer_runs_torchrun_with_etcd_ext_and_an_elastic_node_range() -> None:
    job, container, env = trainer_parts()
    runtime = {"POD_IP": "10.1.2.3", "RUN_ID": job["metadata"]["name"]}
    argv = [expand(a, env, runtime) for a in [*container["command"][1:], *container["args"]]]
    assert container["command"][0] == "torchrun"

    args = get_args_parser().parse_args(argv)  # torchrun accepts them as they will be expanded
    assert args.rdzv_backend == "etcd-ext"
    low, high = (int(x) for x in args.nnodes.split(":"))
    assert 1 <= low < high, f"--nnodes={args.nnodes} is not an elastic range"
    assert args.local_addr == "10.1.2.3"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert args.rdzv_id == job["metadata"]["name"]
    assert (env["RUN_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.labels['batch.kubernetes.io/job-name']")
    assert args.module and args.training_script == "trainer"

    # one pod per node, as many pods as the range's top, and the Job gives up only when
    # fewer than MIN could still run
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == high
    assert job["spec"]["maxFailedIndexes"] == high - low
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it

    # the trainer's own parser takes the rest, and snapshots go to the shared volume
    settings = build_parser().parse_args(args.training_script_args)
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in job["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    shared = [path for path, name in mounts.items() if name in claims]
    assert shared and str(settings.snapshot_dir).startswith(shared[0] + "/"), \
        (settings.snapshot_dir, mounts)
    pvc = one("PersistentVolumeClaim", claims[mounts[shared[0]]])
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_rendezvous_endpoint_is_every_member_of_the_etcd_service() -> None:
    _, container, env = trainer_parts()
    argv = [expand(a, env, {"POD_IP": "10.1.2.3", "RUN_ID": "x"}) for a in container["args"]]
    endpoint = get_args_parser().parse_args(argv).rdzv_endpoint
    sts = one("StatefulSet", "etcd")
    svc = sts["spec"]["serviceName"]
    client_port = next(p["containerPort"]
                       for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]
                       if p["name"] == "client")
    expected = [f"{sts['metadata']['name']}-{i}.{svc}:{client_port}"
                for i in range(sts["spec"]["replicas"])]
    assert endpoint.split(",") == expected
    assert "localhost" not in endpoint and "127.0.0.1" not in endpoint


def test_the_trainer_pod_leaves_time_to_snapshot_and_is_replaced_fast() -> None:
    job, _, env = trainer_parts()
    pod = job["spec"]["template"]["spec"]
    # SIGTERM -> snapshot at the next step -> exit
    assert pod["terminationGracePeriodSeconds"] >= 60
    tolerations = {t["key"]: t for t in pod["tolerations"]}
    for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"):
        assert (tolerations[key]["effect"] == "NoExecute"
                and tolerations[key]["tolerationSeconds"] <= 60)
    ignored = [r for r in job["spec"]["podFailurePolicy"]["rules"] if r["action"] == "Ignore"]
    assert any(c["type"] == "DisruptionTarget" for r in ignored for c in r["onPodConditions"])
    assert job["spec"]["successPolicy"]["rules"] == [{"succeededCount": 1}]
    # a headless Service for the pods' names selects exactly this Job's pods
    svc = one("Service", pod["subdomain"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert int(env["OMP_NUM_THREADS"]["value"]) >= 1


def test_every_pod_runs_the_doctor_on_the_trainers_own_flags_first() -> None:
    """The init container's preflight takes the same torchrun flags as the trainer."""
    import argparse

    from elastic_ext.ops.doctor import add_arguments

    job, container, env = trainer_parts()
    (init,) = job["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["elastic-ext", "doctor"] and init["image"] == container["image"]
    runtime = {"POD_IP": "10.1.2.3", "RUN_ID": job["metadata"]["name"]}
    parser = argparse.ArgumentParser()
    add_arguments(parser, "doctor")
    doctor = parser.parse_args([expand(a, env_of(init), runtime) for a in init["args"]])
    torchrun = get_args_parser().parse_args(
        [expand(a, env, runtime) for a in container["args"]])
    for name in ("nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id",
                 "local_addr"):
        assert str(getattr(doctor, name)) == str(getattr(torchrun, name)), name
    shared = [m for m in container["volumeMounts"] if m["name"] == "snapshots"]
    assert init["volumeMounts"] == shared
