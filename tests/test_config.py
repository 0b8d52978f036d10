"""Configuration: precedence, parsing, errors that name key and value, and its docs."""

import os

import pytest

from supervisor.config import KEYS, load_config
from supervisor.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults():
    """With nothing set, the documented defaults apply."""
    config = load_config(environ={})
    assert config.isolation == "auto"
    assert config.storage == "local"
    assert config.uid_range == (20000, 59999)
    assert config.hello_timeout == 10.0
    assert config.workspace_root == os.path.join(config.state_dir, "workspaces")
    assert all(source == "default" for source in config.sources.values())


def test_precedence(tmp_path):
    """Flags beat the environment, which beats the file, which beats defaults."""
    path = tmp_path / "corral.toml"
    path.write_text('isolation = "setpriv"\nhello_timeout = 3\nmax_connections = 7\n'
                    'uid_range = "30000-30010"\n')
    config = load_config(
        flags={"isolation": "none"},
        environ={"CORRAL_HELLO_TIMEOUT": "4"},
        config_file=str(path),
    )
    assert config.isolation == "none"
    assert config.hello_timeout == 4.0
    assert config.max_connections == 7
    assert config.uid_range == (30000, 30010)
    assert config.sources["isolation"] == "flag --isolation"
    assert config.sources["hello_timeout"] == "environment CORRAL_HELLO_TIMEOUT"


def test_workspace_root_follows_state_dir():
    """The default workspace root lives inside whatever state_dir is chosen."""
    config = load_config(environ={"CORRAL_STATE_DIR": "/srv/corral"})
    assert config.workspace_root == "/srv/corral/workspaces"


@pytest.mark.parametrize(
    "env, key",
    [
        ({"CORRAL_UID_RANGE": "5"}, "uid_range"),
        ({"CORRAL_UID_RANGE": "500-600"}, "uid_range"),
        ({"CORRAL_UID_RANGE": "40000-30000"}, "uid_range"),
        ({"CORRAL_HELLO_TIMEOUT": "-1"}, "hello_timeout"),
        ({"CORRAL_HELLO_TIMEOUT": "soon"}, "hello_timeout"),
        ({"CORRAL_MAX_CONNECTIONS": "0"}, "max_connections"),
        ({"CORRAL_MAX_CONNECTIONS": "1.5"}, "max_connections"),
        ({"CORRAL_SOCKET": "relative.sock"}, "socket"),
        ({"CORRAL_SOCKET_GROUP": "no-such-group-here"}, "socket_group"),
        ({"CORRAL_LOG_FORMAT": "xml"}, "log_format"),
        ({"CORRAL_BASH_TIMEOUT": "7200"}, "bash_timeout"),
    ],
)
def test_bad_values_name_key_and_value(env, key):
    """A bad value stops start-up with a message naming the key and the value."""
    with pytest.raises(ConfigError) as caught:
        load_config(environ=env)
    message = str(caught.value)
    assert key in message
    assert list(env.values())[0] in message


def test_unknown_file_key(tmp_path):
    """A typo in the configuration file is an error listing the known keys."""
    path = tmp_path / "corral.toml"
    path.write_text('isolaton = "bwrap"\n')
    with pytest.raises(ConfigError, match="isolaton"):
        load_config(environ={}, config_file=str(path))


def test_bad_toml(tmp_path):
    """A file that is not TOML is reported with its path."""
    path = tmp_path / "corral.toml"
    path.write_text("isolation = \n")
    with pytest.raises(ConfigError, match=str(path)):
        load_config(environ={}, config_file=str(path))


def test_every_key_is_documented():
    """docs/configuration.md names every key, its environment variable and its flag."""
    with open(os.path.join(REPO, "docs", "configuration.md"), encoding="utf-8") as f:
        doc = f.read()
    for key in KEYS:
        assert f"`{key.name}`" in doc, key.name
        assert f"`{key.env}`" in doc, key.env
        assert f"`{key.flag}`" in doc, key.flag


@pytest.mark.parametrize(
    "text, value",
    [("256M", 256 << 20), ("2G", 2 << 30), ("2GiB", 2 << 30), ("1.5G", 3 << 29),
     ("1048576", 1 << 20), ("max", None), ("4096k", 4 << 20)],
)
def test_sizes(text, value):
    """memory_limit takes bytes, K/M/G/T suffixes (powers of 1024) or max."""
    assert load_config(environ={"CORRAL_MEMORY_LIMIT": text}).memory_limit == value


@pytest.mark.parametrize("text", ["lots", "-1G", "12", "2X"])
def test_bad_sizes(text):
    """A size that is not one, or under 1 MiB, names the key and the value."""
    with pytest.raises(ConfigError, match="memory_limit"):
        load_config(environ={"CORRAL_MEMORY_LIMIT": text})


def test_owner_overrides(tmp_path):
    """[owners.NAME] tables override the global limits for that owner only."""
    path = tmp_path / "corral.toml"
    path.write_text('memory_limit = "1G"\npids_limit = 100\n'
                    '[owners.bot]\nmemory_limit = "4G"\ncpu_limit = 2\n')
    config = load_config(environ={}, config_file=str(path))
    assert config.limits_for("bot") == {
        "memory_limit": 4 << 30, "pids_limit": 100, "cpu_weight": None, "cpu_limit": 2.0}
    assert config.limits_for("other")["memory_limit"] == 1 << 30


@pytest.mark.parametrize(
    "table, message",
    [('[owners."../x"]\npids_limit = 5\n', "not a valid name"),
     ("[owners.bot]\nisolation = \"none\"\n", "unknown keys: isolation"),
     ('[owners.bot]\nmemory_limit = "huge"\n', "owners.bot.memory_limit")],
)
def test_bad_owner_overrides(tmp_path, table, message):
    """A bad owner name, a key an owner may not set, or a bad value stops start-up."""
    path = tmp_path / "corral.toml"
    path.write_text(table)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(environ={}, config_file=str(path))
