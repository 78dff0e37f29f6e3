"""The coverage measures of the emulated-CUDA stage (.ci/emulated-cuda, .ci/emu-coverage).

    python .ci/emu_coverage.py launches LOG_PREFIX [--baseline PATH ...]
    python .ci/emu_coverage.py lines BASE_DIR [OTHER_DIR ...]

launches: the kernel launches a pytest run logged (tests/conftest.py writes one JSON line per
test to $JAX_EP_EMU_LAUNCH_LOG.<xdist worker> when that variable is set): each kernel template
instance with its launch count and how many tests launched it. With --baseline (test files or
folders as pytest names them, e.g. tests/test_permute.py tests/gpu/), the instances that only
the run's other tests launch: what those others add.

lines: the source lines of the CUDA handlers (xla_ffi/*.cu and the headers they include, the
emulator itself left out) that gcov counted as executed, from the `gcov -j` outputs
(*.gcov.json.gz) in each directory: how many BASE_DIR's run executed, and for each OTHER_DIR's
run the lines it executed that BASE_DIR's did not, by file.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def read_launch_log(prefix: str) -> dict[str, dict[str, int]]:
    """{test node id: {kernel instance: launches}} from every worker's file of the run."""
    per_test: dict[str, dict[str, int]] = {}
    paths = glob.glob(prefix + ".main") + glob.glob(prefix + ".gw[0-9]*")  # xdist: gw0, gw1, ...
    for path in sorted(paths):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                per_test[record["test"]] = record["launches"]
    return per_test


def summarise_launches(per_test: dict[str, dict[str, int]], baseline: list[str]) -> str:
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


def executed_lines(directory: str) -> tuple[set, set]:
    """(executed, instrumented) {(file, line)} of the handler sources in a gcov -j directory.
    A line of a template counts as executed if any instance ran it."""
    executed, instrumented = set(), set()
    for path in glob.glob(os.path.join(directory, "*.gcov.json.gz")):
        with gzip.open(path) as f:
            report = json.load(f)
        for source in report["files"]:
            name = source["file"]
            if "/xla_ffi/" not in name or "/xla_ffi/emu/" in name:
                continue
            short = name.split("/xla_ffi/", 1)[1]
            for line in source["lines"]:
                key = (short, line["line_number"])
                instrumented.add(key)
                if line["count"] > 0:
                    executed.add(key)
    return executed, instrumented


def summarise_lines(base_dir: str, others: list[str]) -> str:
    base, instrumented = executed_lines(base_dir)
    out = [f"{base_dir}: {len(base)} of {len(instrumented)} handler source lines executed"]
    for other in others:
        executed, _ = executed_lines(other)
        new = sorted(executed - base)
        out.append(f"{other}: {len(executed)} executed, {len(new)} not executed by {base_dir}")
        by_file = collections.defaultdict(list)
        for name, line in new:
            by_file[name].append(line)
        out += [f"    {name}: {lines}" for name, lines in sorted(by_file.items())]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="measure", required=True)
    launches = sub.add_parser("launches", help="kernel instances launched, from a launch log")
    launches.add_argument("log_prefix", help="the value of JAX_EP_EMU_LAUNCH_LOG in the run")
    launches.add_argument("--baseline", nargs="*", default=[],
                          help="test files or folders whose reach is the baseline")
    lines = sub.add_parser("lines", help="handler source lines executed, from gcov -j outputs")
    lines.add_argument("base_dir")
    lines.add_argument("others", nargs="*")
    args = parser.parse_args()
    if args.measure == "launches":
        print(summarise_launches(read_launch_log(args.log_prefix), args.baseline))
    else:
        print(summarise_lines(args.base_dir, args.others))


if __name__ == "__main__":
    main()
