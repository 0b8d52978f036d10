"""The supervisor's configuration: one table of keys, four sources.

Precedence, highest first: command-line flags, environment variables, the
TOML file named by ``--config`` (or ``CORRAL_CONFIG``), then the defaults
here. Every key is documented in ``docs/configuration.md``; a test keeps the
two in step.
"""

import grp
import os
import tomllib
from typing import Any, Callable

import attrs
from attrs import frozen

from supervisor import paths
from supervisor.errors import ConfigError


def _parse_int(low: int, high: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError("expected a whole number")
        number = int(value, 10) if isinstance(value, str) else int(value)
        if isinstance(value, float) and value != number:
            raise ValueError("expected a whole number")
        if not low <= number <= high:
            raise ValueError(f"expected a number from {low} to {high}")
        return number

    return parse


def _parse_seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number of seconds")
    number = float(value)
    if not 0 < number < 10**7:
        raise ValueError("expected a positive number of seconds")
    return number


_DURATION_SUFFIXES = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _parse_duration(value: Any) -> float:
    """Seconds, or a number with an s, m, h or d suffix; 0 is allowed (it means off or at once)."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30, 90s, 15m, 2h or 30d")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        text = str(value).strip().lower()
        factor = _DURATION_SUFFIXES.get(text[-1:], None)
        try:
            number = float(text[:-1] if factor else text) * (factor or 1)
        except ValueError:
            raise ValueError("expected a duration such as 30, 90s, 15m, 2h or 30d") from None
    if not 0 <= number < 10**10:
        raise ValueError("expected a duration of 0 or more")
    return number


def _parse_positive_duration(value: Any) -> float:
    number = _parse_duration(value)
    if number <= 0:
        raise ValueError("expected a duration greater than 0")
    return number


def _parse_optional_str(value: Any) -> str | None:
    if isinstance(value, str) and value == "":
        return None
    return _parse_str(value)


def _parse_optional_url(value: Any) -> str | None:
    text = _parse_optional_str(value)
    if text is None:
        return None
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL")
    if parts.username or parts.password:
        raise ValueError(
            "the URL must not carry credentials; set s3_access_key_id and "
            "s3_secret_access_key (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
        )
    return text


def _parse_optional_group(value: Any) -> int | None:
    if isinstance(value, str) and value == "":
        return None
    return _parse_group(value)


def _parse_str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a non-empty string")
    return value


def _parse_path(value: Any) -> str:
    text = _parse_str(value)
    if not os.path.isabs(text):
        raise ValueError("expected an absolute path")
    return os.path.normpath(text)


def _parse_uid_range(value: Any) -> tuple[int, int]:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        low, high = (int(v) for v in value)
    else:
        text = _parse_str(value)
        low_text, sep, high_text = text.partition("-")
        if not sep:
            raise ValueError("expected LOW-HIGH, for example 20000-59999")
        low, high = int(low_text), int(high_text)
    if not 1000 <= low <= high <= 2**31 - 2:
        raise ValueError("expected 1000 <= LOW <= HIGH < 2**31-1")
    return (low, high)


def _parse_group(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = _parse_str(value)
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"no group named {text!r} on this host") from None


def _parse_choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = _parse_str(value)
        if text not in choices:
            raise ValueError("expected one of " + ", ".join(choices))
        return text

    return parse


def _parse_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, (list, tuple)):
        items = [_parse_str(v) for v in value]
    else:
        if not isinstance(value, str):
            raise ValueError("expected a comma-separated string")
        items = [part.strip() for part in value.split(",")]
    return tuple(item for item in items if item)


_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _parse_size(value: Any) -> int | None:
    """Bytes, or with a K, M, G or T suffix (powers of 1024); ``max`` for no limit."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 512M or 2G")
    if isinstance(value, int):
        number = value
    else:
        text = _parse_str(value).strip().upper().removesuffix("B").removesuffix("I")
        if text == "MAX":
            return None
        suffix = text[-1:] if text[-1:] in _SIZE_SUFFIXES else ""
        digits = text[: len(text) - len(suffix)]
        try:
            number = int(float(digits) * _SIZE_SUFFIXES[suffix])
        except ValueError:
            raise ValueError("expected a size such as 512M or 2G, or max") from None
    if not 1 << 20 <= number <= 1 << 50:
        raise ValueError("expected a size from 1M to 1024T, or max")
    return number


def _parse_size_required(value: Any) -> int:
    size = _parse_size(value)
    if size is None:
        raise ValueError("expected a size such as 64M; max is not allowed here")
    return size


def _parse_count_or_max(low: int, high: int) -> Callable[[Any], int | None]:
    whole = _parse_int(low, high)

    def parse(value: Any) -> int | None:
        if isinstance(value, str) and value.strip().lower() == "max":
            return None
        return whole(value)

    return parse


def _parse_optional_cpus(value: Any) -> float | None:
    if isinstance(value, str) and value.strip().lower() in ("", "max"):
        return None
    if isinstance(value, bool):
        raise ValueError("expected a number of CPUs such as 1.5")
    number = float(value)
    if not 0.01 <= number <= 4096:
        raise ValueError("expected a number of CPUs from 0.01 to 4096")
    return number


def _parse_optional_weight(value: Any) -> int | None:
    if isinstance(value, str) and value.strip() == "":
        return None
    return _parse_int(1, 10000)(value)


def _parse_cgroup_root(value: Any) -> str | None:
    text = _parse_str(value)
    if text == "auto":
        return None
    if not text.startswith("/") or ".." in text.split("/"):
        raise ValueError("expected an absolute path inside the cgroup hierarchy, or auto")
    return os.path.normpath(text)


#: Keys an ``[owners.NAME]`` table of the configuration file may override.
OWNER_KEYS = ("memory_limit", "pids_limit", "cpu_weight", "cpu_limit")


def _default_group() -> int:
    try:
        return grp.getgrnam("corral").gr_gid
    except KeyError:
        return os.getgid()


@frozen
class Key:
    """One configuration key: its name, environment variable, parser and doc."""

    name: str
    parse: Callable[[Any], Any]
    default: Callable[[dict], Any]
    doc: str

    @property
    def env(self) -> str:
        """The environment variable that sets this key."""
        return "CORRAL_" + self.name.upper()

    @property
    def flag(self) -> str:
        """The command-line flag that sets this key."""
        return "--" + self.name.replace("_", "-")


KEYS: tuple[Key, ...] = (
    Key("socket", _parse_path, lambda c: paths.default_socket(),
        "Path of the Unix socket clients connect to."),
    Key("socket_group", _parse_group, lambda c: _default_group(),
        "Group (name or gid) allowed to connect: owns the socket's directory "
        "(mode 0750) and the socket (mode 0660)."),
    Key("state_dir", _parse_path, lambda c: paths.default_state_dir(),
        "Directory for corral's own state: the runner's code copy, and the "
        "default workspace root and audit file."),
    Key("workspace_root", _parse_path,
        lambda c: os.path.join(c["state_dir"], "workspaces"),
        "Directory holding <owner>/<conversation>/ workspaces."),
    Key("isolation", _parse_str, lambda c: "auto",
        "Isolation strategy: auto, bwrap, setpriv, none, or a plugin's name."),
    Key("storage", _parse_str, lambda c: "local",
        "Storage backend NAME[:ARGUMENT]: local, s3 (s3:s3://BUCKET/PREFIX, see "
        "storage.md), or a plugin's name."),
    Key("audit", _parse_list,
        lambda c: ("jsonl:" + os.path.join(c["state_dir"], "audit.jsonl"),),
        "Audit sinks, comma-separated NAME[:ARGUMENT]: jsonl:/path, or a "
        "plugin's name."),
    Key("plugins", _parse_list, lambda c: (),
        "Extra plugin modules to import by dotted name, comma-separated "
        "(besides those installed through the 'corral' entry-point group)."),
    Key("uid_range", _parse_uid_range, lambda c: (20000, 59999),
        "Range LOW-HIGH of uids given to owners."),
    Key("hello_timeout", _parse_seconds, lambda c: 10.0,
        "Seconds a client has to send its hello."),
    Key("max_connections", _parse_int(1, 1_000_000), lambda c: 1024,
        "Concurrent connections; over the cap a client gets 'limit'."),
    Key("max_connections_per_owner", _parse_int(1, 1_000_000), lambda c: 32,
        "Concurrent connections of one owner; over the cap a client gets 'limit'."),
    Key("max_conversations_per_owner", _parse_int(1, 10_000_000), lambda c: 10000,
        "Conversations (workspace directories) one owner may have; a hello for a "
        "new one over the cap gets 'limit'."),
    Key("conversation_sharing", _parse_choice("owner", "private"), lambda c: "owner",
        "owner: an owner's conversations see each other's files (they share a "
        "uid); private: each conversation sees only its own directory (needs "
        "bwrap isolation)."),
    Key("runner_python", _parse_path, lambda c: "/usr/bin/python3",
        "Interpreter that runs the runner; must be readable by every owner "
        "uid (not under /root)."),
    Key("bash_timeout", _parse_seconds, lambda c: 120.0,
        "Default timeout of a bash call, in seconds."),
    Key("bash_max_timeout", _parse_seconds, lambda c: 3600.0,
        "Largest timeout a bash call may ask for, in seconds."),
    Key("stop_timeout", _parse_seconds, lambda c: 10.0,
        "Seconds to wait for runners to die at shutdown before giving up."),
    Key("max_read_bytes", _parse_size_required, lambda c: 64 << 20,
        "Largest file the read tool opens (it shows 50 KiB at a time; larger "
        "files are refused with advice to use bash)."),
    Key("max_edit_bytes", _parse_size_required, lambda c: 16 << 20,
        "Largest file the edit tool changes."),
    Key("max_output_file_bytes", _parse_size_required, lambda c: 256 << 20,
        "Most of a long bash output saved to its file in the workspace (the "
        "result shows the last 50 KiB)."),
    Key("tmp_size", _parse_size_required, lambda c: 1 << 30,
        "Size of each conversation's private /tmp and of its /dev/shm (tmpfs; "
        "their pages count towards memory_limit, so each is capped at a quarter "
        "of it)."),
    Key("cgroups", _parse_choice("auto", "v2", "v1", "off"), lambda c: "auto",
        "Per-conversation cgroups: auto (v2 with memory and pids controllers, "
        "else v1), v2, v1, or off."),
    Key("cgroup_root", _parse_cgroup_root, lambda c: None,
        "Where conversations' cgroups go, inside the hierarchy: auto (v2: the "
        "delegated subtree of the supervisor's own cgroup under systemd, else "
        "/corral; v1: /corral) or a path such as /corral."),
    Key("memory_limit", _parse_size, lambda c: 2 << 30,
        "Memory per conversation (swap included where the kernel can limit "
        "it): bytes or with a K, M, G suffix, or max."),
    Key("pids_limit", _parse_count_or_max(8, 4_194_304), lambda c: 512,
        "Processes and threads per conversation, or max."),
    Key("cpu_weight", _parse_optional_weight, lambda c: None,
        "CPU weight per conversation, 1-10000 (100 is the kernel's default); "
        "unset leaves the kernel's default."),
    Key("cpu_limit", _parse_optional_cpus, lambda c: None,
        "CPUs per conversation, such as 1.5 (a CFS quota); unset for no quota."),
    Key("sync_delay", _parse_duration, lambda c: 2.0,
        "With a backend that syncs (s3): seconds between a tool call that may "
        "have changed files and the sync that makes the change durable."),
    Key("sync_retry_max", _parse_positive_duration, lambda c: 60.0,
        "Longest wait between retries of a failed sync (the wait doubles from "
        "1 s up to this)."),
    Key("warm_idle_time", _parse_duration, lambda c: 900.0,
        "With a backend that syncs (s3): how long a conversation's local copy "
        "is kept after its last connection closes, for a fast re-attach; 0 "
        "removes it as soon as it is durable. Durations take s, m, h, d."),
    Key("retention", _parse_duration, lambda c: 0.0,
        "Delete conversations not attached for this long (for example 30d); "
        "0 keeps them forever. At least twice cleanup_interval."),
    Key("cleanup_interval", _parse_positive_duration, lambda c: 300.0,
        "How often the cleanup job runs: finishes pending deletions, evicts idle "
        "local copies, applies retention, removes orphans and, at most every "
        "max(cleanup_interval, blob_gc_grace / 4), collects unreferenced blobs."),
    Key("blob_gc_grace", _parse_duration, lambda c: 86400.0,
        "A stored blob no manifest refers to is deleted only once it is older "
        "than this, so collection never races a sync that is uploading it."),
    Key("admin_group", _parse_optional_group, lambda c: None,
        "Group (name or gid) whose members may make administrative requests "
        "(delete, cleanup) on the socket, besides root and the supervisor's own user; unset: those two only."),
    Key("s3_endpoint_url", _parse_optional_url, lambda c: None,
        "S3 endpoint for anything other than AWS (MinIO, Ceph RGW, R2, GCS), "
        "such as http://127.0.0.1:9000; unset: AWS."),
    Key("s3_region", _parse_optional_str, lambda c: None,
        "S3 region; unset: boto3's chain (AWS_DEFAULT_REGION, ~/.aws/config)."),
    Key("s3_access_key_id", _parse_optional_str, lambda c: None,
        "S3 access key id; unset: boto3's chain (AWS_ACCESS_KEY_ID, "
        "~/.aws/credentials, instance roles). Set it and the secret together."),
    Key("s3_secret_access_key", _parse_optional_str, lambda c: None,
        "S3 secret access key (never logged; keep the configuration file "
        "root-only, mode 0600)."),
    Key("s3_session_token", _parse_optional_str, lambda c: None,
        "S3 session token for temporary credentials."),
    Key("s3_max_concurrency", _parse_int(1, 256), lambda c: 8,
        "Blob transfers in flight at once, across all conversations."),
    Key("log_format", _parse_choice("auto", "json", "text"), lambda c: "auto",
        "Log format on stdout: json, text, or auto (json when stdout is not "
        "a terminal)."),
    Key("log_level", _parse_choice("debug", "info", "warn", "error"),
        lambda c: "info", "Lowest level logged."),
)

KEYS_BY_NAME = {key.name: key for key in KEYS}

#: Keys whose values are never shown (``corral check``, logs).
SECRET_KEYS = frozenset({"s3_secret_access_key", "s3_session_token"})


@frozen
class Config:
    """The effective configuration of one supervisor."""

    socket: str
    socket_group: int
    state_dir: str
    workspace_root: str
    isolation: str
    storage: str
    audit: tuple[str, ...]
    plugins: tuple[str, ...]
    uid_range: tuple[int, int]
    hello_timeout: float
    max_connections: int
    max_connections_per_owner: int
    max_conversations_per_owner: int
    conversation_sharing: str
    runner_python: str
    bash_timeout: float
    bash_max_timeout: float
    stop_timeout: float
    max_read_bytes: int
    max_edit_bytes: int
    max_output_file_bytes: int
    tmp_size: int
    cgroups: str
    cgroup_root: str | None
    memory_limit: int | None
    pids_limit: int | None
    cpu_weight: int | None
    cpu_limit: float | None
    sync_delay: float
    sync_retry_max: float
    warm_idle_time: float
    retention: float
    cleanup_interval: float
    blob_gc_grace: float
    admin_group: int | None
    s3_endpoint_url: str | None
    s3_region: str | None
    s3_access_key_id: str | None
    s3_secret_access_key: str | None
    s3_session_token: str | None
    s3_max_concurrency: int
    log_format: str
    log_level: str
    #: Per-owner overrides from ``[owners.NAME]`` tables: {owner: {key: value}}.
    owners: dict = attrs.field(factory=dict)
    #: Where each value came from: flag, env, file or default.
    sources: dict = attrs.field(factory=dict, eq=False, repr=False)

    def as_dict(self) -> dict:
        """The values by key name, for ``corral check`` and logs; secrets are masked."""
        return {
            key.name: "(set)" if key.name in SECRET_KEYS and getattr(self, key.name)
            else getattr(self, key.name)
            for key in KEYS
        }

    def limits_for(self, owner: str) -> dict:
        """The resource limits of ``owner``'s conversations: the global ones, overridden."""
        limits = {name: getattr(self, name) for name in OWNER_KEYS}
        limits.update(self.owners.get(owner, {}))
        return limits


def load_config(
    flags: dict | None = None,
    environ: dict | None = None,
    config_file: str | None = None,
) -> Config:
    """Build the effective configuration, raising ConfigError on a bad value.

    ``flags`` maps key names to the strings given on the command line (None
    for absent); ``environ`` defaults to ``os.environ``.
    """
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get("CORRAL_CONFIG")
    file_values = _read_file(config_file) if config_file else {}
    owners = _owner_overrides(file_values.pop("owners", {}), config_file)
    values: dict = {}
    sources: dict = {}
    for key in KEYS:
        if key.name in flags:
            raw, source = flags[key.name], f"flag {key.flag}"
        elif key.env in environ:
            raw, source = environ[key.env], f"environment {key.env}"
        elif key.name in file_values:
            raw, source = file_values[key.name], f"file {config_file}"
        else:
            values[key.name] = key.default(values)
            sources[key.name] = "default"
            continue
        try:
            values[key.name] = key.parse(raw)
        except (ValueError, TypeError) as e:
            raise ConfigError(
                f"{key.name} = {raw!r} (from {source}) is not valid: {e}"
            ) from None
        sources[key.name] = source
    if values["bash_timeout"] > values["bash_max_timeout"]:
        raise ConfigError(
            f"bash_timeout ({values['bash_timeout']}) is larger than "
            f"bash_max_timeout ({values['bash_max_timeout']})"
        )
    if values["retention"] and values["retention"] < 2 * values["cleanup_interval"]:
        raise ConfigError(
            f"retention ({values['retention']:g} s) must be 0 or at least twice "
            f"cleanup_interval ({values['cleanup_interval']:g} s): attached "
            "conversations are marked as in use once per cleanup"
        )
    if bool(values["s3_access_key_id"]) != bool(values["s3_secret_access_key"]):
        raise ConfigError(
            "set s3_access_key_id and s3_secret_access_key together, or neither "
            "(then boto3's chain is used: AWS_ACCESS_KEY_ID, ~/.aws, instance roles)"
        )
    return Config(**values, owners=owners, sources=sources)


def _owner_overrides(tables: Any, path: str | None) -> dict:
    """Parse ``[owners.NAME]`` tables: each may set the keys in OWNER_KEYS."""
    from supervisor.errors import CorralError
    from supervisor.hello import check_name

    if not isinstance(tables, dict):
        raise ConfigError(f"config file {path}: owners must be a table of [owners.NAME] tables")
    owners = {}
    for owner, table in tables.items():
        try:
            check_name("owner", owner)
        except CorralError as e:
            raise ConfigError(f"config file {path}: [owners.{owner}]: {e.message}") from None
        if not isinstance(table, dict):
            raise ConfigError(f"config file {path}: owners.{owner} must be a table")
        unknown = sorted(set(table) - set(OWNER_KEYS))
        if unknown:
            raise ConfigError(
                f"config file {path}: [owners.{owner}] has unknown keys: "
                f"{', '.join(unknown)}; an owner may set {', '.join(OWNER_KEYS)}"
            )
        parsed = {}
        for name, raw in table.items():
            try:
                parsed[name] = KEYS_BY_NAME[name].parse(raw)
            except (ValueError, TypeError) as e:
                raise ConfigError(
                    f"owners.{owner}.{name} = {raw!r} (from file {path}) is not valid: {e}"
                ) from None
        owners[owner] = parsed
    return owners


def _read_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    data = data.get("corral", data)
    unknown = sorted(set(data) - set(KEYS_BY_NAME) - {"owners"})
    if unknown:
        raise ConfigError(
            f"config file {path} has unknown keys: {', '.join(unknown)}; "
            f"known keys are: {', '.join(KEYS_BY_NAME)}"
        )
    return data
