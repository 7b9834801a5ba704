"""Compare the machine code (SASS) of every kernel with a saved baseline, for refactors that must not
change it. Needs ``cuobjdump`` (on the GPU image; or the ``nvidia-cuda-cuobjdump`` wheel), no GPU.

    python -m tests.sass save DIR      # disassemble every family, sm_90, three builds, into DIR
    python -m tests.sass compare DIR   # the same for the current tree, compared kernel by kernel

Kernel-parameter offsets (``c[0x0][0x...]``) are masked: an entry whose parameters moved but whose
instructions did not reads "same".
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"default": dict(force_fallback=False, aggressive_ptx=False),
            "fallback": dict(force_fallback=True, aggressive_ptx=False),
            "aggressive_ptx": dict(force_fallback=False, aggressive_ptx=True)}
_FUNCTION = re.compile(r"Function : (\S+)")
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
_PARAMETER = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")


def disassemble(cubin: bytes, cuobjdump: str) -> dict[str, list[str]]:
    """Each function's instructions, parameter offsets masked."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([cuobjdump, "-sass", file.name], capture_output=True, text=True, check=True).stdout
    functions: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if match := _FUNCTION.search(line):
            current = functions.setdefault(match.group(1), [])
        elif (match := _INSTRUCTION.match(line)) and current is not None:
            current.append(_PARAMETER.sub("c[0x0][P]", match.group(2)))
    return functions


def disassemble_all(cuobjdump: str) -> dict[str, list[str]]:
    from cuep.jit import compiler, toolchain
    from cuep.kernels import FAMILIES, family_builds
    code = {}
    # A family's other builds (the low-latency hooks') hold kernels of its names: keyed apart by the build's.
    builds = [(variant if name == family else f"{variant}/{name}", spec) for family in sorted(FAMILIES)
              for variant, features in VARIANTS.items()
              for name, spec in family_builds(family, "sm_90", **features).items()]
    for key, spec in builds:
        nvshmem = toolchain.nvshmem() if spec.uses_nvshmem else None
        cubin = compiler.compile_spec(compiler.compile_options(spec, nvshmem), nvshmem).cubin
        code.update({f"{key}/{name}": body for name, body in disassemble(cubin, cuobjdump).items()})
    return code


def compare(baseline: dict[str, list[str]], current: dict[str, list[str]]) -> list[str]:
    lines = []
    for name in sorted(baseline.keys() | current.keys()):
        before, after = baseline.get(name), current.get(name)
        if after is None:
            lines.append(f"{name}: gone")
        elif before is None:
            lines.append(f"{name}: new ({len(after)} instructions)")
        elif before == after:
            lines.append(f"{name}: same ({len(after)} instructions)")
        else:
            changed = [d for d in difflib.unified_diff(before, after, lineterm="", n=0)
                       if d[:1] in "+-" and d[:3] not in ("+++", "---")]
            lines.append(f"{name}: differs ({len(before)} -> {len(after)} instructions): " + " | ".join(changed[:6]))
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("save", "compare"):
        print(__doc__)
        return 2
    cuobjdump = os.environ.get("CUOBJDUMP", "cuobjdump")
    directory = Path(argv[1])
    current = disassemble_all(cuobjdump)
    if argv[0] == "save":
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "sass.json").write_text(json.dumps(current))
        print(f"{len(current)} functions saved to {directory}")
    else:
        print("\n".join(compare(json.loads((directory / "sass.json").read_text()), current)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
