"""Safetensors shards read one tensor at a time through a memory map, and written one at a time.

The ``safetensors`` package's ``safe_open`` keeps every page it has read mapped until the file is
closed, and the OS counts those pages in the process's resident set: loading an 8B model's 16 GB
of bf16 shards peaked at the shard's size above the weights. Here each tensor is viewed in the
map, handed to the caller (who converts it to its served form, a new tensor), and its pages are
released (``MADV_DONTNEED``) before the next one is read, so a load holds at most one source
tensor's pages. The format is the documented one: an 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (offsets from the end of the
header), then the bytes.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Iterator

import torch

from fivefold.errors import ModelLoadError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # the reference implementation's limit


def read_header(file: Path) -> tuple[dict, int]:
    """(header without ``__metadata__``, offset of the data) of a safetensors file, validated against
    the file's size: a truncated or corrupt file is a one-line error naming it (and the tensor)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {size} bytes, no header")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: header of {length} bytes "
                                 f"in a file of {size}")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"corrupt or truncated safetensors file {file}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + length
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: tensor '{name}' has an unsupported or "
                                 f"malformed entry {info}") from None
        numel = 1
        for d in shape:
            numel *= int(d)
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: tensor '{name}' {info['dtype']}{shape} "
                                 f"spans {end - begin} bytes")
        if data_start + end > size:
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: tensor '{name}' ends at byte "
                                 f"{data_start + end}, the file has {size}")
    return header, data_start


def read_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in file order. Each tensor is a view of the map, valid until the next
    one is read: convert or copy it before asking for the next."""
    header, data_start = read_header(file)
    order = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    with open(file, "rb") as f:
        if not order or f.seek(0, 2) == 0:
            return
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable views, file untouched
    page = mmap.PAGESIZE
    for name, info in order:
        begin, end = (data_start + o for o in info["data_offsets"])
        dtype, shape = DTYPES[info["dtype"]], [int(d) for d in info["shape"]]
        count = (end - begin) // dtype.itemsize
        tensor = (torch.frombuffer(mm, dtype=dtype, count=count, offset=begin) if count
                  else torch.empty(0, dtype=dtype))
        yield name, tensor.view(shape)
        del tensor
        start = begin // page * page  # release the pages read (the caller has its own copy now)
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def write_tensors(file: Path, tensors: list[tuple[str, tuple, torch.dtype]], produce) -> None:
    """Write a safetensors file tensor by tensor: ``tensors`` lists (name, shape, dtype) and
    ``produce(name)`` returns each tensor when its turn comes, so that at most one is materialized
    (an int8 layer held in the kernel's layout unpacks its weight only while it is written)."""
    header, offset = {}, 0
    for name, shape, dtype in tensors:
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= int(d)
        header[name] = {"dtype": _NAMES[dtype], "shape": [int(d) for d in shape], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as the reference writer does
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in tensors:
            tensor = produce(name).detach().contiguous()
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"{name}: produced {tuple(tensor.shape)} {tensor.dtype}, declared {shape} {dtype}")
            if tensor.numel():
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
