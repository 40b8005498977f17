"""One runner for every benchmark: ``python -m benchmarks NAME [ARGS]`` runs
``benchmarks/<group>/NAME.py`` as ``python -m benchmarks.<group>.NAME ARGS`` would (same argv,
same recorded ``command``); ``python -m benchmarks`` lists them by group with their first
docstring line. NAME may also be written ``group.name``.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GROUPS = ("claims", "perf", "soak")


def benchmarks() -> dict[str, tuple[str, str]]:
    """``{name: (group, first docstring line)}`` for every module of the groups. Read from the
    source, not imported: listing them must not pay for torch or Flower."""
    found: dict[str, tuple[str, str]] = {}
    for group in GROUPS:
        for path in sorted((HERE / group).glob("*.py")):
            if path.name.startswith("_"):
                continue
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            first = " ".join(doc.strip().split("\n\n")[0].split())
            found[path.stem] = (group, first if len(first) <= 90 else first[:87] + "...")
    return found


def listing(found: dict[str, tuple[str, str]]) -> str:
    lines = ["usage: python -m benchmarks NAME [ARGS]   (NAME --help: its options)", ""]
    for group in GROUPS:
        lines.append(f"{group}:")
        lines += [f"  {n:<18} {d}" for n, (g, d) in found.items() if g == group]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    found = benchmarks()
    if not args or args[0] in ("-h", "--help"):
        print(listing(found))
        return 0
    name = args[0].rsplit(".", 1)[-1]
    if name not in found or ("." in args[0] and args[0] != f"{found[name][0]}.{name}"):
        print(
            f"python -m benchmarks: unknown benchmark {args[0]!r}; valid: "
            + ", ".join(sorted(found)),
            file=sys.stderr,
        )
        return 2
    # As `python -m benchmarks.<group>.NAME`: argv[0] becomes the module's file, so its own
    # argparse and the recorded command (lib/provenance.py) are those of the direct form.
    sys.argv = [name, *args[1:]]
    runpy.run_module(f"benchmarks.{found[name][0]}.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
