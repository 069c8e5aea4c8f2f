"""The settings object: its defaults, the environment (``STOKER_<SECTION>__<FIELD>``) and what
it refuses. The API keys' own parsing is covered by ``test_auth``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

from app.settings import (
    MOVED,
    AuthSettings,
    LimitSettings,
    ModelRepositorySettings,
    ServerSettings,
    Settings,
    StoreSettings,
    UploadSettings,
)

SECTIONS: tuple[type[BaseModel], ...] = (
    ServerSettings,
    ModelRepositorySettings,
    UploadSettings,
    StoreSettings,
    LimitSettings,
    AuthSettings,
)


@pytest.fixture(autouse=True)
def no_stoker_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from an environment without STOKER_ variables (names are read
    case-insensitively, so lower-case ones go too)."""
    for name in list(os.environ):
        if name.upper().startswith("STOKER_"):
            monkeypatch.delenv(name)
    yield


def field(settings: Settings, dotted: str) -> Any:
    value: Any = settings
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def error_fields(error: ValidationError) -> list[str]:
    return [".".join(str(p) for p in err["loc"]) for err in error.errors()]


def test_defaults_keep_a_laptop_server_private_and_bounded() -> None:
    settings = Settings()
    assert settings.server == ServerSettings(
        host="127.0.0.1", port=8000, log_level="info", keep_alive_s=75, drain_timeout_s=30.0
    )
    models = settings.models
    assert models.repository == Path("models")
    assert models.models == []
    assert models.default_model is None and models.backend is None
    uploads = settings.uploads
    assert uploads.image_decode == "auto" and uploads.decode_in_front_ends is True
    # GPU decode batches bounded by pixels, large under load, two in flight in all
    assert (uploads.decode_batch_pixels, uploads.decode_batch_photos) == (48_000_000, 256)
    assert (uploads.decode_processes, uploads.decode_in_flight) == (2, 1)
    assert models.prepare_missing is True and models.exit_on_error is False
    # Model control is off: the set is fixed at start, as before there was any.
    assert (models.control, models.startup, models.poll_s) == ("none", None, 5.0)
    limits = settings.limits
    assert limits.max_body_bytes == 64 * 1024 * 1024
    assert limits.max_image_pixels == 40_000_000
    assert limits.max_image_aspect_ratio == 32.0
    assert limits.max_images_per_request == 64
    assert limits.default_top_k == 5
    # The README's documented default: data nested along any shape numpy holds (64 dims).
    assert limits.max_json_depth == 64
    assert settings.auth.keys() == [] and settings.auth.protect_metrics is False


def test_the_store_defaults_to_the_users_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert Settings().store.path == tmp_path / "xdg" / "stoker" / "engines"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert Settings().store.path == tmp_path / "home" / ".cache" / "stoker" / "engines"


@pytest.mark.parametrize(
    ("variable", "raw", "dotted", "expected"),
    [
        ("STOKER_SERVER__HOST", "0.0.0.0", "server.host", "0.0.0.0"),
        ("STOKER_SERVER__PORT", "9000", "server.port", 9000),
        ("STOKER_SERVER__LOG_LEVEL", "debug", "server.log_level", "debug"),
        ("STOKER_SERVER__KEEP_ALIVE_S", "5", "server.keep_alive_s", 5),
        ("STOKER_SERVER__DRAIN_TIMEOUT_S", "2.5", "server.drain_timeout_s", 2.5),
        ("STOKER_MODELS__REPOSITORY", "/opt/models", "models.repository", Path("/opt/models")),
        ("STOKER_MODELS__MODELS", '["tiny", "resnet50"]', "models.models", ["tiny", "resnet50"]),
        ("STOKER_MODELS__DEFAULT_MODEL", "tiny", "models.default_model", "tiny"),
        ("STOKER_MODELS__BACKEND", "onnxruntime", "models.backend", "onnxruntime"),
        ("STOKER_UPLOADS__IMAGE_DECODE", "cpu", "uploads.image_decode", "cpu"),
        ("STOKER_UPLOADS__DECODE_BATCH_PIXELS", "8", "uploads.decode_batch_pixels", 8),
        ("STOKER_MODELS__PREPARE_MISSING", "false", "models.prepare_missing", False),
        ("STOKER_MODELS__EXIT_ON_ERROR", "1", "models.exit_on_error", True),
        ("STOKER_MODELS__CONTROL", "explicit", "models.control", "explicit"),
        ("STOKER_MODELS__STARTUP", "[]", "models.startup", []),
        ("STOKER_MODELS__POLL_S", "0.5", "models.poll_s", 0.5),
        ("STOKER_STORE__PATH", "/var/cache/e", "store.path", Path("/var/cache/e")),
        ("STOKER_LIMITS__MAX_BODY_BYTES", "1024", "limits.max_body_bytes", 1024),
        ("STOKER_LIMITS__MAX_IMAGE_PIXELS", "100", "limits.max_image_pixels", 100),
        ("STOKER_LIMITS__MAX_IMAGE_ASPECT_RATIO", "4.5", "limits.max_image_aspect_ratio", 4.5),
        ("STOKER_LIMITS__MAX_IMAGES_PER_REQUEST", "3", "limits.max_images_per_request", 3),
        ("STOKER_LIMITS__DEFAULT_TOP_K", "2", "limits.default_top_k", 2),
        ("STOKER_LIMITS__MAX_JSON_DEPTH", "8", "limits.max_json_depth", 8),
        ("STOKER_AUTH__PROTECT_METRICS", "true", "auth.protect_metrics", True),
    ],
)
def test_every_field_is_set_by_its_environment_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, raw: str, dotted: str, expected: object
) -> None:
    before = field(Settings(), dotted)
    assert before != expected, "the case must move the field off its default"
    monkeypatch.setenv(variable, raw)
    assert field(Settings(), dotted) == expected


def test_flat_aliases_are_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """One spelling per field: ``STOKER_PORT`` is not ``STOKER_SERVER__PORT``."""
    monkeypatch.setenv("STOKER_PORT", "9000")
    monkeypatch.setenv("STOKER_HOST", "0.0.0.0")
    settings = Settings()
    assert settings.server.port == 8000 and settings.server.host == "127.0.0.1"


def test_other_programs_stoker_variables_do_not_stop_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The test suite's own knobs share the prefix; a variable naming no section is ignored."""
    monkeypatch.setenv("STOKER_OVERLOAD_SECONDS", "60")
    monkeypatch.setenv("STOKER_SCHEMATHESIS_EXAMPLES", "400")
    assert Settings().server.port == 8000


def test_a_section_can_be_given_whole_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_SERVER", json.dumps({"port": 1234, "host": "0.0.0.0"}))
    server = Settings().server
    assert (server.host, server.port) == ("0.0.0.0", 1234)


def test_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_LIMITS__DEFAULT_TOP_K", "7")
    assert Settings().limits.default_top_k == 7
    assert Settings(limits=LimitSettings(default_top_k=3)).limits.default_top_k == 3


@pytest.mark.parametrize(
    ("variable", "raw", "dotted"),
    [
        ("STOKER_SERVER__PORT", "70000", "server.port"),
        ("STOKER_SERVER__PORT", "eighty-eighty", "server.port"),
        ("STOKER_SERVER__LOG_LEVEL", "chatty-verbose", "server.log_level"),
        ("STOKER_SERVER__KEEP_ALIVE_S", "-31337", "server.keep_alive_s"),
        ("STOKER_SERVER__DRAIN_TIMEOUT_S", "-7.25", "server.drain_timeout_s"),
        ("STOKER_UPLOADS__IMAGE_DECODE", "tpu-decoder", "uploads.image_decode"),
        ("STOKER_UPLOADS__DECODE_BATCH_PIXELS", "-31337", "uploads.decode_batch_pixels"),
        ("STOKER_MODELS__EXIT_ON_ERROR", "perhaps-so", "models.exit_on_error"),
        ("STOKER_LIMITS__MAX_BODY_BYTES", "-31337", "limits.max_body_bytes"),
        ("STOKER_LIMITS__MAX_IMAGE_ASPECT_RATIO", "0.25", "limits.max_image_aspect_ratio"),
        ("STOKER_LIMITS__MAX_JSON_DEPTH", "2000", "limits.max_json_depth"),
        ("STOKER_LIMITS__DEFAULT_TOP_K", "-31337", "limits.default_top_k"),
    ],
)
def test_an_invalid_value_names_the_field_and_never_echoes_the_value(
    monkeypatch: pytest.MonkeyPatch, variable: str, raw: str, dotted: str
) -> None:
    monkeypatch.setenv(variable, raw)
    with pytest.raises(ValidationError) as invalid:
        Settings()
    assert error_fields(invalid.value) == [dotted]
    assert dotted in str(invalid.value)
    assert raw not in str(invalid.value)


def test_an_unknown_field_of_a_section_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo must not be silently ignored (the port would stay the default)."""
    monkeypatch.setenv("STOKER_SERVER__PROT", "9000")
    with pytest.raises(ValidationError) as invalid:
        Settings()
    assert error_fields(invalid.value) == ["server.prot"]
    with pytest.raises(ValidationError) as invalid:
        Settings(server={"prot": 9000})  # type: ignore[arg-type]
    assert error_fields(invalid.value) == ["server.prot"]


def test_an_unknown_section_given_directly_is_refused() -> None:
    with pytest.raises(ValidationError) as invalid:
        Settings(cache={"path": "/tmp"})  # type: ignore[call-arg]
    assert error_fields(invalid.value) == ["cache"]


def test_the_models_list_takes_json_not_commas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commas are refused rather than read as one model named ``tiny,resnet50``."""
    monkeypatch.setenv("STOKER_MODELS__MODELS", "tiny,resnet50")
    with pytest.raises(SettingsError, match='"models"'):
        Settings()


def test_the_startup_log_redacts_keys_and_their_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "mounted-secret-keys"
    key_file.write_text("key-from-the-file-0123\n")
    monkeypatch.setenv("STOKER_AUTH__API_KEYS", "key-from-the-env-4567")
    monkeypatch.setenv("STOKER_AUTH__API_KEYS_FILE", str(key_file))
    monkeypatch.setenv("STOKER_SERVER__PORT", "9001")
    logged = Settings().loggable()
    text = json.dumps(logged)
    for secret in ("key-from-the-file-0123", "key-from-the-env-4567", "mounted-secret-keys"):
        assert secret not in text
    assert logged["auth"]["api_keys"] == "***" and logged["auth"]["api_keys_file"] == "***"
    # Everything else is logged as it is, as JSON data.
    assert logged["auth"]["protect_metrics"] is False
    assert logged["server"]["port"] == 9001
    assert logged["limits"]["max_body_bytes"] == 64 * 1024 * 1024
    assert logged["models"]["repository"] == "models"


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s.__name__)
def test_every_field_says_its_trade_off(section: type[BaseModel]) -> None:
    undocumented = [name for name, info in section.model_fields.items() if not info.description]
    assert undocumented == []


def test_every_section_is_documented() -> None:
    undocumented = [name for name, info in Settings.model_fields.items() if not info.description]
    assert undocumented == []
    assert {info.annotation for info in Settings.model_fields.values()} == set(SECTIONS)


def test_usable_cores_are_the_affinity_cut_to_the_cgroups_cpu_limit(tmp_path: Path) -> None:
    """``auto`` counts what a container may use: its cpuset (the affinity), and its CPU
    limit (cgroup v2 ``cpu.max``: quota over period, rounded up) where one is set."""
    from app import settings as module

    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    assert module.usable_cores(str(tmp_path / "none")) == affinity  # no cgroup v2 file
    cpu_max.write_text("max 100000\n")  # no limit
    assert module.usable_cores(str(cpu_max)) == affinity
    cpu_max.write_text("50000 100000\n")  # half a core: one
    assert module.usable_cores(str(cpu_max)) == 1
    cpu_max.write_text(f"{affinity * 100000 + 1} 100000\n")  # above the cpuset: the cpuset
    assert module.usable_cores(str(cpu_max)) == affinity
    if affinity > 1:
        cpu_max.write_text(f"{(affinity - 1) * 100000} 100000\n")
        assert module.usable_cores(str(cpu_max)) == affinity - 1


def test_front_ends_auto_counts_the_visible_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto``: eight front ends per GPU the driver lists and ``CUDA_VISIBLE_DEVICES``
    leaves, at most half the cores; one process where no GPU is visible."""
    from app import settings as module

    gpus = tmp_path / "gpus"
    gpus.mkdir()
    for bus in ("0000:18:00.0", "0000:2a:00.0"):
        (gpus / bus).mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert module.visible_gpus(str(gpus)) == 2
    assert module.visible_gpus(str(tmp_path / "none")) == 0  # no NVIDIA driver
    for visible, count in (("1", 1), ("0,1", 2), ("", 0), ("-1", 0), ("0,-1,1", 1)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert module.visible_gpus(str(gpus)) == count, visible
    assert module.auto_front_ends(gpus=1, cores=16)[0] == 8
    assert module.auto_front_ends(gpus=1, cores=64)[0] == 8
    assert module.auto_front_ends(gpus=2, cores=64)[0] == 16
    assert module.auto_front_ends(gpus=1, cores=12)[0] == 6  # half the cores
    assert module.auto_front_ends(gpus=1, cores=4)[0] == 2
    assert module.auto_front_ends(gpus=1, cores=2)[0] == 1
    assert module.auto_front_ends(gpus=0, cores=128) == (
        1,
        "no GPU visible: one process, the fastest on a CPU machine",
    )
    # The setting: "auto" (the default) becomes a number, and the choice is kept for the log.
    monkeypatch.setattr(module, "visible_gpus", lambda: 1)
    monkeypatch.setattr(module, "usable_cores", lambda: 16)
    assert Settings().server.front_ends == 8
    assert (
        module.AUTO_FRONT_ENDS
        == "front_ends auto: 8 (1 GPU(s), 16 cores: 8 per GPU, at most half the cores)"
    )
    monkeypatch.setattr(module, "usable_cores", lambda: 8)
    assert Settings().server.front_ends == 4
    monkeypatch.setenv("STOKER_SERVER__FRONT_ENDS", "2")
    assert Settings().server.front_ends == 2
    with pytest.raises(ValidationError):
        Settings(server={"front_ends": "many"})  # type: ignore[arg-type]


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_a_moved_setting_is_refused_naming_where_it_went(
    old: tuple[str, str], new: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    section, name = old
    monkeypatch.setenv(f"STOKER_{section.upper()}__{name.upper()}", "1")
    with pytest.raises(ValidationError) as invalid:
        Settings()
    variable = "STOKER_" + new.upper().replace(".", "__")
    assert f"{section}.{name} is now {new} ({variable})" in str(invalid.value)
    section_name, field_name = new.split(".")  # and it is there
    assert field_name in Settings.model_fields[section_name].annotation.model_fields  # type: ignore[union-attr]
