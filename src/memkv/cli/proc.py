"""Finding a running node's command line in /proc (for `memkv health`)."""

from __future__ import annotations

# How many children of an init process (`docker run --init`: PID 1 is tini) are searched.
_MAX_CHILDREN = 16


def serve_argv(pid: int) -> tuple[int, list[str]] | None:
    """(the process, its arguments from `serve` on) of the `memkv serve` that process `pid` runs,
    or one of its children when it is an init process; None when neither runs `memkv serve`."""
    candidates = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            candidates += [int(c) for c in f.read().split()[:_MAX_CHILDREN]]
    except OSError:
        pass
    for candidate in candidates:
        try:
            with open(f"/proc/{candidate}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        # `memkv serve ...` (the console script) or `python -m memkv serve ...`
        for i, word in enumerate(argv[:-1]):
            if word == "serve" and (argv[i - 1].endswith("memkv") if i else False):
                return candidate, argv[i:]
    return None
