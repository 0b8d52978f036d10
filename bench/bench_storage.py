"""Storage backend ``s3``: change detection, upload volume, cold hydrate, warm re-attach.

Runs against moto's standalone server (``tests/s3_server.py``) started as a
subprocess on a free loopback port, like ``tests/s3_fixtures.py``, with the
backend built as the tests build it (``plugins.storage_s3._build``). Every
floor is measured in the same run, interleaved with the figure it bounds:

1. Change detection: ``supervisor.manifest.plan_sync`` on a 10,000-file
   workspace (110 directories) with one changed 4 KiB file, using the state
   the previous sync saved, against a bare ``os.scandir`` + ``lstat`` walk
   of the same tree (fd-relative and path-based; the faster is the floor).
   Warm page cache, median of the repetitions. Target: at most 1.3x.
2. Upload volume: ``sync_blocking`` after that one change; the request
   bodies actually sent (boto3's ``before-send`` hook, Content-Length) and
   the requests of each kind. Target: the file's 4096-byte blob plus the
   manifest, nothing else.
3. Cold hydrate: ``hydrate_blocking`` of a 1 GiB workspace (200 files of
   random content) into an empty directory, against plain boto3
   ``get_object`` of the same 200 blobs streamed to files in an empty
   directory by a ThreadPoolExecutor as wide as the plugin's transfer pool.
   Five alternating runs each, best of each (the median, and the CPU
   seconds both sides used, recorded too). Target: at least 0.8x plain
   boto3's throughput.
4. Warm re-attach: ``hydrate_blocking`` of the 10,000-file workspace whose
   manifest did not change (a 304 and a stat walk) against the bare walk.
   Target: at most 1.5x.

    .venv/bin/python -m bench.bench_storage [--count N]
"""

import os
import resource
import secrets
import shutil
import stat
import statistics
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

from bench.common import REPO, compare, record, summary
from supervisor.fsutil import DIR_FLAGS
from tests.support import traversable_tempdir

OWNER = "bench"
OWNER_UID = 61000
SMALL = "c-small"
BIG = "c-big"
DIRECTORIES = (10, 10)  # 10 top-level directories of 10 each: 110 directories
FILES = 10_000
CHANGED = "d0/s0/f0000.txt"
CHANGED_SIZE = 4096
DISTINCT = 1000
BIG_FILES = 200
BIG_TOTAL = 1 << 30
HYDRATE_ROUNDS = 5
MIB = 1 << 20


def _count() -> int:
    if "--count" in sys.argv:
        return int(sys.argv[sys.argv.index("--count") + 1])
    return 15


# --- the server and the backend ----------------------------------------------


class Server:
    """moto's S3 server in a subprocess, as tests/s3_fixtures.py starts it."""

    def __init__(self):
        from tests.s3_fixtures import _MOTO_CREDENTIALS, _free_port, _wait_until_up

        os.environ.update(_MOTO_CREDENTIALS)
        port = _free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        # Keep 5 MiB objects in moto's memory (its default spools anything above
        # 5 MiB - 1 KiB to a temporary file, whose write-back would add noise).
        env = {**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(64 * MIB)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.s3_server", "--port", str(port)],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        try:
            _wait_until_up(self.endpoint, self.process)
            os.environ["CORRAL_S3_ENDPOINT_URL"] = self.endpoint
            from plugins.storage_s3 import make_client

            self.bucket = "corral-bench-" + secrets.token_hex(4)
            make_client(self.endpoint).create_bucket(Bucket=self.bucket)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Host:
    """One supervisor host's state directory, owner directory and S3Storage."""

    def __init__(self, base: str, name: str, location: str):
        from plugins.storage_s3 import _build
        from supervisor.identities import OwnerIdentity

        self.state_dir = os.path.join(base, name, "state")
        os.makedirs(self.state_dir, mode=0o700)
        root = os.path.join(self.state_dir, "workspaces")
        os.makedirs(root, mode=0o711)
        directory = os.path.join(root, OWNER)
        os.mkdir(directory, 0o700)
        uid = gid = OWNER_UID
        if os.geteuid() == 0:
            os.chown(directory, uid, gid)
        else:
            uid, gid = os.getuid(), os.getgid()
        self.identity = OwnerIdentity(OWNER, uid, gid, directory)
        self.storage = _build(location, types.SimpleNamespace(state_dir=self.state_dir))

    def workspace(self, conversation: str) -> str:
        return os.path.join(self.identity.directory, conversation)

    def state_path(self, conversation: str) -> str:
        return self.storage._state_path(OWNER, conversation)

    def hydrate(self, conversation: str):
        return self.storage.hydrate_blocking(self.identity, conversation)

    def sync(self, conversation: str):
        return self.storage.sync_blocking(self.identity, conversation)


class RequestLog:
    """Every request the client sends (boto3's ``before-send``) and every answer's status."""

    def __init__(self, client):
        self.client = client
        self.sent = []  # (operation, body bytes on the wire, decoded body bytes)
        self.statuses = []  # (operation, HTTP status)
        client.meta.events.register("before-send.s3", self._send)
        client.meta.events.register("after-call.s3", self._answer)

    def _send(self, request, event_name, **_):
        body = request.body
        length = request.headers.get("Content-Length")
        if length is not None:
            length = int(length)
        elif isinstance(body, (bytes, bytearray)):
            length = len(body)
        else:
            length = 0
        decoded = request.headers.get("X-Amz-Decoded-Content-Length")
        self.sent.append((event_name.rsplit(".", 1)[-1], length,
                          int(decoded) if decoded is not None else length))

    def _answer(self, http_response, model, **_):
        self.statuses.append((model.name, http_response.status_code))

    def clear(self) -> None:
        self.sent.clear()
        self.statuses.clear()

    def close(self) -> None:
        self.client.meta.events.unregister("before-send.s3", self._send)
        self.client.meta.events.unregister("after-call.s3", self._answer)


# --- workspaces ----------------------------------------------------------------


def _own(path: str, uid: int, gid: int) -> None:
    if os.geteuid() == 0:
        os.chown(path, uid, gid, follow_symlinks=False)


def small_paths() -> list[str]:
    """The 10,000 file paths, spread evenly over the 100 leaf directories."""
    leaves = [f"d{i}/s{j}" for i in range(DIRECTORIES[0]) for j in range(DIRECTORIES[1])]
    per = FILES // len(leaves)
    return [f"{leaf}/f{k:04d}.txt" for leaf in leaves for k in range(per)]


def write_small(root: str, uid: int, gid: int) -> None:
    """10,000 files of 200 B to 8 KiB of random bytes (the one that changes: 4 KiB).

    Their contents come from a pool of DISTINCT random blobs, so the first
    sync (set-up, not measured) uploads 1,000 blobs rather than 10,000:
    moto answers a few hundred requests a second on this machine. Nothing
    measured depends on how many blobs there are.
    """
    pool = [os.urandom(int.from_bytes(os.urandom(2), "big") % 8000 + 200)
            for _ in range(DISTINCT)]
    for index, path in enumerate(small_paths()):
        full = os.path.join(root, path)
        parent = os.path.dirname(full)
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o755)
            _own(os.path.dirname(parent), uid, gid)
            _own(parent, uid, gid)
        with open(full, "wb") as f:
            f.write(os.urandom(CHANGED_SIZE) if path == CHANGED else pool[index % DISTINCT])
        _own(full, uid, gid)


def write_big(root: str, uid: int, gid: int) -> None:
    """200 files of random content, 1 GiB in all, in 10 directories."""
    size = BIG_TOTAL // BIG_FILES
    for i in range(BIG_FILES):
        parent = os.path.join(root, f"part{i % 10}")
        if not os.path.isdir(parent):
            os.mkdir(parent, 0o755)
            _own(parent, uid, gid)
        full = os.path.join(parent, f"blob{i:03d}.bin")
        with open(full, "wb") as f:
            f.write(os.urandom(size + (BIG_TOTAL - size * BIG_FILES if i == 0 else 0)))
        _own(full, uid, gid)


# --- floors --------------------------------------------------------------------


def walk_fd(root: str) -> dict:
    """``{path: stat_result}`` by scandir + lstat, relative to directory descriptors."""
    found = {}
    stack = [("", os.open(root, DIR_FLAGS))]
    while stack:
        prefix, fd = stack.pop()
        try:
            with os.scandir(fd) as entries:
                for item in entries:
                    path = prefix + item.name
                    st = item.stat(follow_symlinks=False)
                    found[path] = st
                    if stat.S_ISDIR(st.st_mode):
                        stack.append((path + "/", os.open(item.name, DIR_FLAGS, dir_fd=fd)))
        finally:
            os.close(fd)
    return found


def walk_path(root: str) -> dict:
    """``{path: stat_result}`` by scandir + lstat on full paths."""
    found = {}
    stack = [root]
    cut = len(root) + 1
    while stack:
        with os.scandir(stack.pop()) as entries:
            for item in entries:
                st = item.stat(follow_symlinks=False)
                found[item.path[cut:]] = st
                if stat.S_ISDIR(st.st_mode):
                    stack.append(item.path)
    return found


def boto3_download(client, bucket: str, keys: list[str], directory: str, workers: int) -> int:
    """Plain boto3: every key streamed into a fresh file in ``directory``; returns bytes."""
    def get(item):
        index, key = item
        response = client.get_object(Bucket=bucket, Key=key)
        body = response["Body"]
        size = 0
        try:
            with open(os.path.join(directory, f"{index:03d}"), "wb") as f:
                for chunk in body.iter_chunks(MIB):
                    f.write(chunk)
                    size += len(chunk)
        finally:
            body.close()
        return size

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(get, enumerate(keys)))


def _ms(function) -> float:
    start = time.perf_counter()
    function()
    return (time.perf_counter() - start) * 1000


# --- the measurements ----------------------------------------------------------


def change_detection(host: Host, count: int) -> dict:
    """plan_sync with one changed file against the bare walks, interleaved."""
    from supervisor import manifest as mf
    from supervisor.fsutil import open_directory

    root = host.workspace(SMALL)
    # The state as the backend has it: with the plan of the last sync in memory,
    # made before the one file changed (a supervisor keeps it between syncs).
    state = host.storage._load_state(OWNER, SMALL)
    assert state.plan is not None, "the backend kept no plan of the last sync"
    uid = host.identity.uid

    def plan(previous=state.plan):
        fd = open_directory(host.identity.directory, SMALL)
        try:
            return mf.plan_sync(fd, state, uid, previous=previous)
        finally:
            os.close(fd)

    for _ in range(3):  # warm the page cache and the interpreter for all three
        plan(), walk_fd(root), walk_path(root)
    planned = plan()
    assert planned.hashed == 1 and planned.changed(state.manifest), planned.hashed
    assert len(walk_fd(root)) == len(walk_path(root)) == len(planned.scan)
    ours, by_fd, by_path = [], [], []
    for i in range(count):
        steps = [(ours, plan), (by_fd, lambda: walk_fd(root)), (by_path, lambda: walk_path(root))]
        for samples, function in (steps if i % 2 == 0 else steps[::-1]):
            samples.append(_ms(function))
    fd_p50, path_p50 = statistics.median(by_fd), statistics.median(by_path)
    floor, floor_name = (by_fd, "fd-relative") if fd_p50 <= path_p50 else (by_path, "path-based")
    load = [_ms(lambda: mf.load_state(host.state_path(SMALL))) for _ in range(5)]
    # Without the last plan (after a restart): every entry decided from the stamps.
    cold = [_ms(lambda: plan(None)) for _ in range(5)]
    compare_ms = [_ms(lambda: planned.changed(state.manifest)) for _ in range(5)]
    result = compare(ours, floor, 1.3)
    result.update({
        "entries": len(walk_fd(root)),
        "floor_kind": floor_name,
        "walk_fd": summary(by_fd),
        "walk_path": summary(by_path),
        "load_state_p50_ms": round(statistics.median(load), 3),
        "without_last_plan_p50_ms": round(statistics.median(cold), 3),
        "compare_manifests_p50_ms": round(statistics.median(compare_ms), 3),
        "target_met": result["ratio_p50"] <= 1.3,
    })
    return result


def upload_volume(host: Host, log: RequestLog) -> dict:
    """sync_blocking after rewriting one 4 KiB file: the bodies and requests sent."""
    from supervisor import manifest as mf

    log.clear()
    start = time.perf_counter()
    stats = host.sync(SMALL)
    duration = time.perf_counter() - start
    state = mf.load_state(host.state_path(SMALL))
    manifest_size = len(state.manifest.to_bytes(OWNER, SMALL))
    kinds = {}
    for operation, wire, _ in log.sent:
        kind = kinds.setdefault(operation, {"requests": 0, "body_bytes": 0})
        kind["requests"] += 1
        kind["body_bytes"] += wire
    sent = sum(wire for _, wire, _ in log.sent)
    decoded = sum(d for _, _, d in log.sent)
    expected = CHANGED_SIZE + manifest_size
    return {
        "body_bytes_sent": sent,
        "body_bytes_decoded": decoded,
        "expected_bytes": expected,
        "blob_bytes": CHANGED_SIZE,
        "manifest_bytes": manifest_size,
        "requests": sum(k["requests"] for k in kinds.values()),
        "by_operation": kinds,
        "statuses": sorted(set(log.statuses)),
        "sync_stats": {"uploaded": stats.uploaded, "bytes_uploaded": stats.bytes_uploaded,
                       "hashed": stats.hashed, "committed": stats.committed},
        "sync_ms": round(duration * 1000, 3),
        "target_met": sent == expected and set(kinds) <= {"HeadObject", "PutObject"}
        and kinds.get("PutObject", {}).get("requests") == 2,
    }


def warm_reattach(host: Host, log: RequestLog, count: int) -> dict:
    """hydrate_blocking of the unchanged, already-hydrated workspace against the bare walks."""
    root = host.workspace(SMALL)

    def reattach():
        _, stats = host.hydrate(SMALL)
        assert stats.downloaded == 0 and stats.hashed == 0 and stats.removed == 0, stats

    for _ in range(3):
        reattach(), walk_fd(root), walk_path(root)
    log.clear()
    ours, by_fd, by_path = [], [], []
    for i in range(count):
        steps = [(ours, reattach), (by_fd, lambda: walk_fd(root)),
                 (by_path, lambda: walk_path(root))]
        for samples, function in (steps if i % 2 == 0 else steps[::-1]):
            samples.append(_ms(function))
    requests = sorted(set(log.statuses))
    assert len(log.statuses) == count and requests == [("GetObject", 304)], requests
    fd_p50, path_p50 = statistics.median(by_fd), statistics.median(by_path)
    floor, floor_name = (by_fd, "fd-relative") if fd_p50 <= path_p50 else (by_path, "path-based")
    result = compare(ours, floor, 1.5)
    result.update({
        "floor_kind": floor_name,
        "walk_fd": summary(by_fd),
        "walk_path": summary(by_path),
        "requests_per_reattach": len(log.statuses) / count,
        "answers": [f"{op} {status}" for op, status in requests],
        "target_met": result["ratio_p50"] <= 1.5,
    })
    return result


def _cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (all threads), or of ``pid``."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cold_hydrate(cold: Host, server: Server, keys: list[str], base: str) -> dict:
    """hydrate_blocking of the 1 GiB workspace into an empty directory against plain boto3.

    The floor is a plain boto3 client (its default configuration) and a
    ThreadPoolExecutor as wide as the plugin's transfer pool.
    """
    import boto3

    from plugins.storage_s3 import TRANSFERS

    workers = cold.storage._transfers._max_workers
    assert workers == TRANSFERS
    client = boto3.session.Session().client("s3", endpoint_url=server.endpoint)
    floor_dir = os.path.join(base, "boto3-download")

    def reset():
        shutil.rmtree(cold.workspace(BIG), ignore_errors=True)
        shutil.rmtree(floor_dir, ignore_errors=True)
        try:
            os.unlink(cold.state_path(BIG))
        except FileNotFoundError:
            pass
        os.sync()

    def plugin():
        start = time.perf_counter()
        _, stats = cold.hydrate(BIG)
        seconds = time.perf_counter() - start
        assert stats.downloaded == BIG_FILES and stats.bytes_downloaded == BIG_TOTAL, stats
        return BIG_TOTAL / seconds / 1e6

    def plain():
        start = time.perf_counter()
        os.mkdir(floor_dir, 0o700)
        size = boto3_download(client, server.bucket, keys, floor_dir, workers)
        seconds = time.perf_counter() - start
        assert size == BIG_TOTAL, size
        return BIG_TOTAL / seconds / 1e6

    ours, floor = [], []
    cpu = {"corral": [], "floor": []}
    for i in range(HYDRATE_ROUNDS):
        order = [(ours, plugin, "corral"), (floor, plain, "floor")]
        for samples, function, name in (order if i % 2 == 0 else order[::-1]):
            reset()
            before = _cpu_seconds(), _cpu_seconds(server.process.pid)
            samples.append(function())
            cpu[name].append((_cpu_seconds() - before[0],
                              _cpu_seconds(server.process.pid) - before[1]))
    reset()
    best_ratio = max(ours) / max(floor)
    return {
        "corral_mb_s": [round(x, 1) for x in ours],
        "floor_mb_s": [round(x, 1) for x in floor],
        "corral_best_mb_s": round(max(ours), 1),
        "floor_best_mb_s": round(max(floor), 1),
        "ratio_best": round(best_ratio, 3),
        "ratio_median": round(statistics.median(ours) / statistics.median(floor), 3),
        # CPU seconds for the GiB (median of the runs), this process and the
        # server's: steadier than MB/s on a shared machine.
        "corral_cpu_s": round(statistics.median(c for c, _ in cpu["corral"]), 2),
        "floor_cpu_s": round(statistics.median(c for c, _ in cpu["floor"]), 2),
        "server_cpu_s_corral": round(statistics.median(s for _, s in cpu["corral"]), 2),
        "server_cpu_s_floor": round(statistics.median(s for _, s in cpu["floor"]), 2),
        "files": BIG_FILES,
        "bytes": BIG_TOTAL,
        "transfers": workers,
        "target_ratio": 0.8,
        "target_met": best_ratio >= 0.8,
    }


def main() -> None:
    count = _count()
    started = time.monotonic()
    base = traversable_tempdir("corral-bench-s3-")
    server = None
    hosts = []
    try:
        server = Server()
        location = f"s3://{server.bucket}/bench-{secrets.token_hex(4)}"
        warm = Host(base, "warm", location)
        hosts.append(warm)
        uid, gid = warm.identity.uid, warm.identity.gid
        log = RequestLog(warm.storage.client)

        warm.hydrate(SMALL)  # creates the directory; nothing in the store yet
        write_small(warm.workspace(SMALL), uid, gid)
        # Files changed within RACY_NS of a walk are hashed again by the next
        # plan (coarse timestamps); a real workspace's files are older than that.
        from supervisor.manifest import RACY_NS

        time.sleep(RACY_NS / 1e9)
        setup = time.monotonic()
        warm.sync(SMALL)
        print(f"setup: first sync of {FILES} files took {time.monotonic() - setup:.1f} s",
              file=sys.stderr, flush=True)
        with open(os.path.join(warm.workspace(SMALL), CHANGED), "r+b") as f:
            f.write(os.urandom(CHANGED_SIZE))

        results = {"change_detection": change_detection(warm, count)}
        results["upload_one_file"] = upload_volume(warm, log)
        results["warm_reattach"] = warm_reattach(warm, log, count)
        log.close()

        warm.hydrate(BIG)
        write_big(warm.workspace(BIG), uid, gid)
        setup = time.monotonic()
        warm.sync(BIG)
        print(f"setup: first sync of 1 GiB took {time.monotonic() - setup:.1f} s",
              file=sys.stderr, flush=True)
        shutil.rmtree(warm.workspace(BIG))
        from supervisor import manifest as mf

        manifest = mf.load_state(warm.state_path(BIG)).manifest
        keys = [warm.storage._blob_key(OWNER, e.sha256) for e in manifest.entries
                if e.kind == mf.FILE]
        cold = Host(base, "cold", location)
        hosts.append(cold)
        results["hydrate_cold_1gib"] = cold_hydrate(cold, server, keys, base)
    finally:
        for host in hosts:
            host.storage.close()
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
    record("storage", {"results": results, "seconds": round(time.monotonic() - started, 1)})
    print_table(results)


def print_table(results: dict) -> None:
    """The figures, one line each, and whether each target is met."""
    c, u, w, h = (results[k] for k in ("change_detection", "upload_one_file", "warm_reattach",
                                       "hydrate_cold_1gib"))
    rows = [
        ("change detection, 10k files, p50", f"{c['corral']['p50_ms']:.1f} ms",
         f"{c['floor']['p50_ms']:.1f} ms", f"{c['ratio_p50']:.2f}", "<= 1.3", c["target_met"]),
        ("bytes sent after a 4 KiB change", f"{u['body_bytes_sent']} B",
         f"{u['expected_bytes']} B", f"{u['body_bytes_sent'] / u['expected_bytes']:.3f}",
         "blob + manifest", u["target_met"]),
        ("cold hydrate 1 GiB, best", f"{h['corral_best_mb_s']:.0f} MB/s",
         f"{h['floor_best_mb_s']:.0f} MB/s", f"{h['ratio_best']:.2f}", ">= 0.8", h["target_met"]),
        ("cold hydrate 1 GiB, median", "", "", f"{h['ratio_median']:.2f}", "", None),
        ("cold hydrate 1 GiB, client CPU", f"{h['corral_cpu_s']:.2f} s",
         f"{h['floor_cpu_s']:.2f} s", f"{h['corral_cpu_s'] / h['floor_cpu_s']:.2f}", "", None),
        ("warm re-attach, 10k files, p50", f"{w['corral']['p50_ms']:.1f} ms",
         f"{w['floor']['p50_ms']:.1f} ms", f"{w['ratio_p50']:.2f}", "<= 1.5", w["target_met"]),
    ]
    print(f"{'measurement':36} {'corral':>12} {'floor':>12} {'ratio':>7}  {'target':16} met")
    for name, ours, floor, ratio, target, met in rows:
        verdict = "" if met is None else "yes" if met else "NO"
        print(f"{name:36} {ours:>12} {floor:>12} {ratio:>7}  {target:16} {verdict}")
    print("requests after a 4 KiB change:",
          ", ".join(f"{op} x{k['requests']} ({k['body_bytes']} B)"
                    for op, k in u["by_operation"].items()))


if __name__ == "__main__":
    main()
