"""TLS, auth and hostile state: who can join, read or change a job's rendezvous.

Two jobs that share one etcd run at once in the password test, each as its own user:
that one run proves they stay apart and leave no key behind (a run of their own, without
auth, proved nothing more).
"""

from __future__ import annotations

import base64
import pickle
import re
from pathlib import Path

import pytest
import requests

from elastic_ext.local.etcd import start_cluster
from elastic_ext.rendezvous.errors import StoreAuthError
from elastic_ext.rendezvous.stores.etcd.backend import EtcdBackend
from elastic_ext.rendezvous.stores.etcd.client import EtcdClient
from elastic_ext.rendezvous.stores.etcd.wire import prefix_end
from tests.support.agents import ALLREDUCE_JOB, torchrun
from tests.support.stores import plant_etcd_state, settings_for
from tests.support.tls import ThrowawayCA

pytestmark = pytest.mark.etcd


def b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def tls_etcd(processes, tmp_path: Path, *, client_cert_auth: bool):
    ca = ThrowawayCA(tmp_path / "pki")
    server = ca.issue("etcd-server", server=True)
    args = ["--cert-file", str(server.cert), "--key-file", str(server.key)]
    if client_cert_auth:
        args += ["--client-cert-auth", "--trusted-ca-file", str(ca.cert_path)]
    return ca, start_cluster(processes, tmp_path, size=1, extra_args=args, scheme="https")


def enable_auth(url: str, ca: Path, users: dict[str, tuple[str, str]]) -> None:
    """users: name -> (password, key prefix it may read and write)."""
    s = requests.Session()
    s.trust_env = False
    s.verify = str(ca)

    def post(path, body, token=None):
        r = s.post(f"{url}/v3/{path}", json=body, timeout=5,
                   headers={"Authorization": token} if token else {})
        r.raise_for_status()
        return r.json()
    post("auth/user/add", {"name": "root", "password": "rootpw"})
    post("auth/user/grant", {"user": "root", "role": "root"})
    for name, (password, prefix) in users.items():
        post("auth/user/add", {"name": name, "password": password})
        post("auth/role/add", {"name": f"r-{name}"})
        post("auth/role/grant", {"name": f"r-{name}", "perm": {
            "key": b64(prefix), "range_end": b64(prefix_end(prefix.encode())),
            "permType": "READWRITE"}})
        post("auth/user/grant", {"user": name, "role": f"r-{name}"})
    post("auth/enable", {})


def start_job(processes, endpoint, run_id, conf, env=None, n=2):
    return [torchrun(processes, f"{run_id}-{i}", endpoint=endpoint, run_id=run_id,
                     nnodes=f"{n}:{n}", script=[str(ALLREDUCE_JOB)], conf=conf, env=env)
            for i in range(n)]


def run_job(processes, endpoint, run_id, conf, env=None, n=2):
    procs = start_job(processes, endpoint, run_id, conf, env, n)
    return [p.wait(timeout=120) for p in procs], procs


@pytest.mark.timeout(240)
def test_mutual_tls_job_runs_and_strangers_are_refused(processes, tmp_path):
    ca, etcd = tls_etcd(processes, tmp_path, client_cert_auth=True)
    client_cert = ca.issue("agent", server=False)
    endpoint = f"https://{etcd.members[0].endpoint}"
    conf = f"cacert={ca.cert_path},cert={client_cert.cert},key={client_cert.key}"
    codes, procs = run_job(processes, endpoint, "tls-job", conf)
    assert codes == [0, 0], procs[0].output()[-3000:]

    other_ca = ThrowawayCA(tmp_path / "other", name="other-ca")
    forged = other_ca.issue("mallory", server=False)
    for cert in (forged, None):
        extra: dict[str, str] = {"cert": str(cert.cert), "key": str(cert.key)} if cert else {}
        client = EtcdClient(settings_for(endpoint, "run1", (1, 3), cacert=str(ca.cert_path),
                                         **extra))
        with pytest.raises(StoreAuthError, match="TLS handshake"):
            client.server_version()


@pytest.mark.timeout(240)
def test_password_auth_jobs_share_an_etcd_apart_and_wrong_or_foreign_credentials_are_refused(
        processes, tmp_path, monkeypatch):
    ca, etcd = tls_etcd(processes, tmp_path, client_cert_auth=False)
    endpoint = f"https://{etcd.members[0].endpoint}"
    enable_auth(etcd.members[0].client_url, ca.cert_path, {
        "alice": ("alicepw", "/elastic-ext/job-a/"), "bob": ("bobpw", "/elastic-ext/job-b/")})
    # two jobs at once on one etcd, each as its own user: neither sees the other's nodes
    jobs = [start_job(processes, endpoint, "job-a",
                      f"cacert={ca.cert_path},user=alice,password_env=JOB_A_PW",
                      env={"JOB_A_PW": "alicepw"}),
            start_job(processes, endpoint, "job-b",
                      f"cacert={ca.cert_path},user=bob,password_env=JOB_B_PW",
                      env={"JOB_B_PW": "bobpw"})]
    for procs in jobs:
        assert [p.wait(timeout=150) for p in procs] == [0, 0], procs[0].output()[-3000:]
        worlds = re.findall(r"ALLREDUCE rank=\d+ world=(\d+)", "".join(p.output() for p in procs))
        assert worlds == ["2", "2"]
    # a finished job leaves no key behind (read as root, who may read both)
    monkeypatch.setenv("ROOT_PW", "rootpw")
    root = EtcdClient(settings_for(endpoint, cacert=str(ca.cert_path), user="root",
                                   password_env="ROOT_PW"))
    assert root.get_prefix("/elastic-ext/job-a/") == []
    assert root.get_prefix("/elastic-ext/job-b/") == []

    monkeypatch.setenv("WRONG_PW", "not-it")
    wrong = settings_for(endpoint, "job-a", cacert=str(ca.cert_path), user="alice",
                         password_env="WRONG_PW")
    with pytest.raises(StoreAuthError, match="refused.*authentication failed"):
        EtcdBackend(wrong).get_state()

    monkeypatch.setenv("BOB_PW", "bobpw")
    bob = EtcdBackend(settings_for(endpoint, "job-a", cacert=str(ca.cert_path), user="bob",
                                   password_env="BOB_PW"))
    with pytest.raises(StoreAuthError, match="permission denied"):
        bob.get_state()
    with pytest.raises(StoreAuthError, match="permission denied"):
        bob.set_state(b"hijack")
    # the agent refuses a password on the command line before anything else
    p = torchrun(processes, "cli-pw", endpoint=endpoint, run_id="job-a", nnodes="1:1",
                 script=[str(ALLREDUCE_JOB)], conf=f"cacert={ca.cert_path},user=alice,password=x")
    assert p.wait(timeout=60) != 0 and "never on the command line" in p.output()


@pytest.mark.timeout(120)
def test_a_planted_pickle_in_the_state_key_is_refused_not_executed(processes, tmp_path, etcd):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))
    endpoint = etcd.members[0].endpoint
    payload = b"elastic-ext/1\n" + pickle.dumps(Exploit())
    plant_etcd_state(settings_for(endpoint, "victim"), payload)
    p = torchrun(processes, "victim", endpoint=endpoint, run_id="victim", nnodes="1:1",
                 script=[str(ALLREDUCE_JOB)], conf="join_timeout=20")
    assert p.wait(timeout=60) != 0
    assert not marker.exists()
    assert "does not hold an etcd-ext state" in p.output()
