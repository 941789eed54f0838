"""The prefix cache's second tier: full KV blocks as files in one directory
(`kv_offload_dir`), shared by every engine on the host that names it.

Bytes in, bytes out; no tensors (the worker turns a block's K/V into bytes and
back: worker/kv_offload.py). The scheduler only asks which blocks are there.

A block's file is named by the engine's fingerprint (model, dtype, KV format,
block size: worker/kv_offload.py `fingerprint`) and the block's chain hash
(core/kv_cache_manager.py), and holds, in order:

    magic (8 bytes) | header: fingerprint (16 bytes), block hash, parent hash
    (int64 each), token count (uint32), payload bytes (uint64) | the block's
    token ids (int32 each) | payload (the K/V bytes) | crc32 of all before it

A reader checks all of it: the name's fingerprint and hash against the header,
the parent hash and token ids against the request's (so the disk tier adds no
hash collision the RAM cache does not already risk), the length, the checksum.
Anything else is a miss, never an error: the block is recomputed.

Writes go to a temporary file renamed over the name (atomic on POSIX), so a
reader in another process never sees half a block. Nothing is fsynced: a file
torn by a power cut fails its checksum and is a miss.

The directory is bounded in bytes across everyone's files, least recently used
first: a file's mtime is its last use (written, or loaded: `touch`), and a
writer that has written past its estimate of the bound rescans the directory
and unlinks the oldest files until the bound holds.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"TMKVBLK1"
_HEADER = struct.Struct("<16sqqIQ")  # fingerprint, block hash, parent hash, tokens, payload bytes
_CRC = struct.Struct("<I")
SUFFIX = ".kvblock"
TMP_SUFFIX = ".tmp"
# A temporary file older than this is a dead writer's: the bound's scan removes it.
STALE_TMP_S = 600.0
FINGERPRINT_HEX = 32  # 16 bytes


def block_file_name(fingerprint: str, block_hash: int) -> str:
    """`<fingerprint>-<hash as 16 hex digits>.kvblock` (the hash as unsigned 64 bits)."""
    return f"{fingerprint}-{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}{SUFFIX}"


def encoded_size(num_tokens: int, payload_bytes: int) -> int:
    """A block file's length."""
    return len(MAGIC) + _HEADER.size + 4 * num_tokens + payload_bytes + _CRC.size


def encode_block(fingerprint: str, block_hash: int, parent_hash: int, token_ids: Sequence[int],
                 payload: bytes | memoryview) -> list[bytes | memoryview]:
    """A block file's bytes, in pieces (the payload is not copied)."""
    head = MAGIC + _HEADER.pack(bytes.fromhex(fingerprint), block_hash, parent_hash,
                                len(token_ids), len(payload))
    tokens = struct.pack(f"<{len(token_ids)}i", *token_ids)
    crc = zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(head)))
    return [head, tokens, payload, _CRC.pack(crc)]


def decode_block(data: bytes | bytearray | memoryview, fingerprint: str, block_hash: int, parent_hash: int,
                 token_ids: Sequence[int], payload_bytes: int) -> memoryview | None:
    """The payload of a block file's bytes if they are this block's, whole and
    intact (see the module's docstring), else None."""
    view = memoryview(data)
    head_end = len(MAGIC) + _HEADER.size
    tokens_end = head_end + 4 * len(token_ids)
    if len(view) != encoded_size(len(token_ids), payload_bytes) or bytes(view[:len(MAGIC)]) != MAGIC:
        return None
    fp, file_hash, file_parent, num_tokens, num_payload = _HEADER.unpack_from(view, len(MAGIC))
    if (fp != bytes.fromhex(fingerprint) or file_hash != block_hash or file_parent != parent_hash
            or num_tokens != len(token_ids) or num_payload != payload_bytes):
        return None
    if struct.unpack_from(f"<{num_tokens}i", view, head_end) != tuple(token_ids):
        return None
    (crc,) = _CRC.unpack_from(view, tokens_end + payload_bytes)
    if zlib.crc32(view[:tokens_end + payload_bytes]) != crc:
        return None
    return view[tokens_end:tokens_end + payload_bytes]


@dataclass
class DirectoryScan:
    """What one pass over the directory found and removed."""

    total_bytes: int  # after the removals
    num_removed: int


class BlockFiles:
    """One engine's view of the shared directory: its own fingerprint's names,
    and the byte bound it keeps over everyone's files."""

    def __init__(self, directory: str, fingerprint: str, max_bytes: int) -> None:
        if len(fingerprint) != FINGERPRINT_HEX:
            raise ValueError(f"a fingerprint is {FINGERPRINT_HEX} hex digits, got {fingerprint!r}")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        # The directory's bytes as last scanned plus what this process wrote since.
        self._estimate = self.enforce_bound().total_bytes

    def path(self, block_hash: int) -> str:
        return os.path.join(self.directory, block_file_name(self.fingerprint, block_hash))

    def count_present(self, block_hashes: Sequence[int]) -> int:
        """How many of `block_hashes`, from the first, have a file (unchecked:
        a bad one is found, and is a miss, when it is read)."""
        for n, block_hash in enumerate(block_hashes):
            if not os.path.exists(self.path(block_hash)):
                return n
        return len(block_hashes)

    def read(self, block_hash: int, parent_hash: int, token_ids: Sequence[int],
             payload_bytes: int) -> memoryview | None:
        """The block's payload, or None (missing, or not this block's: a bad file
        is removed, so the block is written again once recomputed). A hit
        counts as a use (the LRU's clock)."""
        path = self.path(block_hash)
        size = encoded_size(len(token_ids), payload_bytes)
        data = bytearray(size)  # (writable: the runner's tensor views it without a copy)
        try:
            with open(path, "rb") as f:
                ok = os.fstat(f.fileno()).st_size == size and f.readinto(data) == size
        except OSError:
            return None
        payload = decode_block(data, self.fingerprint, block_hash, parent_hash, token_ids,
                               payload_bytes) if ok else None
        if payload is None:
            _unlink(path)
            return None
        _touch(path)
        return payload

    def write(self, block_hash: int, parent_hash: int, token_ids: Sequence[int],
              payload: bytes | memoryview) -> int:
        """Store a block unless a file of it is there (then it is only touched);
        the bytes written."""
        path = self.path(block_hash)
        if os.path.exists(path):
            _touch(path)
            return 0
        tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}{TMP_SUFFIX}"
        pieces = encode_block(self.fingerprint, block_hash, parent_hash, token_ids, payload)
        try:
            with open(tmp, "wb") as f:
                for piece in pieces:
                    f.write(piece)
            os.replace(tmp, path)
        except OSError:  # (a full disk: the block is recomputed when next needed)
            _unlink(tmp)
            return 0
        size = sum(len(p) for p in pieces)
        self._estimate += size
        return size

    def after_writes(self) -> DirectoryScan | None:
        """Keep the bound: rescan and remove the oldest files once this process's
        estimate of the directory passes it (the scan sees the others' writes)."""
        if self._estimate <= self.max_bytes:
            return None
        scan = self.enforce_bound()
        self._estimate = scan.total_bytes
        return scan

    def enforce_bound(self) -> DirectoryScan:
        """Remove block files, least recently used first, until the directory's
        block files fit in max_bytes; remove dead writers' temporary files."""
        files: list[tuple[int, int, str]] = []  # (mtime ns, bytes, path)
        now = time.time()
        removed = 0
        with os.scandir(self.directory) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # (removed meanwhile)
                if entry.name.endswith(TMP_SUFFIX):
                    if now - st.st_mtime > STALE_TMP_S:
                        removed += _unlink(entry.path)
                elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                    files.append((st.st_mtime_ns, st.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        if total > self.max_bytes:
            files.sort()
            for _, size, path in files:
                if total <= self.max_bytes:
                    break
                removed += _unlink(path)
                total -= size  # (gone, by us or by another process)
        return DirectoryScan(total_bytes=total, num_removed=removed)


def _touch(path: str) -> None:
    with contextlib.suppress(OSError):  # (removed meanwhile: the next reader misses)
        os.utime(path)


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
    except OSError:
        return 0
    return 1
