"""One settings object, nested by concern, every field settable by environment.

``STOKER_SERVER__PORT=9000`` sets ``settings.server.port``; the flat aliases listed in the
README (``STOKER_PORT``...) are not provided on purpose: one spelling per field.

Kept in one module (~600 lines): each group is a small class whose field docs are the
reference for its variables, and what reads across groups (``front_ends: auto`` from the
cores and GPUs, the refusal of a moved setting naming its new place) sits beside them;
split, the one reference would be scattered.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.protocol import MAX_JSON_DEPTH
from engines.store import default_root

FRONT_ENDS_PER_GPU = 8
"""Front ends per GPU for ``front_ends: auto``. Once the engine read its control channel by a
protocol (f314aea) and answered in the turn (5a0c316), four front ends' loops were the bound
of batch 1 (0.90-0.96 of a core each): eight served 1.22x the batch-1 requests/s of four, p99
32 ms against 41, and the same 32-row and photo rates (one H100, one call; BENCHMARKS.md,
"Eight front ends"). Before them, runs 6-13 on an H200 had found 4 best of 2, 4 and 8."""
AUTO_FRONT_ENDS: str | None = None
"""What ``front_ends: auto`` last chose and why (the server logs it at start)."""


def visible_gpus(root: str = "/proc/driver/nvidia/gpus") -> int:
    """NVIDIA GPUs this process may use, without loading CUDA: the driver's list, cut to
    ``CUDA_VISIBLE_DEVICES`` where that is set ("" or -1: none)."""
    try:
        found = len(os.listdir(root))
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    wanted = []
    for item in (v.strip() for v in visible.split(",")):
        if not item or item.startswith("-"):
            break  # CUDA stops at the first invalid entry
        wanted.append(item)
    return min(found, len(wanted))


def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may use, not the machine's: its affinity (a container's
    cpuset), cut to its cgroup's CPU limit where one is set (cgroup v2 ``cpu.max``, quota
    over period, rounded up: a container's ``--cpus``, a pod's CPU limit)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    try:
        quota, period = Path(cpu_max).read_text().split()[:2]
        limit = math.ceil(int(quota) / int(period))
    except (OSError, ValueError, ZeroDivisionError):  # none read, or "max": no limit
        return cores
    return max(1, min(cores, limit))


def auto_front_ends(gpus: int | None = None, cores: int | None = None) -> tuple[int, str]:
    """The front ends ``auto`` gives, and why: ``FRONT_ENDS_PER_GPU`` per visible GPU, at
    most half the usable cores (the engine needs the rest); 1 without a GPU."""
    gpus = visible_gpus() if gpus is None else gpus
    cores = usable_cores() if cores is None else cores
    if gpus == 0:
        return 1, "no GPU visible: one process, the fastest on a CPU machine"
    count = max(1, min(FRONT_ENDS_PER_GPU * gpus, cores // 2, 64))
    return (
        count,
        f"{gpus} GPU(s), {cores} cores: {FRONT_ENDS_PER_GPU} per GPU, at most half the cores",
    )


class ServerSettings(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    host: str = "127.0.0.1"
    """Address to bind. 127.0.0.1 keeps a laptop server private; containers set 0.0.0.0."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port; 0 picks a free one (tests)."""
    grpc_port: int = Field(default=8001, ge=0, le=65535)
    """Port of the KServe V2 / Triton gRPC API (``inference.GRPCInferenceService`` and
    ``grpc.health.v1``) on ``host``, Triton's 8001; 0 turns gRPC off. Every front end serves
    it beside HTTP through the same data plane, limits and keys (with several front ends each
    binds it with SO_REUSEPORT, as they share the HTTP port). Off saves a listening socket
    and gRPC's threads where only HTTP is used."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log verbosity. ``debug`` logs every batch, which costs throughput."""
    frames_in_flight: int = Field(default=4, ge=0)
    """With front ends: how many frames of requests that may share a batch one front end
    keeps in flight to the engine before the next ones wait, gathering, for one of them to
    come back, until they hold an eighth of the max batch, or for 5 ms at most. Requests
    that arrive one per turn of the loop (gRPC calls do) then still cross in frames of many,
    and the engine pays per frame. 0: no limit (each turn's requests cross at once). One
    process never waits: a frame costs nothing to cross there."""
    gil_switch_ms: float = Field(default=5.0, gt=0, le=100)
    """How long a thread that holds the GIL runs on before a thread waiting for it is given
    it (Python's ``sys.setswitchinterval``, 5 ms by default), in the engine processes, the
    front ends and the one-process server (not the decode processes). A runner or decoder
    thread back from the GPU waits up to this long for a busy event loop of its process;
    lower hands it over sooner, at the cost of more switches. On an H100, 0.5 ms made
    1.10-1.12x the photos at one a request and c=256 and 0.97-0.98x at 16 a request
    (BENCHMARKS.md, issue 43): not enough, measured on one path, to change the default."""
    gathering_log_s: float = Field(default=0.0, ge=0)
    """Every this many seconds of traffic, each front end logs how many requests it sent
    to the engine in how many frames (how well requests gather); 0: only at drain."""
    keep_alive_s: int = Field(default=75, ge=1)
    """How long an idle kept-alive connection stays open. Longer than clients' own idle timeouts
    (aiohttp 15 s, most load balancers 60 s), so the server never closes a connection a
    client is about to reuse, which loses that request; each idle connection costs a socket."""
    drain_timeout_s: float = Field(default=30.0, ge=0)
    """On shutdown, how long in-flight and queued requests may take to finish before exit.
    Keep it below Kubernetes' terminationGracePeriodSeconds."""
    front_ends: int = Field(default="auto", validate_default=True, ge=1, le=64)
    """HTTP front-end processes. 1: one process serves HTTP and runs the models (the embedded
    default, fastest on a small CPU machine). N > 1: N front ends accept on the one port,
    authenticate, apply the limits and read bodies, and one engine process runs the models;
    bodies cross in shared memory (``/dev/shm``: give containers ``shm_slots x
    shm_slot_bytes`` per front end). One event loop takes in about 2 GB/s of bodies (a
    2-core EPYC) and 1,000 requests/s: a GPU wants 4 to 8. ``auto`` (the default): 8 per
    visible GPU (``FRONT_ENDS_PER_GPU``: the number measured best on an H100), at most half
    the cores this process may use (``usable_cores``: its cpuset and its cgroup's CPU limit;
    a pod's CPU request alone sets neither); 1 where no GPU is visible.
    What ``auto`` chose, and why, is logged at start."""

    @field_validator("front_ends", mode="before")
    @classmethod
    def _front_ends(cls, value: object) -> object:
        global AUTO_FRONT_ENDS
        if value == "auto":
            count, why = auto_front_ends()
            AUTO_FRONT_ENDS = f"front_ends auto: {count} ({why})"
            return count
        return value

    engine_gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """One engine process per listed GPU, each serving every model on that GPU alone (its
    ``CUDA_VISIBLE_DEVICES`` is that GPU; the models' own ``gpus`` are then not used), behind
    the same front ends: each request goes to the ready engine with the least work waiting,
    metrics carry a ``gpu`` label, and an engine that fails is restarted while the others
    serve. GPU numbers are as this process sees them (within an inherited
    ``CUDA_VISIBLE_DEVICES``). Empty: one engine process, the models' ``gpus`` as
    configured. Any entry runs front ends and engines as processes, even with
    ``front_ends`` 1."""
    shm_slots: int = Field(default=4, ge=1)
    """Shared-memory arena per front end, in slots: the arena is ``shm_slots x
    shm_slot_bytes`` bytes (256 MiB by default, at most half of what ``/dev/shm`` has free,
    shared by the front ends), lent to bodies in 4 KiB pages (a 150 KB image takes 37), so
    it holds many small bodies at once or ``shm_slots`` of the largest. When it is full a
    body waits for pages (``arena_wait_s``, then 503), never taking a slower road."""
    shm_slot_bytes: int = Field(default=64 * 1024 * 1024, ge=64 * 1024)
    """The largest body (and answer) that travels in shared memory (the largest body by
    default: ``limits.max_body_bytes``); a larger one crosses over the control socket, and
    the front end logs it once. 32 UINT8 images of 224x224 take 4.8 MB."""
    pin_arena: bool = True
    """The engine process registers each front end's arena with CUDA (``cudaHostRegister``)
    where it sees a GPU, so a runner copies request tensors from it to the GPU by DMA,
    without a host copy into its own pinned buffer first. It locks the arena's pages in
    RAM (a container's ``ulimit -l`` must allow ``shm_slots x shm_slot_bytes`` per front
    end; where it does not, the arena stays pageable and the log says so). Off: pageable."""
    arena_wait_s: float = Field(default=5.0, gt=0)
    """How long a body waits for room in a full arena before its 503 (counted as
    ``stoker_http_refusals_total{reason="arena_full"}``)."""
    allowed_hosts: list[str] = Field(default_factory=list)
    """``Host`` names HTTP requests may carry (without the port; ``*`` allows any), against
    DNS rebinding: a web page whose name a browser resolves to this server would otherwise
    read and drive it as its own origin. Empty: with no API keys and a loopback ``host``
    (127.0.0.1, the default), only ``localhost``, ``*.localhost`` and loopback addresses;
    any other ``host`` (0.0.0.0 in containers, where probes and Services use pod IPs and DNS
    names) allows any name, so list yours where a browser can reach it. Health probes are
    never refused for their ``Host``."""
    allowed_origins: list[str] = Field(default_factory=list)
    """Browser origins (``https://app.example.com``; ``*``: any) that may POST to the server
    when no API keys are set, beside the server's own (an ``Origin`` naming the request's
    ``Host``). Another origin's POST, and a POST of a form or text content type to a route
    that takes JSON or octet-stream, is refused with 403: without keys, any web page a
    browser opens could otherwise register shared memory or run inferences here."""


class ConfigBounds(BaseModel):
    """The most any model config may ask for (config.yaml or a load's ``parameters.config``):
    a config past one is refused with 400 naming the field and the setting."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    max_batch_size: int = Field(default=256, gt=0)
    """Largest ``max_batch_size``. Each runner holds buffers for a whole max batch: ResNet-50
    at 256 takes 154 MB of input per runner (FP32); EfficientNet-Lite0 on ONNX Runtime
    took +1.4 GB at 128. 256 is what the GPU benchmarks run (``scripts/gpu_repo.py``)."""
    max_runners_per_device: int = Field(default=8, gt=0)
    """Most runners of one model per device (the CPU, or each GPU of its ``gpus``): twice the
    4 per GPU measured best on an H200 (BENCHMARKS.md, "Runners per GPU"). Each runner holds
    its own buffers and, on ONNX Runtime, its own session: 8 of EfficientNet-Lite0 took
    +2.4 GB."""
    max_image_side: int = Field(default=1024, gt=0)
    """Largest ``preprocess.resize_shorter`` and ``preprocess.crop``. An upload is resized
    before it is cropped, so its cost grows with the square of the side and with the aspect
    ratio (``limits.max_image_aspect_ratio``): 256 costs at most 6 MB an upload, 1024 at most
    100 MB, 8000 about 1 GB."""
    max_batch_bytes: int = Field(default=1024**3, gt=0)
    """Largest max batch (``max_batch_size`` rows, at least one) of the tensors the config
    declares, all of them together (``inputs``, ``outputs``; a dynamic dimension counted as
    1), or of the rows its preprocessing makes (as FP32): each runner holds a batch of each.
    ResNet-50's input at 256 rows takes 154 MB; a declared row of 10^9 elements would have
    taken 4 GB a row."""
    max_gpus: int = Field(default=16, gt=0)
    """Most GPUs one model's ``gpus`` may list (the runners bound is per listed GPU, so the
    list bounds the runners too): 16, the most one host has (HGX-2)."""
    max_queue_size: int = Field(default=65536, gt=0)
    """Largest ``dynamic_batching.max_queue_size`` (requests waiting per version)."""
    max_priority_levels: int = Field(default=16, gt=0)
    """Largest ``dynamic_batching.priority_levels``; each level is a queue of its own."""
    max_samples: int = Field(default=10_000, gt=0)
    """Most rows INT8 calibration and the accuracy gate may take together (``int8.samples``
    plus ``accuracy.evaluation_samples``), each held in memory for the build: 10,000 rows of
    224x224 FP32 take 6 GB."""


class ModelRepositorySettings(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    repository: Path = Path("models")
    """Folder with one sub-folder per model, each holding a config.yaml."""
    models: list[str] = Field(default_factory=list)
    """Models to load (folder names); empty loads every model that has a config. Loading
    fewer models starts faster and uses less memory."""
    default_model: str | None = None
    """Model answering the plain ``POST /infer``; defaults to the first loaded model."""
    backend: str | None = None
    """Override every model's backend (``auto``, ``onnxruntime``...). ``auto`` picks the
    fastest backend this machine can run."""
    prepare_missing: bool = True
    """Generate a missing ONNX file from the model's ``generator`` at startup (offline,
    seconds for the bundled models). Off makes a missing file a startup error."""
    exit_on_error: bool = False
    """Stop the server when any model version fails to load or misses its accuracy budget
    (Triton's ``--exit-on-error``). Off: that version answers 503 with the reason and the
    rest serve, which keeps a pod up when one precision does not hold on its CPU."""
    control: Literal["none", "explicit", "poll"] = "none"
    """How the model set changes while serving (Triton's ``--model-control-mode``). ``none``:
    fixed at start; ``POST /v2/repository/models/<m>/load`` and ``/unload`` are refused.
    ``explicit``: those endpoints (and gRPC's RepositoryModelLoad/Unload) load, reload and
    unload models, for key holders (``auth``; without keys only where
    ``control_without_keys`` says so); ``startup`` says what loads at start. ``poll``: the
    repository is checked every ``poll_s``, and a model whose config.yaml or files changed
    is reloaded, a new folder loaded, a removed one unloaded and forgotten (404); the
    endpoints are refused, as in Triton. A reload warms the new version beside the old one,
    which costs both in memory meanwhile."""
    startup: list[str] | None = None
    """Explicit mode: the models loaded at start (folder names). Unset: those the other
    modes load (``models``, else every model whose config autoloads); empty: none, the
    server is ready with nothing loaded and waits for load requests."""
    poll_s: float = Field(default=5.0, gt=0)
    """Poll mode: seconds between looks at the repository's files (modification times and
    sizes, not contents). Shorter picks a change up sooner at the cost of a stat per file."""
    control_without_keys: bool = False
    """Take model control (load and unload over HTTP and gRPC, explicit mode) from anyone
    when no API keys are set. Off (the default): without keys those calls are refused with
    403, since a load reads files and builds engines on the server, and Triton too keeps
    model control to its operators. On suits a private network or a sidecar that
    authenticates; with keys set, model control takes a key like every model endpoint."""
    handlers: list[str] = Field(default_factory=list)
    """``package.module:Class`` handlers a model config (config.yaml, or a load's
    ``parameters.config``) may name, beside the built-in ``image-classifier`` and ``none``.
    Empty (the default): only those two; a handler is code the server imports and runs, so
    only the operator decides which."""
    max_config_bytes: int = Field(default=64 * 1024, gt=0)
    """Largest config.yaml; a larger one is refused unread. The bundled configs take 3 KB;
    parsing YAML costs about 300 bytes of memory and 10 us per byte of input."""
    bounds: ConfigBounds = Field(default_factory=ConfigBounds)
    """The most a model config may ask for, so that no config (least of all one sent with a
    load) takes the server's memory or CPU."""


class UploadSettings(BaseModel):
    """Image uploads (``POST /infer``): where they are decoded, and how the engine's decode
    queue batches JPEGs for the GPU.

    Uploads have one batching owner. A front end only gathers the uploads of one turn of its
    loop into one crossing (as many as fit a slot of its arena, ``server.shm_slot_bytes``);
    the engine's decode queue then sizes each GPU decode batch from what is queued, as the
    dynamic batcher sizes model batches: when a decoder is free it takes every queued upload
    up to ``decode_batch_pixels`` (and ``decode_batch_photos``, ``decode_batch_bytes``), and
    the model's batcher bounds the model batches. A lone photo goes at once (no timer); under
    load the queue fills while a batch decodes, so batches grow to what the GPU wants (128-256
    photos), and a second batch starts beside one that decodes only once a share of a batch
    is queued (``decode_spread_pixels``), never as many small batches across the decoders."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    image_decode: Literal["auto", "cpu", "gpu"] = "auto"
    """Where ``/infer`` decodes and preprocesses JPEG uploads: ``gpu`` decodes batches of
    them with nvJPEG (torchvision) on the model's first GPU; ``auto`` does so when the model
    runs on a GPU backend and torchvision sees CUDA, else on the CPU. Other formats are
    always decoded on the CPU."""
    decode_in_front_ends: bool = True
    """Where front ends and engines are processes (``server.front_ends`` > 1 or
    ``server.engine_gpus``), uploads for a model whose engine decodes them on the CPU (no GPU
    decoder: ``image_decode``) are decoded, resized and cropped in the front ends, in
    parallel across their processes, each with a share of the cores in threads (8 at most,
    each holding one decoded image: 240 MB at most at the default
    ``limits.max_image_pixels``), and cross to the engine as UINT8 rows (150 KB for 224x224,
    more than most photos' files) that it only batches and runs. Off: the files cross and the
    engine decodes them in its own process. Uploads decoded on a GPU always cross as files."""
    jpeg_decoder: Literal["torchvision", "nvimgcodec"] = "torchvision"
    """What decodes JPEG uploads on the GPU: torchvision's nvJPEG, or nvImageCodec (the
    ``nvimgcodec`` extra), which parses a batch without holding the GIL and hands its
    baseline JPEGs to the GPU's hardware JPEG engines where it has them (A100, H100, H200),
    leaving the SMs to the model. On an H200 nvImageCodec made 0.56-0.60x torchvision's
    photos/s in the service and fewer alone in every form (BENCHMARKS.md, runs 45-46), at
    batches of about 21 photos. An image the chosen decoder refuses goes to Pillow."""
    jpeg_hardware_share: float = Field(default=1.0, ge=0.0, le=1.0)
    """With nvImageCodec, the share of each batch offered to the hardware JPEG engines (its
    load hint); the rest, and what they cannot take (progressive JPEGs), go to nvJPEG's
    CUDA decoder on the SMs. Lower it when the engines, not the SMs, are the bound."""
    resize_kernel: bool = True
    """Resize and centre-crop each GPU decode batch in one Triton kernel
    (``engines/backends/torch/resize_kernel.py``: each image read where nvJPEG left it, no
    padding) where Triton imports, as it does with CUDA builds of torch. Off: the batched
    matrix products over images padded to a group's size, a few launches a group of sizes,
    which launched for 8.5 ms of a 55-photo batch on an H100 (BENCHMARKS.md, issue 43). Both
    give Pillow's BILINEAR pixels within a level."""
    decode_batch_pixels: int = Field(default=48_000_000, gt=0)
    """The bound of one GPU decode batch: its decoded pixels (width x height from each
    upload's header, read before any decode), since what a batch costs in time and GPU
    memory (3 bytes a pixel decoded, 12 while it is resized) grows with its pixels, not its
    count. 48 M: 256 photos of 500x375 (ImageNet's most common size; 144 MB decoded), where
    an H200's batched decode gives 12-14k photos/s against 3-4k at 20 (BENCHMARKS.md, issue
    43). A request larger than the bound decodes alone. Smaller bounds the GPU memory a
    batch takes, and how long the last photo of a batch waits for its first."""
    decode_batch_photos: int = Field(default=256, gt=0)
    """The most photos in one GPU decode batch, whatever their pixels. Each decode process
    holds a GPU buffer of this many model rows a batch in flight (256 rows of 224x224: 38
    MB)."""
    decode_batch_bytes: int = Field(default=32 * 1024 * 1024, ge=1024 * 1024)
    """The most JPEG bytes in one GPU decode batch: each decode process takes this much
    ``/dev/shm`` a batch in flight for the files it is handed (256 photos of 128 KB). A
    photo larger than it decodes alone, its bytes over the process's pipe."""
    decode_spread_pixels: int = Field(default=12_000_000, ge=0)
    """While a batch decodes, a free decoder starts another only once the queue holds this
    many pixels (a quarter of ``decode_batch_pixels``: 64 photos of 500x375) or a full
    batch; until then the uploads that arrive gather and go together when a decoder frees.
    So the queue is not cut into several small batches across decoders, each paying nvJPEG's
    and the crossing's cost per batch. 0: every free decoder takes what is queued at once
    (at 256 clients on an H200 that gave batches of about 21 photos with 4 in flight)."""
    decode_processes: int = Field(default=2, ge=0)
    """GPU JPEG decoders per model in processes of their own, spawned by the engine: the
    JPEG bytes go to them through shared memory and the decoded rows come back on the GPU
    (CUDA IPC), so their Python work does not take the engine's GIL. On an H200 two served
    1.32x the photos of one decoder thread at 256 clients and 1.34x at 16 photos a request
    (BENCHMARKS.md, run 35); three, 0.93-0.99 of two at one photo a request and 1.14x at 16
    (run 36). Each costs a CUDA context (~0.5 GiB of GPU memory) and seconds at load. 0:
    ``decode_workers`` threads in the engine instead. Unused where uploads decode on the CPU."""
    decode_in_flight: int = Field(default=1, ge=1, le=8)
    """Batches each decode process holds and decodes at once, a thread and a stream each in
    the process. Each costs a buffer of ``decode_batch_photos`` rows on the GPU and
    ``decode_batch_bytes`` of ``/dev/shm``. With small batches two a process helped at 16
    photos a request (4,912 photos/s against 4,352, BENCHMARKS.md, run 44) and four changed
    nothing (run 47); with batches sized by ``decode_batch_pixels`` one a process, so two in
    flight in all, keeps each batch large while the other process's decodes."""
    decode_workers: int = Field(default=1, gt=0)
    """GPU JPEG decoders per model in threads of the engine (each on a CUDA stream of its
    own), where ``decode_processes`` is 0. They share the engine's GIL with its event loop
    and runners: three threads served 0.62-0.82 of what two processes did on an H200
    (BENCHMARKS.md, run 36)."""


class StoreSettings(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    path: Path = Field(default_factory=default_root)
    """Where built variants, engines and calibration ranges are kept. Put it on a volume in
    containers so a restarted pod loads in seconds instead of rebuilding."""


class LimitSettings(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    max_body_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    """Largest request body; bigger ones get 413 before they are read whole. Raise it for
    large binary batches, at the cost of memory per concurrent request."""
    max_inflight_body_bytes: int = Field(default=1024 * 1024 * 1024, gt=0)
    """Most body bytes being received at once by one process (by declared length); more is
    answered 503 at once. With ``max_body_bytes`` it bounds what bodies in flight may cost:
    40 clients that each declare 64 MiB get 16 in, the rest a 503. gRPC has a budget of
    this size of its own, for the requests of its calls in flight from their arrival to
    their answer (RESOURCE_EXHAUSTED past it)."""
    max_image_pixels: int = Field(default=40_000_000, gt=0)
    """Largest decoded image (width x height); protects against decompression bombs."""
    max_image_aspect_ratio: float = Field(default=32.0, ge=1)
    """Longest side over shortest side of an uploaded image. Resizing the shorter side to the
    model's size scales the longer one with it: a 1x8000 PNG of 117 bytes would become
    256x2,048,000 pixels (2 GB). At 32, a resized image stays under 256 x 8192 x 3 bytes
    (6 MB); phone panoramas are about 12:1."""
    max_images_per_request: int = Field(default=64, gt=0)
    """Most images in one ``/infer`` upload; each costs a decode on the CPU."""
    default_top_k: int = Field(default=5, gt=0)
    """Labels returned by ``/infer`` when the request does not say ``k``."""
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    """Most bytes of a request's URL and headers together; more is answered 431 as they
    arrive. Browsers and gRPC-web clients stay under 16 KiB; nginx allows 32 KiB."""
    max_headers: int = Field(default=100, gt=0)
    """Most header fields in one request; more is answered 431."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A new connection must send its first request, and a request its headers, within this
    (408 or a close): slow-loris clients and silent connections cost a socket this long."""
    body_timeout_s: float = Field(default=60.0, gt=0)
    """A V2 body must arrive whole within this, else 408: a client that declares 64 MiB and
    trickles it holds its memory this long at most. 60 s admits 64 MiB at 1.1 MB/s."""
    max_connections: int = Field(default=1000, gt=0)
    """Open connections per process (per front end with several). Beyond it, requests get
    503 and the connection closes, except ``/v2/health/*``, so probes still answer. Keep it
    under the open-file limit (``ulimit -n``)."""
    max_grpc_calls: int = Field(default=1000, gt=0)
    """gRPC calls in flight per process (per front end with several), streams among them,
    liveness, readiness and health checks and watches not; beyond it a call is
    RESOURCE_EXHAUSTED at once. gRPC's counterpart of ``max_connections``: an HTTP/1.1
    connection carries one request at a time, a gRPC connection many calls. Each call may
    hold a message of up to ``max_body_bytes`` while it arrives."""
    max_grpc_watches: int = Field(default=100, gt=0)
    """gRPC health ``Watch`` streams open at once per process, ``max_share_per_address`` of
    them from one address; beyond it a Watch is RESOURCE_EXHAUSTED. Counted apart from
    ``max_grpc_calls``: a Watch needs no API key and stays open, so watches must not take
    the room of inference calls. A watcher holds a call and wakes once a second; a
    Kubernetes probe uses Check, not Watch."""
    max_grpc_probes: int = Field(default=100, gt=0)
    """gRPC liveness, readiness and health Check calls in flight at once per process,
    ``max_share_per_address`` of them from one address; beyond it a probe is
    RESOURCE_EXHAUSTED. Counted apart from ``max_grpc_calls`` so probes answer while the
    server is full; a probe is answered at once, and one whose (empty) message does not
    arrive within a second is ended, so a few are plenty, and this bounds what calls that
    never send their message cost (some 4 KB each)."""
    max_share_per_address: float = Field(default=0.75, gt=0, le=1)
    """The most of ``max_connections`` (HTTP's and gRPC's), ``max_grpc_calls``,
    ``max_grpc_watches`` and ``max_inflight_body_bytes`` one client address may hold, so
    one address can never lock every other out: the rest stays for the others. Lower it
    where many clients share the server evenly; 1 turns it off (behind a proxy every client
    has the proxy's address)."""
    saturated_after_s: float = Field(default=5.0, ge=0)
    """Once ``max_connections`` or ``max_inflight_body_bytes`` has been full this long,
    ``/v2/health/ready`` answers 503 with the reason, so an orchestrator routes elsewhere
    until it frees (liveness stays 200). Full: no connection left, or no room for a body of
    ``max_body_bytes``. Shorter reacts sooner to a burst that would have passed."""
    max_json_decodes: int = Field(default=1, gt=0)
    """Most JSON request parts over 256 KiB decoded at once per process (more wait their
    turn). A JSON value costs 8 to 80 bytes of Python objects while decoded, so this bounds
    their peak: 64 MiB of floats costs ~0.85 GB, of one-element lists (valid for a model with
    a dynamic dimension before the last) ~2 GB. The parser holds the GIL, so more at once
    buys no speed on the same cores."""
    max_json_depth: int = Field(default=MAX_JSON_DEPTH, gt=0, le=1024)
    """Deepest nesting of lists in a JSON tensor's ``data``. The default admits data nested
    along any shape numpy can hold (64 dimensions); lower refuses odd clients sooner. Whole
    documents nested past 1024 levels are refused by the JSON parser whatever this says."""
    max_control_body_bytes: int = Field(default=64 * 1024, ge=1024, le=512 * 1024)
    """Largest body of a model load or unload and of a shared-memory registration, over HTTP
    (413, from its ``Content-Length`` or as it streams) and gRPC (RESOURCE_EXHAUSTED), refused
    before any parsing. Such a body is a few hundred bytes (a load's ``parameters.config`` a
    few KiB); it crosses to the engine whole in one control frame, so the cap stays well
    under the frame's 1 MiB."""


class AuthSettings(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Keys accepted on inference and model endpoints, sent as ``Authorization: Bearer <key>``
    or ``X-API-Key: <key>``; ``STOKER_AUTH__API_KEYS`` takes a JSON list or commas. Empty
    (and no file) leaves the server open, which suits a private network or a mesh that
    authenticates; keys in the environment are visible to whoever can inspect the process,
    a file is not."""
    api_keys_file: Path | None = None
    """A file with one key per line (blank lines and ``#`` comments skipped), e.g. a mounted
    Kubernetes Secret; read at startup, so a rotated key needs a restart. A file that is
    missing or holds no key stops the server from starting rather than leave it open."""
    protect_metrics: bool = False
    """Ask for a key on ``/metrics`` too. Off by default: scrapers reach it from inside the
    cluster and the NetworkPolicy already limits who can; on when the port is exposed more
    widely (the scraper then sends the key as a bearer token). Health probes stay open."""

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            if text.startswith(("{", '"')):
                # JSON, but not a list: taken as a literal key it would lock every client out.
                raise ValueError("give a JSON list of keys or comma-separated keys")
            return [key for key in text.split(",") if key.strip()]
        return value

    @field_validator("api_keys")
    @classmethod
    def _no_blank_key(cls, keys: list[str]) -> list[str]:
        if any(not key.strip() for key in keys):
            raise ValueError("an API key is blank")
        return [key.strip() for key in keys]

    @field_validator("api_keys_file")
    @classmethod
    def _keys_in_file(cls, path: Path | None) -> Path | None:
        if path is not None:
            read_key_file(path)
        return path

    def keys(self) -> list[str]:
        """Every accepted key, from the list and the file."""
        from_file = read_key_file(self.api_keys_file) if self.api_keys_file else []
        return [*self.api_keys, *from_file]


def read_key_file(path: Path) -> list[str]:
    """The keys of a key file; refuses a missing, unreadable or empty one, naming the file
    and never its content."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read API key file {path}: {type(exc).__name__}") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [key for key in keys if key and not key.startswith("#")]
    if not keys:
        raise ValueError(f"API key file {path} holds no key")
    return keys


MOVED = {
    ("models", "image_decode"): "uploads.image_decode",
    ("models", "jpeg_decoder"): "uploads.jpeg_decoder",
    ("models", "jpeg_hardware_share"): "uploads.jpeg_hardware_share",
    ("models", "decode_batch"): "uploads.decode_batch_photos",
    ("models", "decode_workers"): "uploads.decode_workers",
    ("models", "decode_processes"): "uploads.decode_processes",
    ("models", "decode_in_flight"): "uploads.decode_in_flight",
    ("server", "decode_uploads_in_front_ends"): "uploads.decode_in_front_ends",
}
"""The upload settings that moved into ``uploads`` (issue 43), by their old section and name."""


class Settings(BaseSettings):
    """Stoker's configuration: built once at startup, logged, passed down."""

    model_config = SettingsConfigDict(
        env_prefix="STOKER_",
        env_nested_delimiter="__",
        use_attribute_docstrings=True,
        extra="forbid",
        # Errors name the field and the problem but never echo the value: it may be a key.
        hide_input_in_errors=True,
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    """HTTP server."""
    models: ModelRepositorySettings = Field(default_factory=ModelRepositorySettings)
    """Which models are served and how they are found."""
    uploads: UploadSettings = Field(default_factory=UploadSettings)
    """Image uploads: where they decode and how their GPU decode batches form."""
    limits: LimitSettings = Field(default_factory=LimitSettings)
    """What one request may ask for."""
    auth: AuthSettings = Field(default_factory=AuthSettings)
    """Who may call the server."""
    store: StoreSettings = Field(default_factory=StoreSettings)
    """The engine store."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        """A setting of an earlier release that moved is refused naming where it went."""
        if isinstance(data, dict):
            for (section, name), place in MOVED.items():
                old = data.get(section)
                if isinstance(old, dict) and name in old:
                    variable = "STOKER_" + place.upper().replace(".", "__")
                    raise ValueError(f"{section}.{name} is now {place} ({variable})")
        return data

    def loggable(self) -> dict[str, Any]:
        """Settings for the startup log: every field named like a secret (the API keys and
        their file among them) is redacted, so a key never reaches a log."""
        data: dict[str, Any] = self.model_dump(mode="json")

        def redact(node: Any) -> Any:
            if isinstance(node, dict):
                return {
                    k: "***"
                    if any(s in k for s in ("key", "token", "secret", "password"))
                    else redact(v)
                    for k, v in node.items()
                }
            return node

        result: dict[str, Any] = redact(data)
        return result
