"""Config files hold the same settings as the flags; flags win; mistakes are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.entrypoints.cli import _parse
from kvgate.entrypoints.serve import server_config
from kvgate.errors import InvalidConfig


def test_toml_settings_and_flag_precedence(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(
        'port = 9001\nkv_cache_memory = "2GiB"\nmax-num-seqs = 7\nno-prefix-caching = true\n'
        'served_model_name = "prod"\n'
    )
    args = _parse(["serve", "--config", str(path), "--port", "9002"])
    assert args.port == 9002  # the flag wins
    assert args.kv_cache_memory == "2GiB" and args.max_num_seqs == 7
    assert args.no_prefix_caching is True
    assert server_config(args).served_model_name == "prod"


def test_yaml_settings(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("host: 0.0.0.0\nmax_queue_len: 3\n")
    config = server_config(_parse(["serve", "--config", str(path)]))
    assert (config.host, config.max_queue_len) == ("0.0.0.0", 3)


def test_default_served_name_is_the_model_directory(tmp_path: Path) -> None:
    args = _parse(["serve", "--model", str(tmp_path / "my-llama") + "/"])
    assert server_config(args).served_model_name == "my-llama"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("prot = 1\n", "unknown setting 'prot'"),
        ("no-prefix-caching = 1\n", "must be true or false"),
        ("port = [1, 2]\n", "must be a single value"),
        ("port = \n", "is not valid"),
    ],
)
def test_bad_config_files_are_named(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(content)
    with pytest.raises(InvalidConfig, match=message):
        _parse(["serve", "--config", str(path)])


def test_a_wrongly_typed_value_fails_like_a_flag(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('port = "eighty"\n')
    with pytest.raises(SystemExit):
        _parse(["serve", "--config", str(path)])
