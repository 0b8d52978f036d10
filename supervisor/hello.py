"""The hello: the one line a client sends before the stream is the runner's.

Everything here is pure: no file system call happens before a hello and its
names have been accepted.
"""

import json
import re

from attrs import frozen

from supervisor.errors import BAD_HELLO, BAD_NAME, CorralError

#: The hello's size limit in bytes, newline included.
MAX_HELLO_BYTES = 4096

#: The only protocol version this supervisor speaks.
PROTOCOL_VERSION = 1

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@frozen
class Hello:
    """A client's validated request for a conversation's workspace."""

    owner: str
    conversation: str


#: Administrative requests a hello may carry instead of asking for a runner.
ADMIN_ACTIONS = ("delete", "cleanup")


@frozen
class AdminRequest:
    """An administrative request: delete an owner or a conversation, or run the cleanup now."""

    action: str
    owner: str | None = None
    conversation: str | None = None


def check_name(kind: str, value: object) -> str:
    """Return ``value`` if it is a valid owner or conversation name, else refuse.

    Names are 1 to 64 ASCII letters, digits, ``.``, ``_`` or ``-``, starting
    with a letter or digit, so ``..``, ``/``, NUL and non-ASCII never reach a
    path.
    """
    if not isinstance(value, str):
        raise CorralError(
            BAD_NAME, f"{kind} must be a string, got {type(value).__name__}"
        )
    if NAME_PATTERN.fullmatch(value) is None or not value.isascii():
        raise CorralError(
            BAD_NAME,
            f"{kind} {safe_repr(value)} is not a valid name: use 1 to 64 ASCII "
            "letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    return value


def parse_hello(line: bytes) -> Hello | AdminRequest:
    """Parse one hello line (its trailing newline optional) or raise CorralError.

    A hello with an ``admin`` key is an :class:`AdminRequest`.
    """
    if len(line) > MAX_HELLO_BYTES:
        raise CorralError(
            BAD_HELLO, f"the hello is longer than {MAX_HELLO_BYTES} bytes"
        )
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise CorralError(BAD_HELLO, "the hello is not valid UTF-8") from None
    try:
        message = json.loads(text)
    except ValueError:
        raise CorralError(
            BAD_HELLO,
            'the hello is not JSON; send one line like '
            '{"corral": 1, "owner": "alice", "conversation": "c-42"}',
        ) from None
    if not isinstance(message, dict):
        raise CorralError(BAD_HELLO, "the hello must be a JSON object")
    version = message.get("corral")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise CorralError(
            BAD_HELLO,
            f'the hello must carry "corral": {PROTOCOL_VERSION}, '
            f"got {safe_repr(version)}",
        )
    if "admin" in message:
        return _parse_admin(message)
    unknown = sorted(set(message) - {"corral", "owner", "conversation"})
    if unknown:
        raise CorralError(
            BAD_HELLO,
            "the hello has unknown keys: " + ", ".join(safe_repr(k) for k in unknown),
        )
    for key in ("owner", "conversation"):
        if key not in message:
            raise CorralError(BAD_HELLO, f'the hello lacks "{key}"')
    return Hello(
        owner=check_name("owner", message["owner"]),
        conversation=check_name("conversation", message["conversation"]),
    )


def _parse_admin(message: dict) -> AdminRequest:
    action = message["admin"]
    if action not in ADMIN_ACTIONS:
        raise CorralError(
            BAD_HELLO,
            f"unknown admin request {safe_repr(action)}; known: " + ", ".join(ADMIN_ACTIONS),
        )
    allowed = {"corral", "admin"} | ({"owner", "conversation"} if action == "delete" else set())
    unknown = sorted(set(message) - allowed)
    if unknown:
        raise CorralError(
            BAD_HELLO,
            f"the {action} request has unknown keys: " + ", ".join(safe_repr(k) for k in unknown),
        )
    if action == "cleanup":
        return AdminRequest("cleanup")
    if "owner" not in message:
        raise CorralError(BAD_HELLO, 'a delete request needs "owner" (and optionally "conversation")')
    conversation = message.get("conversation")
    return AdminRequest(
        "delete",
        owner=check_name("owner", message["owner"]),
        conversation=None if conversation is None else check_name("conversation", conversation),
    )


def safe_repr(value: object, limit: int = 80) -> str:
    """A printable, length-capped rendering of a hostile value for messages and logs."""
    text = json.dumps(value, ensure_ascii=True, default=repr)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text
