"""A tar read once, front to back, as `shard-convert index` and `verify` read the tars they adopt: each regular
member's name, data offset and size (what a DALI index lists), the bytes of the members the caller asks for,
and the size and sha256 of every byte of the file, hashed as the bytes go by. Works on any binary stream (a
local file, an object streamed from a store); nothing is read twice and nothing is held beyond two buffers
(of CHUNK bytes, or of the largest member asked for).

Why not `tarfile`: on ShardWriter's tars (a pax header before every member) its header parsing and stream
layer cost more CPU than reading and hashing them (docs/benchmarks.md, "shard-convert index against DALI's
wds2idx"). This reads the same headers with a few slices each.

The headers are read as POSIX (ustar, pax) and GNU tar write them and as `tarfile` reads them; regular files
are the members, GNU sparse files are skipped as wds2idx skips them, and the first zero block ends the archive.
Anything else -- a bad checksum, a member or header cut short -- is `TarDamaged` naming the member, where
`tarfile` would silently end the archive at a bad header.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
REGULAR = (b"0", b"\0", b"7")  # regular file, old regular file, contiguous file
NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # hard and symbolic link, devices, directory, fifo
PAX_LOCAL, PAX_GLOBAL, PAX_SOLARIS = b"x", b"g", b"X"
GNU_LONGNAME, GNU_LONGLINK, GNU_SPARSE = b"L", b"K", b"S"
USTAR_MAGIC = b"ustar\x0000"  # POSIX: the 155-byte prefix field is a name prefix (GNU's `ustar  ` uses it for times)
CHUNK = 1 << 20  # bytes asked of the stream at a time; any size from 64 KiB to 4 MiB reads and hashes alike


class TarDamaged(Exception):
    """The stream is not a whole tar: the message says what and at which byte (the caller names the tar)."""


class TarMember:
    __slots__ = ("name", "offset", "size")

    def __init__(self, name: str, offset: int, size: int):
        self.name, self.offset, self.size = name, offset, size  # offset: of the member's data in the tar


class TarScan:
    """Iterate `members()`; `data()` gives the bytes of the member just yielded (valid until the next one is
    asked for); `sha256` and `size` cover the whole file once `members()` is exhausted."""

    def __init__(self, stream, chunk: int = CHUNK):
        self.stream = stream
        self.sha256 = hashlib.sha256()
        self.size = 0
        # Two buffers, used in turn: the unread tail of one is copied to the front of the other before the next
        # read, so a copy never overlaps its source and a view given out by `data()` stays intact until then.
        self._buffers = [bytearray(chunk), bytearray(chunk)]
        self._buf = memoryview(self._buffers[0])
        self._start = self._end = 0  # the bytes read but not yet consumed: _buf[_start:_end]
        self._base = 0  # the file offset of _buf[0]
        self._member: TarMember | None = None  # the member whose data follows _start, while it is yielded

    # --- bytes in, hashed -------------------------------------------------------------------------------

    def _fill(self, n: int) -> bool:
        """Make the next `n` unconsumed bytes available at _buf[_start:]; False if the file ends first."""
        have = self._end - self._start
        if have >= n:
            return True
        if self._start or n > len(self._buf):
            spare = self._buffers[1] if self._buf.obj is self._buffers[0] else self._buffers[0]
            if len(spare) < n:  # a member larger than the buffer: a new, larger one (views given out stay valid)
                spare = bytearray(max(n, 2 * len(spare)))
                self._buffers = [self._buf.obj, spare]
            target = memoryview(spare)
            target[:have] = self._buf[self._start:self._end]
            self._base += self._start
            self._buf, self._start, self._end = target, 0, have
        while self._end - self._start < n:
            got = self._read_into(self._end)
            if not got:
                return False
        return True

    def _read_into(self, at: int) -> int:
        """Read as much as fits after _buf[at], hash it; 0 at the end of the file."""
        free = self._buf[at:]
        readinto = getattr(self.stream, "readinto", None)
        if readinto is not None:
            got = readinto(free) or 0
        else:
            data = self.stream.read(len(free))
            got = len(data)
            free[:got] = data
        if got:
            self.sha256.update(free[:got])
            self.size += got
            self._end = at + got
        return got

    def _skip(self, n: int) -> bool:
        """Consume `n` bytes (read and hashed, not kept); False if the file ends first."""
        have = self._end - self._start
        if have >= n:
            self._start += n
            return True
        n -= have
        self._base += self._end
        self._start = self._end = 0
        while True:
            got = self._read_into(0)
            if not got:
                return False
            if got >= n:
                self._start = n
                return True
            self._base += got
            n -= got

    def drain(self) -> None:
        """Read what follows the archive's end (its zero blocks, padding) into the size and sha256."""
        self._start = self._end = 0
        while self._read_into(0):
            pass

    def offset(self) -> int:
        """The file offset of the next unconsumed byte."""
        return self._base + self._start

    def _take(self, n: int, what: str, at: int, last: str) -> bytes:
        """The next `n` bytes, consumed; TarDamaged naming `what` (the header at `at`) if the file ends first."""
        if not self._fill(n):
            raise TarDamaged(f"{what} at {place(at, last)} is cut short: the file ends at byte {self.size}")
        data = bytes(self._buf[self._start:self._start + n])
        self._start += n
        return data

    # --- members ------------------------------------------------------------------------------------------

    def data(self) -> memoryview:
        """The bytes of the member `members()` just yielded (a view into the buffer, valid until the next)."""
        member = self._member
        if member is None:
            raise RuntimeError("data() is for the member members() just yielded")
        if not self._fill(member.size):
            raise TarDamaged(cut_short(member, self.size))
        return self._buf[self._start:self._start + member.size]

    def members(self) -> Iterator[TarMember]:
        """The regular members in tar order; the archive's size and sha256 are complete when this ends."""
        global_pax: dict[bytes, bytes] = {}
        local_pax: dict[bytes, bytes] = {}
        long_name: bytes | None = None
        last = ""  # the last member's name, for the messages
        while True:
            at = self.offset()
            if not self._fill(BLOCK):
                if self._end == self._start and at:  # ends at a header: the end, as tarfile and GNU tar take it
                    break
                if at == 0:
                    raise TarDamaged(too_short(bytes(self._buf[self._start:self._end])))
                raise TarDamaged(f"the header at {place(at, last)} is cut short: the file ends at byte {self.size}")
            block = bytes(self._buf[self._start:self._start + BLOCK])
            self._start += BLOCK
            if block == ZERO_BLOCK:
                break
            check_header(block, at, last)
            kind, size = block[156:157], header_number(block[124:136], at, last)
            if kind in (PAX_LOCAL, PAX_SOLARIS, PAX_GLOBAL):
                text = self._take(padded(size), "the pax header", at, last)[:size]
                # parsed only when it holds a record that changes what a member is (ShardWriter's hold an mtime)
                if b" path=" in text or b" size=" in text or b" GNU.sparse." in text:
                    (global_pax if kind == PAX_GLOBAL else local_pax).update(pax_records(text, at, last))
                continue
            if kind in (GNU_LONGNAME, GNU_LONGLINK):
                text = self._take(padded(size), "the GNU long name", at, last)[:size]
                if kind == GNU_LONGNAME:
                    long_name = text.split(b"\0", 1)[0]
                continue
            pax = {**global_pax, **local_pax} if global_pax else local_pax
            raw_name = long_name if long_name is not None else header_name(block)
            if b"path" in pax:
                raw_name = pax[b"path"].rstrip(b"/")
            if b"size" in pax:
                size = pax_size(pax[b"size"], at, last)
            local_pax, long_name = {}, None
            last = raw_name.decode("utf-8", "surrogateescape")
            if kind in NO_DATA:
                continue
            if kind == GNU_SPARSE:  # the extension blocks of its sparse map come before its data
                extended = block[482]
                while extended:
                    extended = self._take(BLOCK, "the GNU sparse map of the member", at, last)[504]
            member = TarMember(last, self.offset(), size)
            if is_regular(kind, raw_name, pax):
                self._member = member
                yield member
                self._member = None
            if not self._skip(padded(size)):
                raise TarDamaged(cut_short(member, self.size))
        self.drain()


LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def too_short(head: bytes) -> str:
    """What a file shorter than one tar header is: empty, a Git LFS pointer left where the tar should be (a
    clone without `git lfs pull`), or a cut-short file."""
    if not head:
        return "an empty file"
    if head.startswith(LFS_POINTER):
        return "a Git LFS pointer, not the tar: fetch the file itself (git lfs pull)"
    return "shorter than one tar header"


def place(at: int, last: str) -> str:
    """Where in the tar, for a message: the byte, and the member before it."""
    return f"byte {at}" + (f" (after member {last!r})" if last else "")


def padded(size: int) -> int:
    """A member's size in the tar: whole blocks."""
    return -(-size // BLOCK) * BLOCK


def is_regular(kind: bytes, name: bytes, pax: dict[bytes, bytes]) -> bool:
    """Whether the member is a file whose bytes are its data: not a V7 directory (a regular type whose name
    ends in /), not a sparse file (GNU's type S, or pax GNU.sparse records), whose bytes in the tar are not
    the file's."""
    return kind in REGULAR and not (kind == b"\0" and name.endswith(b"/")) and \
        not any(k.startswith(b"GNU.sparse.") for k in pax)


def cut_short(member: TarMember, file_size: int) -> str:
    return (f"member {member.name!r} is cut short: its data runs to byte {member.offset + member.size}, the file "
            f"ends at byte {file_size}")


def check_header(block: bytes, at: int, last: str) -> None:
    """TarDamaged unless the header's checksum is its bytes' sum (the checksum field counted as spaces),
    unsigned or, as some old tars wrote it, signed."""
    try:
        stored = int(block[148:156].split(b"\0", 1)[0] or b"0", 8)
    except ValueError:
        stored = -1
    if stored != byte_sum(block) - sum(block[148:156]) + 8 * 32 and \
            stored != 256 + sum(struct.unpack_from("148b8x356b", block)):
        raise TarDamaged(f"not a tar header at {place(at, last)} (bad checksum)")


_BYTES_1 = int.from_bytes(b"\xff\x00" * (BLOCK // 2), "little")  # every other byte of a block
_PAIRS_1 = int.from_bytes(b"\xff\xff\x00\x00" * (BLOCK // 4), "little")  # every other 16-bit lane
_LANE_MOD = 2**32 - 1


def byte_sum(data: bytes) -> int:
    """sum(data) for up to 512 bytes, in a few big-integer operations instead of a loop over the bytes (twice as
    fast; the header checksums were a tenth of `index`'s parsing): adjacent bytes, then adjacent 16-bit sums,
    are added into 32-bit lanes, and since 2**32 = 1 modulo 2**32 - 1, the number those lanes spell is, modulo
    2**32 - 1, the sum of the lanes, which is below 2**17."""
    x = int.from_bytes(data, "little")
    x = (x & _BYTES_1) + ((x >> 8) & _BYTES_1)
    x = (x & _PAIRS_1) + ((x >> 16) & _PAIRS_1)
    return x % _LANE_MOD


def header_number(field: bytes, at: int, last: str) -> int:
    """A numeric header field: octal text, or GNU's base-256 (first byte 0x80)."""
    if field[0] == 0x80:
        return int.from_bytes(field[1:], "big")
    try:
        return int(field.split(b"\0", 1)[0] or b"0", 8)
    except ValueError:
        raise TarDamaged(f"the header at {place(at, last)} has a size that is not a number ({field!r})") from None


def header_name(block: bytes) -> bytes:
    name = block[:100].split(b"\0", 1)[0]
    if block[257:265] == USTAR_MAGIC and block[345] and block[156:157] not in (GNU_LONGNAME, GNU_LONGLINK):
        name = block[345:500].split(b"\0", 1)[0] + b"/" + name
    return name


def pax_records(data: bytes, at: int, last: str) -> dict[bytes, bytes]:
    """A pax header's `LENGTH KEY=VALUE\\n` records (LENGTH counts the whole record), as bytes."""
    records, pos = {}, 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        equals = data.find(b"=", space)
        try:
            length = int(data[pos:space])
        except ValueError:
            length = 0
        if space < 0 or equals < 0 or length <= equals - pos or data[pos + length - 1:pos + length] != b"\n":
            raise TarDamaged(f"the pax header at {place(at, last)} has a malformed record at its byte {pos}")
        records[data[space + 1:equals]] = data[equals + 1:pos + length - 1]
        pos += length
    return records


def pax_size(value: bytes, at: int, last: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise TarDamaged(f"the pax header before {place(at, last)} has a size that is not a number ({value[:20]!r})") \
            from None
