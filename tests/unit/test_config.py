"""Configuration (memkv.config): the env -> MEMKV_CONFIG yaml -> defaults chain and its errors.

Behaviour under test:
* precedence: a `MEMKV_*` variable beats the yaml named by MEMKV_CONFIG, which beats the
  defaults; the default key file is the last resort for the key;
* every bad value raises ConfigError naming the variable (or the yaml file and key), and no
  message or repr ever contains the 64-hex auth key, even when the key itself is the bad value;
* server lists: host:port, IPv6 as [addr]:port, weights as host:port=W or yaml
  {address, weight}; duplicates, missing ports and bad weights are refused; a ';' separator
  and a URL scheme are named as such; a blank variable ('' or ' ') counts as unset;
* unknown yaml keys are refused with the list of known ones;
* sizes (512MiB, 8GiB, 1.5GB, plain bytes; units case-sensitive, ambiguous ones like 512mb
  refused naming both spellings) and bad sizes; a --capacity above the memory limit warns; lanes NAME:PREFIX:SHARE and bad
  shares; server-side consistency checks;
* AuthKey's repr and str mask the key;
* the default node capacity is a quarter of the host's RAM or of the cgroup memory limit,
  whichever is lower (cgroup v2 memory.max, then v1 memory.limit_in_bytes; "max" and v1's
  near-2**63 "unlimited" mean no limit; unreadable or garbage files are ignored).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from memkv.config import (
    AuthKey,
    ClientConfig,
    LaneSpec,
    ServerAddress,
    ServerConfig,
    capacity_warning,
    cgroup_memory_limit_bytes,
    default_capacity_bytes,
    default_key_path,
    format_size,
    host_memory_bytes,
    parse_address,
    parse_servers,
    parse_size,
)
from memkv.errors import ConfigError

pytestmark = pytest.mark.unit

SECRET = "5e" * 8 + "c7" * 8 + "a1" * 8 + "f0" * 8  # 64 hex chars, easy to grep for
OTHER = "0d" * 32


@pytest.fixture(autouse=True)
def no_default_key_file(tmp_path, monkeypatch) -> Path:
    """Point the default key location at an empty directory, whatever the host has."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "memkv" / "auth.key"


def write_yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "client.yaml"
    path.write_text(text)
    return str(path)


def config_error(env: dict) -> str:
    with pytest.raises(ConfigError) as info:
        ClientConfig.from_env(env)
    message = str(info.value)
    assert SECRET not in message and SECRET.upper() not in message
    return message


# --------------------------------------------------------------------------------------------
# Precedence
# --------------------------------------------------------------------------------------------


def test_defaults_apply_when_only_the_key_is_set() -> None:
    cfg = ClientConfig.from_env({"MEMKV_AUTH_KEY": SECRET})
    assert cfg.servers == (ServerAddress("127.0.0.1", 9900),)
    assert cfg.auth_key == AuthKey.from_hex(SECRET, "x")
    assert (cfg.transport, cfg.integrity, cfg.prometheus_bind, cfg.license) == ("auto", "xxh3", None, None)
    assert (cfg.connect_timeout_s, cfg.io_timeout_s, cfg.pool_size, cfg.down_for_s) == (2.0, 10.0, 8, 2.0)


def test_yaml_beats_defaults(tmp_path) -> None:
    path = write_yaml(
        tmp_path,
        f"servers: [10.0.0.1:9900, 10.0.0.2:9901]\nauth_key: {SECRET}\nintegrity: blake3\n"
        "io_timeout_s: 3.5\npool_size: 2\nprometheus_bind: 127.0.0.1:9400\n",
    )
    cfg = ClientConfig.from_env({"MEMKV_CONFIG": path})
    assert [s.name for s in cfg.servers] == ["10.0.0.1:9900", "10.0.0.2:9901"]
    assert cfg.auth_key.raw == bytes.fromhex(SECRET)
    assert (cfg.integrity, cfg.io_timeout_s, cfg.pool_size, cfg.prometheus_bind) == (
        "blake3",
        3.5,
        2,
        ("127.0.0.1", 9400),
    )


def test_env_beats_yaml(tmp_path) -> None:
    path = write_yaml(tmp_path, f"servers: [10.0.0.1:9900]\nauth_key: {OTHER}\nintegrity: blake3\ntransport: tcp\n")
    cfg = ClientConfig.from_env(
        {
            "MEMKV_CONFIG": path,
            "MEMKV_SERVERS": "10.9.9.9:1234",
            "MEMKV_AUTH_KEY": SECRET,
            "MEMKV_INTEGRITY": "xxh3",
            "MEMKV_TRANSPORT": "RDMA",
        }
    )
    assert [s.name for s in cfg.servers] == ["10.9.9.9:1234"]
    assert cfg.auth_key.raw == bytes.fromhex(SECRET)
    assert (cfg.integrity, cfg.transport) == ("xxh3", "rdma")


def test_empty_env_variable_counts_as_unset(tmp_path) -> None:
    path = write_yaml(tmp_path, f"servers: [10.0.0.1:9900]\nauth_key: {SECRET}\n")
    cfg = ClientConfig.from_env({"MEMKV_CONFIG": path, "MEMKV_SERVERS": "", "MEMKV_AUTH_KEY": ""})
    assert cfg.servers[0].name == "10.0.0.1:9900"


def test_yaml_key_file_is_read(tmp_path) -> None:
    key_file = tmp_path / "k"
    key_file.write_text(SECRET + "\n")
    path = write_yaml(tmp_path, f"auth_key_file: {key_file}\n")
    assert ClientConfig.from_env({"MEMKV_CONFIG": path}).auth_key.raw == bytes.fromhex(SECRET)


def test_default_key_file_is_the_last_resort(no_default_key_file) -> None:
    no_default_key_file.parent.mkdir(parents=True)
    no_default_key_file.write_text(SECRET + "\n")
    assert default_key_path() == no_default_key_file
    assert ClientConfig.from_env({}).auth_key.raw == bytes.fromhex(SECRET)
    assert ClientConfig.from_env({"MEMKV_AUTH_KEY": OTHER}).auth_key.raw == bytes.fromhex(OTHER)


def test_missing_key_names_the_variable_and_the_fix() -> None:
    message = config_error({})
    assert "MEMKV_AUTH_KEY" in message and "memkv keygen" in message


# --------------------------------------------------------------------------------------------
# Bad values: the variable is named, the secret never appears
# --------------------------------------------------------------------------------------------

BAD_ENV = [
    ("MEMKV_SERVERS", "just-a-host"),
    ("MEMKV_SERVERS", "host:notaport"),
    ("MEMKV_SERVERS", "host:70000"),
    ("MEMKV_SERVERS", "host:0"),
    ("MEMKV_SERVERS", "::1:9900"),
    ("MEMKV_SERVERS", "[::1:9900"),
    ("MEMKV_SERVERS", "[not-v6]:9900"),
    ("MEMKV_SERVERS", "a:1,a:1"),
    ("MEMKV_SERVERS", "a:1=0"),
    ("MEMKV_SERVERS", "a:1=-2"),
    ("MEMKV_SERVERS", "a:1=heavy"),
    ("MEMKV_SERVERS", " , "),
    ("MEMKV_TRANSPORT", "carrier-pigeon"),
    ("MEMKV_INTEGRITY", "md5"),
    ("MEMKV_PROMETHEUS_BIND", "nohostport"),
    ("MEMKV_RDMA_DEVICES", "mlx5_0,bad/dev"),
]


@pytest.mark.parametrize("var,value", BAD_ENV, ids=[f"{v}={x}" for v, x in BAD_ENV])
def test_bad_env_value_names_the_variable_and_never_the_key(var, value) -> None:
    message = config_error({"MEMKV_AUTH_KEY": SECRET, var: value})
    assert var in message


BAD_KEYS = [
    ("one-char-short", SECRET[:-1]),
    ("one-char-long", SECRET + "0"),
    ("not-hex", "g" + SECRET[1:]),
    ("space-inside", SECRET[:32] + " " + SECRET[32:]),
    ("base64", "XsfHx8fHx8ehoaGhoaGhofDw8PDw8PDw" + SECRET[:32]),
]


@pytest.mark.parametrize("bad", [b[1] for b in BAD_KEYS], ids=[b[0] for b in BAD_KEYS])
def test_bad_key_names_the_variable_and_never_echoes_the_value(bad) -> None:
    message = config_error({"MEMKV_AUTH_KEY": bad})
    assert "MEMKV_AUTH_KEY" in message
    assert SECRET[:32] not in message and SECRET[32:] not in message and bad not in message


def test_bad_yaml_key_names_the_file_and_key_and_never_echoes_the_value(tmp_path) -> None:
    path = write_yaml(tmp_path, f"auth_key: {SECRET[:-2]}\n")
    message = config_error({"MEMKV_CONFIG": path})
    assert path in message and "auth_key" in message
    assert SECRET[:-2] not in message


def test_bad_key_file_names_the_file_and_never_echoes_its_content(tmp_path) -> None:
    key_file = tmp_path / "k"
    key_file.write_text(SECRET[:-4])
    path = write_yaml(tmp_path, f"auth_key_file: {key_file}\n")
    message = config_error({"MEMKV_CONFIG": path})
    assert "auth_key_file" in message and str(key_file) in message
    assert SECRET[:-4] not in message


def test_unreadable_key_file_names_the_file(tmp_path) -> None:
    path = write_yaml(tmp_path, f"auth_key_file: {tmp_path / 'nope'}\n")
    message = config_error({"MEMKV_CONFIG": path})
    assert "auth_key_file" in message and "nope" in message


BAD_YAML = [
    ("servers: 12\n", "servers"),
    ("servers: [{address: 'a:1', weight: 0}]\n", "servers"),
    ("servers: [{host: a, port: 1}]\n", "servers"),
    ("servers: [{weight: 2}]\n", "servers"),
    ("servers: [[a, 1]]\n", "servers"),
    ("io_timeout_s: 0\n", "io_timeout_s"),
    ("connect_timeout_s: soon\n", "connect_timeout_s"),
    ("down_for_s: -1\n", "down_for_s"),
    ("pool_size: 0\n", "pool_size"),
    ("pool_size: 2.5\n", "pool_size"),
    ("pool_size: true\n", "pool_size"),
    ("transport: udp\n", "MEMKV_TRANSPORT"),
    ("integrity: sha1\n", "integrity"),
    ("rdma_devices: ['a b']\n", "rdma_devices"),
]


@pytest.mark.parametrize("text,name", BAD_YAML, ids=[b[0].strip() for b in BAD_YAML])
def test_bad_yaml_value_names_the_file_and_setting_and_never_the_key(tmp_path, text, name) -> None:
    path = write_yaml(tmp_path, f"auth_key: {SECRET}\n" + text)
    message = config_error({"MEMKV_CONFIG": path})
    assert path in message and name in message


def test_unknown_yaml_key_is_refused_with_the_known_keys(tmp_path) -> None:
    path = write_yaml(tmp_path, f"auth_key: {SECRET}\nserver: [a:1]\n")
    message = config_error({"MEMKV_CONFIG": path})
    assert "MEMKV_CONFIG" in message and "'server'" in message and "'servers'" in message


@pytest.mark.parametrize(
    "text",
    [f"auth_key: {SECRET}\nservers: [a:1\n", f"- {SECRET}\n", f'auth_key: "{SECRET}\n'],
    ids=["invalid-yaml", "not-a-mapping", "unclosed-quote-on-the-key-line"],
)
def test_broken_yaml_names_the_variable_and_never_the_key(tmp_path, text) -> None:
    message = config_error({"MEMKV_CONFIG": write_yaml(tmp_path, text)})
    assert "MEMKV_CONFIG" in message


def test_missing_yaml_file_names_the_variable(tmp_path) -> None:
    message = config_error({"MEMKV_CONFIG": str(tmp_path / "missing.yaml"), "MEMKV_AUTH_KEY": SECRET})
    assert "MEMKV_CONFIG" in message and "missing.yaml" in message


def test_config_repr_never_shows_the_key() -> None:
    cfg = ClientConfig.from_env({"MEMKV_AUTH_KEY": SECRET})
    for text in (repr(cfg), str(cfg), repr(cfg.auth_key), str(cfg.auth_key), f"{cfg}"):
        assert SECRET not in text and SECRET.upper() not in text
    assert "********" in repr(cfg.auth_key)


# --------------------------------------------------------------------------------------------
# Server lists and weights
# --------------------------------------------------------------------------------------------


def test_ipv6_servers_need_brackets_and_print_with_them() -> None:
    servers = parse_servers("[::1]:9900, [fe80::1]:9901 127.0.0.1:9902", "MEMKV_SERVERS")
    assert [(s.host, s.port) for s in servers] == [("::1", 9900), ("fe80::1", 9901), ("127.0.0.1", 9902)]
    assert [s.name for s in servers] == ["[::1]:9900", "[fe80::1]:9901", "127.0.0.1:9902"]


def test_semicolon_separated_servers_say_the_separator_is_a_comma() -> None:
    message = config_error({"MEMKV_SERVERS": "127.0.0.1:9900;127.0.0.1:9901", "MEMKV_AUTH_KEY": SECRET})
    assert message.startswith("MEMKV_SERVERS: servers are separated by ','") and "not ';'" in message
    assert "IPv6" not in message


@pytest.mark.parametrize("text", ["http://127.0.0.1:9900", "tcp://10.0.0.1:9900", "memkv://[::1]:9900"])
def test_a_url_scheme_is_named_as_the_problem(text) -> None:
    message = config_error({"MEMKV_SERVERS": text, "MEMKV_AUTH_KEY": SECRET})
    assert message.startswith("MEMKV_SERVERS: no scheme: write host:port") and "IPv6" not in message


@pytest.mark.parametrize("blank", ["", " ", "\t", " \n "])
def test_blank_servers_and_key_variables_mean_unset(tmp_path, blank) -> None:
    """One rule: a MEMKV_* variable that is empty or only whitespace is unset, so the next
    source applies (the yaml, else the default 127.0.0.1:9900); ' ' used to be an error."""
    assert ClientConfig.from_env({"MEMKV_SERVERS": blank, "MEMKV_AUTH_KEY": SECRET}).servers == (
        ServerAddress("127.0.0.1", 9900),
    )
    path = write_yaml(tmp_path, f"servers: [10.0.0.1:9900]\nauth_key: {SECRET}\n")
    cfg = ClientConfig.from_env({"MEMKV_CONFIG": path, "MEMKV_SERVERS": blank, "MEMKV_AUTH_KEY": blank})
    assert cfg.servers[0].name == "10.0.0.1:9900" and cfg.auth_key.raw == bytes.fromhex(SECRET)


def test_parse_address_default_port_applies_only_when_given() -> None:
    assert parse_address("[::1]", "--listen", 9900) == ("::1", 9900)
    assert parse_address("0.0.0.0", "--listen", 9900) == ("0.0.0.0", 9900)
    with pytest.raises(ConfigError, match="--listen"):
        parse_address("0.0.0.0", "--listen")


def test_weights_in_host_port_form() -> None:
    servers = parse_servers("a:1=2,b:2,[::1]:3=0.5", "MEMKV_SERVERS")
    assert [(s.name, s.weight) for s in servers] == [("a:1", 2.0), ("b:2", 1.0), ("[::1]:3", 0.5)]


def test_weights_in_yaml_mapping_form(tmp_path) -> None:
    path = write_yaml(
        tmp_path,
        f"auth_key: {SECRET}\nservers:\n  - address: 10.0.0.1:9900\n    weight: 2\n  - 10.0.0.2:9900\n  - {{address: '[::1]:9900'}}\n",
    )
    cfg = ClientConfig.from_env({"MEMKV_CONFIG": path})
    assert [(s.name, s.weight) for s in cfg.servers] == [
        ("10.0.0.1:9900", 2.0),
        ("10.0.0.2:9900", 1.0),
        ("[::1]:9900", 1.0),
    ]


# --------------------------------------------------------------------------------------------
# Sizes, lanes, server config
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("512MiB", 512 << 20),
        ("8GiB", 8 << 30),
        ("1.5GB", 1_500_000_000),
        (" 4 KiB ", 4096),
        ("1000", 1000),
        ("512B", 512),
        ("10KB", 10_000),
        ("10kB", 10_000),
        ("512MB", 512_000_000),
        ("2TiB", 2 << 40),
        (123, 123),
    ],
)
def test_sizes_parse_binary_and_decimal_units(text, expected) -> None:
    assert parse_size(text, "--capacity") == expected


@pytest.mark.parametrize(
    "text", ["", "abc", "12XB", "-1", "0", "0MiB", "1.5.5GB", "1e9", "0.0001B", True, 0, -5, "8 GiB extra"]
)
def test_bad_sizes_name_the_setting(text) -> None:
    with pytest.raises(ConfigError, match="--capacity"):
        parse_size(text, "--capacity")


@pytest.mark.parametrize(
    "text,hint",
    [
        ("512mb", "write 512MiB (binary) or 512MB (decimal)"),
        ("512m", "write 512MiB (binary) or 512MB (decimal)"),
        ("8g", "write 8GiB (binary) or 8GB (decimal)"),
        ("10k", "write 10KiB (binary) or 10KB (decimal)"),
        ("64mib", "write 64MiB"),
        ("1gib", "write 1GiB"),
    ],
)
def test_ambiguous_units_are_refused_with_both_spellings_named(text, hint) -> None:
    """Units are case-sensitive: `512mb` cannot say whether 2^20 or 10^6 bytes were meant, so
    it is refused (it used to mean 488.3 MiB silently)."""
    with pytest.raises(ConfigError) as info:
        parse_size(text, "--capacity")
    message = str(info.value)
    assert message.startswith("--capacity: ambiguous or unknown unit") and hint in message
    assert "binary: 1024" in message and "decimal: 1000" in message


def test_format_size_is_readable() -> None:
    assert format_size(512 << 20) == "512.0MiB"
    assert format_size(3 << 30) == "3.0GiB"
    assert format_size(100) == "100B"


def test_lane_spec_parses_name_prefix_share() -> None:
    assert LaneSpec.parse("fleet-a:llama/:0.5") == LaneSpec("fleet-a", b"llama/", 0.5)
    assert LaneSpec.parse("all:: 1") == LaneSpec("all", b"", 1.0)


@pytest.mark.parametrize("text", ["a:p:0", "a:p:1.5", "a:p:-0.1", "a:p:half", "a:p:nan", "a:p:inf"])
def test_bad_lane_shares_name_the_lane(text) -> None:
    with pytest.raises(ConfigError, match="--lane a"):
        LaneSpec.parse(text)


@pytest.mark.parametrize("text", ["a:0.5", "a:b:c:0.5", "bad name:p:0.5", ":p:0.5"])
def test_bad_lane_syntax_is_a_config_error(text) -> None:
    with pytest.raises(ConfigError, match="--lane"):
        LaneSpec.parse(text)


def test_server_config_refuses_lane_shares_over_one_and_duplicate_names() -> None:
    with pytest.raises(ConfigError, match="add up"):
        ServerConfig(capacity_bytes=1 << 30, lanes=(LaneSpec.parse("a:a:0.6"), LaneSpec.parse("b:b:0.5")))
    with pytest.raises(ConfigError, match="unique"):
        ServerConfig(capacity_bytes=1 << 30, lanes=(LaneSpec.parse("a:a:0.2"), LaneSpec.parse("a:b:0.2")))
    with pytest.raises(ConfigError, match="default"):
        ServerConfig(capacity_bytes=1 << 30, lanes=(LaneSpec.parse("default:a:0.2"),))


def test_server_config_refuses_max_value_over_capacity() -> None:
    with pytest.raises(ConfigError, match="--max-value-size"):
        ServerConfig(capacity_bytes=32 << 20, max_value_bytes=64 << 20)


# --------------------------------------------------------------------------------------------
# AuthKey
# --------------------------------------------------------------------------------------------


def test_auth_key_repr_and_str_mask_the_key() -> None:
    key = AuthKey.from_hex(SECRET, "MEMKV_AUTH_KEY")
    assert repr(key) == "AuthKey(source='MEMKV_AUTH_KEY', value=********)"
    assert str(key) == repr(key)
    assert SECRET not in repr([key]) and SECRET not in repr({"k": key})


def test_auth_key_accepts_upper_case_and_surrounding_whitespace() -> None:
    assert AuthKey.from_hex(f"  {SECRET.upper()}\n", "x") == AuthKey.from_hex(SECRET, "y")
    assert AuthKey.from_hex(SECRET, "x") != AuthKey.from_hex(OTHER, "x")


def test_auth_key_must_be_32_bytes() -> None:
    with pytest.raises(ConfigError, match="32 bytes"):
        AuthKey(bytes(31), "test")


def test_key_file_with_surrounding_whitespace_is_accepted(tmp_path) -> None:
    path = tmp_path / "key"
    path.write_text(f"\n{SECRET}\n\n")
    assert AuthKey.from_file(path, "--key-file").raw == bytes.fromhex(SECRET)
    assert os.fspath(path) in AuthKey.from_file(path, "--key-file").source


# --------------------------------------------------------------------------------------------
# Default capacity: host RAM or the container's cgroup memory limit
# --------------------------------------------------------------------------------------------

V1_UNLIMITED = "9223372036854771712"  # what cgroup v1 writes when no limit is set


@pytest.fixture
def cgroup_files(tmp_path) -> tuple[Path, Path]:
    """(v2 memory.max, v1 memory.limit_in_bytes) stand-ins; neither exists until written."""
    return tmp_path / "memory.max", tmp_path / "memory" / "memory.limit_in_bytes"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_is_read_and_max_means_no_limit(cgroup_files) -> None:
    v2, v1 = cgroup_files
    write(v2, "17179869184\n")
    assert cgroup_memory_limit_bytes((v2, v1)) == 16 << 30
    write(v2, "max\n")
    write(v1, "1073741824\n")
    assert cgroup_memory_limit_bytes((v2, v1)) is None  # v2 decides when it exists


def test_cgroup_v1_limit_is_read_when_there_is_no_v2_file(cgroup_files) -> None:
    v2, v1 = cgroup_files
    write(v1, "2147483648\n")
    assert cgroup_memory_limit_bytes((v2, v1)) == 2 << 30


def test_no_cgroup_file_or_garbage_means_no_limit(cgroup_files, tmp_path) -> None:
    v2, v1 = cgroup_files
    assert cgroup_memory_limit_bytes((v2, v1)) is None
    write(v2, "not a number\n")
    write(v1, "-1\n")
    assert cgroup_memory_limit_bytes((v2, v1)) is None
    assert cgroup_memory_limit_bytes((tmp_path,)) is None  # a directory: unreadable, skipped


def test_default_capacity_is_a_quarter_of_the_lower_of_ram_and_the_cgroup_limit(cgroup_files) -> None:
    v2, v1 = cgroup_files
    ram = host_memory_bytes()
    assert default_capacity_bytes((v2, v1)) == max(64 << 20, ram // 4)  # no cgroup files
    write(v2, str(ram // 2))
    assert default_capacity_bytes((v2, v1)) == max(64 << 20, ram // 8)
    write(v2, str(ram * 4))  # a limit above the host's RAM: the RAM bounds it
    assert default_capacity_bytes((v2, v1)) == max(64 << 20, ram // 4)
    v2.unlink()
    write(v1, V1_UNLIMITED)
    assert default_capacity_bytes((v2, v1)) == max(64 << 20, ram // 4)
    write(v1, str(128 << 20))  # a tiny container still gets the 64 MiB floor
    assert default_capacity_bytes((v2, v1)) == 64 << 20


def test_capacity_above_the_memory_limit_warns_and_below_it_does_not(cgroup_files) -> None:
    v2, v1 = cgroup_files
    write(v2, str(1 << 30))  # a 1 GiB container
    warning = capacity_warning(64 << 30, (v2, v1))
    assert warning is not None and "--capacity 64.0GiB exceeds this machine's memory (1.0GiB" in warning
    assert capacity_warning(512 << 20, (v2, v1)) is None
    assert capacity_warning(host_memory_bytes() * 2) is not None  # the real files and RAM


def test_default_capacity_reads_the_real_cgroup_files_by_default() -> None:
    limit = cgroup_memory_limit_bytes()
    expected = host_memory_bytes() if limit is None else min(host_memory_bytes(), limit)
    assert default_capacity_bytes() == max(64 << 20, expected // 4)
    assert ServerConfig().capacity_bytes == default_capacity_bytes()
