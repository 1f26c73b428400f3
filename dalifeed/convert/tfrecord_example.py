"""The `tf.train.Example` protobuf, decoded by hand: Example{features: Features{feature: map<string, Feature>}},
each Feature a bytes, float or int64 list. No TensorFlow and no generated code; a bytes value is kept as the
span of the record's data it occupies, so an image is never copied to be found."""

from __future__ import annotations

import struct
from dataclasses import dataclass


class ExampleError(Exception):
    """A record's data is not a well-formed `tf.train.Example`; the message says where it broke."""


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ExampleError("a varint runs past its message")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview, start: int, end: int):
    """(field number, wire type, value) of each field of the message in buf[start:end]; a length-delimited
    value is (its start, its end), a varint an int, fixed-size values their bytes."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > end:
                raise ExampleError(f"field {number} is {size} bytes long, past its message's end")
            value, pos = (pos, pos + size), pos + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > end:
                raise ExampleError(f"field {number} runs past its message's end")
            value, pos = bytes(buf[pos:pos + size]), pos + size
        else:
            raise ExampleError(f"field {number} has wire type {wire}, which an Example never holds")
        yield number, wire, value


@dataclass(frozen=True)
class Feature:
    kind: str  # bytes | int64 | float
    values: tuple  # bytes features: (start, end) spans of the record's data; the others: numbers


def parse_example(data: bytes | memoryview) -> dict[str, Feature]:
    """The features of a serialized `tf.train.Example`, each as the spans (bytes) or numbers it holds."""
    buf = memoryview(data)
    features: dict[str, Feature] = {}
    for number, wire, span in _fields(buf, 0, len(buf)):
        if number != 1 or wire != 2:
            continue
        for entry_number, entry_wire, entry in _fields(buf, *span):
            if entry_number != 1 or entry_wire != 2:
                continue
            key, feature = "", Feature("bytes", ())
            for part_number, part_wire, part in _fields(buf, *entry):
                if part_number == 1 and part_wire == 2:
                    try:
                        key = bytes(buf[part[0]:part[1]]).decode()
                    except UnicodeDecodeError:
                        raise ExampleError("a feature name is not UTF-8") from None
                elif part_number == 2 and part_wire == 2:
                    feature = _feature(buf, *part)
            features[key] = feature
    return features


def _feature(buf: memoryview, start: int, end: int) -> Feature:
    feature = Feature("bytes", ())  # a Feature with no list set: TensorFlow reads it as empty
    for number, wire, span in _fields(buf, start, end):
        if wire != 2 or number not in (1, 2, 3):
            continue
        values = []
        for value_number, value_wire, value in _fields(buf, *span):
            if value_number != 1:
                continue
            if (number, value_wire) not in ((1, 2), (2, 2), (2, 5), (3, 2), (3, 0)):
                raise ExampleError(f"a {('bytes', 'float', 'int64')[number - 1]} list holds a value of wire type "
                                   f"{value_wire}")
            if number == 1:
                values.append(value)
            elif number == 2:  # floats: packed (wire 2) or one by one (wire 5)
                raw = bytes(buf[value[0]:value[1]]) if value_wire == 2 else value
                values += struct.unpack(f"<{len(raw) // 4}f", raw[: len(raw) // 4 * 4])
            elif number == 3 and value_wire == 2:  # int64s, packed
                pos = value[0]
                while pos < value[1]:
                    v, pos = _varint(buf, pos)
                    values.append(v - (1 << 64) if v >= 1 << 63 else v)
            elif number == 3 and value_wire == 0:
                values.append(value - (1 << 64) if value >= 1 << 63 else value)
        feature = Feature({1: "bytes", 2: "float", 3: "int64"}[number], tuple(values))
    return feature
