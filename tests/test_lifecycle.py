"""The workspace lifecycle through a real supervisor: side-channel syncs, checkpoints,
outages, warm reuse, eviction, deletion, retention and garbage collection.

Each test runs ``corral serve`` processes (tests.support.RunningSupervisor)
and, for ``s3``, the tests' own S3 server process (tests.s3_fixtures).
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from supervisor.client import HelloRefused, RpcError, Session, admin_request
from tests.s3_fixtures import s3_location, s3_outage, s3_server  # noqa: F401 (fixtures)
from tests.support import REPO, RunningSupervisor, processes_of_uid, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.root]


class Store:
    """The test's view of one bucket prefix."""

    def __init__(self, server, location: str):
        self.client = server.client
        self.bucket = server.bucket
        self.prefix = location.split("/", 3)[3]

    def keys(self, below: str = "") -> list[str]:
        keys = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{self.prefix}/{below}"):
            keys += [item["Key"][len(self.prefix) + 1:] for item in page.get("Contents", [])]
        return keys

    def manifest(self, owner: str, conversation: str) -> dict | None:
        try:
            response = self.client.get_object(
                Bucket=self.bucket,
                Key=f"{self.prefix}/{owner}/conversations/{conversation}/manifest.json")
        except self.client.exceptions.NoSuchKey:
            return None
        return json.loads(response["Body"].read())

    def paths(self, owner: str, conversation: str) -> set:
        manifest = self.manifest(owner, conversation)
        return {e["path"] for e in manifest["entries"]} if manifest else set()

    def put_blob(self, owner: str, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{owner}/blobs/{digest}",
                               Body=data)
        return digest


@pytest.fixture
def store(s3_server, s3_location):
    return Store(s3_server, s3_location)


@pytest.fixture
def s3_supervisor(start_supervisor, isolation, s3_location):
    """Start a supervisor on this test's bucket prefix with extra flags."""
    endpoint = {"CORRAL_S3_ENDPOINT_URL": os.environ["CORRAL_S3_ENDPOINT_URL"]}

    def start(*flags, base=None):
        args = ["--storage", f"s3:{s3_location}", *flags]
        if base is None:
            return start_supervisor(isolation, extra_args=args, env=endpoint)
        supervisor = RunningSupervisor(isolation, args, endpoint, base=base)
        return supervisor.start()

    return start


def events(supervisor, name: str) -> list[dict]:
    return [e for e in supervisor.audit_events() if e["event"] == name]


def write(session, path: str, content: str) -> None:
    result = session.call_tool("write", {"path": path, "content": content})
    assert not result.get("isError"), result


# -- syncs while attached, checkpoints --------------------------------------


def test_a_tool_call_is_synced_within_the_delay(s3_supervisor, store):
    """The runner's side channel says a write happened; the supervisor syncs while attached."""
    supervisor = s3_supervisor("--sync-delay", "0.2")
    with Session.connect(supervisor.socket, "alice", "live") as session:
        session.initialize()
        write(session, "notes.txt", "one\n")
        wait_until(lambda: "notes.txt" in store.paths("alice", "live"), timeout=10)
        session.call_tool("bash", {"command": "mkdir -p d && echo two > d/two.txt"})
        wait_until(lambda: "d/two.txt" in store.paths("alice", "live"), timeout=10)
        assert session.call_tool("read", {"path": "notes.txt"})["content"][0]["text"] == "one\n"
    synced = wait_until(lambda: events(supervisor, "workspace_synced"))
    assert all(e["owner"] == "alice" for e in synced)


def test_checkpoint_answers_once_durable(s3_supervisor, store):
    """With no delayed sync, a checkpoint's answer means the store already has the change."""
    supervisor = s3_supervisor("--sync-delay", "3600")
    with Session.connect(supervisor.socket, "alice", "cp") as session:
        session.initialize()
        write(session, "plan.md", "ship it\n")
        assert store.manifest("alice", "cp") is None
        result = session.checkpoint()
        assert result["durable"] is True and result["storage"] == "s3"
        assert result["committed"] is True and result["uploaded"] == 1
        assert "plan.md" in store.paths("alice", "cp")
        # Nothing changed since: the next checkpoint commits nothing.
        again = session.checkpoint()
        assert again["durable"] is True and not again.get("committed")


def test_checkpoint_with_local_storage(start_supervisor, isolation):
    """local is durable on disk: a checkpoint flushes the file system and answers."""
    supervisor = start_supervisor(isolation)
    with Session.connect(supervisor.socket, "alice", "c") as session:
        session.initialize()
        write(session, "a.txt", "a")
        assert session.checkpoint() == {"durable": True, "storage": "local"}


def test_checkpoint_cli(s3_supervisor, store):
    """``corral checkpoint`` prints the durable result."""
    supervisor = s3_supervisor("--sync-delay", "3600")
    with Session.connect(supervisor.socket, "alice", "cli") as session:
        session.initialize()
        write(session, "x.txt", "x")
        out = subprocess.run(
            [sys.executable, "-m", "supervisor", "checkpoint", "--socket", supervisor.socket,
             "--owner", "alice", "--conversation", "cli"],
            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["durable"] is True
    assert "x.txt" in store.paths("alice", "cli")


def test_commands_cannot_reach_the_side_channel(s3_supervisor, store):
    """The side channel's pipes are root's: a command cannot reopen them through /proc."""
    supervisor = s3_supervisor("--sync-delay", "0.2")
    with Session.connect(supervisor.socket, "alice", "forge") as session:
        session.initialize()
        result = session.call_tool("bash", {"command": (
            "for fd in 3 4; do for pid in $PPID $(pgrep -u $(id -u) -f runner); do "
            "  (printf '{\"event\":\"checkpoint\",\"token\":1}\\n' > /proc/$pid/fd/$fd) "
            "  2>/dev/null && echo OPENED; done; done; ls /proc/self/fd")})
        # Nothing could be opened, and the command itself holds no side-channel descriptor.
        assert result["content"][0]["text"].split() == ["0", "1", "2", "3"]
        write(session, "after.txt", "fine")
        assert session.checkpoint()["durable"] is True
    assert "after.txt" in store.paths("alice", "forge")


# -- outages ----------------------------------------------------------------


def test_outage_mid_session_keeps_working_and_catches_up(s3_supervisor, store, s3_outage):
    """Stop the store: tools keep working, checkpoints say why, retries deliver everything."""
    supervisor = s3_supervisor("--sync-delay", "0.2", "--sync-retry-max", "0.5")
    with Session.connect(supervisor.socket, "alice", "out") as session:
        session.initialize()
        write(session, "before.txt", "1")
        session.checkpoint()
        s3_outage.stop()
        write(session, "during.txt", "2")
        assert session.call_tool("bash", {"command": "cat during.txt"})["content"][0][
            "text"].startswith("2")
        with pytest.raises(RpcError) as failure:
            session.checkpoint()
        assert failure.value.data["code"] == "storage_unavailable"
        s3_outage.start()
        wait_until(lambda: "during.txt" in store.paths("alice", "out"), timeout=20)
        write(session, "after.txt", "3")
        assert session.checkpoint()["durable"] is True
    assert {"before.txt", "during.txt", "after.txt"} <= store.paths("alice", "out")
    failed = events(supervisor, "workspace_sync_failed")
    assert failed and {e["code"] for e in failed} == {"storage_unavailable"}
    with open(supervisor.audit_path) as f:
        assert "corral-test-secret" not in f.read()


def test_changes_not_durable_are_never_evicted(s3_supervisor, store, s3_outage):
    """The last close fails to sync during an outage: the directory stays until it is durable."""
    supervisor = s3_supervisor("--warm-idle-time", "0", "--sync-retry-max", "0.5")
    with Session.connect(supervisor.socket, "alice", "keep") as session:
        session.initialize()
        workspace = session.workspace
        s3_outage.stop()
        write(session, "precious.txt", "do not lose me")
    wait_until(lambda: events(supervisor, "workspace_sync_failed"), timeout=20)
    time.sleep(1.5)  # several retries fail meanwhile
    assert os.path.exists(os.path.join(workspace, "precious.txt"))
    admin_request(supervisor.socket, {"admin": "cleanup"})
    assert os.path.exists(os.path.join(workspace, "precious.txt"))
    s3_outage.start()
    wait_until(lambda: "precious.txt" in store.paths("alice", "keep"), timeout=20)
    wait_until(lambda: not os.path.exists(workspace), timeout=10)
    # The directory goes in a worker thread; the event is written when it reports back.
    wait_until(lambda: events(supervisor, "workspace_evicted"), timeout=10)


def test_supervisor_killed_before_a_sync_converges_at_the_next_start(
        s3_supervisor, store, start_supervisor):
    """SIGKILL with changes not yet synced: the next start's cleanup commits them."""
    first = s3_supervisor("--sync-delay", "3600")
    with Session.connect(first.socket, "alice", "crash") as session:
        session.initialize()
        write(session, "unsynced.txt", "still here")
        workspace = session.workspace
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
    assert store.manifest("alice", "crash") is None
    # The same host restarts with eviction on: its first cleanup syncs, then evicts.
    second = s3_supervisor("--warm-idle-time", "0", base=first.base)
    try:
        wait_until(lambda: "unsynced.txt" in store.paths("alice", "crash"), timeout=20)
        # Durable now: a later cleanup (run here on request) evicts it.
        wait_until(lambda: admin_request(second.socket, {"admin": "cleanup"})["evicted"] == 1
                   or not os.path.exists(workspace), timeout=20)
        assert not os.path.exists(workspace)
    finally:
        second.stop()


# -- warm reuse and eviction -------------------------------------------------


def test_warm_directory_is_reused_without_downloads(s3_supervisor):
    """Within warm_idle_time a re-attach reconciles with a 304 and a stat walk."""
    supervisor = s3_supervisor("--warm-idle-time", "3600")
    with Session.connect(supervisor.socket, "alice", "warm") as session:
        session.initialize()
        write(session, "big.txt", "x" * 100_000)
        workspace = session.workspace
    wait_until(lambda: events(supervisor, "workspace_synced"))
    assert os.path.exists(os.path.join(workspace, "big.txt"))
    with Session.connect(supervisor.socket, "alice", "warm") as session:
        session.initialize()
        assert session.call_tool("bash", {"command": "wc -c < big.txt"})["content"][0][
            "text"].strip() == "100000"
    hydrated = events(supervisor, "workspace_hydrated")
    assert len(hydrated) == 2 and hydrated[-1]["downloaded"] == 0


def test_idle_time_zero_evicts_and_rehydrates(s3_supervisor):
    """warm_idle_time 0: the directory goes once durable; the next attach downloads it."""
    supervisor = s3_supervisor("--warm-idle-time", "0")
    with Session.connect(supervisor.socket, "alice", "cold") as session:
        session.initialize()
        write(session, "f.txt", "cold start")
        workspace = session.workspace
    wait_until(lambda: not os.path.exists(workspace), timeout=10)
    with Session.connect(supervisor.socket, "alice", "cold") as session:
        session.initialize()
        assert session.call_tool("read", {"path": "f.txt"})["content"][0]["text"] == "cold start"
    assert events(supervisor, "workspace_hydrated")[-1]["downloaded"] == 1


def test_cleanup_evicts_directories_idle_longer_than_the_idle_time(s3_supervisor):
    """The periodic cleanup (run on request here) removes idle, durable local copies."""
    supervisor = s3_supervisor("--warm-idle-time", "1")
    with Session.connect(supervisor.socket, "alice", "idle") as session:
        session.initialize()
        write(session, "f.txt", "idle")
        workspace = session.workspace
    wait_until(lambda: events(supervisor, "workspace_synced"))
    time.sleep(1.2)
    result = admin_request(supervisor.socket, {"admin": "cleanup"})
    assert result["evicted"] == 1
    assert not os.path.exists(workspace)
    assert events(supervisor, "cleanup_finished")[-1]["evicted"] == 1


# -- deletion -----------------------------------------------------------------


def test_delete_a_conversation_while_attached(s3_supervisor, store):
    """``corral delete``: the runner dies, the local files and the store's copy go.

    With ``blob_gc_grace`` 0 unshared blobs go at once (younger ones are
    otherwise left to the collection, see docs/operations.md).
    """
    supervisor = s3_supervisor("--sync-delay", "3600", "--blob-gc-grace", "0")
    with Session.connect(supervisor.socket, "alice", "keep") as other:
        other.initialize()
        write(other, "shared.txt", "same bytes")
        other.checkpoint()
    session = Session.connect(supervisor.socket, "alice", "doomed")
    session.initialize()
    write(session, "shared.txt", "same bytes")
    write(session, "own.txt", "only here")
    session.checkpoint()
    uid, workspace = session.uid, session.workspace
    session.call_tool("bash", {"command": "sleep 600 >/dev/null 2>&1 &"})
    out = subprocess.run(
        [sys.executable, "-m", "supervisor", "delete", "--socket", supervisor.socket,
         "--owner", "alice", "--conversation", "doomed"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["owner"] == "alice" and result["conversation"] == "doomed"
    with pytest.raises((OSError, ConnectionError)):
        session.call_tool("bash", {"command": "true"}, timeout=10)
    session.close()
    assert not os.path.exists(workspace)
    assert store.manifest("alice", "doomed") is None
    assert not store.keys("alice/conversations/doomed/")
    # The blob the other conversation uses stays; the deleted one's own blob goes.
    blobs = store.keys("alice/blobs/")
    assert hashlib.sha256(b"same bytes").hexdigest() in "".join(blobs)
    assert hashlib.sha256(b"only here").hexdigest() not in "".join(blobs)
    assert store.paths("alice", "keep") == {"shared.txt"}
    wait_until(lambda: not processes_of_uid(uid), timeout=10)
    deleted = events(supervisor, "workspace_deleted")
    assert deleted and deleted[0]["reason"] == "request"
    # The conversation can start afresh.
    with Session.connect(supervisor.socket, "alice", "doomed") as session:
        session.initialize()
        assert session.call_tool("bash", {"command": "ls -A | wc -l"})["content"][0][
            "text"].strip() == "0"


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_delete_an_owner_frees_everything(storage, start_supervisor, isolation, s3_location,
                                          store):
    """Deleting an owner removes its directory (its uid is free) and all it stored."""
    args = ["--storage", f"s3:{s3_location}"] if storage == "s3" else []
    supervisor = start_supervisor(isolation, extra_args=args,
                                  env={"CORRAL_S3_ENDPOINT_URL": os.environ[
                                      "CORRAL_S3_ENDPOINT_URL"]})
    for conversation in ("one", "two"):
        with Session.connect(supervisor.socket, "bob", conversation) as session:
            session.initialize()
            write(session, "f.txt", conversation)
            session.checkpoint()
    owner_dir = os.path.join(supervisor.workspace_root, "bob")
    assert os.path.isdir(owner_dir)
    result = admin_request(supervisor.socket, {"admin": "delete", "owner": "bob"})
    assert result["owner"] == "bob" and result["local_removed"] is True
    assert not os.path.exists(owner_dir)
    if storage == "s3":
        assert store.keys("bob/") == []
    assert events(supervisor, "owner_deleted")
    with Session.connect(supervisor.socket, "bob", "one") as session:
        session.initialize()
        assert session.call_tool("bash", {"command": "ls -A | wc -l"})["content"][0][
            "text"].strip() == "0"


def test_admin_requests_need_root_or_the_admin_group(start_supervisor, isolation):
    """A socket-group member who is not in admin_group is refused ``forbidden``."""
    group = 4242
    supervisor = start_supervisor(isolation, extra_args=["--socket-group", str(group)])
    # The standard library only: the repository need not be readable by that uid.
    script = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n"
              "s.sendall(b'{\"corral\": 1, \"admin\": \"cleanup\"}\\n')\n"
              "print(s.makefile().readline())\n")
    run = ["setpriv", "--reuid", "23456", "--regid", str(group), "--clear-groups",
           "/usr/bin/python3", "-I", "-c", script, supervisor.socket]
    out = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)["error"]["code"] == "forbidden", out.stderr
    supervisor.stop()
    allowed = start_supervisor(isolation, extra_args=[
        "--socket-group", str(group), "--admin-group", str(group)])
    run[-1] = allowed.socket
    out = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert "evicted" in json.loads(out.stdout)["result"], out.stderr
    with pytest.raises(HelloRefused) as refused:
        admin_request(allowed.socket, {"admin": "delete", "owner": "../etc"})
    assert refused.value.code == "bad_name"


# -- retention and garbage ----------------------------------------------------


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_retention_deletes_conversations_not_attached_for_long(
        storage, start_supervisor, isolation, s3_location, store):
    """Unused for longer than retention: deleted by the cleanup; an attached one is kept."""
    args = ["--retention", "2", "--cleanup-interval", "1"]
    if storage == "s3":
        args += ["--storage", f"s3:{s3_location}"]
    supervisor = start_supervisor(isolation, extra_args=args, env={
        "CORRAL_S3_ENDPOINT_URL": os.environ["CORRAL_S3_ENDPOINT_URL"]})
    with Session.connect(supervisor.socket, "carol", "old") as session:
        session.initialize()
        write(session, "f.txt", "old")
        session.checkpoint()
        old = session.workspace
    with Session.connect(supervisor.socket, "carol", "busy") as busy:
        busy.initialize()
        wait_until(lambda: [e for e in events(supervisor, "workspace_deleted")
                            if e["conversation"] == "old"], timeout=15)
        assert not os.path.exists(old)
        if storage == "s3":
            assert store.manifest("carol", "old") is None
        time.sleep(2.5)  # longer than retention, but attached all along
        assert busy.call_tool("bash", {"command": "true"})["structuredContent"]["exitCode"] == 0
        assert os.path.isdir(busy.workspace)
    assert events(supervisor, "workspace_deleted")[0]["reason"] == "retention"


def test_cleanup_collects_orphan_blobs(s3_supervisor, store):
    """Blobs no manifest names, older than blob_gc_grace, are deleted; referenced ones stay."""
    supervisor = s3_supervisor("--blob-gc-grace", "0", "--sync-delay", "3600")
    with Session.connect(supervisor.socket, "dave", "c") as session:
        session.initialize()
        write(session, "kept.txt", "referenced")
        session.checkpoint()
    orphan = store.put_blob("dave", b"nobody refers to me")
    time.sleep(1.1)
    result = admin_request(supervisor.socket, {"admin": "cleanup"})
    assert result["blobs_deleted"] == 1
    blobs = "".join(store.keys("dave/blobs/"))
    assert orphan not in blobs
    assert hashlib.sha256(b"referenced").hexdigest() in blobs


# -- two hosts ---------------------------------------------------------------------


def test_two_supervisors_committing_one_conversation_conflict_loudly(s3_supervisor, store):
    """Both attach the same conversation and change it: one wins, the other is told and kept."""
    first = s3_supervisor("--sync-delay", "3600")
    second = s3_supervisor("--sync-delay", "3600")
    with Session.connect(first.socket, "erin", "both") as a, \
            Session.connect(second.socket, "erin", "both") as b:
        a.initialize()
        b.initialize()
        write(a, "from-a.txt", "a")
        write(b, "from-b.txt", "b")
        assert a.checkpoint()["durable"] is True
        with pytest.raises(RpcError) as conflict:
            b.checkpoint()
        assert conflict.value.data["code"] == "sync_conflict"
    assert store.paths("erin", "both") == {"from-a.txt"}
    copies = store.keys("erin/conversations/both/conflicts/")
    assert copies
    assert events(second, "workspace_sync_conflict")


def test_an_interrupted_deletion_is_finished_at_the_next_start(s3_supervisor, store):
    """A crash between the store's and the local deletion: the next start finishes it."""
    first = s3_supervisor("--sync-delay", "3600")
    with Session.connect(first.socket, "frank", "gone") as session:
        session.initialize()
        write(session, "f.txt", "deleted soon")
        session.checkpoint()
        workspace = session.workspace
    first.stop()
    # What a crash half-way through ``corral delete`` leaves: its marker, the files.
    marker = os.path.join(first.state_dir, "deletions", "frank", "gone")
    os.makedirs(os.path.dirname(marker))
    open(marker, "w").close()
    second = s3_supervisor(base=first.base)
    try:
        wait_until(lambda: not os.path.exists(workspace) and not os.path.exists(marker),
                   timeout=15)
        assert store.manifest("frank", "gone") is None
        wait_until(lambda: [e for e in events(second, "workspace_deleted")
                            if e["reason"] == "resumed"], timeout=10)
    finally:
        second.stop()


def test_a_host_switches_from_local_to_s3_with_configuration_alone(
        start_supervisor, isolation, s3_location, store):
    """Stop a local supervisor, start it again with storage = s3: the work is kept and stored."""
    local = start_supervisor(isolation)
    with Session.connect(local.socket, "gina", "switch") as session:
        session.initialize()
        write(session, "kept/notes.txt", "written under local")
    local.stop()
    endpoint = {"CORRAL_S3_ENDPOINT_URL": os.environ["CORRAL_S3_ENDPOINT_URL"]}
    s3 = RunningSupervisor(isolation, ["--storage", f"s3:{s3_location}"], endpoint,
                           base=local.base).start()
    try:
        with Session.connect(s3.socket, "gina", "switch") as session:
            session.initialize()
            assert session.call_tool("read", {"path": "kept/notes.txt"})["content"][0][
                "text"] == "written under local"
            assert "kept/notes.txt" in store.paths("gina", "switch")
    finally:
        s3.stop()


def test_swaps_and_renames_during_syncs_never_lead_root_outside(s3_supervisor, store):
    """A tenant swaps its directories and files for symlinks to root-only files while
    root syncs again and again: nothing outside the workspace is read, written or stored."""
    supervisor = s3_supervisor("--sync-delay", "0.05")
    canary_dir = os.path.join(supervisor.base, "canary")
    os.mkdir(canary_dir, 0o700)
    secret = os.urandom(16).hex().encode()
    canary = os.path.join(canary_dir, "secret.txt")
    with open(canary, "wb") as f:
        f.write(secret)
    os.chmod(canary, 0o600)
    before = os.lstat(canary)
    swapper = (
        "mkdir -p d && echo inside > d/inside.txt && echo f > f.txt; "
        "end=$((SECONDS + 6)); "
        "(while [ $SECONDS -lt $end ]; do "
        f"  mv d d.real; ln -s {canary_dir} d; rm d; mv d.real d; "
        f"  mv f.txt f.real; ln -s {canary} f.txt; rm f.txt; mv f.real f.txt; "
        f"  ln -sfn {canary_dir} d/link; echo $RANDOM > d/inside.txt; "
        "done) >/dev/null 2>&1 & echo started")
    with Session.connect(supervisor.socket, "ivan", "race") as session:
        session.initialize()
        assert "started" in session.call_tool("bash", {"command": swapper})["content"][0]["text"]
        deadline = time.monotonic() + 6
        syncs = 0
        while time.monotonic() < deadline:
            session.checkpoint()
            syncs += 1
        session.call_tool("bash", {"command": "sleep 0.5; wait"})
        session.checkpoint()
    assert syncs >= 3  # many more on an idle machine; CI shares 2 cores
    digest = hashlib.sha256(secret).hexdigest()
    assert digest not in "".join(store.keys("ivan/blobs/"))
    after = os.lstat(canary)
    assert (after.st_uid, after.st_mode, after.st_mtime_ns) == (
        before.st_uid, before.st_mode, before.st_mtime_ns)
    with open(canary, "rb") as f:
        assert f.read() == secret
    assert sorted(os.listdir(canary_dir)) == ["secret.txt"]
    for entry in store.manifest("ivan", "race")["entries"]:
        assert entry["type"] in ("file", "dir", "symlink")
