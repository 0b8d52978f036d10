"""Fixtures for the object-store tests: a real S3-compatible server process.

By default a moto server (``tests/s3_server.py``, moto's own server with
atomic conditional PUTs) is started on a free loopback port for the session.
Set ``CORRAL_TEST_S3_ENDPOINT`` (and the usual ``AWS_*`` credentials,
optionally ``CORRAL_TEST_S3_BUCKET``) to run the same tests against MinIO,
Ceph or AWS instead. Every test works under its own key prefix.
"""

import os
import secrets
import socket
import subprocess
import sys
import time
import types

import pytest

from tests.support import REPO, traversable_tempdir

_MOTO_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "corral-test",
    "AWS_SECRET_ACCESS_KEY": "corral-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(endpoint: str):
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=endpoint)


def _wait_until_up(endpoint: str, process, timeout: float = 30.0) -> None:
    client = _client(endpoint)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the S3 test server exited {process.returncode}")
        try:
            client.list_buckets()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(scope="session")
def s3_server():
    """``SimpleNamespace(endpoint, bucket, client)`` of a running S3-compatible server."""
    saved = {k: os.environ.get(k) for k in _MOTO_CREDENTIALS}
    endpoint = os.environ.get("CORRAL_TEST_S3_ENDPOINT")
    process = None
    if not endpoint:
        os.environ.update(_MOTO_CREDENTIALS)
        port = _free_port()
        endpoint = f"http://127.0.0.1:{port}"
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.s3_server", "--port", str(port)],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
    try:
        if process is not None:
            _wait_until_up(endpoint, process)
        client = _client(endpoint)
        bucket = os.environ.get("CORRAL_TEST_S3_BUCKET")
        if not bucket:
            bucket = "corral-test-" + secrets.token_hex(4)
            client.create_bucket(Bucket=bucket)
        yield types.SimpleNamespace(endpoint=endpoint, bucket=bucket, client=client)
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_location(s3_server, monkeypatch):
    """An ``s3://BUCKET/PREFIX`` private to this test, with the endpoint variable set."""
    monkeypatch.setenv("CORRAL_S3_ENDPOINT_URL", s3_server.endpoint)
    return f"s3://{s3_server.bucket}/test-{secrets.token_hex(6)}"


class Host:
    """One supervisor host: its own state directory and workspace root, one bucket."""

    def __init__(self, location: str, uid: int, owner: str = "alice"):
        from plugins.storage_s3 import _build
        from supervisor.identities import OwnerIdentity

        self.base = traversable_tempdir("corral-s3-host-")
        self.state_dir = os.path.join(self.base, "state")
        os.makedirs(self.state_dir, mode=0o700)
        root = os.path.join(self.state_dir, "workspaces")
        os.makedirs(root, mode=0o711)
        directory = os.path.join(root, owner)
        os.mkdir(directory, 0o700)
        if os.geteuid() == 0:
            os.chown(directory, uid, uid)
        else:
            uid = os.getuid()
        self.identity = OwnerIdentity(owner, uid, uid if os.geteuid() == 0 else os.getgid(),
                                      directory)
        self.storage = _build(location, types.SimpleNamespace(state_dir=self.state_dir))
        self.requests = []
        self.storage.client.meta.events.register("provide-client-params.s3", self._record)

    def _record(self, params, model, **_):
        self.requests.append((model.name, params.get("Key", "")))

    def calls(self, operation: str, key_part: str = "") -> list:
        """Recorded requests of ``operation`` whose key contains ``key_part``."""
        return [k for op, k in self.requests if op == operation and key_part in k]

    def workspace(self, conversation: str = "c-1") -> str:
        """The conversation directory's path on this host."""
        return os.path.join(self.identity.directory, conversation)

    def hydrate(self, conversation: str = "c-1"):
        """Run ``prepare_workspace``'s blocking work in this thread."""
        return self.storage.hydrate_blocking(self.identity, conversation)

    def sync(self, conversation: str = "c-1"):
        """Run ``release_workspace``'s blocking work in this thread."""
        return self.storage.sync_blocking(self.identity, conversation)

    def cleanup(self) -> None:
        import shutil

        self.storage.close()
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def make_host(s3_location):
    """Build Hosts sharing this test's bucket prefix; all removed afterwards."""
    hosts = []

    def make(uid: int = 31337, owner: str = "alice") -> Host:
        host = Host(s3_location, uid, owner)
        hosts.append(host)
        return host

    yield make
    for host in hosts:
        host.cleanup()
