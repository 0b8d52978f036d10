"""Plugin loading: built-ins, the entry-point group, selection by name, Interface checks."""

import importlib
import json
import os
import subprocess
import sys

import pytest
from zope.interface.verify import verifyObject

from supervisor.config import load_config
from supervisor.errors import ConfigError
from supervisor.interfaces import IAuditSink, IIsolationStrategy, IStorageBackend
from supervisor.plugins import PluginRegistry, split_spec
from tests.support import wait_until


EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "example_plugin")


@pytest.fixture(scope="module")
def example_plugin():
    """Install the third-party example distribution into this environment, as an operator would."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", EXAMPLE],
        check=True,
    )
    importlib.invalidate_caches()
    yield
    subprocess.run(
        [sys.executable, "-m", "pip", "uninstall", "--quiet", "--yes", "corral-example-plugin"],
        check=True,
    )


@pytest.fixture(scope="module")
def registry():
    return PluginRegistry()


@pytest.fixture
def config(tmp_path):
    return load_config(environ={"CORRAL_STATE_DIR": str(tmp_path)})


def test_builtin_names(registry):
    """The built-in plugins offer the documented names."""
    assert {"local"} <= set(registry.names("storage"))
    assert {"jsonl"} <= set(registry.names("audit"))
    assert {"auto", "none", "setpriv", "bwrap"} <= set(registry.names("isolation"))


def test_split_spec():
    """NAME[:ARGUMENT] splits at the first colon only."""
    assert split_spec("jsonl:/a:b") == ("jsonl", "/a:b")
    assert split_spec("local") == ("local", None)


def test_unknown_name_lists_available(registry, config):
    """An unknown name stops start-up and lists what is available."""
    with pytest.raises(ConfigError) as caught:
        registry.build("isolation", "docker", config)
    message = str(caught.value)
    assert "'docker'" in message and "bwrap" in message and "setpriv" in message


def test_builtins_provide_their_interfaces(registry, config, tmp_path):
    """Every built-in object passes verifyObject against its Interface."""
    verifyObject(IStorageBackend, registry.build("storage", "local", config))
    verifyObject(IAuditSink, registry.build("audit", f"jsonl:{tmp_path}/a.jsonl", config))
    verifyObject(IIsolationStrategy, registry.build("isolation", "none", config))


def test_object_without_interface_is_refused(config):
    """A plugin whose object lacks the Interface's methods is refused at load time."""
    registry = PluginRegistry(extra_modules=("tests.broken_plugin",))
    with pytest.raises(ConfigError, match="IIsolationStrategy"):
        registry.build("isolation", "broken", config)


def test_bad_plugin_module_named(config):
    """A module in the plugins key that cannot be imported is named in the error."""
    with pytest.raises(ConfigError, match="no_such_module"):
        PluginRegistry(extra_modules=("no_such_module",))


def test_plugin_argument_errors_name_the_spec(registry, config):
    """A factory's ValueError becomes a ConfigError naming the configured value."""
    with pytest.raises(ConfigError, match="local:oops"):
        registry.build("storage", "local:oops", config)


def test_entry_point_plugin_is_found(example_plugin):
    """The example distribution in tests/example_plugin registers 'tally' via the entry point."""
    assert "tally" in PluginRegistry().names("audit")


@pytest.mark.integration
def test_entry_point_plugin_selected_end_to_end(example_plugin, start_supervisor, tmp_path):
    """A supervisor configured with the third-party sink by name feeds it real events."""
    counts = tmp_path / "counts.json"
    supervisor = start_supervisor("none", extra_args=["--audit", f"jsonl,tally:{counts}"])
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(supervisor.socket)
        sock.sendall(b"not a hello\n")
        assert json.loads(sock.makefile().readline())["error"]["code"] == "bad_hello"
    data = wait_until(lambda: counts.exists() and json.loads(counts.read_text()))
    assert data.get("hello_refused") == 1
    assert os.path.exists(supervisor.audit_path)
