"""Index arithmetic shared by every floor: which block of a blocked layout holds a row, and
where blocks end in a buffer of bounded rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["group_bounds", "search", "segment_of"]


def search(sorted_values, queries, side: str = "right"):
    """jnp.searchsorted(sorted_values, queries, side=side) for a 1-D ascending sorted_values
    [S] and queries of any shape: i32 like queries.

    An unrolled binary search: log2(S) steps of straight-line XLA ops, which fuse. JAX's
    default ("scan") is a while loop, and on XLA:CPU each of its iterations is a few runtime
    thunks: 512 queries into 4 offsets take about 3x as long, 100,000 into 256 about 2.7x
    (one CPU device, jax 0.11.2; benchmarks/RESULTS.md).
    """
    return jnp.searchsorted(sorted_values, queries, side=side,
                            method="scan_unrolled").astype(jnp.int32)


def segment_of(starts, positions):
    """The segment holding each position, given the ascending start offsets i32[S] of S
    consecutive segments (empty ones allowed): i32 like positions, in [0, S). A position
    past the last segment's end gets the last segment, whose bounds the caller checks."""
    return jnp.clip(search(starts, positions) - 1, 0, starts.shape[0] - 1)


def group_bounds(group_sizes, num_rows):
    """(starts i32[G], ends i32[G]) of consecutive groups of group_sizes rows (integers of any
    dtype; negative sizes count as 0) in a buffer of num_rows rows (a static int in
    [0, 2^31 - 1]), cut there. The running sum saturates at num_rows, so no sum of sizes can
    overflow int32 ([2^31 - 1, 1] in 10 rows ends at [10, 10])."""
    cap = jnp.uint32(num_rows)
    if jnp.dtype(group_sizes.dtype).itemsize < 4:  # num_rows may not fit int8 / int16 / ...
        group_sizes = group_sizes.astype(jnp.int32)
    # each term <= num_rows < 2^31, so a + b fits in uint32 before the cut
    terms = jnp.clip(group_sizes, 0, num_rows).astype(jnp.uint32)
    ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, cap), terms).astype(
        jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends
