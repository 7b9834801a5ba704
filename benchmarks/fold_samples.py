"""Sum a sampling profile of ``benchmarks/sample_calls.py`` by function: where one eager call's host time goes.

    python benchmarks/fold_samples.py calls.txt [--under timed_call] [--top 40]

The input is py-spy's ``--format raw`` (one line per distinct stack, ``frame;frame;...;frame count``, the
outermost frame first). Only the samples taken inside a call count: stacks through a frame named ``--under``
(by default ``timed_call``, the function of ``sample_calls.py`` around each call; the outermost such frame; a
qualified name counts by its last part). The syncs between bursts are left out. Prints each function's
inclusive share of those samples (a function counted once per stack), then the innermost frames' own shares
(a Python frame with its line: the statement running, C calls included), then the call's direct children.
"""

from __future__ import annotations

import argparse
import collections
import re

_FRAME = re.compile(r"^(?P<name>.*?) \((?P<where>[^()]*)\)$")


def frame_label(frame: str, line: bool = False) -> str:
    """``name (folder/file)``: a Python frame's function and the last two parts of its file's path (so that
    ``cuep/buffer.py`` and ``cuep/torch/buffer.py`` stay apart; with ``line``, its line too), or a native
    frame's symbol and library."""
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    where = match["where"]
    if not line and re.search(r":\d+$", where):
        where = where.rsplit(":", 1)[0]
    return f"{match['name']} ({'/'.join(where.split('/')[-2:])})"


def fold(lines, under: str) -> tuple[int, collections.Counter, collections.Counter, collections.Counter]:
    """``(samples inside calls, inclusive counts, leaf counts, counts of the call's direct children)``."""
    total, inclusive, leaves, children = 0, collections.Counter(), collections.Counter(), collections.Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        raw = stack.split(";")
        frames = [frame_label(f) for f in raw]
        named = [i for i, f in enumerate(frames) if f.split(" (")[0].rsplit(".", 1)[-1] == under]
        if not named:
            continue
        start = named[0]  # the outermost frame named `under`: the benchmark's, not one inside the call
        inside = frames[start + 1:]
        samples = int(count)
        total += samples
        for label in set(inside):
            inclusive[label] += samples
        leaves[frame_label(raw[-1], line=True)] += samples  # the statement running, where Python tells it
        children[inside[0] if inside else "(the closure itself)"] += samples
    return total, inclusive, leaves, children


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", help="py-spy --format raw output")
    parser.add_argument("--under", default="timed_call", help="the frame name around each call (its last part)")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    with open(args.raw) as source:
        total, inclusive, leaves, children = fold(source, args.under)
    if not total:
        raise SystemExit(f"fold_samples.py: no sample under a frame named {args.under!r}")
    for title, counter in (("inclusive", inclusive), ("own (leaf)", leaves), ("the call's children", children)):
        print(f"{title}: share of {total} samples inside calls")
        for label, samples in counter.most_common(args.top):
            print(f"  {samples / total:6.1%}  {label}")


if __name__ == "__main__":
    main()
