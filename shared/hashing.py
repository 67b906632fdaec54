"""Stable names for KV blocks: a SHA-256 chain over token ids and the model's K/V fingerprint.

    h_0 = SHA-256(root        || fingerprint || token ids of block 0)
    h_i = SHA-256(h_{i-1}     || fingerprint || token ids of block i)

`root` is ZERO_HASH for the shared namespace, else `namespace_root(namespace)`: requests of
different cache namespaces (tenants, or clients that send different `cache_salt`s) name even
equal prompts differently, so none can find, or time, another's blocks.

Token ids are packed as little-endian int32, so a name is the same in every process, on every
host and after every restart (never Python's `hash()`, which is salted per process). A block's
name covers everything before it: equal names mean equal prefixes, up to SHA-256 collisions,
and hits still compare the token ids. The fingerprint names everything else that changes K/V
bytes (the model file, the KV dtype and layout, the kernels), so K/V computed under one setup is
never served under another.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ZERO_HASH = bytes(32)
HASH_BYTES = 32


def kv_fingerprint(**facts: object) -> bytes:
    """32 bytes naming a K/V setup; every fact that changes the K/V bytes must be passed."""
    text = ";".join(f"{key}={facts[key]}" for key in sorted(facts))
    return hashlib.sha256(b"reame-kv/" + text.encode()).digest()


def namespace_root(namespace: bytes) -> bytes:
    """The parent of block 0 in a cache namespace (b"" = the shared one: ZERO_HASH)."""
    if not namespace:
        return ZERO_HASH
    return hashlib.sha256(b"reame-namespace/" + namespace).digest()


def block_hash(parent: bytes, token_ids: Sequence[int], fingerprint: bytes) -> bytes:
    digest = hashlib.sha256(parent)
    digest.update(fingerprint)
    digest.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return digest.digest()


def extend_chain(chain: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int,
                 fingerprint: bytes, root: bytes = ZERO_HASH) -> list[bytes]:
    """Grow `chain` (the hashes of the first blocks of token_ids) to num_blocks full blocks."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} blocks of {block_size} need {num_blocks * block_size} tokens, "
                         f"got {len(token_ids)}")
    for i in range(len(chain), num_blocks):
        parent = chain[i - 1] if i else root
        chain.append(block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], fingerprint))
    return chain
