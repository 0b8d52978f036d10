"""Property tests with hypothesis: the runner's JSON-RPC reader and its tools under garbage.

The reader is fuzzed through one real runner process per test, reused
across examples: every example sends a few lines followed by a ``ping``
sentinel, and checks that each line that needs an answer got exactly one
well-formed answer, before or (for a tool that runs) after the sentinel's.
The argument checks and the file tools are fuzzed in process.

Generated tool calls never run generated commands or touch generated paths:
a call that would run is rewritten first (bash runs ``true``; file paths are
put under ``fuzz/`` in the workspace), see :func:`make_harmless`.
"""

import json
import os
import shutil
import socket
import stat
import tempfile

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from runner.server import Options
from runner.tools import INPUT_SCHEMAS, Call, InvalidArguments, check_arguments, run
from runner_harness import UNPARSABLE

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR = (
    -32700, -32600, -32601, -32602, -32603)
TOOL_NAMES = sorted(INPUT_SCHEMAS)
METHODS = ["initialize", "ping", "tools/list", "tools/call", "notifications/initialized",
           "notifications/cancelled", "resources/list", "", "PING", "tools/call/"]
#: A few examples of each kind; together the tests below take some seconds.
FEW = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ---------------------------------------------------------------

huge_numbers = st.sampled_from([2 ** 63, -2 ** 63 - 1, 2 ** 64, 10 ** 300, -10 ** 4000, 1e308,
                                -0.0, 5e-324, float("inf"), float("-inf"), float("nan")])
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), huge_numbers, st.floats(),
                         st.text(max_size=12))
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                      children, max_size=4),
    max_leaves=12)


def chance(draw, tenths):
    """True with a probability of tenths/10 (hypothesis shrinks towards True)."""
    return draw(st.integers(min_value=0, max_value=9)) < tenths


#: Per tool and argument: values its schema accepts.
VALID_VALUES = {
    "bash": {"command": st.text(max_size=20), "timeout": st.floats(min_value=0.001, max_value=5)},
    "read": {"path": st.text(min_size=1, max_size=20),
             "offset": st.integers(min_value=1, max_value=10 ** 20),
             "limit": st.integers(min_value=1, max_value=10 ** 20)},
    "write": {"path": st.text(min_size=1, max_size=20), "content": st.text(max_size=40)},
    "edit": {"path": st.text(min_size=1, max_size=20),
             "edits": st.lists(st.fixed_dictionaries({"oldText": st.text(max_size=12),
                                                      "newText": st.text(max_size=12)}),
                               min_size=1, max_size=3)},
}


@st.composite
def tool_arguments(draw, name):
    """Arguments for tool name that are mostly right: now and then a value is wrong,
    a required one missing, or an unknown one added."""
    required = INPUT_SCHEMAS[name]["required"]
    arguments = {}
    for key, valid in VALID_VALUES[name].items():
        if chance(draw, 9 if key in required else 4):
            arguments[key] = draw(json_values) if chance(draw, 1) else draw(valid)
    if chance(draw, 1):
        arguments[draw(st.text(max_size=6))] = draw(json_values)
    return arguments


@st.composite
def tool_call_params(draw):
    """params of a tools/call: mostly a tool's name and nearly right arguments."""
    name = draw(st.sampled_from(TOOL_NAMES)) if chance(draw, 9) else draw(json_values)
    known = isinstance(name, str) and name in INPUT_SCHEMAS
    params = {"name": name}
    if chance(draw, 9):
        params["arguments"] = (draw(tool_arguments(name)) if known and chance(draw, 9)
                               else draw(json_values))
    if chance(draw, 3):
        params["_meta"] = draw(st.one_of(json_values, st.fixed_dictionaries(
            {"progressToken": st.one_of(st.integers(), st.text(max_size=5), json_values)})))
    return params


@st.composite
def messages(draw):
    """A JSON-RPC request (mostly a tools/call), right or wrong in one or a few members."""
    message = {}
    if chance(draw, 9):
        message["jsonrpc"] = "2.0"
    elif chance(draw, 5):
        message["jsonrpc"] = draw(json_values)
    if chance(draw, 8):
        message["id"] = draw(st.one_of(st.integers(), st.text(max_size=8)))
    elif chance(draw, 5):
        message["id"] = draw(json_values)
    if chance(draw, 5):
        message["method"] = "tools/call"
    elif chance(draw, 6):
        message["method"] = draw(st.sampled_from(METHODS))
    elif chance(draw, 8):
        message["method"] = draw(st.one_of(st.text(max_size=20), json_values))
    if message.get("method") == "tools/call" and chance(draw, 8):
        message["params"] = draw(tool_call_params())
    elif chance(draw, 5):
        message["params"] = draw(json_values)
    if chance(draw, 1):
        message.update(draw(st.dictionaries(st.sampled_from(["result", "error", "other"]),
                                            json_values, min_size=1, max_size=2)))
    return message


def encode(message):
    """message as one line of JSON (NaN and Infinity as Python writes them)."""
    return json.dumps(message).encode()


@st.composite
def corrupted_messages(draw):
    """A message's JSON with a few bytes deleted, replaced, inserted, or cut off."""
    data = bytearray(encode(draw(messages())))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        position = draw(st.integers(min_value=0, max_value=len(data)))
        action = draw(st.sampled_from(["delete", "replace", "insert", "cut"]))
        if action == "delete":
            del data[position:position + draw(st.integers(min_value=1, max_value=4))]
        elif action == "replace" and position < len(data):
            data[position] = draw(st.integers(min_value=0, max_value=255))
        elif action == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=4))
        else:
            del data[position:]
    return bytes(data)


@st.composite
def deep_nesting(draw):
    """A request whose params (or the whole line) nest arrays or objects very deeply."""
    depth = draw(st.sampled_from([10, 500, 2000, 100000]))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    inner = opener * depth + "1" + closer * depth
    method = draw(st.sampled_from(["ping", "tools/call", "initialize"]))
    if draw(st.booleans()):
        return inner.encode()
    return ('{"jsonrpc":"2.0","id":7,"method":"%s","params":%s}' % (method, inner)).encode()


json_alphabet = st.sampled_from(list('{}[]":,0123456789.eE+-truefalsnl \\/u\t') + ["2.0"])
#: Lines worth trying every time, by name (so that a failure's report stays short).
SPECIAL_LINES = {
    "empty": b"", "spaces": b"   ", "carriage return": b"\r", "vertical tab": b"\x0b",
    "null": b"null", "empty batch": b"[]", "empty object": b"{}",
    "5000 digits": b"1" * 5000, "BOM then object": b"\xef\xbb\xbf{}",
    "ping with CR": b'{"jsonrpc":"2.0","id":1,"method":"ping"}\r',
    "id 1e400": b'{"jsonrpc":"2.0","id":1e400,"method":"ping"}',
    "id of 5000 digits": b'{"jsonrpc":"2.0","id":' + b"9" * 5000 + b',"method":"ping"}',
    "id NaN": b'{"jsonrpc":"2.0","id":NaN,"method":"ping"}',
    "lone surrogate": b'{"jsonrpc":"2.0","id":"\\ud800","method":"ping"}',
    "method with NUL": b'{"jsonrpc":"2.0","id":2,"method":"ping\\u0000"}',
}
lines = st.one_of(
    st.binary(max_size=120),
    st.lists(json_alphabet, max_size=40).map(lambda parts: "".join(parts).encode()),
    messages().map(encode),
    messages().map(encode),
    messages().map(encode),
    corrupted_messages(),
    deep_nesting(),
    st.sampled_from(sorted(SPECIAL_LINES)).map(SPECIAL_LINES.get),
).map(lambda line: line.replace(b"\n", b""))


# -- what the protocol promises for one line -----------------------------------


class Expected:
    """What the runner must answer to one line."""

    def __init__(self, answers=0, request_id=None, code=None, runs_tool=False, message=None):
        #: 0 or 1: how many answers the line gets.
        self.answers = answers
        #: The id of the answer.
        self.request_id = request_id
        #: The error code of the answer, or None for a result.
        self.code = code
        #: True when the line is a valid tools/call, answered by a thread when the tool is done.
        self.runs_tool = runs_tool
        self.message = message


def expected_for(line):
    """The answer docs/protocol.md promises for line (without its newline)."""
    if not line.strip():
        return Expected()
    try:
        message = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return Expected(1, None, PARSE_ERROR)
    if not isinstance(message, dict):
        return Expected(1, None, INVALID_REQUEST)
    request_id = message.get("id")
    id_ok = isinstance(request_id, (str, int)) and not isinstance(request_id, bool)
    answer_id = request_id if id_ok else None
    if message.get("jsonrpc") != "2.0":
        return Expected(1, answer_id, INVALID_REQUEST)
    method = message.get("method")
    if method is None and ("result" in message or "error" in message):
        return Expected()
    if not isinstance(method, str):
        return Expected(1, answer_id, INVALID_REQUEST)
    if "id" in message and not id_ok:
        return Expected(1, None, INVALID_REQUEST)
    if "id" not in message:
        return Expected()
    if method not in ("initialize", "ping", "tools/list", "tools/call"):
        return Expected(1, request_id, METHOD_NOT_FOUND)
    params = message.get("params")
    params = {} if params is None else params
    if not isinstance(params, dict):
        return Expected(1, request_id, INVALID_PARAMS if isinstance(params, list)
                        else INVALID_REQUEST)
    if method == "initialize":
        version = params.get("protocolVersion")
        bad = version is not None and not isinstance(version, str)
        return Expected(1, request_id, INVALID_PARAMS if bad else None)
    if method != "tools/call":
        return Expected(1, request_id)
    arguments = params.get("arguments")
    try:
        check_arguments(params.get("name"), {} if arguments is None else arguments)
    except InvalidArguments:
        return Expected(1, request_id, INVALID_PARAMS)
    return Expected(1, request_id, None, runs_tool=True, message=message)


def make_harmless(name, arguments):
    """Arguments that fit name's schema, rewritten so that running them touches only fuzz/."""
    arguments = dict(arguments)
    if name == "bash":
        arguments["command"] = "true"
    else:  # one path component under fuzz/: no "..", no "/", no "~" can lead out
        arguments["path"] = "fuzz/" + arguments["path"].replace("/", "_")
    return arguments


def check_well_formed(message):
    """Fail unless message is a JSON-RPC answer or a progress notification, well formed."""
    assert UNPARSABLE not in message, message
    assert message.get("jsonrpc") == "2.0", message
    if "method" in message:
        assert message["method"] == "notifications/progress", message
        assert set(message) == {"jsonrpc", "method", "params"}, message
        return
    assert set(message) in ({"jsonrpc", "id", "result"}, {"jsonrpc", "id", "error"}), message
    assert message["id"] is None or (isinstance(message["id"], (str, int))
                                     and not isinstance(message["id"], bool)), message
    if "error" in message:
        error = message["error"]
        assert isinstance(error, dict) and isinstance(error.get("code"), int), message
        assert isinstance(error.get("message"), str) and error["message"], message
        assert error["code"] != INTERNAL_ERROR, message
    else:
        assert isinstance(message["result"], dict), message


class Exchange:
    """Sends lines to one runner and checks the answers, example after example."""

    def __init__(self, runner):
        self.runner = runner
        self.sentinels = 0
        self.calls = 0

    def send_and_check(self, fuzz_lines):
        """Send fuzz_lines in one write, then a ping; check every answer the lines got."""
        runner = self.runner
        expected = [expected_for(line) for line in fuzz_lines]
        for expectation in expected:  # shown by pytest --hypothesis-show-statistics
            event("runs a tool" if expectation.runs_tool else
                  f"answer {expectation.code or 'result'}" if expectation.answers else "no answer")
        for index, expectation in enumerate(expected):
            if expectation.runs_tool:  # made harmless, with an id of its own
                self.calls += 1
                message = dict(expectation.message, id=f"tool call {self.calls}")
                params = dict(message["params"])
                params["arguments"] = make_harmless(params["name"], params.get("arguments") or {})
                message["params"] = params
                fuzz_lines[index] = encode(message)
                expectation.request_id = message["id"]
        self.sentinels += 1
        sentinel = f"sentinel {self.sentinels}"
        start = len(runner.messages)
        runner.send_raw(b"".join(line + b"\n" for line in fuzz_lines)
                        + encode({"jsonrpc": "2.0", "id": sentinel, "method": "ping"}) + b"\n")
        runner.wait_for(lambda m: m.get("id") == sentinel, start=start)
        for expectation in expected:
            if expectation.runs_tool:
                request_id = expectation.request_id
                runner.wait_for(lambda m: m.get("id") == request_id
                                and "content" in m.get("result", {}), timeout=20, start=start)
        received = [m for m in runner.messages[start:] if m.get("id") != sentinel]
        for message in received:
            check_well_formed(message)
        answers = [m for m in received if "method" not in m]
        # Each line's answer: its id, and its error code (0 for a result).
        wanted = sorted((repr(e.request_id), e.code or 0) for e in expected if e.answers)
        got = sorted((repr(m["id"]), m["error"]["code"] if "error" in m else 0) for m in answers)
        assert got == wanted, (fuzz_lines, answers)


def assert_still_serving(runner):
    """The runner process is alive and answers a ping."""
    assert runner.process.poll() is None, runner.stderr
    start = len(runner.messages)
    runner.request("ping", request_id="final ping")
    answer = runner.wait_for(lambda m: m.get("id") == "final ping", start=start)
    assert answer["result"] == {}


# -- the JSON-RPC reader, through a real runner --------------------------------


def test_every_fuzzed_line_gets_exactly_one_well_formed_answer(start_runner):
    """Arbitrary bytes and near-miss JSON-RPC lines each get the one answer they need, or none."""
    runner = start_runner()
    exchange = Exchange(runner)

    @FEW
    @given(st.lists(lines, min_size=1, max_size=3))
    def check(fuzz_lines):
        exchange.send_and_check(fuzz_lines)

    check()
    assert_still_serving(runner)


def test_structured_near_misses_get_the_documented_errors(start_runner):
    """Messages with wrong ids, methods, params and tool arguments get the documented answers."""
    runner = start_runner()
    (runner.workspace / "fuzz").mkdir()
    exchange = Exchange(runner)

    @FEW
    @given(messages())
    def check(message):
        exchange.send_and_check([encode(message)])

    check()
    assert_still_serving(runner)


def test_the_expected_answers_match_known_lines():
    """The test's model of the protocol agrees with hand-checked lines (a check on the checker)."""
    cases = {
        b"": (0, None, None),
        b"{": (1, None, PARSE_ERROR),
        b"\xff": (1, None, PARSE_ERROR),
        b"[" * 100000: (1, None, PARSE_ERROR),
        b"[]": (1, None, INVALID_REQUEST),
        b'{"jsonrpc":"2.0","id":true,"method":"ping"}': (1, None, INVALID_REQUEST),
        b'{"jsonrpc":"2.0","id":3,"method":"nope"}': (1, 3, METHOD_NOT_FOUND),
        b'{"jsonrpc":"2.0","id":"a","method":"ping","params":[]}': (1, "a", INVALID_PARAMS),
        b'{"jsonrpc":"2.0","method":"ping"}': (0, None, None),
        b'{"jsonrpc":"2.0","id":4,"result":{}}': (0, None, None),
        b'{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"read"}}':
            (1, 5, INVALID_PARAMS),
    }
    for line, (answers, request_id, code) in cases.items():
        expectation = expected_for(line)
        assert (expectation.answers, expectation.request_id, expectation.code) == \
            (answers, request_id, code), line
    assert expected_for(b'{"jsonrpc":"2.0","id":6,"method":"tools/call",'
                        b'"params":{"name":"bash","arguments":{"command":"x"}}}').runs_tool


# -- argument checks, in process ------------------------------------------------


def has_known_deviation(arguments):
    """True when arguments hold what check_arguments refuses on purpose but JSON Schema allows.

    check_arguments is stricter than JSON Schema in two places: an integer
    must be a JSON integer (not 2.0), and a number must be finite.
    """
    if not isinstance(arguments, dict):
        return False
    for key in ("offset", "limit"):
        if isinstance(arguments.get(key), float):
            return True
    timeout = arguments.get("timeout")
    return isinstance(timeout, float) and (timeout != timeout or timeout in (float("inf"),))


def test_check_arguments_agrees_with_json_schema():
    """check_arguments raises only InvalidArguments, when and only when JSON Schema refuses."""
    jsonschema = pytest.importorskip("jsonschema")
    validators = {name: jsonschema.Draft202012Validator(schema)
                  for name, schema in INPUT_SCHEMAS.items()}

    @FEW
    @given(name=st.one_of(st.sampled_from(TOOL_NAMES), json_values),
           arguments=st.one_of(json_values, *map(tool_arguments, TOOL_NAMES),
                               st.sampled_from([{"path": "a", "offset": 2.0},
                                                {"command": "x", "timeout": float("nan")},
                                                {"command": "x", "timeout": float("inf")},
                                                {"path": "a", "limit": True}])))
    def check(name, arguments):
        try:
            check_arguments(name, arguments)
            accepted = True
        except InvalidArguments as error:
            accepted = False
            assert str(error).endswith("."), error
        if not isinstance(name, str) or name not in INPUT_SCHEMAS:
            assert not accepted
            return
        valid = validators[name].is_valid(arguments)
        if valid and has_known_deviation(arguments):
            assert not accepted
        else:
            assert accepted == valid, (name, arguments)

    check()


# -- the file tools, in process ---------------------------------------------------

#: Files every example's fresh workspace starts with: name -> bytes (None: made otherwise).
PREPARED = {
    "text.txt": b"alpha\nbeta\ngamma\nbeta\n",
    "crlf.txt": b"one\r\ntwo\r\nthree\r\n",
    "bom.txt": b"\xef\xbb\xbfhello\nworld\n",
    "empty.txt": b"",
    "latin1.txt": "café\n".encode("latin-1"),
    "blob.bin": b"abc\0def",
    "dot.png": b"\x89PNG\r\n\x1a\n" + b"\0" * 40,
    "long.txt": b"".join(b"line %d\n" % number for number in range(3000)),
    "big.txt": b"0123456789abcdef\n" * 400,
    "over-the-caps.txt": b"x" * 99 + b"\n" * 401,
}
SPECIAL = ["pipe", "sock", "dir", "loop", "dangling", "link-to-text"]


def prepare_workspace(root):
    """A fresh workspace under root with PREPARED files and special entries; returns its path."""
    workspace = tempfile.mkdtemp(dir=root)
    for name, data in PREPARED.items():
        with open(os.path.join(workspace, name), "wb") as file:
            file.write(data)
    os.mkfifo(os.path.join(workspace, "pipe"))
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(os.path.join(workspace, "sock"))
    os.mkdir(os.path.join(workspace, "dir"))
    os.symlink("loop", os.path.join(workspace, "loop"))
    os.symlink("nowhere/at/all", os.path.join(workspace, "dangling"))
    os.symlink("text.txt", os.path.join(workspace, "link-to-text"))
    return workspace


def snapshot(workspace):
    """Every entry of workspace: file type and, for regular files, the bytes."""
    found = {}
    for parent, directories, names in os.walk(workspace):
        for name in directories + names:
            path = os.path.join(parent, name)
            info = os.lstat(path)
            data = None
            if stat.S_ISREG(info.st_mode):
                with open(path, "rb") as file:
                    data = file.read()
            found[os.path.relpath(path, workspace)] = (stat.S_IFMT(info.st_mode), data)
    return found


paths = st.one_of(st.sampled_from(list(PREPARED) + SPECIAL),
                  st.sampled_from(["/dev/null", "/dev/zero", "dir/", "text.txt/x", "a\0b",
                                   "x" * 300, ".", "dir/new.txt"]),
                  st.text(min_size=1, max_size=20).map(
                      lambda text: "fuzz/" + text.replace("/", "_")))
#: Text files edit may well succeed on.
editable = st.sampled_from(["text.txt", "crlf.txt", "bom.txt", "long.txt", "link-to-text",
                            "over-the-caps.txt"])
snippets = st.one_of(st.sampled_from(["alpha", "alpha\n", "beta", "beta\n", "gamma", "gamma\n",
                                      "one", "two\nthree", "two\r\nthree", "three\r\n",
                                      "hello", "hello\nworld", "world", "\ufeff", "",
                                      "line 12\n", "line 2999\n", "0123", "a\ud800", "\r",
                                      "\n", "\r\n"]),
                     st.sampled_from(["alpha", "gamma", "one", "three", "hello", "world"]),
                     st.text(max_size=8))


@st.composite
def edit_calls(draw):
    """An edit call, its oldTexts often cut from the file's own text (unique or not)."""
    path = draw(st.one_of(editable, editable, paths))
    name = "text.txt" if path == "link-to-text" else path
    text = PREPARED.get(name, b"").decode("utf-8", "replace").lstrip("\ufeff")
    if "\r\n" in text and draw(st.booleans()):
        text = text.replace("\r\n", "\n")  # as a model that was shown LF would write it
    edits = []
    for _ in range(draw(st.integers(min_value=1, max_value=2))):
        if text and chance(draw, 7):
            start = draw(st.integers(min_value=0, max_value=len(text) - 1))
            end = draw(st.integers(min_value=start, max_value=min(len(text), start + 30)))
            old_text = text[start:end]
        else:
            old_text = draw(snippets)
        edits.append({"oldText": old_text, "newText": draw(snippets)})
    return "edit", {"path": path, "edits": edits}


tool_calls = st.one_of(
    st.tuples(st.just("read"), st.fixed_dictionaries(
        {"path": paths},
        optional={"offset": st.integers(min_value=1, max_value=10 ** 12),
                  "limit": st.integers(min_value=1, max_value=10 ** 12)})),
    st.tuples(st.just("write"), st.fixed_dictionaries(
        {"path": paths, "content": st.one_of(st.text(max_size=40), snippets)})),
    edit_calls(),
)


def test_file_tools_survive_generated_calls(tmp_path):
    """read, write and edit with generated arguments give well-formed results, keep promises."""
    options = Options(str(tmp_path), max_read_bytes=30000, max_edit_bytes=20000)

    @FEW
    @given(tool_calls)
    def check(call):
        name, arguments = call
        workspace = prepare_workspace(str(tmp_path))
        options.workspace = workspace
        check_arguments(name, arguments)
        target = arguments["path"]
        if target in ("/dev/null", "/dev/zero") and name == "write":
            target = arguments["path"] = "fuzz/device"  # never replace the host's devices
        before = snapshot(workspace)
        try:
            result = run(name, arguments, Call(options))
            json.dumps(result)  # what the server sends must encode
            assert isinstance(result["isError"], bool)
            assert result["content"][0]["type"] == "text" and result["content"][0]["text"]
            after = snapshot(workspace)
            assert not [path for path in after if path.endswith(".corral-tmp")], after
            if result["isError"]:
                assert result["structuredContent"] == {
                    "path": target, "error": result["content"][0]["text"]}
                assert after == before, (name, arguments, result)
            elif name == "read":
                assert after == before
            elif name == "write":
                full = os.path.realpath(os.path.join(workspace, target))
                with open(full, "rb") as file:
                    assert file.read() == arguments["content"].encode("utf-8")
            else:
                full = os.path.realpath(os.path.join(workspace, target))
                with open(full, "rb") as file:
                    data = file.read()
                old = before[os.path.relpath(full, workspace)][1]
                assert data != old
                if old.startswith(b"\xef\xbb\xbf"):
                    assert data.startswith(b"\xef\xbb\xbf")
                if old.count(b"\n") == old.count(b"\r\n") and b"\r\n" in old:
                    assert data.count(b"\n") == data.count(b"\r\n")
            for special in ("pipe", "sock"):
                assert before[special] == after[special]
        finally:
            shutil.rmtree(workspace)

    check()
