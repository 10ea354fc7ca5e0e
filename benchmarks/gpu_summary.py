"""The line ``benchmarks/gpu_check.sh`` writes to RESULTS.md, from its verbose pytest logs.

    python benchmarks/gpu_summary.py --gpu "NVIDIA H200" --commit abc1234 LOG [LOG ...]

Each test's last outcome is read from the ``-v`` lines themselves (``[gw3] [ 40%] PASSED
tests/...`` under xdist, ``tests/... PASSED [ 40%]`` without), so a run cut off before its
summary still counts what it finished and names what failed. Prints the line
``GPU suite: N passed, F failed, M skipped on NVIDIA <name> (commit <sha>)``, then one
failing test per line, then a note when a log has no final summary (the run was cut off).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

_XDIST = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) "
                    r"(tests/.+?)\s*$")
_PLAIN = re.compile(r"^(tests/\S+::.+?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_SHORT = re.compile(r"^(FAILED|ERROR) (tests/.+?)(?: - .*)?$")
_SUMMARY = re.compile(r"^=+ .*\d+ (passed|failed|skipped|error).* in [\d.]+s")


def outcomes(text: str) -> tuple[dict[str, str], bool]:
    """Each test's last outcome in a log, and whether the log has pytest's final summary."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        if match := _XDIST.match(line):
            found[match[2]] = match[1]
        elif match := _PLAIN.match(line):
            found[match[1]] = match[2]
        elif match := _SHORT.match(line):
            found[match[2].rstrip(":")] = match[1]
    finished = any(_SUMMARY.match(line) for line in text.splitlines()) \
        and "KeyboardInterrupt" not in text  # a summary printed when stopped by SIGINT
    return found, finished


def collected(text: str) -> int | None:
    """How many tests the run collected (``15 workers [1490 items]``, ``collected 20 items``)."""
    match = re.search(r"\[(\d+) items?\]|collected (\d+) items?", text)
    return None if match is None else int(match[1] or match[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("logs", nargs="+", type=Path)
    args = parser.parse_args()
    everything: dict[str, str] = {}
    cut: list[str] = []
    for log in args.logs:
        text = log.read_text(errors="replace")
        found, finished = outcomes(text)
        everything.update(found)
        if not finished:
            total = collected(text)
            cut.append(log.name if total is None else
                       f"{log.name}: {total - len(found)} of its {total} tests did not finish")
    counts = {kind: sum(1 for v in everything.values() if v == kind)
              for kind in ("PASSED", "FAILED", "SKIPPED", "ERROR")}
    name = args.gpu.removeprefix("NVIDIA ").strip()
    print(f"GPU suite: {counts['PASSED']} passed, {counts['FAILED'] + counts['ERROR']} failed, "
          f"{counts['SKIPPED']} skipped on NVIDIA {name} (commit {args.commit})")
    for test, outcome in sorted(everything.items()):
        if outcome in ("FAILED", "ERROR"):
            print(f"{outcome} {test}")
    for log in cut:
        print(f"({log}; the run was cut off: counted what it finished)")


if __name__ == "__main__":
    main()
