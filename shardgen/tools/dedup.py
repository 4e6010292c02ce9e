"""Near-duplicate groups from the perceptual hashes in a run's index (``signals=[phash]``).

Two images are near duplicates when their 64-bit phashes differ in at most ``max_distance`` bits.
Candidates come from banding (the hash cut into ``max_distance + 1`` bands: two hashes that
close agree on at least one band, by the pigeonhole principle), so the work grows with the number
of samples, not its square; candidates are confirmed by their Hamming distance and joined with
union-find into groups.
"""

from __future__ import annotations

from collections import defaultdict


def hamming(a: int, b: int) -> int:
    """Bits that differ between two hashes."""
    return (a ^ b).bit_count()


def _bands(h: int, n: int) -> list[tuple[int, int]]:
    width = -(-64 // n)
    return [(i, (h >> (i * width)) & ((1 << width) - 1)) for i in range(n)]


def near_duplicate_groups(keys: list[str], hashes: list[str], max_distance: int = 4) -> list[list[str]]:
    """Groups (of 2 or more keys, sorted, largest group first) whose phashes (hex) are within
    ``max_distance`` bits of another member."""
    values = [int(h, 16) for h in hashes]
    parent = list(range(len(keys)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    buckets: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, h in enumerate(values):
        for band in _bands(h, max_distance + 1):
            buckets[band].append(i)
    for members in buckets.values():
        for n, j in enumerate(members[1:], 1):
            for i in members[:n]:
                if find(i) != find(j) and hamming(values[i], values[j]) <= max_distance:
                    parent[find(j)] = find(i)
    groups: dict[int, list[str]] = defaultdict(list)
    for i, key in enumerate(keys):
        groups[find(i)].append(key)
    return sorted((sorted(g) for g in groups.values() if len(g) > 1), key=lambda g: (-len(g), g))
