"""`wt`: command-line entry point.

`wt backends` lists installed backends. `wt demo [...]` (train a tiny Llama,
sync it into a live vLLM after every step) and `wt bench [...]` run the
applications of the `wt-tools` distribution when it is installed.
"""

from __future__ import annotations

import argparse
import sys

from weight_transfer.factory import list_backends


def _backends() -> int:
    found = list_backends()
    names = sorted(set(found["trainer"]) | set(found["engine"]))
    if not names:
        print("no weight transfer backends installed (try: pip install wt-nccl)")
        return 0
    print(f"{'backend':<16} {'trainer':<28} {'engine':<28}")
    for name in names:
        cells = []
        for kind in ("trainer", "engine"):
            info = found[kind].get(name)
            if info is None:
                cells.append("-")
            elif info.distribution:
                cells.append(f"{info.distribution} {info.version}")
            else:
                cells.append("registered in-process")
        print(f"{name:<16} {cells[0]:<28} {cells[1]:<28}")
    return 0


TOOLS = {
    "demo": "train a tiny Llama, sync it into vLLM after every step, verify",
    "bench": "time syncs into a live vLLM against its own reload and save-and-reload",
}


def _run_tool(name: str, argv: list[str]) -> int:
    import importlib

    try:
        module = importlib.import_module(f"wt_tools.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("wt_tools", f"wt_tools.{name}"):
            raise
        print(
            f"wt {name} is part of the wt-tools distribution: pip install wt-tools", file=sys.stderr
        )
        return 2
    result: int = module.main(argv)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list installed backends and their distributions")
    for name, what in TOOLS.items():
        sub.add_parser(name, help=f"{what} (needs wt-tools)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command in TOOLS:
        return _run_tool(args.command, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "backends":
        return _backends()
    return 2


if __name__ == "__main__":
    sys.exit(main())
