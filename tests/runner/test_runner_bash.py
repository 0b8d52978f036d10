"""The bash tool, run through a real runner process."""

import os
import time

import pytest

from runner_harness import process_gone, read_pid, wait_until


def test_output_and_success(runner):
    """A successful command returns its output and exit code 0."""
    result = runner.call_tool("bash", {"command": "echo hello; echo world"})
    assert result["content"] == [{"type": "text", "text": "hello\nworld\n"}]
    assert result["isError"] is False
    structured = result["structuredContent"]
    assert structured["exitCode"] == 0
    assert structured["signal"] is None
    assert not structured["timedOut"] and not structured["cancelled"]
    assert not structured["truncated"] and structured["fullOutputPath"] is None
    assert isinstance(structured["durationMs"], int)


def test_stdout_and_stderr_are_interleaved(runner):
    """stdout and stderr arrive on one stream, in the order written."""
    result = runner.call_tool("bash", {"command": "echo one; echo two >&2; echo three"})
    assert result["content"][0]["text"] == "one\ntwo\nthree\n"


def test_nonzero_exit_is_an_error_with_output(runner):
    """A non-zero exit marks the result isError, keeps the output and names the code."""
    result = runner.call_tool("bash", {"command": "echo partial; exit 3"})
    assert result["isError"] is True
    text = result["content"][0]["text"]
    assert text.startswith("partial\n")
    assert text.endswith("Command exited with code 3")
    assert result["structuredContent"]["exitCode"] == 3


def test_death_by_signal_reports_the_signal(runner):
    """A command killed by a signal reports exitCode null and the signal."""
    result = runner.call_tool("bash", {"command": "kill -SEGV $$"})
    assert result["isError"] is True
    assert result["structuredContent"]["exitCode"] is None
    assert result["structuredContent"]["signal"] == 11
    assert "SIGSEGV" in result["content"][0]["text"]


def test_no_output_says_so(runner):
    """A silent successful command returns "(no output)"."""
    result = runner.call_tool("bash", {"command": "true"})
    assert result["content"][0]["text"] == "(no output)"


def test_command_runs_in_the_workspace_with_stdin_closed(runner):
    """The command's working directory is the workspace and stdin is /dev/null."""
    result = runner.call_tool("bash", {"command": "pwd; cat; echo end"})
    assert result["content"][0]["text"] == f"{runner.workspace}\nend\n"


def test_command_runs_in_its_own_process_group(runner):
    """The command leads its own session and process group."""
    result = runner.call_tool("bash", {"command": "ps -o pid=,pgid=,sid= -p $$"})
    pid, pgid, sid = result["content"][0]["text"].split()
    assert pid == pgid == sid


def test_sigpipe_has_its_default_action(runner):
    """SIGPIPE is not ignored in commands, so pipelines end quietly."""
    result = runner.call_tool("bash", {"command": "yes | head -n 2"})
    assert result["content"][0]["text"] == "y\ny\n"


def test_invalid_utf8_output_is_replaced(runner):
    """Bytes that are not UTF-8 come back as replacement characters."""
    result = runner.call_tool("bash", {"command": r"printf 'a\377b\n'"})
    assert result["content"][0]["text"] == "a\ufffdb\n"


def test_concurrent_calls_answer_independently(runner):
    """A fast call started after a slow one is answered first."""
    slow = runner.start_tool("bash", {"command": "sleep 1; echo slow"})
    fast = runner.start_tool("bash", {"command": "echo fast"})
    runner.response(slow)
    answers = [m["id"] for m in runner.messages if m.get("id") in (slow, fast)]
    assert answers == [fast, slow]


def test_cancel_kills_the_process_group(runner, kill_leftovers):
    """notifications/cancelled kills the call's processes and answers with the output so far."""
    pid_file = runner.workspace / "child.pid"
    command = "echo started; sleep 100 & echo $! > child.pid; wait"
    call = runner.start_tool("bash", {"command": command})
    child = read_pid(pid_file)
    kill_leftovers.append(child)
    runner.notify("notifications/cancelled", {"requestId": call, "reason": "user stop"})
    result = runner.response(call)["result"]
    assert result["isError"] is True
    assert result["structuredContent"]["cancelled"] is True
    assert result["structuredContent"]["timedOut"] is False
    text = result["content"][0]["text"]
    assert text.startswith("started\n")
    assert "cancelled" in text and "user stop" in text
    assert wait_until(lambda: process_gone(child))


def test_cancel_of_an_unknown_request_is_ignored(runner):
    """Cancelling an id that is not in flight changes nothing."""
    runner.notify("notifications/cancelled", {"requestId": 12345})
    assert runner.call_tool("bash", {"command": "echo ok"})["content"][0]["text"] == "ok\n"


@pytest.mark.parametrize("options", [[], ["--subreaper"]], ids=["plain", "subreaper"])
def test_timeout_kills_the_whole_tree(start_runner, options, kill_leftovers):
    """On timeout, children, setsid children and double-forked children all die."""
    runner = start_runner(*options)
    command = (
        "sleep 100 & echo $! > child.pid; "
        "setsid sleep 100 & echo $! > session.pid; "
        "( setsid sleep 100 & echo $! > orphan.pid ); "
        "echo ready; wait"
    )
    started = time.monotonic()
    result = runner.call_tool("bash", {"command": command, "timeout": 1})
    assert time.monotonic() - started < 10
    names = ("child.pid", "session.pid", "orphan.pid")
    pids = [read_pid(runner.workspace / name) for name in names]
    kill_leftovers.extend(pids)
    assert result["isError"] is True
    assert result["structuredContent"]["timedOut"] is True
    assert result["structuredContent"]["exitCode"] is None
    assert "ready" in result["content"][0]["text"]
    assert result["content"][0]["text"].endswith("Command timed out after 1 s")
    for pid in pids:
        assert wait_until(lambda: process_gone(pid)), pid


def test_default_timeout_and_cap_apply(start_runner):
    """--bash-timeout is the default and --bash-max-timeout caps a requested timeout."""
    runner = start_runner("--bash-timeout", "0.5", "--bash-max-timeout", "1")
    result = runner.call_tool("bash", {"command": "sleep 30"})
    assert result["structuredContent"]["timedOut"] is True
    assert "after 0.5 s" in result["content"][0]["text"]
    started = time.monotonic()
    result = runner.call_tool("bash", {"command": "sleep 30", "timeout": 100})
    assert result["structuredContent"]["timedOut"] is True
    assert time.monotonic() - started < 10


def test_background_child_holding_the_pipe_does_not_hang(runner, kill_leftovers):
    """A background process that keeps stdout open neither hangs the call nor gets killed."""
    started = time.monotonic()
    result = runner.call_tool("bash", {"command": "sleep 30 & echo $! > bg.pid; echo done"})
    assert time.monotonic() - started < 10
    assert result["isError"] is False
    assert result["content"][0]["text"] == "done\n"
    background = read_pid(runner.workspace / "bg.pid")
    kill_leftovers.append(background)
    time.sleep(0.2)
    assert not process_gone(background)
    assert runner.call_tool("bash", {"command": "echo next"})["content"][0]["text"] == "next\n"


def test_background_output_after_return_does_not_kill_the_writer(runner, kill_leftovers):
    """A background process may keep writing to the call's stdout after the call returns."""
    runner.call_tool("bash", {"command": "(sleep 0.3; for i in 1 2 3; do echo $i; done; "
                                         "sleep 30) & echo $! > bg.pid"})
    background = read_pid(runner.workspace / "bg.pid")
    kill_leftovers.append(background)
    time.sleep(1)
    assert not process_gone(background)


def test_output_over_the_line_limit_is_cut_and_saved(runner):
    """Past 2000 lines the last 2000 are shown and the full output is saved to a file."""
    result = runner.call_tool("bash", {"command": "seq 1 5000"})
    structured = result["structuredContent"]
    assert structured["truncated"] is True
    text = result["content"][0]["text"]
    shown, note = text.split("\n\n")
    assert shown.split("\n") == [str(n) for n in range(3001, 5001)]
    path = structured["fullOutputPath"]
    assert note == f"[output truncated: showing last 2000 lines of 5000; full output: {path}]"
    assert path.startswith(str(runner.workspace / ".corral" / "output" / "bash-"))
    with open(path) as file:
        assert file.read() == "".join(f"{n}\n" for n in range(1, 5001))
    assert result["isError"] is False


def test_output_over_the_byte_limit_is_cut_at_a_line_boundary(runner):
    """Past 50 KiB the shown part is at most 50 KiB of whole lines; the file has everything."""
    command = "for i in $(seq 1 3000); do printf '%099d\\n' $i; done"
    result = runner.call_tool("bash", {"command": command})
    structured = result["structuredContent"]
    assert structured["truncated"] is True
    shown, note = result["content"][0]["text"].split("\n\n")
    lines = shown.split("\n")
    assert len(shown.encode()) + 1 <= 51200
    assert all(len(line) == 99 for line in lines)
    assert lines[-1] == "%099d" % 3000
    assert len(lines) == 51200 // 100
    assert f"showing last {len(lines)} lines of 3000" in note
    with open(structured["fullOutputPath"]) as file:
        assert file.read() == "".join("%099d\n" % i for i in range(1, 3001))


def test_configured_limits_apply(start_runner):
    """--max-output-lines and --max-output-bytes set the limits, the smaller one wins."""
    runner = start_runner("--max-output-lines", "5", "--max-output-bytes", "1000")
    result = runner.call_tool("bash", {"command": "seq 1 20"})
    assert result["content"][0]["text"].split("\n\n")[0] == "16\n17\n18\n19\n20"
    result = runner.call_tool("bash", {"command": "seq 1 20; head -c 3000 /dev/zero | tr '\\0' x"})
    text = result["content"][0]["text"].split("\n\n")[0]
    assert len(text) == 1000 and set(text) == {"x"}
    with open(result["structuredContent"]["fullOutputPath"], "rb") as file:
        assert file.read().endswith(b"20\n" + b"x" * 3000)


def test_output_within_limits_is_not_saved(runner):
    """Exactly 2000 lines are shown whole and no file is written."""
    result = runner.call_tool("bash", {"command": "seq 1 2000"})
    assert result["structuredContent"]["truncated"] is False
    assert result["content"][0]["text"] == "".join(f"{n}\n" for n in range(1, 2001))
    assert not (runner.workspace / ".corral").exists()


def test_progress_notifications_stream_output(runner):
    """With a progressToken, output arrives as progress notifications before the answer."""
    call = runner.start_tool("bash", {"command": "for i in 1 2 3; do echo line$i; sleep 0.3; done"},
                             meta={"progressToken": "tok"})
    answer = runner.response(call)
    position = runner.messages.index(answer)
    progress = [m["params"] for m in runner.messages[:position]
                if m.get("method") == "notifications/progress"]
    assert len(progress) >= 2
    assert all(p["progressToken"] == "tok" for p in progress)
    values = [p["progress"] for p in progress]
    assert values == sorted(set(values))
    assert "".join(p["message"] for p in progress) == "line1\nline2\nline3\n"
    assert values[-1] == len("line1\nline2\nline3\n")


def test_progress_is_coalesced_for_a_flood_and_complete(runner):
    """A flood yields few progress notifications that together carry every byte, in order."""
    call = runner.start_tool("bash", {"command": "seq 1 200000"}, meta={"progressToken": 7})
    runner.response(call, timeout=30)
    progress = [m["params"] for m in runner.messages if m.get("method") == "notifications/progress"]
    assert 1 <= len(progress) < 200
    expected = "".join(f"{i}\n" for i in range(1, 200001))
    assert "".join(p["message"] for p in progress) == expected
    assert progress[-1]["progress"] == len(expected)


def test_no_progress_without_a_token(runner):
    """Without a progressToken no progress notifications are sent."""
    runner.call_tool("bash", {"command": "echo a; sleep 0.2; echo b"})
    assert not [m for m in runner.messages if m.get("method") == "notifications/progress"]


def test_stdin_eof_answers_calls_in_flight_then_kills_leftovers(start_runner, kill_leftovers):
    """End of input is a half-close: the call in flight still answers, then what it left dies."""
    runner = start_runner("--subreaper")
    request_id = runner.start_tool("bash", {"command": (
        "sleep 100 > /dev/null 2>&1 & echo $! > child.pid; "
        "( env -i setsid sleep 100 > /dev/null 2>&1 & echo $! > escaped.pid ); "
        "sleep 0.5; echo finished")})
    pids = [read_pid(runner.workspace / name) for name in ("child.pid", "escaped.pid")]
    kill_leftovers.extend(pids)
    runner.process.stdin.close()
    answer = runner.response(request_id)
    assert "finished" in answer["result"]["content"][0]["text"]
    assert runner.close() == 0
    for pid in pids:
        assert wait_until(lambda: process_gone(pid)), pid


def test_sigterm_kills_running_commands(start_runner, kill_leftovers):
    """SIGTERM kills running commands, including ones that left the process group."""
    runner = start_runner()
    runner.start_tool("bash", {"command": "( setsid sleep 100 & echo $! > orphan.pid ); sleep 100"})
    orphan = read_pid(runner.workspace / "orphan.pid")
    kill_leftovers.append(orphan)
    runner.process.terminate()
    assert runner.process.wait(10) == 0
    assert wait_until(lambda: process_gone(orphan))


def test_background_servers_die_with_the_runner(start_runner, kill_leftovers):
    """A background process left by a finished call is killed when the runner exits."""
    runner = start_runner()
    runner.call_tool("bash", {"command": "sleep 100 > /dev/null 2>&1 & echo $! > bg.pid"})
    background = read_pid(runner.workspace / "bg.pid")
    kill_leftovers.append(background)
    assert not process_gone(background)
    assert runner.close() == 0
    assert wait_until(lambda: process_gone(background))


def test_orphans_are_reaped_under_subreaper(start_runner):
    """Orphans adopted by a subreaper runner do not pile up as zombies."""
    runner = start_runner("--subreaper")
    for _ in range(3):
        runner.call_tool("bash", {"command": "( true & )"})
    children = runner.call_tool("bash", {"command": f"ps -o stat= --ppid {runner.process.pid}"})
    states = children["content"][0]["text"].split()
    assert states.count("Z") <= 1  # at most a just-exited one awaiting the next reap


def test_command_environment_is_inherited(runner):
    """Commands see the runner's environment plus the call marker."""
    text = runner.call_tool("bash", {"command": "echo $HOME; echo $CORRAL_BASH_CALL"})
    home, marker = text["content"][0]["text"].split("\n")[:2]
    assert home == os.environ.get("HOME", "")
    assert marker


def test_timeout_holds_while_the_client_does_not_read(tmp_path):
    """A timeout kills the command on time even while progress output cannot be delivered."""
    import json
    import subprocess
    import sys
    import time

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    process = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.join(repo, "runner", "__main__.py"),
         "--workspace", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    try:
        request = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                   "params": {"name": "bash", "arguments": {"command": "yes", "timeout": 1},
                              "_meta": {"progressToken": "t"}}}
        process.stdin.write(json.dumps(request).encode() + b"\n")
        process.stdin.flush()
        time.sleep(0.5)
        assert yes_processes(), "the command did not start"
        time.sleep(2.5)
        assert yes_processes() == [], "the timeout did not kill the command while output was blocked"
        while True:
            message = json.loads(process.stdout.readline())
            if message.get("id") == 1:
                break
        assert message["result"]["structuredContent"]["timedOut"] is True
    finally:
        process.kill()
        process.wait()


def yes_processes():
    """Live processes running ``yes`` (the blocked-output test's command)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                data = f.read()
        except OSError:
            continue
        name, state = data[data.index("(") + 1:data.rindex(")")], data[data.rindex(")") + 2]
        if name == "yes" and state not in "ZX":
            found.append(int(entry))
    return found


def test_full_output_file_is_capped(start_runner):
    """A flood's full-output file stops at --max-spill-bytes, and the result says so."""
    runner = start_runner("--max-spill-bytes", "1048576")
    result = runner.call_tool("bash", {"command": "head -c 5000000 /dev/zero | tr '\\0' 'a' | fold -w 99"})
    text = result["content"][0]["text"]
    assert "holds only the first 1048576 bytes" in text
    spilled = [p for p in (runner.workspace / ".corral" / "output").iterdir()]
    assert len(spilled) == 1 and spilled[0].stat().st_size == 1048576
