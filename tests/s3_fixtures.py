"""Fixtures for the object-store tests: a real S3-compatible server process.

By default a moto server (``tests/s3_server.py``, moto's own server with
atomic conditional PUTs) is started on a free loopback port for the session.
Set ``CORRAL_TEST_S3_ENDPOINT`` (and the usual ``AWS_*`` credentials,
optionally ``CORRAL_TEST_S3_BUCKET``) to run the same tests against MinIO,
Ceph or AWS instead. Every test works under its own key prefix.

Outages: with our own moto server, ``s3_server.stop()`` makes the store
unreachable (connection refused, open connections dropped) and
``s3_server.start()`` brings it back on the same port with everything it
stored (see ``tests/s3_server.py``). Use the ``s3_outage`` fixture: it skips,
saying why, when the server is not ours (``CORRAL_TEST_S3_ENDPOINT``), and it
always restarts the server after the test. ``s3_location`` restarts it too.
"""

import errno
import os
import secrets
import signal
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


def _wait_until_refused(port: int, process, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the S3 test server exited {process.returncode}")
        with socket.socket() as s:
            try:
                s.connect(("127.0.0.1", port))
            except ConnectionRefusedError:
                return
            except OSError as e:
                if e.errno == errno.ECONNREFUSED:
                    return
                raise
        if time.monotonic() > deadline:
            raise RuntimeError(f"the S3 test server still accepts on port {port}")
        time.sleep(0.02)


class ServerControl:
    """Stop and start our own moto server process without losing what it stores."""

    def __init__(self, endpoint: str, process):
        self.endpoint = endpoint
        self.process = process
        self.stopped = False

    @property
    def controllable(self) -> bool:
        """True when the server is our own process (False with CORRAL_TEST_S3_ENDPOINT)."""
        return self.process is not None

    def _require(self) -> None:
        if self.process is None:
            pytest.skip("this test stops and restarts the S3 server, which only works with "
                        "the tests' own moto server, not CORRAL_TEST_S3_ENDPOINT="
                        f"{self.endpoint}")

    def stop(self) -> None:
        """Make the store unreachable: connections are refused until ``start()``."""
        self._require()
        self.stopped = True
        self.process.send_signal(signal.SIGUSR1)
        _wait_until_refused(int(self.endpoint.rsplit(":", 1)[1]), self.process)

    def start(self) -> None:
        """Serve again on the same port, with the same buckets and objects; wait until it answers."""
        self._require()
        self.process.send_signal(signal.SIGUSR2)
        _wait_until_up(self.endpoint, self.process)
        self.stopped = False

    def ensure_running(self) -> None:
        """Start the server again if a test left it stopped."""
        if self.stopped:
            self.start()


@pytest.fixture(scope="session")
def s3_server():
    """``SimpleNamespace(endpoint, bucket, client, stop, start, controllable)`` of a running server.

    ``stop`` and ``start`` skip the test when the server is not our own
    process; prefer the ``s3_outage`` fixture, which also restarts it.
    """
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
        control = ServerControl(endpoint, process)
        yield types.SimpleNamespace(endpoint=endpoint, bucket=bucket, client=client,
                                    stop=control.stop, start=control.start,
                                    ensure_running=control.ensure_running,
                                    controllable=control.controllable)
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
    yield f"s3://{s3_server.bucket}/test-{secrets.token_hex(6)}"
    s3_server.ensure_running()


@pytest.fixture
def s3_outage(s3_server):
    """The ``s3_server`` namespace, for a test that stops it; skips when it cannot.

    Whatever the test does, the server is serving again afterwards.
    """
    if not s3_server.controllable:
        pytest.skip("this test needs an S3 outage, which only the tests' own moto server "
                    "can simulate; CORRAL_TEST_S3_ENDPOINT points at "
                    f"{s3_server.endpoint}")
    yield s3_server
    s3_server.ensure_running()


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


# --- trees and the store, for tests that compare them -----------------------


def write_file(root: str, path: str, data: bytes, mode: int = 0o644) -> None:
    """Create ``root/path`` (and its parents) with ``data`` and ``mode``."""
    full = os.path.join(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "wb") as f:
        f.write(data)
    os.chmod(full, mode)


def give_to_owner(root: str, identity) -> None:
    """As root, hand every entry below ``root`` to the owner, as if a runner had made it."""
    if os.geteuid() != 0:
        return
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chown(os.path.join(directory, name), identity.uid, identity.gid,
                     follow_symlinks=False)


def snapshot(root: str) -> dict:
    """``{path: (kind, mode, content or target, mtime_ns, uid, gid)}`` of a tree, by lstat."""
    import stat

    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(directory, name)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                what = ("symlink", os.readlink(full), st.st_uid, st.st_gid)
            elif stat.S_ISDIR(st.st_mode):
                what = ("dir", stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            else:
                with open(full, "rb") as f:
                    what = ("file", stat.S_IMODE(st.st_mode), f.read(), st.st_mtime_ns,
                            st.st_uid, st.st_gid)
            found[os.path.relpath(full, root)] = what
    return found


def tree_entries(root: str) -> set:
    """What a manifest of ``root`` must say, from an ``lstat`` walk independent of the backend.

    Tuples: ``(path, "dir", mode)``, ``(path, "symlink", target)``,
    ``(path, "file", mode, size, sha256, mtime_ns)``.
    """
    import hashlib
    import stat

    found = set()
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(directory, name)
            path = os.path.relpath(full, root).replace(os.sep, "/")
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                found.add((path, "symlink", os.readlink(full)))
            elif stat.S_ISDIR(st.st_mode):
                found.add((path, "dir", stat.S_IMODE(st.st_mode)))
            else:
                with open(full, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                found.add((path, "file", stat.S_IMODE(st.st_mode), st.st_size, digest,
                           st.st_mtime_ns))
    return found


def manifest_entries(manifest) -> set:
    """The tuples of ``tree_entries`` from a ``supervisor.manifest.Manifest``."""
    found = set()
    for e in manifest.entries:
        if e.kind == "symlink":
            found.add((e.path, e.kind, e.target))
        elif e.kind == "dir":
            found.add((e.path, e.kind, e.mode))
        else:
            found.add((e.path, e.kind, e.mode, e.size, e.sha256, e.mtime_ns))
    return found


class StoreReader:
    """Read one conversation's objects under a test's prefix, with the session's client."""

    def __init__(self, server, location: str, owner: str, conversation: str):
        from plugins.storage_s3 import parse_location

        self.client = server.client
        self.location = parse_location(location)
        self.bucket = self.location.bucket
        self.owner = owner
        self.conversation = conversation

    def _get(self, key: str) -> bytes:
        body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        try:
            return body.read()
        finally:
            body.close()

    def manifest(self):
        """The conversation's manifest, parsed (and so checked)."""
        from supervisor import manifest as mf

        return mf.Manifest.from_bytes(self._get(self.location.key(
            self.owner, "conversations", self.conversation, "manifest.json")))

    def check_blobs(self, manifest) -> None:
        """Assert that every blob ``manifest`` names exists and hashes to its name."""
        import hashlib

        for sha in sorted(manifest.hashes()):
            key = self.location.key(self.owner, "blobs", sha)
            assert hashlib.sha256(self._get(key)).hexdigest() == sha, key

    def _list(self, prefix: str) -> list:
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix):
            keys.extend(o["Key"] for o in page.get("Contents", []))
        return keys

    def blobs(self) -> set:
        """The hashes of every blob stored for the owner."""
        prefix = self.location.key(self.owner, "blobs") + "/"
        return {k[len(prefix):] for k in self._list(prefix)}

    def conflict_copies(self) -> dict:
        """``{key: Manifest}`` of the conversation's conflict copies."""
        from supervisor import manifest as mf

        prefix = self.location.key(self.owner, "conversations", self.conversation,
                                   "conflicts") + "/"
        return {k: mf.Manifest.from_bytes(self._get(k)) for k in self._list(prefix)}
