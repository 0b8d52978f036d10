"""The four tools as MCP sees them: definitions, argument checks and dispatch.

The tools themselves live in :mod:`runner.bash` and :mod:`runner.files`,
imported when first called.
"""

import threading


class InvalidArguments(Exception):
    """A tools/call names an unknown tool or gives arguments its schema refuses."""


#: Each tool's JSON Schema for its arguments.
INPUT_SCHEMAS = {
    "bash": {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The bash command to run."},
            "timeout": {"type": "number", "exclusiveMinimum": 0,
                        "description": "Timeout in seconds (optional)."},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
    "read": {
        "type": "object",
        "properties": {
            "path": {"type": "string", "minLength": 1,
                     "description": "Path of the file to read."},
            "offset": {"type": "integer", "minimum": 1,
                       "description": "First line to show, counting from 1."},
            "limit": {"type": "integer", "minimum": 1,
                      "description": "Largest number of lines to show."},
        },
        "required": ["path"],
        "additionalProperties": False,
    },
    "write": {
        "type": "object",
        "properties": {
            "path": {"type": "string", "minLength": 1,
                     "description": "Path of the file to write."},
            "content": {"type": "string", "description": "The complete new content."},
        },
        "required": ["path", "content"],
        "additionalProperties": False,
    },
    "edit": {
        "type": "object",
        "properties": {
            "path": {"type": "string", "minLength": 1,
                     "description": "Path of the file to edit."},
            "edits": {
                "type": "array",
                "minItems": 1,
                "description": "Replacements, each applied to the original text.",
                "items": {
                    "type": "object",
                    "properties": {
                        "oldText": {"type": "string",
                                    "description": "Exact text to replace."},
                        "newText": {"type": "string",
                                    "description": "Text to put in its place."},
                    },
                    "required": ["oldText", "newText"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["path", "edits"],
        "additionalProperties": False,
    },
}


def tool_definitions(options):
    """The tools/list entries: name, description, input schema and hints."""
    limits = (f"{options.max_output_lines} lines or {options.max_output_bytes // 1024} KiB"
              if options.max_output_bytes % 1024 == 0
              else f"{options.max_output_lines} lines or {options.max_output_bytes} bytes")
    return [
        {
            "name": "bash",
            "title": "Run a shell command",
            "description": (
                "Run a command with `bash -c` in the workspace directory, in its own process "
                "group, with stdin from /dev/null. Returns stdout and stderr interleaved. Only "
                f"the last {limits} (whichever is smaller) are returned; when output is cut, "
                "the full output is saved to a file in the workspace whose path is given. "
                f"Default timeout {options.bash_timeout:g} s, at most "
                f"{options.bash_max_timeout:g} s; on timeout or cancellation the whole process "
                "tree is killed. A non-zero exit, a timeout or a cancellation is an error "
                "result that still includes the output. Background processes (`cmd &`) keep "
                "running after the call returns, but their later output is discarded: "
                "redirect it to a file if you need it."
            ),
            "inputSchema": INPUT_SCHEMAS["bash"],
            "annotations": {"openWorldHint": False},
        },
        {
            "name": "read",
            "title": "Read a file",
            "description": (
                "Read a UTF-8 text file. Returns at most 2000 lines or 50 KiB (whichever comes "
                "first), never a partial line, with a note saying which offset continues. "
                "PNG, JPEG, GIF and WebP images (up to 5 MiB) come back as images; other "
                "binary files, text files over "
                f"{_size_text(options.max_read_bytes)} and anything that is not a regular file "
                "(a FIFO, a device, a socket) are refused: use bash (head, sed, tail) for those. "
                "Relative paths resolve against the workspace; ~ is the home directory."
            ),
            "inputSchema": INPUT_SCHEMAS["read"],
            "annotations": {"readOnlyHint": True, "openWorldHint": False},
        },
        {
            "name": "write",
            "title": "Write a file",
            "description": (
                "Write content to a file, replacing it atomically if it exists (a crash leaves "
                "the old or the new content, never a mix) and creating parent directories. "
                "An existing FIFO, device or socket is refused, not replaced. "
                "The content is written as UTF-8 exactly as given. Relative paths resolve "
                "against the workspace."
            ),
            "inputSchema": INPUT_SCHEMAS["write"],
            "annotations": {"destructiveHint": True, "idempotentHint": True,
                            "openWorldHint": False},
        },
        {
            "name": "edit",
            "title": "Edit a file",
            "description": (
                "Replace exact text in a file. Each oldText must be non-empty, occur exactly "
                "once in the current file and not overlap another edit; all edits apply to "
                "the original file in one atomic write, or none do. CRLF line endings and a "
                "byte order mark are kept. Returns a unified diff. Files over "
                f"{_size_text(options.max_edit_bytes)} are refused."
            ),
            "inputSchema": INPUT_SCHEMAS["edit"],
            "annotations": {"destructiveHint": True, "openWorldHint": False},
        },
    ]


def _size_text(count):
    """count bytes in words for a description: ``64 MiB``, or the byte count."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale and count % scale == 0:
            return f"{count // scale} {unit}"
    return f"{count} bytes"


def check_arguments(name, arguments):
    """Raise :class:`InvalidArguments` unless name is a tool and arguments fit its schema."""
    if not isinstance(name, str):
        raise InvalidArguments('Invalid params: "name" must be a string naming a tool.')
    if name not in INPUT_SCHEMAS:
        shown = repr(name) if len(name) <= 60 else repr(name[:60]) + "..."
        raise InvalidArguments(f"Unknown tool {shown}; the tools are {', '.join(INPUT_SCHEMAS)}.")
    problem = _schema_problem(INPUT_SCHEMAS[name], arguments, "arguments")
    if problem:
        raise InvalidArguments(f"Invalid arguments for tool {name}: {problem}.")


def _schema_problem(schema, value, where):
    """Say how value breaks schema (the small subset of JSON Schema used here), or None."""
    kind = schema["type"]
    if kind == "object":
        if not isinstance(value, dict):
            return f"{where} must be an object"
        for key in schema["required"]:
            if key not in value:
                return f"{where} lacks the required property {key!r}"
        for key, item in value.items():
            if key not in schema["properties"]:
                allowed = ", ".join(schema["properties"])
                return f"{where} has the unknown property {key[:60]!r} (allowed: {allowed})"
            problem = _schema_problem(schema["properties"][key], item, f"{where}.{key}")
            if problem:
                return problem
    elif kind == "array":
        if not isinstance(value, list):
            return f"{where} must be an array"
        if len(value) < schema.get("minItems", 0):
            return f"{where} must not be empty"
        for index, item in enumerate(value):
            problem = _schema_problem(schema["items"], item, f"{where}[{index}]")
            if problem:
                return problem
    elif kind == "string":
        if not isinstance(value, str):
            return f"{where} must be a string"
        if len(value) < schema.get("minLength", 0):
            return f"{where} must not be empty"
    else:  # "number" or "integer"
        wanted = (int,) if kind == "integer" else (int, float)
        if isinstance(value, bool) or not isinstance(value, wanted):
            return f"{where} must be {'an integer' if kind == 'integer' else 'a number'}"
        if value != value or value in (float("inf"), float("-inf")):
            return f"{where} must be a finite number"
        if "minimum" in schema and value < schema["minimum"]:
            return f"{where} must be at least {schema['minimum']} (got {value})"
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            return f"{where} must be greater than {schema['exclusiveMinimum']} (got {value})"
    return None


class Call:
    """One tools/call in flight: the runner's options, a progress sink, cancellation."""

    def __init__(self, options, progress=None):
        self.options = options
        #: ``progress(bytes_so_far, text)`` sends a progress notification, or None.
        self.progress = progress
        self.cancelled = False
        self.cancel_reason = None
        self._on_cancel = None
        self._lock = threading.Lock()

    def cancel(self, reason=None):
        """Ask the call to stop; runs the tool's cancel hook, if it has one."""
        with self._lock:
            if self.cancelled:
                return
            self.cancelled = True
            self.cancel_reason = reason
            hook = self._on_cancel
        if hook is not None:
            hook()

    def set_cancel_hook(self, hook):
        """Make cancel() call hook(); runs it at once if the call is already cancelled."""
        with self._lock:
            self._on_cancel = hook
            run_now = self.cancelled and hook is not None
        if run_now:
            hook()


def tool_result(text, structured, is_error=False, content=None):
    """An MCP CallToolResult: text (or the given content items) plus structured content."""
    return {
        "content": content if content is not None else [{"type": "text", "text": text}],
        "isError": is_error,
        "structuredContent": structured,
    }


def run(name, arguments, call):
    """Run the tool name (already checked) with arguments; return a CallToolResult."""
    options = call.options
    if name == "bash":
        from runner import bash

        timeout = min(arguments.get("timeout", options.bash_timeout), options.bash_max_timeout)
        return bash.run_bash(arguments["command"], timeout, call)
    from runner import files

    if name == "read":
        return files.read_file(options.workspace, arguments["path"],
                               arguments.get("offset"), arguments.get("limit"),
                               max_bytes=options.max_read_bytes)
    if name == "write":
        return files.write_file(options.workspace, arguments["path"], arguments["content"])
    return files.edit_file(options.workspace, arguments["path"], arguments["edits"],
                           max_bytes=options.max_edit_bytes)
