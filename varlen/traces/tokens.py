"""Prompt token ids synthesised from a trace request: equal Mooncake hash ids give equal blocks."""

from __future__ import annotations

import hashlib

import numpy as np

from varlen.traces.mooncake import MOONCAKE_BLOCK_TOKENS
from varlen.traces.trace import TraceRequest

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_DOMAIN_BLOCK = 0x426C6F636B  # separates hash-id block content from per-request content
_DOMAIN_REQUEST = 0x52657175


def _mix_int(x: int) -> int:
    """splitmix64 finaliser on a Python int (same function as _mix on arrays)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _stream(keys: np.ndarray, start: int, length: int) -> np.ndarray:
    """Token words for positions start..start+length of each key: [len(keys), length]."""
    pos = np.arange(start, start + length, dtype=np.uint64) + np.uint64(1)
    return _mix(keys[:, None] + pos[None, :] * np.uint64(_GOLDEN))


def _request_key(req: TraceRequest, seed: int) -> int:
    ident = req.req_id if req.req_id is not None else repr((req.arrival_s, req.prompt_len, req.output_len))
    # blake2b rather than hash(): str hashes are salted per process and must not be.
    digest = int.from_bytes(hashlib.blake2b(ident.encode(), digest_size=8).digest(), "little")
    return _mix_int(digest ^ _mix_int(seed ^ _DOMAIN_REQUEST))


def synth_prompt_tokens(req: TraceRequest, vocab_size: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                        seed: int = 0) -> np.ndarray:
    """Deterministic token ids (int64, req.prompt_len of them, in [0, vocab_size)): block j depends on
    (hash_ids[j], seed) only, the rest on the request, so distinct requests share no content."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    n = int(req.prompt_len)
    parts: list[np.ndarray] = []
    if req.hash_ids:
        nb = min(len(req.hash_ids), -(-n // block_tokens))
        base = np.uint64(_mix_int(seed ^ _DOMAIN_BLOCK))
        # Ids as 64-bit words: signed and unsigned ids of the same bits are the same block.
        keys = _mix(np.asarray([h & _M64 for h in req.hash_ids[:nb]], dtype=np.uint64) ^ base)
        parts.append(_stream(keys, 0, block_tokens).ravel()[:n])
    have = sum(len(p) for p in parts)
    if have < n:
        key = np.asarray([_request_key(req, seed)], dtype=np.uint64)
        parts.append(_stream(key, have, n - have).ravel())
    words = np.concatenate(parts) if parts else np.empty(0, np.uint64)
    return (words % np.uint64(vocab_size)).astype(np.int64)
