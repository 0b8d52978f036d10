"""``corral check``: the effective configuration and whether each prerequisite is present."""

import os
import shutil


def _cgroup_status(config) -> tuple[bool, str]:
    from supervisor.cgroups import find_hierarchy

    hierarchy, reasons = find_hierarchy(config.cgroups, config.cgroup_root)
    if hierarchy is None:
        return False, (
            "; ".join(reasons) + ": conversations get no memory or process limits"
        )
    return True, hierarchy.describe() + (f" (passed over: {'; '.join(reasons)})" if reasons else "")


def prerequisites(config) -> list[tuple[str, bool, str]]:
    """(name, ok, detail) for each thing corral relies on."""
    from plugins.isolation_bwrap import BwrapIsolation

    root = os.geteuid() == 0
    rows = [("root", root, "yes" if root else f"no (uid {os.geteuid()}): runners run as this uid")]
    setpriv = shutil.which("setpriv")
    rows.append(("setpriv", bool(setpriv), setpriv or "missing: apt-get install util-linux"))
    unshare = shutil.which("unshare")
    rows.append(("unshare", bool(unshare), unshare or "missing: apt-get install util-linux"))
    bwrap = BwrapIsolation()
    reason = bwrap.unavailable_reason()
    rows.append(("bwrap", reason is None, bwrap.bwrap if reason is None else reason))
    ok, detail = _cgroup_status(config)
    rows.append(("cgroups", ok, detail))
    python_ok = os.access(config.runner_python, os.X_OK)
    rows.append(("runner_python", python_ok, config.runner_python if python_ok else f"{config.runner_python} is not executable"))
    directory = os.path.dirname(config.socket)
    if os.path.isdir(directory):
        st = os.stat(directory)
        detail = f"{directory} exists (mode {st.st_mode & 0o7777:o}, uid {st.st_uid}, gid {st.st_gid})"
        if os.path.exists(config.socket):
            detail += f"; {config.socket} exists"
        rows.append(("socket directory", os.access(directory, os.W_OK), detail))
    else:
        parent = os.path.dirname(directory)
        rows.append(("socket directory", os.access(parent, os.W_OK),
                     f"{directory} will be created in {parent}"))
    return rows


def run_check(config) -> int:
    """Print configuration and prerequisites; exit 1 when the chosen isolation cannot run."""
    print("configuration:")
    for name, value in config.as_dict().items():
        if isinstance(value, tuple) and name == "uid_range":
            value = f"{value[0]}-{value[1]}"
        elif isinstance(value, tuple):
            value = ",".join(value)
        print(f"  {name:18} {value}    ({config.sources.get(name, 'default')})")
    print("prerequisites:")
    rows = prerequisites(config)
    for name, ok, detail in rows:
        print(f"  {'ok ' if ok else 'NO '} {name:18} {detail}")
    from supervisor.errors import ConfigError
    from supervisor.plugins import PluginRegistry

    try:
        registry = PluginRegistry(config.plugins)
        isolation = registry.build("isolation", config.isolation, config)
        for kind in ("storage", "audit", "isolation"):
            print(f"plugins {kind}: {', '.join(registry.names(kind))}")
    except ConfigError as e:
        print(f"isolation: {e}")
        return 1
    print(f"isolation in effect: {isolation.name}")
    return 0
