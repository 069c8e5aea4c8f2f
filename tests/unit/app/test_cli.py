"""``stoker``'s options as settings (the model control mode, the models loaded at start) and
``stoker models --load/--unload`` refusing what it cannot do."""

from __future__ import annotations

import pytest

from app.cli import build_settings, control_models, parse_args


def test_serve_takes_tritons_model_control_options() -> None:
    args = parse_args(
        ["serve", "--model-control-mode", "explicit", "--load-model", "a", "--load-model", "b"]
    )
    models = build_settings(args).models
    assert (models.control, models.startup) == ("explicit", ["a", "b"])
    assert build_settings(parse_args(["serve"])).models.startup is None


def test_a_config_file_goes_with_one_load(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["models", "--load", "a", "--load", "b", "--config", "c.yaml"])
    code = control_models(build_settings(args), args)
    assert code == 2 and "--config goes with exactly one --load" in capsys.readouterr().err


def test_an_unreachable_server_is_said_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["models", "--unload", "a", "--url", "http://127.0.0.1:9", "--timeout", "5"])
    code = control_models(build_settings(args), args)
    assert code == 1 and "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


def test_front_ends_given_on_the_command_line_leave_no_auto_choice_to_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--front-ends 4`` on a machine where ``auto`` gives 1: the server serves 4 and does
    not log what ``auto`` would have chosen (it did, before: "front_ends auto: 1")."""
    from app import settings as settings_module

    monkeypatch.setattr(settings_module, "visible_gpus", lambda: 0)
    monkeypatch.setattr(settings_module, "AUTO_FRONT_ENDS", None)  # restored after
    monkeypatch.delenv("STOKER_SERVER__FRONT_ENDS", raising=False)
    assert build_settings(parse_args(["serve"])).server.front_ends == 1
    assert settings_module.AUTO_FRONT_ENDS is not None
    assert build_settings(parse_args(["serve", "--front-ends", "4"])).server.front_ends == 4
    assert settings_module.AUTO_FRONT_ENDS is None
