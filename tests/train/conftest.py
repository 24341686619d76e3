"""What the training tests share: reading an offline wandb run file."""

from __future__ import annotations

import json


def wandb_history(run_file: str) -> dict[int, dict]:
    """History rows of an offline ``run-*.wandb`` file, read independently of wandb's
    own service: LevelDB-log framing (7-byte file header, 32 KiB blocks, records with
    crc/length/type headers) around protobuf ``Record`` messages."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, rows = open(run_file, "rb").read(), 7, b"", {}
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST piece of a record
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                rows.setdefault(items.get("_step"), {}).update(items)
    return rows
