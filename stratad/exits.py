"""How the command-line tools (stratad, stratactl) end: an expected error is one line `error: ...` on stderr and
its exit code, Ctrl-C is 130; anything else is a bug and keeps its traceback."""
from __future__ import annotations

import sys
from typing import Callable


def run(body: Callable[[], int], codes: dict[type[BaseException], int]) -> int:
    """body()'s exit code; an exception of one of codes' types gives that code (the first that matches)."""
    try:
        return body()
    except KeyboardInterrupt:
        return 130
    except tuple(codes) as e:
        print(f"error: {e}", file=sys.stderr)
        return next(code for t, code in codes.items() if isinstance(e, t))
