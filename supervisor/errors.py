"""Errors that reach users: a stable code clients can branch on and a sentence.

No imports: ``supervisor.client`` uses the codes without Twisted or attrs.
"""

#: The stable error codes of the reply (DESIGN.md, "The reply").
BAD_HELLO = "bad_hello"
BAD_NAME = "bad_name"
UID_CONFLICT = "uid_conflict"
LIMIT = "limit"
UNAVAILABLE = "unavailable"
INTERNAL = "internal"
FORBIDDEN = "forbidden"

ERROR_CODES = frozenset(
    {BAD_HELLO, BAD_NAME, UID_CONFLICT, LIMIT, UNAVAILABLE, INTERNAL, FORBIDDEN}
)


class CorralError(Exception):
    """A refusal with a stable ``code`` and a ``message`` a person can act on."""

    def __init__(self, code: str, message: str) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message

    def as_reply(self) -> dict:
        """The ``{"ok": false, ...}`` reply that carries this error."""
        return {"ok": False, "error": {"code": self.code, "message": self.message}}


class ConfigError(Exception):
    """A configuration value that stops start-up; the message names key and value."""
