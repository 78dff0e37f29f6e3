"""Summarises the emulated CUDA kernel launches that a pytest run logged (tests/conftest.py
writes one JSON line per test to $JAX_EP_EMU_LAUNCH_LOG.<worker> when that variable is set).

    python .ci/emu_launches.py LOG_PREFIX [--baseline FILE ...]

Prints each kernel instance with its launch count and how many tests launched it, and the
distinct instances in all. With --baseline (test files or folders, e.g. tests/test_permute.py
tests/gpu/), the instances that only the run's other tests launch: what those others add.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json


def read_log(prefix: str) -> dict[str, dict[str, int]]:
    """{test node id: {kernel instance: launches}} from every worker's file of the run."""
    per_test: dict[str, dict[str, int]] = {}
    for path in sorted(glob.glob(prefix + ".*")):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                per_test[record["test"]] = record["launches"]
    return per_test


def summarise(per_test: dict[str, dict[str, int]], baseline: list[str]) -> str:
    launches: collections.Counter = collections.Counter()
    tests_of: dict[str, set[str]] = collections.defaultdict(set)
    for test, counts in per_test.items():
        for instance, n in counts.items():
            launches[instance] += n
            tests_of[instance].add(test)
    lines = [f"{'kernel instance':<60} {'launches':>10} {'tests':>6}"]
    for instance in sorted(launches):
        lines.append(f"{instance:<60} {launches[instance]:>10} {len(tests_of[instance]):>6}")
    lines.append(f"{len(launches)} distinct kernel instances, {sum(launches.values())} launches, "
                 f"{len(per_test)} tests")
    if baseline:
        in_baseline = {i for i, tests in tests_of.items()
                       if any(t.startswith(tuple(baseline)) for t in tests)}
        only_elsewhere = sorted(set(launches) - in_baseline)
        lines.append(f"reached by the baseline files: {len(in_baseline)}; only by the others: "
                     f"{len(only_elsewhere)} {only_elsewhere}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_prefix", help="the value of JAX_EP_EMU_LAUNCH_LOG in the run")
    parser.add_argument("--baseline", nargs="*", default=[],
                        help="test files or folders (as pytest names them, e.g. tests/gpu/) "
                             "whose reach is the baseline")
    args = parser.parse_args()
    print(summarise(read_log(args.log_prefix), args.baseline))


if __name__ == "__main__":
    main()
