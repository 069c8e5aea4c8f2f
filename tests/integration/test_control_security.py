"""Model control and model configs as an attacker would use them, on a real ``stoker serve``
in explicit mode (one process, and two front ends before an engine process), over HTTP
(httpx) and gRPC (tritonclient.grpc); poll mode in one process.

A config sent with a load is data about the model's folder: a path out of it (absolute, by
``..`` or by a symlink) is refused with 400, so no file of the server's becomes labels; a
handler outside the built-in ones and ``models.handlers`` is never imported (``sys:exit``
used to stop the server); numbers past ``models.bounds`` are refused. config.yaml is held to
the same rules, to a size limit, and nesting it deeply is a 400, not a 500. Without API keys
model control is refused with 403. A model name no file system takes is a 404 on every model
route, never a 500. Errors name the model, never a server path.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.launch import free_port
from tests.conftest import TINY_CONFIG, jpeg_bytes, tiny_onnx
from tests.integration.conftest import Server, start_server, stop_server
from tests.integration.test_model_control import add_model, wait_until

KEY = "security-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = {"authorization": f"Bearer {KEY}"}
CLASSES = 32
SECRET = [f"secret line {i}" for i in range(CLASSES)]
PICS_CONFIG = {
    "max_batch_size": 4,
    "runners": 1,
    "labels": "labels.txt",
    "preprocess": {"resize_shorter": 8, "crop": 8},
}


def pics_onnx() -> onnx.ModelProto:
    """An image classifier of 8x8 RGB rows: the channels' means times a [3, CLASSES] matrix."""
    weights = np.random.default_rng(5).standard_normal((3, CLASSES)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["x"], ["m"], axes=[2, 3], keepdims=0),
            helper.make_node("MatMul", ["m", "W"], ["y"]),
        ],
        "pics",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", CLASSES])],
        initializer=[numpy_helper.from_array(weights, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def build_repository(root: Path) -> Path:
    """A repository with the tiny model, an image classifier (``pics``) and, beside the
    repository, a file no config may read (``secret.txt``)."""
    repo = root / "repository"
    add_model(repo, "tiny", tiny_onnx(), TINY_CONFIG)
    pics = add_model(repo, "pics", pics_onnx(), json.dumps(PICS_CONFIG))
    (pics / "labels.txt").write_text("\n".join(f"class {i}" for i in range(CLASSES)))
    (root / "secret.txt").write_text("\n".join(SECRET))
    (pics / "leak.txt").symlink_to(root / "secret.txt")
    outside = root / "outside-model"
    add_model(root, "outside-model", tiny_onnx(), TINY_CONFIG)
    (repo / "linked").symlink_to(outside, target_is_directory=True)
    triton = repo / "triton" / "1"
    triton.mkdir(parents=True)
    onnx.save(tiny_onnx(), str(triton / "model.onnx"))
    return repo


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-front-ends"])
def explicit(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, int]]:
    root = tmp_path_factory.mktemp(f"security-{request.param}")
    repo = build_repository(root)
    grpc_port = free_port()
    env = {
        "STOKER_MODELS__CONTROL": "explicit",
        "STOKER_MODELS__STARTUP": '["tiny"]',
        "STOKER_AUTH__API_KEYS": KEY,
        "STOKER_SERVER__GRPC_PORT": str(grpc_port),
        "STOKER_SERVER__FRONT_ENDS": str(request.param),
    }
    server = start_server(repo, root / "server.log", env)
    yield server, grpc_port
    code = stop_server(server)
    assert code == 0, f"exit {code}:\n{server.log.read_text()[-3000:]}"


def load(server: Server, name: str, config: dict[str, object] | None = None) -> httpx.Response:
    body = {"parameters": {"config": json.dumps(config)}} if config is not None else None
    return httpx.post(
        f"{server.url}/v2/repository/models/{name}/load", json=body, headers=AUTH, timeout=120
    )


def classify(server: Server, name: str) -> httpx.Response:
    photo = jpeg_bytes(np.random.default_rng(1).integers(0, 255, (16, 16, 3), dtype=np.uint8))
    return httpx.post(
        f"{server.url}/v2/models/{name}/classify?k={CLASSES}",
        content=photo,
        headers={**AUTH, "Content-Type": "image/jpeg"},
        timeout=60,
    )


def alive(server: Server) -> bool:
    return httpx.get(f"{server.url}/v2/health/live", timeout=10).status_code == 200


ESCAPES = {
    "labels absolute": {"labels": "/etc/passwd"},
    "labels ..": {"labels": "../../secret.txt"},
    "labels symlink out": {"labels": "leak.txt"},
    "labels /proc": {"labels": "/proc/self/environ"},
    "onnx /dev/zero": {"onnx": "/dev/zero"},
    "onnx ..": {"onnx": "../tiny/model.onnx"},
    "int8 calibration out": {"int8": {"calibration": "/etc"}},
}


@pytest.mark.parametrize("change", list(ESCAPES.values()), ids=list(ESCAPES))
def test_a_loads_paths_stay_inside_the_model_folder(
    explicit: tuple[Server, int], change: dict[str, object]
) -> None:
    server, _ = explicit
    refused = load(server, "pics", {**PICS_CONFIG, **change})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "model's folder" in error and str(server.log.parent) not in error, error
    assert alive(server)
    # What serves, if anything, is the folder's own labels, never the file outside.
    answer = classify(server, "pics")
    if answer.status_code == 200:
        labels = {item["label"] for item in answer.json()["predictions"][0]}
        assert not labels & set(SECRET), labels


def test_the_folders_own_labels_still_load(explicit: tuple[Server, int]) -> None:
    server, _ = explicit
    assert load(server, "pics", PICS_CONFIG).status_code == 200
    answer = classify(server, "pics")
    assert answer.status_code == 200, answer.text
    assert {item["label"] for item in answer.json()["predictions"][0]} == {
        f"class {i}" for i in range(CLASSES)
    }


def test_a_handler_a_request_names_is_never_imported(explicit: tuple[Server, int]) -> None:
    """``sys:exit`` used to be imported and called at load: the server exited 1."""
    server, _ = explicit
    for handler in ("sys:exit", "os:abort", "tests.conftest:Whatever"):
        refused = load(server, "pics", {**PICS_CONFIG, "handler": handler})
        assert refused.status_code == 400, refused.text
        assert "models.handlers" in refused.json()["error"]
        assert alive(server)
    assert httpx.get(f"{server.url}/v2/models/tiny/ready", headers=AUTH).status_code == 200


BOUNDS = {
    "max_batch_size": ({"max_batch_size": 4096}, "models.bounds.max_batch_size"),
    "runners": ({"runners": 9}, "models.bounds.max_runners_per_device"),
    "resize_shorter": (
        {"preprocess": {"resize_shorter": 8000, "crop": 8}},
        "models.bounds.max_image_side",
    ),
    "max_queue_size": (
        {"dynamic_batching": {"max_queue_size": 10**9}},
        "models.bounds.max_queue_size",
    ),
    "priority_levels": (
        {"dynamic_batching": {"priority_levels": 10**8}},
        "models.bounds.max_priority_levels",
    ),
}


@pytest.mark.parametrize("change, setting", list(BOUNDS.values()), ids=list(BOUNDS))
def test_a_loads_numbers_are_bounded(
    explicit: tuple[Server, int], change: dict[str, object], setting: str
) -> None:
    server, _ = explicit
    refused = load(server, "pics", {**PICS_CONFIG, **change})
    assert refused.status_code == 400, refused.text
    assert setting in refused.json()["error"], refused.text


def test_grpc_loads_are_held_to_the_same_rules(explicit: tuple[Server, int]) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    server, port = explicit
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        for change, said in (
            ({"labels": "/etc/shadow"}, "model's folder"),
            ({"handler": "sys:exit"}, "models.handlers"),
            ({"max_batch_size": 100_000}, "models.bounds.max_batch_size"),
        ):
            with pytest.raises(InferenceServerException, match=said) as refused:
                client.load_model(
                    "pics", headers=GRPC_AUTH, config=json.dumps(PICS_CONFIG | change)
                )
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert alive(server)
    finally:
        client.close()


def repository_of(server: Server) -> Path:
    return server.log.parent / "repository"


def write_config(server: Server, name: str, text: str) -> None:
    folder = repository_of(server) / name
    folder.mkdir(exist_ok=True)
    onnx.save(tiny_onnx(), str(folder / "model.onnx"))
    (folder / "config.yaml").write_text(text)


CONFIGS = {
    # 60,000 bytes, under the size limit: PyYAML recursed past Python's limit, a 500.
    "deep": ("[" * 30_000 + "]" * 30_000, "nested too deeply"),
    "large": ("# padding\n" * 10_000, "larger than 65536 bytes (models.max_config_bytes)"),
    "aliases": (
        "a: &a [1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n",
        "aliases",
    ),
    "labels out": ("labels: ../../secret.txt\n", "leads out of the model's folder"),
    "handler": ("handler: sys:exit\n", "models.handlers"),
}


@pytest.mark.parametrize("text, said", list(CONFIGS.values()), ids=list(CONFIGS))
def test_config_yaml_is_held_to_the_same_rules(
    explicit: tuple[Server, int], text: str, said: str, request: pytest.FixtureRequest
) -> None:
    server, _ = explicit
    name = f"cfg-{request.node.callspec.id.split('-')[-1]}"
    write_config(server, name, text)
    refused = load(server, name)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert said in error and str(repository_of(server)) not in error, error
    assert alive(server)
    assert "Traceback" not in server.log.read_text()


def test_a_model_folder_linked_out_of_the_repository_is_refused(
    explicit: tuple[Server, int],
) -> None:
    server, _ = explicit
    refused = load(server, "linked")
    assert refused.status_code == 400, refused.text
    assert "link out of the repository" in refused.json()["error"]


def test_a_triton_version_folder_is_refused_saying_versions_are_precisions(
    explicit: tuple[Server, int],
) -> None:
    server, _ = explicit
    refused = load(server, "triton")
    assert refused.status_code == 400, refused.text
    assert "versions are its precisions" in refused.json()["error"], refused.text
    index = httpx.post(f"{server.url}/v2/repository/index", headers=AUTH, timeout=60).json()
    (item,) = [i for i in index if i["name"] == "triton"]
    assert "versions are its precisions" in item["reason"], item


def test_errors_name_the_model_and_never_a_server_path(explicit: tuple[Server, int]) -> None:
    server, _ = explicit
    missing = load(server, "nope")
    assert missing.status_code == 404, missing.text
    assert str(repository_of(server)) not in missing.text and "nope" in missing.text
    write_config(server, "no-onnx", "max_batch_size: 4\n")
    (repository_of(server) / "no-onnx" / "model.onnx").unlink()
    failed = load(server, "no-onnx")
    assert failed.status_code == 400, failed.text
    assert "model.onnx does not exist" in failed.text
    index = httpx.post(f"{server.url}/v2/repository/index", headers=AUTH, timeout=60)
    assert str(server.log.parent) not in index.text, index.text
    assert str(repository_of(server) / "no-onnx") in server.log.read_text()  # the log has it


LONG = "a" * 300
NAME_ROUTES = [
    ("GET", f"/v2/models/{LONG}"),
    ("GET", f"/v2/models/{LONG}/ready"),
    ("GET", f"/v2/models/{LONG}/config"),
    ("GET", f"/v2/models/{LONG}/stats"),
    ("GET", f"/v2/models/{LONG}/versions/fp32"),
    ("POST", f"/v2/models/{LONG}/infer"),
    ("POST", f"/v2/models/{LONG}/versions/fp32/infer"),
    ("POST", f"/v2/models/{LONG}/classify"),
    ("POST", f"/v2/repository/models/{LONG}/load"),
    ("POST", f"/v2/repository/models/{LONG}/unload"),
    ("POST", f"/v2/repository/models/{'é' * 130}/load"),  # 260 bytes of UTF-8
]


def test_a_name_no_file_system_takes_is_not_found_on_every_model_route(
    explicit: tuple[Server, int],
) -> None:
    server, port = explicit
    before = server.log.read_text().count("Traceback")
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    for method, path in NAME_ROUTES:
        answer = httpx.request(
            method,
            f"{server.url}{path}",
            json=body if path.endswith("infer") else None,
            headers=AUTH,
            timeout=60,
        )
        assert answer.status_code in (400, 404), (path[:40], answer.status_code, answer.text)
        assert "error" in answer.json()
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        for call in (client.load_model, client.unload_model, client.get_model_metadata):
            with pytest.raises(InferenceServerException) as refused:
                call(LONG, headers=GRPC_AUTH)
            assert refused.value.status() in (
                "StatusCode.NOT_FOUND",
                "StatusCode.INVALID_ARGUMENT",
            ), refused.value
        assert not client.is_model_ready(LONG, headers=GRPC_AUTH)
    finally:
        client.close()
    assert server.log.read_text().count("Traceback") == before


# -- model control without keys -----------------------------------------------------------


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-front-ends"])
def keyless(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, int]]:
    root = tmp_path_factory.mktemp(f"keyless-{request.param}")
    repo = root / "repository"
    add_model(repo, "tiny", tiny_onnx(), TINY_CONFIG)
    add_model(repo, "other", tiny_onnx(), TINY_CONFIG)
    grpc_port = free_port()
    env = {
        "STOKER_MODELS__CONTROL": "explicit",
        "STOKER_MODELS__STARTUP": '["tiny"]',
        "STOKER_SERVER__GRPC_PORT": str(grpc_port),
        "STOKER_SERVER__FRONT_ENDS": str(request.param),
    }
    server = start_server(repo, root / "server.log", env)
    yield server, grpc_port
    code = stop_server(server)
    assert code == 0, f"exit {code}:\n{server.log.read_text()[-3000:]}"


def test_without_keys_model_control_is_refused_naming_the_setting(
    keyless: tuple[Server, int],
) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    server, port = keyless
    for action in ("load", "unload"):
        for name in ("other", "tiny"):
            refused = httpx.post(f"{server.url}/v2/repository/models/{name}/{action}", timeout=60)
            assert refused.status_code == 403, refused.text
            assert "STOKER_MODELS__CONTROL_WITHOUT_KEYS" in refused.json()["error"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        for call in (client.load_model, client.unload_model):
            with pytest.raises(InferenceServerException, match="CONTROL_WITHOUT_KEYS") as denied:
                call("other")
            assert denied.value.status() == "StatusCode.PERMISSION_DENIED"
    finally:
        client.close()
    assert httpx.get(f"{server.url}/v2/models/tiny/ready").status_code == 200
    assert httpx.get(f"{server.url}/v2/models/other/ready").status_code != 200


# -- poll mode ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def polled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("security-poll")
    repo = root / "repository"
    add_model(repo, "tiny", tiny_onnx(), TINY_CONFIG)
    env = {
        "STOKER_MODELS__CONTROL": "poll",
        "STOKER_MODELS__POLL_S": "0.2",
        "STOKER_AUTH__API_KEYS": KEY,
    }
    server = start_server(repo, root / "server.log", env)
    yield server
    code = stop_server(server)
    assert code == 0, f"exit {code}:\n{server.log.read_text()[-3000:]}"


def test_poll_mode_refuses_folders_and_paths_out_of_the_repository(polled: Server) -> None:
    """Folders that appear while serving: one linked out of the repository, one whose labels
    are a symlink out of its folder, one laid out as Triton's."""
    aside = polled.log.parent / "aside"
    build_repository(aside)
    repo = repository_of(polled)
    (aside / "repository" / "pics" / "config.yaml").write_text(
        json.dumps({**PICS_CONFIG, "labels": "leak.txt"})
    )
    for name in ("pics", "linked", "triton"):
        (aside / "repository" / name).rename(repo / name)

    def reasons() -> dict[str, str]:
        index = httpx.post(f"{polled.url}/v2/repository/index", headers=AUTH, timeout=60).json()
        return {i["name"]: i.get("reason", i["state"]) for i in index}

    wait_until(
        lambda: "out of" in reasons().get("linked", "") and "out of" in reasons().get("pics", ""),
        "the folders were not refused",
        polled,
    )
    found = reasons()
    assert "link out of the repository" in found["linked"], found
    assert "leads out of the model's folder" in found["pics"], found
    assert "versions are its precisions" in found["triton"], found
    assert str(polled.log.parent) not in json.dumps(found)
    answer = classify(polled, "pics")
    assert answer.status_code == 503, answer.text
    assert str(polled.log.parent) not in answer.text
    assert httpx.get(f"{polled.url}/v2/models/linked/ready", headers=AUTH).status_code != 200
