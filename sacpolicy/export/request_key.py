"""A served request's key: vLLM's proposer hook gives no request ids, so the proposer knows a request by its committed
tokens. One key function for both of its users: the proposer's request table (``proposer._History``: a request found
again, step to step, under the key of the context its last block was drafted on) and the canary
(``reload.PolicySlot``: a request's arm drawn from the key of the context it was first seen with, so the same prompt
lands on the same arm on every server).
"""

from __future__ import annotations

import hashlib

import numpy as np


def request_key(context: np.ndarray) -> tuple[int, bytes]:
    """(length, 16-byte blake2b digest) of ``context``'s token ids (an int64 array): equal for equal contexts only
    (up to hash collisions), and cheap beside a step (one pass over the bytes)."""
    return len(context), hashlib.blake2b(context.tobytes(), digest_size=16).digest()


def key_position(key: tuple[int, bytes]) -> float:
    """Where ``key`` (``request_key``) falls in [0, 1), uniform over contexts: a request is on a canary of fraction f
    when its first context's position is below f."""
    return int.from_bytes(key[1][:8], "big") / 2**64
