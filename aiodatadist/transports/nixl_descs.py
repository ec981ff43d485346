"""NIXL descriptor lists of a plan, for ``transports/nixl.py``'s requests.

* :func:`chunks`: a plan's (local, remote) descriptors, cut into requests of about
  :data:`CHUNK_BYTES` (numpy; plain Python for a small plan, where numpy's fixed cost
  dominates), for ``initialize_xfer``.
* :class:`BlockLists`: whole blocks caches prepared once (``prep_xfer_dlist``, one
  descriptor per block per tensor), so that a small pull of new blocks is a request by
  indices (``make_prepped_xfer``, ~1 us here) rather than lists made and checked for it
  (``initialize_xfer`` ~3 us, plus making the lists).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .engine import on_device

if TYPE_CHECKING:
    from .._caches import CacheEntry

__all__ = [
    "CHUNK_BYTES",
    "PREP_KEEP",
    "PREP_MAX_DESCS",
    "BlockLists",
    "chunks",
    "dev",
    "host",
    "mem",
]

CHUNK_BYTES = 8 * 1024 * 1024
"""Bytes per NIXL request of one transfer (an abort waits for at most one)."""
SMALL_PLAN = 16
"""Segments up to which a plan's descriptors are made without numpy."""
PREP_MAX_DESCS = 1 << 16
"""A blocks cache of more blocks x tensors than this gets no prepared list."""
PREP_KEEP = 16
"""Prepared lists (one per side of a cache) kept per connection; more are not made."""
_INIT_AGENT = "NIXL_INIT_AGENT"  # (prep_xfer_dlist: the local side)


def chunks(op: str, segs: Any, local: CacheEntry, remote: CacheEntry) -> list[tuple[Any, Any]]:
    """(local, remote) Nx3 descriptor arrays, in chunks of about CHUNK_BYTES.

    NIXL over UCX's CMA moves a request inside ``postXferReq``: one request per chunk
    bounds how long an abort (deadline, cancel) waits for the engine.
    """
    # READ: src = remote (columns 0, 1), dst = local (2, 3); WRITE the other way.
    r_cols, l_cols = ((0, 1), (2, 3)) if op == "READ" else ((2, 3), (0, 1))
    if len(segs) <= SMALL_PLAN:  # plain Python: numpy's fixed cost dominates a small pull
        table = segs.tolist()
        if sum(row[4] for row in table) <= CHUNK_BYTES:
            ra, la, rdev, ldev = remote.addrs, local.addrs, dev(remote), dev(local)
            r_list = [(ra[row[r_cols[0]]] + row[r_cols[1]], row[4], rdev) for row in table]
            l_list = [(la[row[l_cols[0]]] + row[l_cols[1]], row[4], ldev) for row in table]
            return [(l_list, r_list)]
    r_addrs = np.asarray(remote.addrs, dtype=np.uint64)
    l_addrs = np.asarray(local.addrs, dtype=np.uint64)
    r = r_addrs[segs[:, r_cols[0]].astype(np.intp)] + segs[:, r_cols[1]]
    lo = l_addrs[segs[:, l_cols[0]].astype(np.intp)] + segs[:, l_cols[1]]
    n = segs[:, 4]
    if int(n.max(initial=0)) > CHUNK_BYTES:  # split long segments into CHUNK_BYTES pieces
        pieces = (n + CHUNK_BYTES - 1) // CHUNK_BYTES
        idx = np.repeat(np.arange(len(n)), pieces.astype(np.intp))
        first = np.cumsum(pieces) - pieces
        k = (np.arange(len(idx)) - first[idx]).astype(np.uint64)
        off = k * np.uint64(CHUNK_BYTES)
        r, lo = r[idx] + off, lo[idx] + off
        n = np.minimum(n[idx] - off, np.uint64(CHUNK_BYTES))
    rows = len(n)
    rd = np.empty((rows, 3), dtype=np.uint64)
    ld = np.empty((rows, 3), dtype=np.uint64)
    rd[:, 0], ld[:, 0] = r, lo
    rd[:, 1] = ld[:, 1] = n
    rd[:, 2] = dev(remote)
    ld[:, 2] = dev(local)
    ends = np.cumsum(n)
    if int(ends[-1]) <= CHUNK_BYTES:
        return [(ld, rd)]
    group = (ends - n) // np.uint64(CHUNK_BYTES)
    cuts = np.flatnonzero(np.diff(group)) + 1
    return list(zip(np.split(ld, cuts), np.split(rd, cuts), strict=True))


def host(*entries: CacheEntry) -> bool:
    """Whether every entry is in host memory."""
    return all(on_device(e) is None for e in entries)


def mem(entry: CacheEntry) -> str:
    """NIXL's memory type of ``entry``."""
    return "DRAM" if on_device(entry) is None else "VRAM"


def dev(entry: CacheEntry) -> int:
    return on_device(entry) or 0


class BlockLists:
    """One connection's prepared lists of whole blocks caches (see the module docstring).

    A list is made on first use, for a cache of at most :data:`PREP_MAX_DESCS`
    descriptors, at most :data:`PREP_KEEP` of them. Requests made from a list must be
    released before it: the connection drops its requests first, and :meth:`retire`
    keeps lists a reaped request may still use until :meth:`release`.
    """

    def __init__(self, nx: Any) -> None:
        self.nx = nx
        self._lists: dict[tuple[Any, ...], Any] = {}
        self._retired: list[Any] = []

    def _side(self, key: tuple[Any, ...], agent: str, entry: CacheEntry) -> Any:
        if key in self._lists:
            return self._lists[key]
        if len(self._lists) >= PREP_KEEP:
            return None
        nb, bb, addrs = entry.num_blocks, entry.block_bytes, entry.addrs
        handle = None
        if entry.is_blocks and bb > 0 and 0 < nb * len(addrs) <= PREP_MAX_DESCS:
            base = np.repeat(np.asarray(addrs, dtype=np.uint64), nb)
            descs = np.empty((len(base), 3), dtype=np.uint64)
            descs[:, 0] = base + np.tile(np.arange(nb, dtype=np.uint64) * np.uint64(bb), len(addrs))
            descs[:, 1] = bb
            descs[:, 2] = dev(entry)
            try:
                handle = self.nx.prep_xfer_dlist(agent, descs, mem(entry))
            except Exception:
                handle = None  # (the request is then made from lists of its own)
        self._lists[key] = handle
        return handle

    def request(
        self, op: str, rows: list[list[int]], local: CacheEntry, remote: CacheEntry, peer: str
    ) -> Any:
        """A request moving whole blocks ``rows`` (a plan's segments) made by indices into
        the two caches' lists, or None (not whole blocks, no list: make it otherwise)."""
        bb = remote.block_bytes
        if bb != local.block_bytes or bb <= 0:
            return None
        r_cols, l_cols = ((0, 1), (2, 3)) if op == "READ" else ((2, 3), (0, 1))
        r_nb, l_nb = remote.num_blocks, local.num_blocks
        r_idx: list[int] = []
        l_idx: list[int] = []
        for row in rows:
            ro, lo, n = row[r_cols[1]], row[l_cols[1]], row[4]
            if ro % bb or lo % bb or n % bb or not n:
                return None
            r0, l0 = row[r_cols[0]] * r_nb + ro // bb, row[l_cols[0]] * l_nb + lo // bb
            r_idx.extend(range(r0, r0 + n // bb))
            l_idx.extend(range(l0, l0 + n // bb))
        lp = self._side(("L", local.cache_id), _INIT_AGENT, local)
        rp = self._side(("R", remote.cache_id, remote.lease), peer, remote) if lp else None
        if rp is None:
            return None
        try:
            return self.nx.make_prepped_xfer(op, lp, l_idx, rp, r_idx)
        except Exception:
            return None  # NIXL refused it by indices: made from lists of its own

    def retire(self, local_cache: int | None = None) -> None:
        """Forgets the lists of local cache ``local_cache`` (None: every list); they are
        released by :meth:`release` (their requests are gone by then)."""
        keys = [k for k in self._lists if local_cache is None or k == ("L", local_cache)]
        self._retired += [h for h in (self._lists.pop(k) for k in keys) if h is not None]

    def release(self) -> None:
        """Releases the retired lists (no request made from them is left)."""
        retired, self._retired = self._retired, []
        for h in retired:
            try:
                self.nx.release_dlist_handle(h)
            except Exception:
                pass  # best effort: NIXL frees them with the agent
