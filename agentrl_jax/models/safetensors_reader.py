"""Reading safetensors weights: headers parsed and validated here, data memory-mapped.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``), then
the raw little-endian tensor data, offsets counted from the end of the header. We parse the
header ourselves (the ``safetensors`` NumPy reader cannot read bfloat16 and its JAX reader
materialises on a device) and check everything before a byte of data is touched, as the format's
reference implementation does: the header is a JSON object of at most
:data:`MAX_HEADER_BYTES`; every entry has a known dtype, a shape of non-negative ints and
``0 <= begin <= end``; ``end - begin`` is the shape's size times the dtype's; the tensors tile
the data exactly (no overlap, no gap, nothing after the last) and the data fits in the file.
Every error is a :class:`~agentrl_jax.errors.CheckpointError` naming the file and the tensor or
field. Only the header is read; tensors are ``np.memmap`` views, so a multi-GB file is never
read whole, and never twice.

:func:`index_checkpoint` lists a model directory's tensors, from ``model.safetensors`` or a
sharded ``model.safetensors.index.json``. Its ``weight_map`` must be an object of tensor name ->
shard file name, each a plain file name of the directory itself: a non-empty string without NUL
bytes that the file system can encode, relative, without path separators, and inside the
directory after symlinks are followed (``../x``, ``/abs/x``, ``sub/x`` or a link out are
errors), except for the Hugging Face hub cache's own layout, where ``snapshots/<rev>/<file>``
links to ``../../blobs/<hash>`` of the same repository. Messages show names cut to
:data:`SHOWN_NAME` characters.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from agentrl_jax.errors import CheckpointError
from agentrl_jax.models.strict_json import json_kind, load_json_object
from agentrl_jax.validation import is_int, short_repr

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit
METADATA_KEY = "__metadata__"
SHOWN_NAME = 120  # characters of a tensor or file name a message shows

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live inside a safetensors file."""

    name: str
    file: Path
    dtype_name: str  # safetensors dtype tag, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file

    @property
    def dtype(self) -> np.dtype:
        return DTYPES[self.dtype_name]

    def mmap(self) -> np.ndarray:
        """The tensor as a read-only memory map: indexing it reads only the pages it touches."""
        if math.prod(self.shape) == 0:
            return np.zeros(self.shape, self.dtype)
        return np.memmap(
            self.file, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape
        )

    def read(self, index: Any = (), dtype: Any = None) -> np.ndarray:
        """``tensor[index]`` as a new array (cast to ``dtype`` while copying)."""
        return np.array(self.mmap()[index], dtype=dtype)


@dataclasses.dataclass(frozen=True)
class HeaderEntry:
    """One validated header entry; ``begin``/``end`` count from the end of the header."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    begin: int
    end: int


# ---------------------------------------------------------------------------- one file
def header_length(prefix: bytes, file_size: int, source: str) -> int:
    """The header length the first 8 bytes give, checked against the file's size."""
    if len(prefix) < 8:
        raise CheckpointError(
            f"{source}: not a safetensors file: {file_size} bytes, fewer than "
            "the 8 of the header length"
        )
    n = int.from_bytes(prefix[:8], "little")
    if n < 2:
        raise CheckpointError(
            f"{source}: not a safetensors file: header length {n} is too small for a JSON object"
        )
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{source}: not a safetensors file: header length {n} is over "
            f"the {MAX_HEADER_BYTES}-byte limit"
        )
    if 8 + n > file_size:
        raise CheckpointError(
            f"{source}: not a safetensors file: header length {n} is more "
            f"than the {file_size - 8} bytes after the length field"
        )
    return n


def parse_header(header: bytes, data_size: int, source: str) -> list[HeaderEntry]:
    """The tensors of a safetensors header, validated against ``data_size`` bytes of data.

    Pure: ``header`` is the JSON header's bytes, ``data_size`` the file's size minus the
    header and its length field. Raises :class:`CheckpointError` naming ``source`` and the
    tensor or field for anything the format does not allow.
    """
    parsed = load_json_object(
        header, source=source, what="safetensors header", error=CheckpointError
    )
    metadata = parsed.get(METADATA_KEY, {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(
            f"{source}: safetensors header field {METADATA_KEY!r} must be an "
            f"object of strings, got {short_repr(metadata)}"
        )
    entries = [_entry(name, meta, source) for name, meta in parsed.items() if name != METADATA_KEY]
    _check_layout(entries, data_size, source)
    return entries


def _entry(name: str, meta: Any, source: str) -> HeaderEntry:
    where = f"{source}: tensor {name!r}"
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"{where}: header entry must be an object with dtype, shape and "
            f"data_offsets, got {json_kind(meta)}"
        )
    for key in ("dtype", "shape", "data_offsets"):
        if key not in meta:
            raise CheckpointError(f"{where}: header entry has no {key!r}")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not (isinstance(dtype, str) and dtype in DTYPES):
        raise CheckpointError(
            f"{where}: dtype {short_repr(dtype)} is not a supported "
            f"safetensors dtype ({', '.join(DTYPES)})"
        )
    if not (isinstance(shape, list) and all(is_int(d, 0) for d in shape)):
        raise CheckpointError(
            f"{where}: shape must be a list of ints >= 0, got {short_repr(shape)}"
        )
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(is_int(o) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(
            f"{where}: data_offsets must be [begin, end] with "
            f"0 <= begin <= end, got {short_repr(offsets)}"
        )
    begin, end = offsets
    needed = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != needed:
        raise CheckpointError(
            f"{where}: shape {shape} of {dtype} needs {needed} bytes, but "
            f"data_offsets [{begin}, {end}] hold {end - begin}"
        )
    return HeaderEntry(name, dtype, tuple(shape), begin, end)


def _check_layout(entries: list[HeaderEntry], data_size: int, source: str) -> None:
    """The tensors tile ``[0, data_size)`` exactly: in offset order, each starts where the
    previous ends, and the last ends at the end of the file."""
    position, previous = 0, None
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.end > data_size:
            raise CheckpointError(
                f"{source}: tensor {entry.name!r}: data_offsets [{entry.begin}, {entry.end}] "
                f"run past the end of the data ({data_size} bytes after the header); the file "
                "is truncated or corrupt"
            )
        if entry.begin < position:
            raise CheckpointError(
                f"{source}: tensors {previous.name!r} (data_offsets [{previous.begin}, "
                f"{previous.end}]) and {entry.name!r} (data_offsets [{entry.begin}, "
                f"{entry.end}]) overlap"
            )
        if entry.begin > position:
            after = f"after tensor {previous.name!r}" if previous else "at the start of the data"
            raise CheckpointError(
                f"{source}: tensor {entry.name!r}: data_offsets [{entry.begin}, {entry.end}] "
                f"leave bytes [{position}, {entry.begin}) {after} unused; tensors must be "
                "contiguous"
            )
        position, previous = entry.end, entry
    if position != data_size:
        raise CheckpointError(
            f"{source}: {data_size - position} bytes after the last tensor's "
            f"data (which ends at {position}) belong to no tensor"
        )


def read_safetensors_header(path: str | Path) -> dict[str, TensorEntry]:
    """Parse one safetensors file's header into :class:`TensorEntry` records (no data read)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: safetensors file does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = header_length(f.read(8), size, str(path))
        header = f.read(n)
    entries = parse_header(header, size - 8 - n, str(path))
    return {
        e.name: TensorEntry(e.name, path, e.dtype_name, e.shape, 8 + n + e.begin) for e in entries
    }


# ---------------------------------------------------------------------------- a model directory
def index_checkpoint(model_dir: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of a model directory, single-file or sharded, by Hugging Face name."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = read_weight_map(index_path)
        headers = {}
        for file_name in sorted(set(weight_map.values())):
            tensor = next(n for n, f in weight_map.items() if f == file_name)
            where = f"{index_path}: {_map_entry(tensor, file_name)}"
            headers[file_name] = read_safetensors_header(
                contained_file(model_dir, file_name, where)
            )
        entries = {}
        for name, file_name in weight_map.items():
            if name not in headers[file_name]:
                raise CheckpointError(
                    f"{index_path}: {_map_entry(name, file_name)}, but "
                    f"that file holds no tensor {_name(name)}"
                )
            entries[name] = headers[file_name][name]
        return entries
    single = model_dir / SINGLE_FILE
    if single.is_file() or single.is_symlink():
        return read_safetensors_header(contained_file(model_dir, SINGLE_FILE, str(single)))
    raise FileNotFoundError(f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE}")


def read_weight_map(index_path: Path) -> dict[str, str]:
    """The ``weight_map`` of a shard index: tensor name -> shard file name (not yet checked
    against the directory, see :func:`contained_file`)."""
    index = load_json_object(
        index_path.read_bytes(), source=str(index_path), what="the index", error=CheckpointError
    )
    if "weight_map" not in index:
        raise CheckpointError(f"{index_path}: field 'weight_map' is missing")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index_path}: field 'weight_map' must be an object of tensor "
            f"name -> file name, got {json_kind(weight_map)}"
        )
    for name, file_name in weight_map.items():
        if not (isinstance(file_name, str) and file_name):
            raise CheckpointError(
                f"{index_path}: weight_map[{_name(name)}] must be a file name, "
                f"got {_name(file_name)}"
            )
        problem = file_name_problem(file_name)
        if problem:
            raise CheckpointError(f"{index_path}: {_map_entry(name, file_name)} {problem}")
    return weight_map


def file_name_problem(name: str) -> str:
    """Why the string ``name`` cannot name a file at all ("" if it can): a NUL byte, or
    characters the file system cannot encode (lone surrogates). Pure; where it points is
    :func:`contained_file`'s to check."""
    if "\0" in name:
        return "holds a NUL byte; shard files must be plain file names"
    try:
        os.fsencode(name)
    except UnicodeError:
        return "holds characters no file name can hold (unpaired surrogates)"
    return ""


def _name(value: Any) -> str:
    return short_repr(value, SHOWN_NAME)


def _map_entry(tensor: Any, file_name: Any) -> str:
    return f"weight_map[{_name(tensor)}] = {_name(file_name)}"


def contained_file(model_dir: Path, name: str, where: str) -> Path:
    """``model_dir / name``, after checking that it is a relative name of an existing file that
    stays inside ``model_dir`` with symlinks followed, in ``model_dir`` itself (no path
    separators; see the module docstring). Every failure is a :class:`CheckpointError` that
    starts with ``where``."""
    problem = file_name_problem(name)
    if problem:
        raise CheckpointError(f"{where} {problem}")
    if os.path.isabs(name):
        raise CheckpointError(
            f"{where} is an absolute path; shard files must be named "
            "relative to the model directory"
        )
    root = model_dir.resolve()
    try:
        target = (root / name).resolve()
        if not any(target.is_relative_to(allowed) for allowed in _allowed_roots(root)):
            raise CheckpointError(
                f"{where} resolves to {target}, outside the model directory {root}"
            )
        if name in (".", "..") or "/" in name or "\\" in name:
            raise CheckpointError(
                f"{where} is a path, not a file name: shard files must lie in the model "
                "directory itself"
            )
        if not target.exists():
            raise CheckpointError(f"{where}, which does not exist in {model_dir}")
        if not target.is_file():
            raise CheckpointError(f"{where} is not a regular file")
    except (OSError, RuntimeError) as e:  # a name too long, a symlink loop
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)[:SHOWN_NAME]
        raise CheckpointError(f"{where} cannot be looked up ({reason})") from None
    return model_dir / name  # the name the files are known by (in a hub cache, not the blob's)


def _allowed_roots(root: Path) -> tuple[Path, ...]:
    """The model directory, and for a Hugging Face hub cache snapshot
    (``models--org--name/snapshots/<rev>``) that repository's ``blobs`` folder."""
    blobs = root.parent.parent / "blobs"
    if (
        root.parent.name == "snapshots"
        and root.parent.parent.name.startswith("models--")
        and blobs.is_dir()
    ):
        return root, blobs
    return (root,)
