"""The prefix cache's block names: a FULL block is named by ``H_i = blake2b(H_{i-1} || tokens_i)``, so equal
names mean equal token prefixes up to and including that block (pure Python, no torch)."""
from __future__ import annotations

from array import array
from hashlib import blake2b

ROOT = b"kiln-kv-root"   # H_{-1}


def hash_block(parent: bytes, tokens) -> bytes:
    """Chained block hash. blake2b rather than Python's ``hash()``: tuple hashes of ints are
    deterministic and easy to collide on purpose, and a collision would serve another user's KV."""
    h = blake2b(parent, digest_size=16)
    h.update(array("q", tokens))   # (the array's buffer as is: no bytes copies, no concatenation)
    return h.digest()


def extend_hashes(hashes: list[bytes], tokens, num_full_blocks: int, block_size: int) -> list[bytes]:
    """``hashes`` (a request's, kept between calls) extended in place to its first ``num_full_blocks``
    blocks of ``tokens``; returns it."""
    parent = hashes[-1] if hashes else ROOT
    for i in range(len(hashes), num_full_blocks):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


__all__ = ["ROOT", "extend_hashes", "hash_block"]
