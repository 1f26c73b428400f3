"""Class labels of shards `shard-convert index` adopted (dalifeed.convert.index): DALI reads them as ASCII
decimal text, from a `.cls` member or from the end of an index component's name, and these operators turn
the text into the int64 of shape (1,) that dalifeed's own `.cls.i64` members give.

Cost per sample: a concatenation, a slice, a cast and a 10-element dot product on at most 20 bytes: nothing
beside a JPEG decode. The text must be 1..`width` ASCII digits: `shard-convert index` leaves out every
sample whose label is not (docs/format.md).
"""

from __future__ import annotations

import numpy as np
from nvidia.dali import fn, types

ZERO = ord("0")


def ascii_decimal(text, width: int):
    """(n,) uint8 ASCII digits, 1 <= n <= width -> int64 (1,). Right-aligns the digits behind `width` ASCII
    zeros, keeps the last `width` bytes and takes their dot product with 10^(width-1) .. 10^0."""
    padded = fn.cat(types.Constant(np.full(width, ZERO, np.uint8)), text, axis=0)
    tail = fn.slice(padded, _int64(text.shape(device="cpu")[0]), _int64(width + 0 * text.shape(device="cpu")[0]),
                    axes=[0])
    digits = fn.cast(tail, dtype=types.INT64) - ZERO
    powers = types.Constant(np.array([10 ** (width - 1 - i) for i in range(width)], np.int64))
    return fn.reshape(fn.reductions.sum(digits * powers, axes=[0]), shape=[1])


def _int64(node):
    return fn.cast(node, dtype=types.INT64)


def name_digits(component, width: int):
    """The last `width` bytes of a component's index name: DALI 2.4 reports a webdataset component's source
    as `<tar>:<offset>:<name from the index>` (tests/test_index.py holds it to that)."""
    source = fn.get_property(component, key="source_info")
    length = source.shape(device="cpu")[0]
    return fn.slice(source, _int64(length - width), _int64(0 * length + width), axes=[0])


def text_labels(component, how: dict):
    """The int64 (1,) label of each sample from the component the reader gave for `how["ext"]`, as the
    manifest's `webdataset.label.dali` says: its bytes (`from: member`) or its name (`from: name`)."""
    if how["from"] == "member":
        return ascii_decimal(component, int(how.get("digits", 10)))
    width = int(how["digits"])
    return ascii_decimal(name_digits(component, width), width)
