"""MaxText's RoutedMoE as a peer for bench_moe --peer maxtext (not a test dependency).

MaxText needs Python >= 3.12. Install it without its training stack:
`pip install --no-deps maxtext` plus the packages `maxtext.layers.moe` imports (the list is in
benchmarks/RESULTS.md); no TensorFlow is needed. `missing()` says what is absent.
"""

from __future__ import annotations

import sys


def missing() -> str:
    """'' when MaxText's MoE layer imports here, else why not (one line)."""
    if sys.version_info < (3, 12):
        return (f"maxtext needs Python >= 3.12, this is {sys.version.split()[0]} "
                "(see benchmarks/RESULTS.md for the install)")
    try:
        import maxtext.layers.moe  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- any failed import of a peer skips it
        return f"maxtext.layers.moe does not import: {type(e).__name__}: {e}"
    return ""
