"""Chained hashes of full KV blocks: a block's identity is its tokens and everything before them.

``hash(block i) = blake2b(hash(block i-1) || token ids of block i || extra keys)``. blake2b with a
16-byte digest is collision-resistant for this purpose (a collision would silently serve another
prompt's KV) and hashes a 16-token block in about a microsecond. Extra keys (a LongRoPE request's
long rotation, then a tenant's ``cache_salt``) enter the first block's hash, and through the chain
every later one.
"""

from __future__ import annotations

import hashlib
from array import array

_EMPTY = b""


def block_hash(
    parent: bytes | None, token_ids: list[int], salt: str | None = None, *, long_rope: bool = False
) -> bytes:
    """The chained hash of one full block.

    Args:
        parent: The previous block's hash (None for the first block).
        token_ids: The block's tokens.
        salt: The request's cache salt (only used for the first block).
        long_rope: The KV is rotated by LongRoPE's long frequencies (only used for the first block;
            before the salt, so no salt can spell it).
    """
    digest = hashlib.blake2b(parent or _EMPTY, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    if parent is None and long_rope:
        digest.update(b"\x00long-rope\x00")
    if parent is None and salt is not None:
        digest.update(b"\x00salt\x00" + salt.encode())
    return digest.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: list[int], block_size: int, salt: str | None, *, long_rope: bool = False
) -> None:
    """Append the hashes of every full block of ``token_ids`` not yet in ``hashes``."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(block_hash(parent, token_ids[start : start + block_size], salt, long_rope=long_rope))
