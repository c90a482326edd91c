"""``kvgate.launch.settings``: one reading of ``kvgate serve``'s arguments, for the CLI and
the replicas alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.entrypoints.cli import build_parser, parse
from kvgate.launch.settings import Launch, parse_serve, serve_parser, serve_settings


def _flags(parser: object) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}  # type: ignore[attr-defined]


def test_the_cli_serves_exactly_the_launchers_flags() -> None:
    sub = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    assert _flags(sub) == _flags(serve_parser())


def test_a_launch_from_flags_and_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text('model = "gemma3-270m"\nport = 9001\nmax-num-seqs = 7\n')
    argv = ["--config", str(path), "--port", "9002", "--served-model-name", "prod"]
    launch = serve_settings(argv)
    assert isinstance(launch, Launch)
    assert launch.argv == tuple(argv)  # what the replicas of --replicas are given
    assert launch.config.port == 9002 and launch.config.served_model_name == "prod"
    (model,) = launch.models
    assert (model.name, model.engine.model, model.engine.max_num_seqs) == (
        "prod", "gemma3-270m", 7,
    )  # fmt: skip
    # The CLI reads `kvgate serve ...` the same way.
    cli = parse(["serve", *argv])
    assert cli.command == "serve" and callable(cli.func)
    assert (cli.port, cli.max_num_seqs, cli.argv) == (9002, 7, argv)


def test_the_fault_hook_is_not_a_served_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--fault" not in _flags(serve_parser())
    with pytest.raises(SystemExit):
        parse_serve(["--fault", "errors=0.5"])
    assert "unrecognized arguments: --fault" in capsys.readouterr().err
