"""The runner's JSON-RPC 2.0 / MCP stdio protocol, spoken to a real runner process."""

import json
import signal
import subprocess
import sys

import pytest

from runner_harness import REPO_ROOT, RUNNER_MAIN
from runner.server import PROTOCOL_VERSIONS, UsageError, parse_options
from runner.tools import InvalidArguments, check_arguments


@pytest.mark.parametrize("version", PROTOCOL_VERSIONS)
def test_initialize_echoes_a_supported_version(start_runner, version):
    """initialize answers with the client's protocol version when the runner speaks it."""
    runner = start_runner()
    result = runner.call("initialize", {"protocolVersion": version, "capabilities": {},
                                        "clientInfo": {"name": "t", "version": "1"}})["result"]
    assert result["protocolVersion"] == version
    assert result["serverInfo"] == {"name": "corral", "version": "0.1.0"}
    assert result["capabilities"] == {"tools": {"listChanged": False}}
    assert str(runner.workspace) in result["instructions"]


def test_initialize_offers_the_latest_version_for_an_unknown_one(start_runner):
    """initialize answers with the newest version when the client asks for an unknown one."""
    runner = start_runner()
    result = runner.call("initialize", {"protocolVersion": "1999-01-01"})["result"]
    assert result["protocolVersion"] == "2025-11-25"


def test_initialize_rejects_a_non_string_version(start_runner):
    """A protocolVersion that is not a string is an invalid-params error."""
    runner = start_runner()
    assert runner.call("initialize", {"protocolVersion": 7})["error"]["code"] == -32602


def test_ping_answers_an_empty_result(runner):
    """ping is answered with an empty object."""
    assert runner.call("ping") == {"jsonrpc": "2.0", "id": runner._next_id, "result": {}}


def test_string_ids_are_echoed(runner):
    """A string request id comes back unchanged."""
    runner.request("ping", request_id="abc")
    assert runner.response("abc")["result"] == {}


def test_tools_list_describes_four_tools_with_strict_schemas(runner):
    """tools/list lists bash, read, write and edit with closed object schemas."""
    tools = runner.call("tools/list")["result"]["tools"]
    assert [tool["name"] for tool in tools] == ["bash", "read", "write", "edit"]
    required = {"bash": ["command"], "read": ["path"], "write": ["path", "content"],
                "edit": ["path", "edits"]}
    for tool in tools:
        schema = tool["inputSchema"]
        assert tool["description"]
        assert schema["type"] == "object"
        assert schema["additionalProperties"] is False
        assert schema["required"] == required[tool["name"]]
        assert set(schema["required"]) <= set(schema["properties"])
    edit_item = tools[3]["inputSchema"]["properties"]["edits"]["items"]
    assert edit_item["required"] == ["oldText", "newText"]
    assert edit_item["additionalProperties"] is False


def test_tools_list_mentions_the_configured_limits(start_runner):
    """The bash description states the runner's timeout and output limits."""
    runner = start_runner("--bash-timeout", "7", "--max-output-lines", "30")
    bash = runner.call("tools/list")["result"]["tools"][0]
    assert "timeout 7 s" in bash["description"]
    assert "30 lines" in bash["description"]


def test_a_line_that_is_not_json_is_a_parse_error(runner):
    """A line that is not JSON gets -32700 with a null id."""
    runner.send_raw(b"this is not json\n")
    answer = runner.wait_for(lambda m: "error" in m)
    assert answer["id"] is None
    assert answer["error"]["code"] == -32700


def test_invalid_utf8_is_a_parse_error(runner):
    """A line that is not valid UTF-8 gets -32700, and the runner carries on."""
    runner.send_raw(b'{"jsonrpc":"2.0","id":1,"method":"p\xffing"}\n')
    answer = runner.wait_for(lambda m: "error" in m)
    assert answer == {"jsonrpc": "2.0", "id": None, "error": answer["error"]}
    assert answer["error"]["code"] == -32700
    assert "UTF-8" in answer["error"]["message"]
    assert runner.call("ping")["result"] == {}


@pytest.mark.parametrize("message, expected_id", [
    ([{"jsonrpc": "2.0", "id": 1, "method": "ping"}], None),
    ([], None),
    ("ping", None),
    (42, None),
    ({"id": 5, "method": "ping"}, 5),
    ({"jsonrpc": "1.0", "id": 5, "method": "ping"}, 5),
    ({"jsonrpc": "2.0", "id": 5, "method": 12}, 5),
    ({"jsonrpc": "2.0", "id": 5}, 5),
    ({"jsonrpc": "2.0", "id": 1.5, "method": "ping"}, None),
    ({"jsonrpc": "2.0", "id": True, "method": "ping"}, None),
    ({"jsonrpc": "2.0", "id": None, "method": "ping"}, None),
    ({"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}, None),
    ({"jsonrpc": "2.0", "id": 5, "method": "ping", "params": "x"}, 5),
])
def test_malformed_requests_are_invalid_requests(runner, message, expected_id):
    """Batches, non-objects, a wrong jsonrpc, method or id, scalar params: -32600."""
    runner.send(message)
    answer = runner.wait_for(lambda m: "error" in m)
    assert answer["error"]["code"] == -32600
    assert answer["id"] == expected_id
    assert runner.call("ping")["result"] == {}


def test_batches_are_refused_with_a_reason(runner):
    """A JSON array gets -32600 saying batches are not supported."""
    runner.send([{"jsonrpc": "2.0", "id": 1, "method": "ping"}])
    answer = runner.wait_for(lambda m: "error" in m)
    assert "batch" in answer["error"]["message"]


def test_unknown_method_is_method_not_found(runner):
    """An unknown request method gets -32601 with its id."""
    answer = runner.call("resources/list")
    assert answer["error"]["code"] == -32601
    assert "resources/list" in answer["error"]["message"]


def test_unknown_notifications_are_ignored(runner):
    """A notification with an unknown method gets no answer at all."""
    runner.notify("notifications/something-new", {"x": 1})
    runner.notify("notifications/cancelled", {"requestId": 999})
    request_id = runner.request("ping")
    runner.response(request_id)
    assert runner.messages[-1]["id"] == request_id
    assert all(m.get("id") != 999 for m in runner.messages)
    assert len([m for m in runner.messages if "error" in m]) == 0


def test_blank_lines_are_ignored(runner):
    """Empty and whitespace-only lines get no answer."""
    before = len(runner.messages)
    runner.send_raw(b"\n   \n\r\n\t\n")
    runner.call("ping")
    assert len(runner.messages) == before + 1


def test_responses_from_the_client_are_not_answered(runner):
    """A JSON-RPC response sent to the runner is dropped without an error answer."""
    before = len(runner.messages)
    runner.send({"jsonrpc": "2.0", "id": 77, "result": {}})
    runner.call("ping")
    assert len(runner.messages) == before + 1


def test_params_that_are_an_array_are_invalid_params(runner):
    """By-position params get -32602: every method here takes named params."""
    runner.send({"jsonrpc": "2.0", "id": 3, "method": "ping", "params": [1]})
    assert runner.response(3)["error"]["code"] == -32602


def test_an_overlong_line_is_refused_and_skipped(runner):
    """A line over 16 MiB gets -32600 and the runner goes on with the next line."""
    chunk = b"x" * (1 << 20)
    for _ in range(17):
        runner.send_raw(chunk)
    runner.send_raw(b'"}\n')
    answer = runner.wait_for(lambda m: "error" in m, timeout=30)
    assert answer["id"] is None
    assert answer["error"]["code"] == -32600
    assert runner.call("ping")["result"] == {}
    assert len([m for m in runner.messages if "error" in m]) == 1


def test_a_last_line_without_newline_is_handled(start_runner):
    """The final message is answered even if stdin ends without a newline."""
    runner = start_runner()
    runner.send_raw(b'{"jsonrpc":"2.0","id":9,"method":"ping"}')
    runner.process.stdin.close()
    assert runner.response(9)["result"] == {}
    assert runner.process.wait(10) == 0


@pytest.mark.parametrize("params, fragment", [
    ({"name": "nope", "arguments": {}}, "Unknown tool"),
    ({"name": 5, "arguments": {}}, "name"),
    ({"arguments": {}}, "name"),
    ({"name": "bash", "arguments": {}}, "command"),
    ({"name": "bash", "arguments": {"command": 1}}, "must be a string"),
    ({"name": "bash", "arguments": {"command": "true", "timeout": 0}}, "greater than 0"),
    ({"name": "bash", "arguments": {"command": "true", "timeout": -3}}, "greater than 0"),
    ({"name": "bash", "arguments": {"command": "true", "timeout": "5"}}, "must be a number"),
    ({"name": "bash", "arguments": {"command": "true", "extra": 1}}, "unknown property"),
    ({"name": "bash", "arguments": "echo"}, "must be an object"),
    ({"name": "read", "arguments": {"path": "x", "offset": 0}}, "at least 1"),
    ({"name": "read", "arguments": {"path": "x", "limit": 2.5}}, "integer"),
    ({"name": "read", "arguments": {"path": ""}}, "must not be empty"),
    ({"name": "write", "arguments": {"path": "x"}}, "content"),
    ({"name": "edit", "arguments": {"path": "x", "edits": []}}, "must not be empty"),
    ({"name": "edit", "arguments": {"path": "x", "edits": [{"oldText": "a"}]}}, "newText"),
    ({"name": "edit", "arguments": {"path": "x", "edits": "a"}}, "must be an array"),
])
def test_bad_tool_calls_are_invalid_params(runner, params, fragment):
    """Unknown tools and arguments that break the schema get -32602 with a reason."""
    answer = runner.call("tools/call", params)
    assert answer["error"]["code"] == -32602
    assert fragment in answer["error"]["message"]


def test_a_reused_in_flight_id_is_refused(runner):
    """A second call with the id of a call still running gets -32600."""
    runner.request("tools/call", {"name": "bash", "arguments": {"command": "sleep 1"}},
                   request_id="same")
    runner.request("tools/call", {"name": "bash", "arguments": {"command": "true"}},
                   request_id="same")
    first = runner.wait_for(lambda m: m.get("id") == "same")
    assert first["error"]["code"] == -32600
    second = runner.wait_for(lambda m: m.get("id") == "same" and "result" in m)
    assert second["result"]["isError"] is False


def test_stdin_eof_makes_the_runner_exit_zero(start_runner):
    """Closing stdin ends the runner with status 0."""
    runner = start_runner()
    assert runner.call("ping")["result"] == {}
    assert runner.close() == 0


def test_sigterm_makes_the_runner_exit_zero(start_runner):
    """SIGTERM ends the runner with status 0."""
    runner = start_runner()
    runner.call("ping")
    runner.process.send_signal(signal.SIGTERM)
    assert runner.process.wait(10) == 0


def test_closed_stdout_makes_the_runner_exit_quietly(tmp_path):
    """When nobody reads the answers any more, the runner exits 0 without a traceback."""
    process = subprocess.Popen([sys.executable, "-I", "-S", str(RUNNER_MAIN), "--workspace",
                                str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()
    process.stdin.write(b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n')
    process.stdin.flush()
    assert process.wait(10) == 0
    assert process.stderr.read() == b""
    process.stdin.close()
    process.stderr.close()


def test_runner_runs_as_a_module(tmp_path):
    """``python -m runner`` starts the same server."""
    process = subprocess.run(
        [sys.executable, "-m", "runner", "--workspace", str(tmp_path)],
        input=b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n', capture_output=True,
        cwd=REPO_ROOT, timeout=10,
    )
    assert json.loads(process.stdout) == {"jsonrpc": "2.0", "id": 1, "result": {}}
    assert process.returncode == 0


def test_runner_refuses_a_bad_command_line(tmp_path):
    """A missing --workspace or an unknown option exits with status 2 and a usage line."""
    for arguments in ([], ["--workspace", str(tmp_path), "--frobnicate"],
                      ["--workspace", str(tmp_path / "missing")]):
        process = subprocess.run([sys.executable, "-I", "-S", str(RUNNER_MAIN), *arguments],
                                 capture_output=True, timeout=10, stdin=subprocess.DEVNULL)
        assert process.returncode == 2
        assert b"corral runner:" in process.stderr


def test_parse_options_reads_every_option():
    """Every option is understood, in both --name value and --name=value forms."""
    options = parse_options(["--workspace", "/w", "--bash-timeout=5", "--bash-max-timeout", "9",
                             "--max-output-lines", "10", "--max-output-bytes=100",
                             "--subreaper", "--setsid"])
    assert (options.workspace, options.bash_timeout, options.bash_max_timeout) == ("/w", 5, 9)
    assert (options.max_output_lines, options.max_output_bytes) == (10, 100)
    assert options.subreaper and options.setsid
    defaults = parse_options(["--workspace", "w"])
    assert defaults.workspace.endswith("/w") and defaults.workspace.startswith("/")
    assert (defaults.bash_timeout, defaults.bash_max_timeout) == (120, 3600)
    assert (defaults.max_output_lines, defaults.max_output_bytes) == (2000, 51200)
    assert not defaults.subreaper and not defaults.setsid


@pytest.mark.parametrize("argv", [
    [], ["--workspace"], ["--workspace", "/w", "--bash-timeout", "-1"],
    ["--workspace", "/w", "--max-output-lines", "many"], ["--workspace", "/w", "extra"],
    ["--workspace="],
])
def test_parse_options_refuses_bad_values(argv):
    """Missing, unknown, non-numeric or non-positive options raise UsageError."""
    with pytest.raises(UsageError):
        parse_options(argv)


def test_check_arguments_accepts_valid_calls():
    """Arguments that fit each schema pass the check."""
    check_arguments("bash", {"command": "ls", "timeout": 1.5})
    check_arguments("read", {"path": "a", "offset": 2, "limit": 3})
    check_arguments("write", {"path": "a", "content": ""})
    check_arguments("edit", {"path": "a", "edits": [{"oldText": "", "newText": "b"}]})
    with pytest.raises(InvalidArguments):
        check_arguments("bash", {"command": "ls", "timeout": float("nan")})
