"""What every `memkv` command shares: exit codes, the usage error, failure and JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad argument found after parsing (a key too long, an unreadable file): exit 2."""


def fail(args: argparse.Namespace, code: int, message: str) -> int:
    print(f"memkv: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print_json({"ok": False, "error": message, "exit_code": code})
    return code


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False), flush=True)


def fmt_host(host: str) -> str:
    """A host as it goes before `:port` (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host
