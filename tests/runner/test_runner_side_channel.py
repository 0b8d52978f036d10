"""The runner's side channel to its supervisor: change notices and checkpoints."""

import json
import os
import select

import pytest
from runner_harness import RunnerProcess, wait_until


def _read_line(fd: int, timeout: float = 10.0) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, f"no side-channel line within {timeout} s (got {data!r})"
        chunk = os.read(fd, 4096)
        assert chunk, "the side channel closed"
        data += chunk
    return json.loads(data)


def _nothing_to_read(fd: int, wait: float = 0.2) -> bool:
    return not select.select([fd], [], [], wait)[0]


@pytest.fixture
def channel(tmp_path):
    """A runner with the side channel: (runner, events read end, answers write end)."""
    events_read, events_write = os.pipe()
    answers_read, answers_write = os.pipe()
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    runner = RunnerProcess(workspace, "--events-fd", str(events_write), "--answers-fd",
                           str(answers_read), "--change-events",
                           pass_fds=(events_write, answers_read))
    os.close(events_write)
    os.close(answers_read)
    yield runner, events_read, answers_write
    runner.stop()
    os.close(events_read)
    try:
        os.close(answers_write)
    except OSError:
        pass


def test_checkpoint_needs_a_supervisor(runner):
    """Without the side channel a checkpoint is an unknown method, said plainly."""
    answer = runner.call("corral/checkpoint")
    assert answer["error"]["code"] == -32601
    assert "supervisor" in answer["error"]["message"]


def test_changing_tools_notify_and_reading_does_not(channel):
    runner, events, _ = channel
    runner.call_tool("write", {"path": "a.txt", "content": "a"})
    assert _read_line(events) == {"event": "changed"}
    runner.call_tool("read", {"path": "a.txt"})
    assert _nothing_to_read(events)
    runner.call_tool("bash", {"command": "true"})
    assert _read_line(events) == {"event": "changed"}


def test_commands_do_not_inherit_the_side_channel(channel):
    runner, _, _ = channel
    result = runner.call_tool("bash", {"command": "ls /proc/self/fd"})
    assert result["content"][0]["text"].split() == ["0", "1", "2", "3"]


def test_checkpoint_is_answered_by_the_supervisor(channel):
    runner, events, answers = channel
    request_id = runner.request("corral/checkpoint")
    event = _read_line(events)
    assert event["event"] == "checkpoint"
    assert _nothing_to_read(events)
    # Garbage and unknown tokens on the answers pipe are ignored.
    os.write(answers, b"not json\n{\"checkpoint\": 999, \"ok\": true}\n[1]\n")
    os.write(answers, json.dumps({"checkpoint": event["token"], "ok": True,
                                  "result": {"storage": "s3", "uploaded": 1}}).encode() + b"\n")
    answer = runner.response(request_id)
    assert answer["result"] == {"durable": True, "storage": "s3", "uploaded": 1}


def test_a_failed_checkpoint_is_an_error_with_its_code(channel):
    runner, events, answers = channel
    request_id = runner.request("corral/checkpoint")
    token = _read_line(events)["token"]
    os.write(answers, json.dumps({"checkpoint": token, "ok": False, "code": "storage_unavailable",
                                  "message": "the store is unreachable"}).encode() + b"\n")
    error = runner.response(request_id)["error"]
    assert error["code"] == -32001 and error["data"] == {"code": "storage_unavailable"}
    assert "unreachable" in error["message"]


def test_checkpoints_fail_when_the_supervisor_goes(channel):
    runner, events, answers = channel
    request_id = runner.request("corral/checkpoint")
    _read_line(events)
    os.close(answers)
    error = runner.response(request_id)["error"]
    assert error["data"]["code"] == "unavailable"


def test_half_close_waits_for_a_pending_checkpoint(channel):
    """End of input is a half-close: the checkpoint in flight is still answered."""
    runner, events, answers = channel
    request_id = runner.request("corral/checkpoint")
    token = _read_line(events)["token"]
    runner.process.stdin.close()
    os.write(answers, json.dumps({"checkpoint": token, "ok": True}).encode() + b"\n")
    assert runner.response(request_id)["result"] == {"durable": True}


def test_the_options_go_together(tmp_path):
    runner = RunnerProcess(tmp_path, "--events-fd", "5")
    assert runner.process.wait(10) == 2
    wait_until(lambda: b"go together" in runner.stderr)


def test_change_events_only_when_asked(tmp_path):
    """Without --change-events (a backend that needs no syncs) nothing is written per call."""
    events_read, events_write = os.pipe()
    answers_read, answers_write = os.pipe()
    runner = RunnerProcess(tmp_path, "--events-fd", str(events_write), "--answers-fd",
                           str(answers_read), pass_fds=(events_write, answers_read))
    os.close(events_write)
    os.close(answers_read)
    try:
        runner.call_tool("write", {"path": "a.txt", "content": "a"})
        assert _nothing_to_read(events_read)
    finally:
        runner.stop()
        os.close(events_read)
        os.close(answers_write)
