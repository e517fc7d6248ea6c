"""Prefix-caching block hashes (plain Python; no torch).

A full block's hash chains its parent's hash, the block's token ids and extra keys that
change the KV content (the per-request ``cache_salt`` and the LoRA adapter's identity, part
of the first block's key only: every later hash chains it; and the content hash of each image
whose placeholder tokens the block holds, as vLLM's ``generate_block_hash_extra_keys``: the
same token ids with another image are other KV)::

    hash(block i) = H(hash(block i-1), tuple(token ids of block i), extra keys)

with ``hash(block -1)`` a root value derived from a seed, so two deployments do not share
hash values by accident. Following vLLM's ``prefix_caching_hash_algo``.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, Callable, NewType, Optional, Sequence

import cbor2
import xxhash

#: The hash of one full block (bytes: 32 for sha256, 16 for xxh3-128).
BlockHash = NewType("BlockHash", bytes)
HashFn = Callable[[Any], bytes]


def _sha256(obj: Any) -> bytes:
    """SHA-256 of the pickle encoding (stable for tuples of ints, bytes, str, None)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of canonical CBOR (RFC 8949 section 4.2): same bytes in every process and version."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash(obj: Any) -> bytes:
    """128-bit xxh3 of the pickle encoding: much faster than SHA-256, not cryptographic."""
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash,
}


def get_hash_fn(name: str) -> HashFn:
    """The hash function called ``name``.

    Raises:
        ValueError: for an unknown name; the message lists the known ones.
    """
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"Unknown prefix_caching_hash_algo {name!r}; choose one of {sorted(HASH_FUNCTIONS)}."
        ) from None


def root_block_hash(hash_fn: HashFn, algo: str, seed: Optional[str] = None) -> BlockHash:
    """The parent hash of every request's first block.

    ``seed`` defaults to the ``PYTHONHASHSEED`` environment variable (as vLLM does); if that
    is unset, ``sha256_cbor`` uses a fixed seed (its hashes are meant to be reproducible
    across processes) and the other algorithms a random one per process.
    """
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        seed = "" if algo == "sha256_cbor" else os.urandom(16).hex()
    return BlockHash(hash_fn(("pagedllm-prefix-cache-root", seed)))


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: BlockHash,
    block_token_ids: Sequence[int],
    extra_keys: Optional[tuple[Any, ...]] = None,
) -> BlockHash:
    """Hash of one full block given its parent's hash, its token ids and extra keys."""
    return BlockHash(hash_fn((parent_block_hash, tuple(block_token_ids), extra_keys)))


def hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHash:
    """The prefix-cache key of a block of KV-cache group ``group_id``: the same tokens have
    a block in each group, each with its own key (vLLM's ``BlockHashWithGroupId``). Group
    0's key is the hash itself (a model with one group keys its blocks as before groups)."""
    if group_id == 0:
        return block_hash
    return BlockHash(block_hash + group_id.to_bytes(4, "big"))


def first_block_extra_keys(
    cache_salt: Optional[str], lora_key: Optional[tuple[str, int, int]]
) -> Optional[tuple[Any, ...]]:
    """The extra keys of a request's first block: ``(cache_salt,)``, ``(cache_salt,
    lora_key)`` with a LoRA adapter (its (name, int id, load generation): another adapter, or
    the same one re-loaded with new weights, never shares blocks), or None with neither."""
    if lora_key is not None:
        return (cache_salt, lora_key)
    return None if cache_salt is None else (cache_salt,)


def mm_extra_keys(extra: Optional[tuple[Any, ...]], mm_spans: Sequence[tuple[int, int, str]], start: int,
                  end: int) -> Optional[tuple[Any, ...]]:
    """``extra`` plus the content hash of each image of ``mm_spans`` ((start, end, hash) of its
    placeholder tokens) that overlaps tokens ``start`` .. ``end - 1`` (``extra`` as it is when none does)."""
    hashes = tuple(h for s, e, h in mm_spans if s < end and e > start)
    if not hashes:
        return extra
    return (*(extra or ()), *hashes)


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    hash_fn: HashFn,
    root_hash: BlockHash,
    first_extra_keys: Optional[tuple[Any, ...]],
    num_full_blocks: int,
    mm_spans: Sequence[tuple[int, int, str]] = (),
) -> None:
    """Append to ``block_hashes`` the hashes of blocks ``len(block_hashes)`` .. ``num_full_blocks - 1``.

    Only the missing blocks are hashed: a request's hashes are extended as its blocks
    fill, never recomputed. ``token_ids`` must hold at least ``num_full_blocks * block_size``
    tokens. ``first_extra_keys``: the first block's extra keys (``first_block_extra_keys``).
    ``mm_spans``: (start, end, content hash) of each image's placeholder tokens, by start
    (``mm_extra_keys``).
    """
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[i - 1] if i > 0 else root_hash
        extra = first_extra_keys if i == 0 else None
        if mm_spans:
            extra = mm_extra_keys(extra, mm_spans, i * block_size, (i + 1) * block_size)
        block = token_ids[i * block_size : (i + 1) * block_size]
        block_hashes.append(hash_block_tokens(hash_fn, parent, block, extra))
