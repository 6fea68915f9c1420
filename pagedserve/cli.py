"""The `pagedserve` console script (DESIGN §4)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print("pagedserve: the CLI is not built yet (see the cluster issue)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
