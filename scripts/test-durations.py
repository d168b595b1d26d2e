#!/usr/bin/env python3
"""scripts/test-durations.py LOG... > tests/durations.txt

Reads the "slowest durations" lists that pytest printed in the logs (scripts/test.sh runs
pytest with --durations=0 --durations-min=1; its logs are in the directory its last line
names) and prints each test's seconds, its setup, call and teardown summed, the largest
over the logs, for the tests of a second or more: "seconds node-id" a line, longest first.
tests/conftest.py deals the tests out to the runs of a CI run by these weights; a test not
listed counts as short."""
import re
import sys

LINE = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown) +(\S+::\S.*?)\s*$")


def main(paths):
    if not paths:
        sys.exit(__doc__.strip())
    best = {}
    for path in paths:
        run = {}
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = LINE.match(line)
                if m:
                    run[m.group(2)] = run.get(m.group(2), 0.0) + float(m.group(1))
        for nodeid, sec in run.items():
            best[nodeid] = max(best.get(nodeid, 0.0), sec)
    print("# seconds node-id: tests/conftest.py's weights (scripts/test-durations.py)")
    for nodeid, sec in sorted(best.items(), key=lambda x: (-x[1], x[0])):
        if sec >= 1.0:
            print(f"{sec:.1f} {nodeid}")


if __name__ == "__main__":
    main(sys.argv[1:])
