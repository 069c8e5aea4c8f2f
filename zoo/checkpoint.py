"""Read a PyTorch checkpoint into numpy arrays without importing torch.

A ``.pth`` file is a pickle, and unpickling runs whatever callables the file names. The
unpickler here resolves only the handful of globals a state dict needs (the tensor rebuild
function, ``OrderedDict`` and the typed storage classes) to harmless local stand-ins, so a
malicious file fails with :class:`UnsafePickleError` before anything runs.

Both of torch's formats are read: the legacy one (a sequence of pickles followed by raw
storage bytes, what ``torch.save`` wrote before 1.6) and the zip one (``data.pkl`` plus one
member per storage).
"""

from __future__ import annotations

import collections
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

# torch's legacy format opens with this magic number, then the protocol version it wrote.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001

# torch.<Name>Storage -> element dtype. BFloat16 is left out: numpy has no such dtype.
_STORAGE_DTYPES: dict[str, np.dtype[Any]] = {
    "DoubleStorage": np.dtype("<f8"),
    "FloatStorage": np.dtype("<f4"),
    "HalfStorage": np.dtype("<f2"),
    "LongStorage": np.dtype("<i8"),
    "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"),
    "CharStorage": np.dtype("i1"),
    "ByteStorage": np.dtype("u1"),
    "BoolStorage": np.dtype("?"),
}


class UnsafePickleError(pickle.UnpicklingError):
    """The checkpoint names a global outside the allow-list; nothing from it was run."""


class CheckpointError(ValueError):
    """The file is not a checkpoint this reader understands (or is corrupt)."""


@dataclass(frozen=True)
class _StorageType:
    dtype: np.dtype[Any]


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: np.dtype[Any]
    numel: int


@dataclass(frozen=True)
class _PendingTensor:
    """A tensor whose storage bytes may not have been read yet (legacy files put them last)."""

    storage: _StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(
    storage: _StorageRef, offset: int, size: tuple[int, ...], stride: tuple[int, ...], *_: Any
) -> _PendingTensor:
    # Stands in for torch._utils._rebuild_tensor_v2; the trailing arguments (requires_grad,
    # backward hooks, metadata) mean nothing to numpy.
    return _PendingTensor(storage, offset, tuple(size), tuple(stride))


_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    **{("torch", name): _StorageType(dtype) for name, dtype in _STORAGE_DTYPES.items()},
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], storages: dict[str, _StorageRef]) -> None:
        super().__init__(file)
        self._storages = storages

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"checkpoint refers to {module}.{name}, which is not a tensor, storage or "
                "OrderedDict: refusing to unpickle it (it could run arbitrary code)"
            ) from None

    def persistent_load(self, pid: Any) -> _StorageRef:
        # Legacy: ('storage', type, key, location, numel, view_metadata); zip: no view part.
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"):
            raise CheckpointError(f"unsupported persistent id in checkpoint: {pid!r}")
        storage_type, key, numel = pid[1], str(pid[2]), pid[4]
        if not isinstance(storage_type, _StorageType) or not isinstance(numel, int):
            raise CheckpointError(f"malformed storage reference in checkpoint: {pid!r}")
        # Only torch before 0.4 wrote storage views; later versions always write None here.
        if len(pid) == 6 and pid[5] is not None:
            raise CheckpointError("storage views (files from torch < 0.4) are not supported")
        return self._storages.setdefault(key, _StorageRef(key, storage_type.dtype, numel))


def _unpickle(file: IO[bytes], storages: dict[str, _StorageRef]) -> Any:
    return _RestrictedUnpickler(file, storages).load()


def _tensor(pending: _PendingTensor, data: dict[str, np.ndarray]) -> np.ndarray:
    flat = data.get(pending.storage.key)
    if flat is None:
        raise CheckpointError(f"storage {pending.storage.key!r} is referenced but never stored")
    if len(pending.size) != len(pending.stride):
        raise CheckpointError(f"tensor size {pending.size} and stride {pending.stride} disagree")
    if 0 in pending.size:
        return np.zeros(pending.size, dtype=flat.dtype)
    # as_strided reads raw memory, so prove every element lies inside the storage first.
    last = pending.offset + sum(
        (n - 1) * s for n, s in zip(pending.size, pending.stride, strict=True)
    )
    if pending.offset < 0 or min(pending.stride, default=0) < 0 or last >= flat.size:
        raise CheckpointError(
            f"tensor (offset {pending.offset}, size {pending.size}, stride {pending.stride}) "
            f"overruns its storage of {flat.size} elements"
        )
    view = np.lib.stride_tricks.as_strided(
        flat[pending.offset :],
        shape=pending.size,
        strides=tuple(s * flat.itemsize for s in pending.stride),
        writeable=False,
    )
    return np.array(view, dtype=flat.dtype.newbyteorder("="))


def _state_dict(obj: Any, data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint holds a {type(obj).__name__}, not a state dict")
    result: dict[str, np.ndarray] = {}
    for name, value in obj.items():
        if not isinstance(value, _PendingTensor):
            raise CheckpointError(f"state dict entry {name!r} is not a tensor")
        result[str(name)] = _tensor(value, data)
    return result


def _read_legacy(file: IO[bytes]) -> dict[str, np.ndarray]:
    storages: dict[str, _StorageRef] = {}
    if _unpickle(file, storages) != _LEGACY_MAGIC:
        raise CheckpointError("not a PyTorch checkpoint (bad magic number)")
    if (version := _unpickle(file, storages)) != _LEGACY_PROTOCOL:
        raise CheckpointError(f"unsupported legacy checkpoint protocol {version!r}")
    sys_info = _unpickle(file, storages)
    if not isinstance(sys_info, dict) or not sys_info.get("little_endian", False):
        raise CheckpointError("only little-endian checkpoints are supported")
    obj = _unpickle(file, storages)
    keys = _unpickle(file, storages)
    if not isinstance(keys, list):
        raise CheckpointError("legacy checkpoint without its list of storage keys")
    data: dict[str, np.ndarray] = {}
    for key in keys:
        ref = storages.get(str(key))
        if ref is None:
            raise CheckpointError(f"storage {key!r} is listed but never referenced")
        # Each storage is prefixed by its element count, as a little-endian int64.
        (numel,) = struct.unpack("<q", file.read(8))
        raw = file.read(numel * ref.dtype.itemsize)
        if numel != ref.numel or len(raw) != numel * ref.dtype.itemsize:
            raise CheckpointError(f"storage {key!r} is truncated or has the wrong size")
        data[ref.key] = np.frombuffer(raw, dtype=ref.dtype)
    return _state_dict(obj, data)


def _read_zip(archive: zipfile.ZipFile) -> dict[str, np.ndarray]:
    # Members live under one top-level folder whose name depends on the torch version.
    pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
    if len(pickles) != 1:
        raise CheckpointError("zip checkpoint without exactly one data.pkl")
    prefix = pickles[0].removesuffix("data.pkl")
    if f"{prefix}byteorder" in archive.namelist():
        byteorder = archive.read(f"{prefix}byteorder").decode().strip()
        if byteorder != "little":
            raise CheckpointError(f"only little-endian checkpoints are supported, not {byteorder}")
    storages: dict[str, _StorageRef] = {}
    with archive.open(pickles[0]) as file:
        obj = _unpickle(file, storages)
    data: dict[str, np.ndarray] = {}
    for ref in storages.values():
        raw = archive.read(f"{prefix}data/{ref.key}")
        if len(raw) != ref.numel * ref.dtype.itemsize:
            raise CheckpointError(f"storage {ref.key!r} is truncated or has the wrong size")
        data[ref.key] = np.frombuffer(raw, dtype=ref.dtype)
    return _state_dict(obj, data)


def load_torch_checkpoint(path: Path | str) -> dict[str, np.ndarray]:
    """The state dict saved at ``path`` as ``{name: array}`` (native byte order, copies).

    Raises :class:`UnsafePickleError` when the file names any global besides tensors,
    storages and ``OrderedDict``, and :class:`CheckpointError` when it is not a state dict.
    """
    with open(path, "rb") as file:
        # torch's own test: the zip format starts with a local file header, the legacy with a
        # pickle (checking for a central directory could misfire on legacy storage bytes).
        is_zip = file.read(4) == b"PK\x03\x04"
        file.seek(0)
        if is_zip:
            with zipfile.ZipFile(file) as archive:
                return _read_zip(archive)
        return _read_legacy(file)
