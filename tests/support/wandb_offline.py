"""Read the history of an offline wandb run (``<dir>/wandb/offline-run-*/run-*.wandb``) without a
server: the file is a LevelDB-style record log (7-byte file header, 32 KiB blocks, each chunk a
7-byte header of checksum, length and type) of ``wandb_internal_pb2.Record`` messages."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_FILE_HEADER = 7
_BLOCK = 32768
_CHUNK_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path):
    data = path.read_bytes()
    if not data.startswith(b":W&B"):
        raise ValueError(f"{path} is not a wandb run file")
    position, pending = _FILE_HEADER, b""
    while position + _CHUNK_HEADER <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        if left_in_block < _CHUNK_HEADER:
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _CHUNK_HEADER])
        if kind == 0:  # zero padding to the end of the block
            position += left_in_block
            continue
        chunk = data[position + _CHUNK_HEADER : position + _CHUNK_HEADER + length]
        position += _CHUNK_HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk


def offline_history(run_file: Path) -> list[dict]:
    """One dict per logged step: key -> value (JSON-decoded), plus ``_step``."""
    rows = []
    for payload in _records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows
