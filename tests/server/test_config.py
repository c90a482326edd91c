"""Config files hold the same settings as the flags; flags win; mistakes are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.errors import InvalidConfig
from kvgate.launch.settings import (
    ModelToServe,
    engine_config,
    models_to_serve,
    parse_serve,
    server_config,
)


def test_toml_settings_and_flag_precedence(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(
        'port = 9001\nkv_cache_memory = "2GiB"\nmax-num-seqs = 7\nno-prefix-caching = true\n'
        'served_model_name = "prod"\n'
    )
    args = parse_serve(["--config", str(path), "--port", "9002"])
    assert args.port == 9002  # the flag wins
    assert args.kv_cache_memory == "2GiB" and args.max_num_seqs == 7
    assert args.no_prefix_caching is True
    assert server_config(args).served_model_name == "prod"


def test_yaml_settings(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("host: 0.0.0.0\nmax_queue_len: 3\n")
    config = server_config(parse_serve(["--config", str(path)]))
    assert (config.host, config.max_queue_len) == ("0.0.0.0", 3)


def test_embed_precision_flag_and_setting(tmp_path: Path) -> None:
    assert server_config(parse_serve([])).embed_precision == "auto"
    config = server_config(parse_serve(["--embed-precision", "bfloat16"]))
    assert config.embed_precision == "bfloat16"
    path = tmp_path / "kvgate.toml"
    path.write_text('embed_precision = "int4"\n')
    with pytest.raises((InvalidConfig, SystemExit)):
        server_config(parse_serve(["--config", str(path)]))


def test_default_served_name_is_the_model_directory(tmp_path: Path) -> None:
    args = parse_serve(["--model", str(tmp_path / "my-llama") + "/"])
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
        parse_serve(["--config", str(path)])


def test_a_wrongly_typed_value_fails_like_a_flag(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('port = "eighty"\n')
    with pytest.raises(SystemExit):
        parse_serve(["--config", str(path)])


def _models(argv: list[str]) -> list[ModelToServe]:
    args = parse_serve([*argv])
    return models_to_serve(args, engine_config(args), getattr(args, "file_models", ()))


def test_several_models_split_one_budget_by_weight() -> None:
    models = _models([
        "--kv-cache-memory", "1GiB", "--model", "smollm2", "--kv-weight", "3",
        "--model", "/m/gemma/", "--served-model-name", "a", "--served-model-name", "g",
    ])  # fmt: skip
    assert [m.name for m in models] == ["a", "g"]
    assert [m.engine.model for m in models] == ["smollm2", "/m/gemma/"]
    assert [m.engine.kv_cache_memory for m in models] == [3 * 2**28, 2**28]
    # Alone, a model keeps the budget as written (a fraction is resolved at its start).
    (only,) = _models(["--kv-cache-memory", "0.25", "--model", "/m/x"])
    assert only.name == "x" and only.engine.kv_cache_memory == "0.25"
    (default,) = _models([])
    assert default.name == "smollm2" and default.engine.model == "smollm2"


def test_a_models_list_in_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(
        'kv-cache-memory = "400MiB"\ndtype = "bfloat16"\n'
        '[[models]]\nmodel = "smollm2"\nkv_weight = 1\n'
        '[[models]]\nmodel = "gemma3-270m"\nname = "gemma"\nkv_weight = 3\n'
        'dtype = "float32"\nmax_model_len = 2048\n'
    )
    a, g = _models(["--config", str(path)])
    assert (a.name, g.name) == ("smollm2", "gemma")
    assert (a.engine.dtype, g.engine.dtype) == ("bfloat16", "float32")
    assert g.engine.max_model_len == 2048 and a.engine.max_model_len is None
    assert (a.engine.kv_cache_memory, g.engine.kv_cache_memory) == (100 * 2**20, 300 * 2**20)
    # --model on the command line replaces the file's list, as any flag wins over the file.
    (only,) = _models(["--config", str(path), "--model", "/m/other"])
    assert only.name == "other"


@pytest.mark.parametrize(
    ("argv", "toml", "message"),
    [
        (["--model", "a", "--model", "b/a"], "", "two models are served as 'a'"),
        (["--model", "a", "--served-model-name", "x", "--served-model-name", "y"], "",
         "at most one of each per --model"),
        ([], '[[models]]\nmodel = "a"\ncolour = 1\n', r"unknown setting\(s\) \['colour'\]"),
        ([], '[[models]]\nname = "a"\n', "needs 'model'"),
        ([], '[[models]]\nmodel = "a"\nkv_weight = 0\n', "kv_weight must be a positive"),
        ([], "models = 3\n", "'models' must be a non-empty list of tables"),
        ([], '[[models]]\nmodel = "a"\ndtype = "int4"\n', "dtype must be one of"),
    ],
)  # fmt: skip
def test_bad_model_lists_are_named(
    tmp_path: Path, argv: list[str], toml: str, message: str
) -> None:
    if toml:
        path = tmp_path / "bad.toml"
        path.write_text(toml)
        argv = ["--config", str(path), *argv]
    with pytest.raises(InvalidConfig, match=message):
        _models(argv)


def test_ingestion_limit_flags_and_settings(tmp_path: Path) -> None:
    from kvgate.retrieval.bounds import IngestLimits

    assert server_config(parse_serve([])).ingest_limits == IngestLimits()
    path = tmp_path / "kvgate.toml"
    path.write_text("ingest_max_pages = 100\n")
    config = server_config(
        parse_serve(["--config", str(path), "--ingest-job-timeout", "30",
                "--ingest-memory-mib", "1024", "--ingest-max-chars", "5000",
                "--ingest-max-unzipped-mib", "16"])
    )  # fmt: skip
    assert config.ingest_limits == IngestLimits(
        max_unzipped_bytes=16 * 2**20, max_pdf_pages=100, max_text_chars=5000,
        job_seconds=30.0, memory_bytes=1024 * 2**20,
    )  # fmt: skip
    with pytest.raises(InvalidConfig, match="max_text_chars"):
        server_config(parse_serve(["--ingest-max-chars", "0"]))
