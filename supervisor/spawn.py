"""What it takes to start a runner, and a copy of its code every uid can read."""

import hashlib
import os
import shutil
import subprocess

import runner
from attrs import field, frozen


@frozen
class RunnerLaunch:
    """Everything an isolation strategy needs to build a runner's command line."""

    owner: str
    conversation: str
    uid: int
    gid: int
    workspace: str
    python: str
    runner_script: str
    runner_args: tuple[str, ...]
    env: dict = field(factory=dict)
    #: Bytes of the private /tmp and /dev/shm a sandbox gives the conversation.
    tmp_size: int = 1 << 30
    #: Host files the runner reads (its cgroup's OOM counter): a sandbox binds them read-only.
    readable_files: tuple[str, ...] = ()
    #: "owner": the owner's other conversations are visible; "private": only this one.
    sharing: str = "owner"

    @property
    def runner_dir(self) -> str:
        """The directory holding the ``runner`` package (to bind into a sandbox)."""
        return os.path.dirname(os.path.dirname(self.runner_script))

    def runner_command(self) -> list[str]:
        """``python -I -S runner/__main__.py ARGS``: the command inside any sandbox."""
        return [self.python, "-I", "-S", self.runner_script, *self.runner_args]


@frozen
class SpawnSpec:
    """The process the supervisor spawns: argv[0] is looked up on no PATH."""

    executable: str
    args: tuple[str, ...]
    env: dict = field(factory=dict)


def runner_env(workspace: str) -> dict:
    """The runner's whole environment: PATH, HOME, TMPDIR, locale, Python settings."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workspace,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    return env


def install_runner_code(state_dir: str, python: str) -> str:
    """Copy the runner package where every uid can read it; return its ``__main__.py``.

    The copy lives in ``<state_dir>/runner/<digest>/runner/`` (directories
    0755, files 0644, owned by the supervisor's user), named by a digest of
    the sources so a running runner's code is never rewritten under it. The
    supervisor's own install may sit under ``/root`` or another path tenant
    uids cannot traverse. The copy is byte-compiled by ``python``, the
    runner's interpreter: runners cannot write ``__pycache__`` there, and
    compiling at every start would cost each conversation milliseconds.
    """
    source_dir = os.path.dirname(os.path.abspath(runner.__file__))
    names = sorted(n for n in os.listdir(source_dir) if n.endswith(".py"))
    digest = hashlib.sha256(python.encode() + b"\0")
    for name in names:
        with open(os.path.join(source_dir, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read() + b"\0")
    base = os.path.join(state_dir, "runner")
    top = os.path.join(base, digest.hexdigest()[:16])
    package = os.path.join(top, "runner")
    if not os.path.isdir(package):
        os.makedirs(base, mode=0o755, exist_ok=True)
        os.chmod(base, 0o755)
        staging = f"{top}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(os.path.join(staging, "runner"), mode=0o755)
        for name in names:
            target = os.path.join(staging, "runner", name)
            shutil.copyfile(os.path.join(source_dir, name), target)
            os.chmod(target, 0o644)
        subprocess.run(
            [python, "-I", "-m", "compileall", "-q", os.path.join(staging, "runner")],
            check=True,
        )
        for directory, _, files in os.walk(staging):
            os.chmod(directory, 0o755)
            for name in files:
                os.chmod(os.path.join(directory, name), 0o644)
        try:
            os.rename(staging, top)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not os.path.isdir(package):
                raise
    for old in os.listdir(base):
        if old != os.path.basename(top) and ".tmp-" not in old:
            shutil.rmtree(os.path.join(base, old), ignore_errors=True)
    return os.path.join(package, "__main__.py")


def unreadable_ancestor(path: str) -> str | None:
    """The first directory above ``path`` that others cannot traverse, or None."""
    current = os.path.dirname(os.path.abspath(path))
    while True:
        mode = os.stat(current).st_mode
        if not mode & 0o001:
            return current
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent
