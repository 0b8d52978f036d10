"""Default locations, as root and as an ordinary user."""

import os


def is_root() -> bool:
    """Whether this process can create uids' directories and drop to them."""
    return os.geteuid() == 0


def runtime_dir() -> str:
    """Where the socket lives when no ``--socket`` is given."""
    if is_root():
        return "/run/corral"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "corral")
    return f"/tmp/corral-{os.getuid()}"


def default_socket() -> str:
    """The supervisor's socket path for this user (root: ``/run/corral/corral.sock``)."""
    return os.path.join(runtime_dir(), "corral.sock")


def default_state_dir() -> str:
    """The directory that holds workspaces and the runner's code copy."""
    if is_root():
        return "/var/lib/corral"
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return os.path.join(data, "corral")
