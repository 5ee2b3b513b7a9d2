"""Row keys of `dsbd batch` as 16-byte fingerprints: what the driver keeps instead of the rows.

Resume and the duplicate-id rule need, before any row is decoded, every row's id and
(id, row_hash) key and every final record's key in the output (docs/BATCH.md, Resume). Held as
Python strings and sets that costs a few hundred bytes a row; here a key is a 16-byte BLAKE2b
digest of its parts (each part length-prefixed, so ("ab", "c") and ("a", "bc") differ) and a
set of keys is one sorted NumPy array of them: 16 bytes a key, looked up in bulk by binary
search. 128 bits make a collision (which would skip a row or flag a false duplicate) as likely
as never: about n**2 / 2**129 for n keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

FINGERPRINT = np.dtype("S16")


def fingerprint(*parts: str) -> bytes:
    """The 16-byte digest of a key's parts (ids may hold lone surrogates: JSON allows them)."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()


def fingerprints(keys: Iterable[str | Sequence[str]]) -> np.ndarray:
    """Fingerprints of ids (a str each) or of (id, row_hash) pairs, as one `S16` array."""
    digests = [fingerprint(k) if isinstance(k, str) else fingerprint(*k) for k in keys]
    return np.frombuffer(b"".join(digests), dtype=FINGERPRINT)


def pack(digests: list[bytes]) -> np.ndarray:
    """Digests collected one by one (`fingerprint`) as an `S16` array."""
    return np.frombuffer(b"".join(digests), dtype=FINGERPRINT)


class KeySet:
    """A set of fingerprints (sorted, unique), with the set operations resume needs.

    `KeySet.of(["a", ("a", "h")])` fingerprints plain values; `in`, `&` and `len` behave as
    for a Python set of the same keys, so callers may also pass ordinary sets of ids or pairs
    where a KeySet is expected (`KeySet.of` converts them)."""

    def __init__(self, values: np.ndarray | None = None) -> None:
        array = np.empty(0, FINGERPRINT) if values is None else np.asarray(values, FINGERPRINT)
        self.values = np.unique(array)  # sorted, unique

    @classmethod
    def of(cls, keys: KeySet | Iterable[Any]) -> KeySet:
        """A KeySet as is, or one of plain ids / (id, row_hash) pairs."""
        return keys if isinstance(keys, KeySet) else cls(fingerprints(keys))

    @classmethod
    def union(cls, parts: Iterable[np.ndarray]) -> KeySet:
        arrays = list(parts)
        return cls(np.concatenate(arrays) if arrays else None)

    def __len__(self) -> int:
        return len(self.values)

    def __contains__(self, key: str | Sequence[str]) -> bool:
        return bool(self.contains(fingerprints([key]))[0])

    def __and__(self, other: KeySet | Iterable[Any]) -> KeySet:
        other = KeySet.of(other)
        return KeySet(other.values[self.contains(other.values)])

    def positions(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each fingerprint of `query`: whether it is in the set, and where (if so)."""
        if not len(self.values) or not len(query):
            return np.zeros(len(query), bool), np.zeros(len(query), np.intp)
        where = np.searchsorted(self.values, query)
        clipped = np.minimum(where, len(self.values) - 1)
        return self.values[clipped] == query, clipped

    def contains(self, query: np.ndarray) -> np.ndarray:
        """Membership of every fingerprint of `query` (a bool array)."""
        return self.positions(query)[0]
