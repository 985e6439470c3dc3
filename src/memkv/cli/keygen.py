"""`memkv keygen`: print a new auth key."""

from __future__ import annotations

import argparse
import secrets

from memkv.cli.common import EXIT_OK, print_json


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    k = sub.add_parser("keygen", help="print a new auth key (64 hex characters)")
    k.add_argument("--json", action="store_true", help='print {"auth_key": ...}')
    k.set_defaults(func=cmd_keygen)


def cmd_keygen(args: argparse.Namespace) -> int:
    key_hex = secrets.token_hex(32)
    if args.json:
        print_json({"ok": True, "auth_key": key_hex})
    else:
        print(key_hex)
    return EXIT_OK
