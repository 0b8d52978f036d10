"""The relay's byte path: completeness and bounded memory whatever the peers do."""

import threading
import time

import pytest

from tests.support import connect_raw, read_all, rss_kib, wait_until

pytestmark = pytest.mark.integration

MIB = 1 << 20


def test_output_after_runner_closes_stdin_arrives(start_supervisor):
    """A runner that closes its stdin keeps its connection: all of its output arrives."""
    supervisor = start_supervisor(
        "flood:16777216", extra_args=["--plugins", "tests.relay_plugin"]
    )
    sock = connect_raw(supervisor.socket, "relay", "c-1")
    time.sleep(0.3)
    assert read_all(sock) == 16 * MIB
    sock.close()


def test_stalled_reader_does_not_grow_the_supervisor(start_supervisor):
    """A client that stops reading during a flood pauses the runner instead of filling memory."""
    size = 512 * MIB
    supervisor = start_supervisor(f"flood:{size}", extra_args=["--plugins", "tests.relay_plugin"])
    pid = supervisor.process.pid
    before = rss_kib(pid)
    sock = connect_raw(supervisor.socket, "relay", "c-1")
    peak = before
    for _ in range(40):
        time.sleep(0.05)
        peak = max(peak, rss_kib(pid))
    assert (peak - before) < 16 * 1024, f"supervisor grew {(peak - before) // 1024} MiB"
    assert read_all(sock) == size
    sock.close()


def test_flooding_client_is_paused_not_buffered(start_supervisor):
    """A client writing to a runner that never reads is paused; the supervisor stays bounded."""
    supervisor = start_supervisor("deaf", extra_args=["--plugins", "tests.relay_plugin"])
    pid = supervisor.process.pid
    before = rss_kib(pid)
    sock = connect_raw(supervisor.socket, "relay", "c-1")
    sock.setblocking(False)
    chunk = b"x" * MIB
    sent = 0
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and sent < 256 * MIB:
        try:
            sent += sock.send(chunk)
        except BlockingIOError:
            time.sleep(0.01)
    assert sent < 64 * MIB, f"{sent // MIB} MiB were accepted from a client the runner never reads"
    assert (rss_kib(pid) - before) < 16 * 1024
    sock.close()
    wait_until(lambda: any(e["event"] == "connection_closed" for e in supervisor.audit_events()))


def test_many_clients_in_parallel_get_all_bytes(start_supervisor):
    """Several floods at once each arrive complete."""
    size = 32 * MIB
    supervisor = start_supervisor(f"flood:{size}", extra_args=["--plugins", "tests.relay_plugin"])
    counts = []

    def client():
        sock = connect_raw(supervisor.socket, "relay", "c-1")
        counts.append(read_all(sock))
        sock.close()

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert counts == [size] * 4


def test_client_leaving_while_output_is_paused_is_closed_completely(start_supervisor):
    """A client that hangs up while the relay has paused the runner's output is fully closed."""
    supervisor = start_supervisor(f"flood:{256 * MIB}", extra_args=["--plugins", "tests.relay_plugin"])
    sock = connect_raw(supervisor.socket, "relay", "c-1")
    time.sleep(0.5)
    sock.close()
    wait_until(
        lambda: {"runner_exited", "connection_closed"}
        <= {e["event"] for e in supervisor.audit_events()}
    )
