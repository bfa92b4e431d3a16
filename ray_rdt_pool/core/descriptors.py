"""Merging of paired transfer descriptors into fewer, longer ones.

Pure (stdlib only). A one-sided READ moves bytes between paired local and remote
ranges; each descriptor costs a fixed overhead in NIXL and in the NIC, so
neighbouring pairs that are contiguous on both sides are fused. A merge is made only
when it moves exactly the same bytes to exactly the same places, which requires
adjacency on *both* sides (and the same device): a range contiguous on one side
only would change the byte mapping.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["merge_descriptors", "merge_segments"]


def merge_descriptors(
    local: Sequence[tuple[int, int, int]],
    remote: Sequence[tuple[int, int, int]],
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Fuse consecutive ``(addr, length, dev)`` pairs adjacent on both sides.

    The i-th local descriptor pairs with the i-th remote one and must have its
    length. Pairs ``i`` and ``i + 1`` fuse when, on each side, ``addr_i + len_i ==
    addr_{i+1}`` and the device is the same. Zero-length pairs are dropped. One
    pass, O(n); the order of the pairs is kept.

    Returns:
        ``(local, remote)``, equally long, pairwise of equal length.

    Raises:
        ValueError: if the lists differ in length, or a pair differs in length or
            has a negative length (the message names the index).
    """
    if len(local) != len(remote):
        raise ValueError(
            f"{len(local)} local descriptors but {len(remote)} remote descriptors"
        )
    out_l: list[tuple[int, int, int]] = []
    out_r: list[tuple[int, int, int]] = []
    # The pending pair is held unpacked so extending it is integer arithmetic only.
    have = False
    la = ra = n = ld = rd = 0
    for i, ((a, length, d), (b, rlength, e)) in enumerate(zip(local, remote)):
        if length != rlength:
            raise ValueError(
                f"descriptor {i}: local length {length} differs from remote length {rlength}"
            )
        if length < 0:
            raise ValueError(f"descriptor {i}: negative length {length}")
        if length == 0:
            continue
        if have and a == la + n and b == ra + n and d == ld and e == rd:
            n += length
            continue
        if have:
            out_l.append((la, n, ld))
            out_r.append((ra, n, rd))
        have = True
        la, ra, n, ld, rd = a, b, length, d, e
    if have:
        out_l.append((la, n, ld))
        out_r.append((ra, n, rd))
    return out_l, out_r


def merge_segments(segments: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Fuse consecutive ``(virt_off, addr, length)`` segments adjacent on both sides.

    Segments ``i`` and ``i + 1`` fuse when ``virt_i + len_i == virt_{i+1}`` and
    ``addr_i + len_i == addr_{i+1}``. Zero-length segments are dropped. One pass,
    O(n); the order is kept.

    Raises:
        ValueError: for a negative length (the message names the index).
    """
    out: list[tuple[int, int, int]] = []
    have = False
    v0 = a0 = n = 0
    for i, (v, a, length) in enumerate(segments):
        if length < 0:
            raise ValueError(f"segment {i}: negative length {length}")
        if length == 0:
            continue
        if have and v == v0 + n and a == a0 + n:
            n += length
            continue
        if have:
            out.append((v0, a0, n))
        have = True
        v0, a0, n = v, a, length
    if have:
        out.append((v0, a0, n))
    return out
