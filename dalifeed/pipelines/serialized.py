"""An epoch's pipeline made from the loader's first, serialized, with the epoch's reader arguments.

Every epoch needs its own pipeline: its shard order is a list the reader is given when the pipeline is built
(loader.py). Defining the graph again is Python, a visible share of a short epoch's CPU for a policy's graph,
half of it DALI recording where each operator was defined (docs/benchmarks.md, "Lanes, and one definition
per loader").
DALI's own serialization avoids it: the first pipeline is serialized (DALI's protobuf `PipelineDef`,
dali/pipeline/proto/dali.proto) and every later one is that definition with the reader's `paths`,
`index_paths`, `shard_id` and `num_shards` replaced (cheap), built by `Pipeline.deserialize_and_build` in C++
(as a defined pipeline's build).

What makes the two the same pipeline: the serialized graph holds every argument given at definition time and no
operator seed (DALI's executor draws those from the pipeline's seed when it builds, in operator order, and a
deserialized pipeline is given the epoch's seed), and operator names are numbered per pipeline, so checkpoints
taken from either restore into the other (tests/test_serialized.py).

DALI 2.4's Python wheel has no generated protobuf module, so the few fields edited here are read and written
in protobuf's wire format directly; every other byte is copied as it is.
"""

from __future__ import annotations

from collections.abc import Iterator

from nvidia.dali import Pipeline

READER_OPERATOR = b"readers__Webdataset"

# dali.proto's field numbers
PIPELINE_OP = 5
OP_NAME, OP_ARG = 1, 4
ARG_NAME, ARG_TYPE, ARG_INTS, ARG_STRINGS, ARG_ELEMENTS, ARG_IS_VECTOR = 1, 2, 4, 5, 7, 8
VARINT, LENGTH_DELIMITED = 0, 2


class NotEditable(ValueError):
    """A serialized pipeline whose reader this module cannot re-aim (no webdataset reader, or several)."""


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _encode_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 in two's complement, as protobuf writes it
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def wire_fields(message: bytes) -> Iterator[tuple[int, int, int | bytes, bytes]]:
    """(field number, wire type, value, the field's bytes as written) of a protobuf message, in order."""
    at = 0
    while at < len(message):
        start = at
        key, at = _varint(message, at)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            value, at = _varint(message, at)
        elif wire == LENGTH_DELIMITED:
            size, at = _varint(message, at)
            value, at = message[at:at + size], at + size
        elif wire in (1, 5):  # fixed 64 and 32 bits
            size = 8 if wire == 1 else 4
            value, at = message[at:at + size], at + size
        else:
            raise NotEditable(f"protobuf wire type {wire} is not one DALI's pipeline definition uses")
        yield number, wire, value, message[start:at]


def _field(number: int, value: int | bytes | str) -> bytes:
    if isinstance(value, int):
        return _encode_varint(number << 3 | VARINT) + _encode_varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _encode_varint(number << 3 | LENGTH_DELIMITED) + _encode_varint(len(data)) + data


def _argument(name: str, value: int | list[str]) -> bytes:
    """dali.proto's `Argument`, written the way DALI writes it: an int64, or a vector of strings (each element
    an `Argument` of its own, named "element i")."""
    if isinstance(value, int):
        return _field(ARG_NAME, name) + _field(ARG_TYPE, "int64") + _field(ARG_INTS, value) + \
            _field(ARG_IS_VECTOR, 0)
    elements = b"".join(
        _field(ARG_ELEMENTS, _field(ARG_NAME, f"element {i}") + _field(ARG_TYPE, "string") +
               _field(ARG_STRINGS, item) + _field(ARG_IS_VECTOR, 0))
        for i, item in enumerate(value))
    return _field(ARG_NAME, name) + _field(ARG_TYPE, "string") + elements + _field(ARG_IS_VECTOR, 1)


def _argument_name(argument: bytes) -> str:
    return next(value for number, _, value, _ in wire_fields(argument) if number == ARG_NAME).decode()


def _reader_replaced(op: bytes, values: dict[str, int | list[str]]) -> bytes:
    out, replaced = [], set()
    for number, _, value, raw in wire_fields(op):
        if number == OP_ARG and (name := _argument_name(value)) in values:
            out.append(_field(OP_ARG, _argument(name, values[name])))
            replaced.add(name)
        else:
            out.append(raw)
    if replaced != set(values):
        raise NotEditable(f"the reader has no argument {sorted(set(values) - replaced)}")
    return b"".join(out)


def with_reader_arguments(serialized: bytes, **values: int | list[str]) -> bytes:
    """`serialized` (Pipeline.serialize()) with the webdataset reader's arguments `values` replaced (each
    must be there already: an int64 or a list of strings)."""
    out, readers = [], 0
    for number, _, value, raw in wire_fields(serialized):
        if number == PIPELINE_OP and _op_name(value) == READER_OPERATOR:
            out.append(_field(PIPELINE_OP, _reader_replaced(value, values)))
            readers += 1
        else:
            out.append(raw)
    if readers != 1:
        raise NotEditable(f"the pipeline has {readers} webdataset readers, not 1")
    return b"".join(out)


def without_origins(serialized: bytes) -> bytes:
    """`serialized` without DALI's record of where each operator was defined (the `_origin_stack_*` arguments,
    most of a policy graph's bytes): it only adds that place to DALI's own error messages, and reading it was
    most of the time that making a policy's pipeline takes."""
    out = []
    for number, _, value, raw in wire_fields(serialized):
        if number == PIPELINE_OP:
            kept = (op_raw for field, _, op_value, op_raw in wire_fields(value)
                    if not (field == OP_ARG and _argument_name(op_value).startswith("_origin_stack_")))
            out.append(_field(PIPELINE_OP, b"".join(kept)))
        else:
            out.append(raw)
    return b"".join(out)


def _op_name(op: bytes) -> bytes:
    return next(value for number, _, value, _ in wire_fields(op) if number == OP_NAME)


class SerializedPipeline(Pipeline):
    """A Pipeline whose graph is a serialized definition, deserialized when it is built (by DALI's iterator or
    the loader), so that it is made where a defined pipeline would have been built. `kwargs`: the Pipeline's
    (batch_size, num_threads, device_id, seed, checkpoint, ...), which the definition's own do not override."""

    def __init__(self, serialized: bytes, **kwargs):
        super().__init__(**kwargs)
        self._serialized = serialized

    def build(self) -> None:
        if not self._built:
            self.deserialize_and_build(self._serialized)
