"""dalifeed.convert.tarscan, the tar reader of `shard-convert index` and `verify`, against Python's tarfile and
GNU tar (the oracles): the same regular members, data offsets, sizes and bytes for every header format
they write, the file's sha256 from the one read, and a one-line error naming the byte (and the member) for
each kind of damage."""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tarfile

import pytest

from dalifeed.convert.tarscan import BLOCK, TarDamaged, TarScan, byte_sum


def make_tar(members: list[tuple[str, bytes | str]], fmt=tarfile.PAX_FORMAT, **kw) -> bytes:
    """A tar of `members`: (name, bytes) a regular file; (name, "dir") a directory; (name, "->target") a
    symlink."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt, **kw) as tar:
        for name, what in members:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000.25  # a float mtime: every member gets a pax header, as ShardWriter's
            if what == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(what, str):
                info.type, info.linkname = tarfile.SYMTYPE, what[2:]
                tar.addfile(info)
            else:
                info.size = len(what)
                tar.addfile(info, io.BytesIO(what))
    return out.getvalue()


def scanned(data: bytes, chunk: int = 1 << 20, read_only: bool = False) -> tuple[list[tuple], TarScan]:
    """(name, offset, size, bytes) of every member tarscan yields, and the scan."""
    stream = ReadOnly(data) if read_only else io.BytesIO(data)
    scan = TarScan(stream, chunk=chunk)
    return [(m.name, m.offset, m.size, bytes(scan.data())) for m in scan.members()], scan


def tarfile_members(data: bytes) -> list[tuple]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        return [(m.name, m.offset_data, m.size, tar.extractfile(m).read()) for m in tar if m.isreg()]


class ReadOnly:
    """A stream with read() only, as an object streamed from a store (s3.ObjectStream) is, giving at most
    1000 bytes a call, as a network read may."""

    def __init__(self, data: bytes):
        self.stream = io.BytesIO(data)

    def read(self, size: int = -1) -> bytes:
        return self.stream.read(min(size, 1000))


LONG_DIR = "a-folder-name-long-enough/" * 5  # 130 characters: the ustar prefix, a GNU long name or a pax path
MEMBERS = [("000001.jpg", b"\xff\xd8" + bytes(range(256)) * 3), ("000001.cls", b"7"),
           ("sub", "dir"), ("sub/000002.jpg", b"x" * 1023), ("link.jpg", "->000001.jpg"),
           (LONG_DIR + "000003.jpg", b"y" * 512), (LONG_DIR + "000003.cls", b""),
           ("caf\u00e9/000004.jpg", b"z" * 513)]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
@pytest.mark.parametrize("chunk", [BLOCK, 1000, 1 << 20])
def test_members_offsets_bytes_and_sha256_are_tarfiles(fmt, chunk):
    """Every header format tarfile writes (pax records, GNU long names, the ustar prefix; a non-ASCII name),
    with buffers smaller than a member (the buffer grows) and larger than the tar."""
    data = make_tar(MEMBERS, fmt, encoding="utf-8")
    got, scan = scanned(data, chunk)
    want = tarfile_members(data)
    assert got == want
    assert [name for name, *_ in got] == ["000001.jpg", "000001.cls", "sub/000002.jpg", LONG_DIR + "000003.jpg",
                                         LONG_DIR + "000003.cls", "caf\u00e9/000004.jpg"]
    assert (scan.size, scan.sha256.hexdigest()) == (len(data), hashlib.sha256(data).hexdigest())


def test_a_stream_without_readinto_read_in_short_pieces():
    data = make_tar(MEMBERS)
    got, scan = scanned(data, chunk=4096, read_only=True)
    assert got == tarfile_members(data)
    assert scan.sha256.hexdigest() == hashlib.sha256(data).hexdigest()


def test_a_global_pax_header_and_a_size_in_base_256():
    """A global pax header (GNU tar writes one with --pax-option; its records apply to every member after
    it) and a size field in GNU's base-256 form, which tarfile writes only for files of 8 GiB and more."""
    data = make_tar([("a.jpg", b"a" * 600)], pax_headers={"comment": "made by a test"})
    assert tarfile.open(fileobj=io.BytesIO(data)).pax_headers == {"comment": "made by a test"}
    block = bytearray(data[BLOCK * 4:BLOCK * 5])  # global header + records, local header + records, then a.jpg's
    assert block[:5] == b"a.jpg"
    block[124:136] = b"\x80" + (600).to_bytes(11, "big")
    block[148:156] = b"%06o\0 " % (sum(block[:148]) + 8 * 32 + sum(block[156:]))
    patched = data[:BLOCK * 4] + bytes(block) + data[BLOCK * 5:]
    got, _ = scanned(patched)
    assert got == [("a.jpg", BLOCK * 5, 600, b"a" * 600)]


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
def test_tars_written_by_gnu_tar(tmp_path):
    """GNU tar's own formats (the oracle wds2idx reads with): gnu (long names as L members), posix (pax)."""
    src = tmp_path / "src"
    (src / LONG_DIR).mkdir(parents=True)
    (src / LONG_DIR / "000001.jpg").write_bytes(b"j" * 700)
    (src / "000002.cls").write_bytes(b"3")
    (src / "000002.link").symlink_to("000002.cls")
    for fmt in ("gnu", "posix", "ustar"):
        tar = tmp_path / f"{fmt}.tar"
        subprocess.run(["tar", f"--format={fmt}", "-cf", str(tar), "-C", str(src), "--sort=name", "."], check=True)
        data = tar.read_bytes()
        got, scan = scanned(data, chunk=BLOCK)
        assert got == tarfile_members(data)
        assert sorted(name for name, *_ in got) == ["./000002.cls", f"./{LONG_DIR}000001.jpg"]
        assert scan.size == len(data)


def test_sparse_members_are_no_members():
    """A GNU sparse file's bytes in the tar are not the file's: DALI would read them as they are. Skipped,
    with its data, as wds2idx (GNU tar lists it as type S, not a regular file) skips it."""
    data = bytearray(make_tar([("a.jpg", b"s" * 100), ("b.jpg", b"b" * 10)], tarfile.GNU_FORMAT))
    data[156:157] = b"S"  # a.jpg, now sparse, with no sparse map extension blocks (byte 482 is 0)
    data[148:156] = b"%06o\0 " % (sum(data[:148]) + 8 * 32 + sum(data[156:BLOCK]))
    got, _ = scanned(bytes(data))
    assert got == [("b.jpg", BLOCK * 3, 10, b"b" * 10)]


def test_the_end_of_the_archive():
    """The first zero block ends it (what follows is hashed, not read as members); so does the file's end at a
    header (no end blocks: tarfile and GNU tar accept that too)."""
    data = make_tar([("a.jpg", b"a")])
    trailing = data + make_tar([("b.jpg", b"b")])
    got, scan = scanned(trailing)
    assert [name for name, *_ in got] == ["a.jpg"] and scan.size == len(trailing)
    # pax header, its records, a.jpg's header, its data block: the tar cut right after a.jpg's data
    got, _ = scanned(data[:BLOCK * 4])
    assert got == [("a.jpg", BLOCK * 3, 1, b"a")]


@pytest.mark.parametrize("damage, message", [
    (lambda d: b"", r"^an empty file$"),
    (lambda d: d[:100], r"^shorter than one tar header$"),
    (lambda d: b"not a tar at all" * 100, r"^not a tar header at byte 0 \(bad checksum\)$"),
    (lambda d: d[:BLOCK * 5] + b"\1" + d[BLOCK * 5 + 1:],  # the .cls's pax header, after the .jpg's 2 blocks
     r"^not a tar header at byte 2560 \(after member '000001.jpg'\) \(bad checksum\)$"),
    (lambda d: d[:BLOCK * 5 + 100], r"^the header at byte 2560 \(after member '000001.jpg'\) is cut short: the "
                                    r"file ends at byte 2660$"),
    (lambda d: d[:BLOCK * 3 + 300], r"^member '000001.jpg' is cut short: its data runs to byte 2304, the file "
                                    r"ends at byte 1836$"),
    (lambda d: d[:BLOCK * 1 + 10], r"^the pax header at byte 0 is cut short: the file ends at byte 522$"),
])
def test_damage_is_one_line_naming_the_byte_and_member(damage, message):
    data = make_tar([("000001.jpg", b"j" * 768), ("000001.cls", b"1")])
    with pytest.raises(TarDamaged, match=message):
        for _ in TarScan(io.BytesIO(damage(data))).members():
            pass


def test_member_cut_short_when_its_data_is_asked_for():
    data = make_tar([("000001.jpg", b"j" * 5000)])[:BLOCK * 3 + 2000]
    scan = TarScan(io.BytesIO(data), chunk=BLOCK)
    member = next(scan.members())
    with pytest.raises(TarDamaged, match=r"^member '000001.jpg' is cut short: its data runs to byte 6536, the file "
                                         r"ends at byte 3536$"):
        scan.data()
    assert member.size == 5000


def test_byte_sum_is_sum():
    blocks = [bytes(BLOCK), b"\xff" * BLOCK, bytes(range(256)) * 2, b"\x80" * 7, b"", make_tar([("a", b"")])[:BLOCK]]
    assert [byte_sum(b) for b in blocks] == [sum(b) for b in blocks] == [0, 255 * 512, 255 * 256, 896, 0,
                                                                           sum(blocks[-1])]
