"""The official MCP Python SDK (``mcp``) uses a workspace through ``corral relay``.

The SDK starts ``corral relay`` as its stdio server, exactly as an MCP
client configured with ``command: corral, args: [relay, ...]`` would.  Its
high-level ``Client`` first probes ``server/discover`` (2026-era MCP) and
falls back to ``initialize``; its ``ClientSession`` does the handshake-era
``initialize`` directly.  Both must work.  The SDK is async: each test runs
its coroutine with ``anyio.run``.
"""

import os

import anyio
import pytest
from mcp import Client, ClientSession, StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from tests.support import CORRAL, REPO

pytestmark = pytest.mark.integration

OWNER, CONVERSATION = "mcp-user", "c-1"


def relay_parameters(supervisor, conversation=CONVERSATION) -> StdioServerParameters:
    """How an MCP client is told to start ``corral relay`` for one conversation."""
    return StdioServerParameters(
        command=CORRAL[0],
        args=[*CORRAL[1:], "relay", "--socket", supervisor.socket,
              "--owner", OWNER, "--conversation", conversation],
        cwd=REPO,
    )


def text_of(result) -> str:
    """The text content of an SDK CallToolResult."""
    return "".join(item.text for item in result.content if item.type == "text")


def test_client_lists_and_calls_every_tool(supervisor):
    """mcp.Client connects, lists the four tools and calls bash, write, read and edit."""

    async def scenario():
        progress = []

        async def on_progress(value, total, message):
            progress.append((value, message))

        async with Client(relay_parameters(supervisor), read_timeout_seconds=60) as client:
            assert client.server_info.name == "corral"
            assert client.protocol_version
            assert "workspace" in (client.instructions or "")

            tools = {tool.name: tool for tool in (await client.list_tools()).tools}
            assert sorted(tools) == ["bash", "edit", "read", "write"]
            assert tools["bash"].input_schema["required"] == ["command"]
            assert tools["edit"].input_schema["properties"]["edits"]["type"] == "array"

            result = await client.call_tool(
                "bash", {"command": "echo hello; pwd"}, progress_callback=on_progress
            )
            workspace = os.path.join(supervisor.workspace_root, OWNER, CONVERSATION)
            assert result.is_error is False
            assert text_of(result) == f"hello\n{workspace}\n"
            assert result.structured_content["exitCode"] == 0
            assert "".join(message for _, message in progress) == text_of(result)
            assert all(isinstance(value, (int, float)) for value, _ in progress)

            result = await client.call_tool("bash", {"command": "echo oops >&2; exit 7"})
            assert result.is_error is True
            assert result.structured_content["exitCode"] == 7
            assert text_of(result).startswith("oops\n")

            result = await client.call_tool("write", {"path": "src/app.py", "content": "x = 1\n"})
            assert result.is_error is False

            result = await client.call_tool("read", {"path": "src/app.py"})
            assert result.is_error is False and text_of(result) == "x = 1\n"

            result = await client.call_tool(
                "edit", {"path": "src/app.py", "edits": [{"oldText": "x = 1", "newText": "x = 2"}]}
            )
            assert result.is_error is False and "+x = 2" in text_of(result)

            result = await client.call_tool("read", {"path": "src/app.py"})
            assert text_of(result) == "x = 2\n"

            result = await client.call_tool("read", {"path": "src/missing.py"})
            assert result.is_error is True

    anyio.run(scenario)


def test_client_session_handshake_and_errors(supervisor):
    """ClientSession over stdio_client: initialize, ping, and JSON-RPC errors as MCPError."""

    async def scenario():
        async with stdio_client(relay_parameters(supervisor, "c-2")) as (read, write):
            async with ClientSession(read, write, read_timeout_seconds=60) as session:
                initialized = await session.initialize()
                assert initialized.server_info.name == "corral"
                assert initialized.capabilities.tools is not None
                await session.send_ping()
                listed = await session.list_tools()
                assert len(listed.tools) == 4
                with pytest.raises(MCPError) as caught:
                    await session.call_tool("no_such_tool", {})
                assert caught.value.error.code == -32602
                with pytest.raises(MCPError):
                    await session.call_tool("bash", {"command": 1})
                result = await session.call_tool("bash", {"command": "sleep 5", "timeout": 0.3})
                assert result.is_error is True
                assert result.structured_content["timedOut"] is True

    anyio.run(scenario)


def test_concurrent_calls_through_the_sdk(supervisor):
    """Several tools/call requests in flight at once through the SDK all get their own answers."""

    async def scenario():
        results = {}
        async with Client(relay_parameters(supervisor, "c-3"), read_timeout_seconds=60) as client:

            async def call(number):
                result = await client.call_tool(
                    "bash", {"command": f"sleep 0.{5 - number}; echo {number}"}
                )
                results[number] = text_of(result)

            async with anyio.create_task_group() as group:
                for number in range(5):
                    group.start_soon(call, number)
        assert results == {number: f"{number}\n" for number in range(5)}

    anyio.run(scenario)
