r"""`memkv get`, `put`, `del` and `ls`: small key tools for debugging a namespace, and how the
command line writes keys (`format_key`) and reads them (`parse_key`)."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from typing import TYPE_CHECKING

from memkv.cli.common import EXIT_FAILED, EXIT_OK, UsageError, print_json
from memkv.config import ClientConfig
from memkv.errors import AuthError, MemKVError

if TYPE_CHECKING:  # the client is imported when a command runs
    from memkv.client.cluster import Client


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser("get", help="print or save one value (exit 1 on a miss)")
    g.add_argument("key")
    g.add_argument("-o", "--output", help="write the value to this file (default: stdout)")
    g.add_argument(
        "--json",
        action="store_true",
        help="print the value's metadata as JSON (the value itself only goes to --output)",
    )
    g.set_defaults(func=cmd_get)
    pu = sub.add_parser("put", help="store one value from a file or stdin")
    pu.add_argument("key")
    pu.add_argument("file", help="path, or - for stdin")
    pu.add_argument("--json", action="store_true")
    pu.set_defaults(func=cmd_put)
    d = sub.add_parser("del", help="delete keys (exit 1 unless every key was deleted)")
    d.add_argument("keys", nargs="+")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_del)
    ls = sub.add_parser(
        "ls", help="list stored keys under a prefix, in byte order (exit 1 when none, or a server fails)"
    )
    ls.add_argument("prefix", nargs="?", default="", help="list keys starting with this (default: every key)")
    ls.add_argument("--limit", type=int, default=1000, help="list at most this many keys (1..4096, default 1000)")
    ls.add_argument("--json", action="store_true", help="print the keys, their sizes and servers as JSON")
    ls.set_defaults(func=cmd_ls)


def _client() -> Client:
    from memkv.client.cluster import Client

    return Client(ClientConfig.from_env())


_PLAIN_KEY_BYTES = frozenset(range(0x21, 0x7F)) - {0x5C}  # printable ASCII but space and backslash


def format_key(key: bytes) -> str:
    r"""A key as the CLI prints it: printable ASCII as is, a backslash as `\\`, every other
    byte (space, control, non-ASCII) as `\xNN`. One whitespace-free token that cannot
    drive the terminal, and `parse_key` turns it back into the same bytes."""
    if all(b in _PLAIN_KEY_BYTES for b in key):
        return key.decode("ascii")
    return "".join(chr(b) if b in _PLAIN_KEY_BYTES else "\\\\" if b == 0x5C else f"\\x{b:02x}" for b in key)


def parse_key(text: str) -> bytes:
    r"""A key argument as bytes: `\\` and `\xNN` are unescaped (what `format_key` writes),
    anything else is taken as typed (UTF-8; os.fsencode keeps the raw bytes of an argument
    that is not valid UTF-8). Raises UsageError on any other backslash sequence."""
    raw = os.fsencode(text)
    if b"\\" not in raw:
        return raw
    out = bytearray()
    i = 0
    while i < len(raw):
        b = raw[i]
        if b != 0x5C:
            out.append(b)
            i += 1
        elif raw[i + 1 : i + 2] == b"\\":
            out.append(0x5C)
            i += 2
        elif raw[i + 1 : i + 2] == b"x" and re.fullmatch(rb"[0-9a-fA-F]{2}", raw[i + 2 : i + 4]):
            out.append(int(raw[i + 2 : i + 4], 16))
            i += 4
        else:
            bad = raw[i : i + (4 if raw[i + 1 : i + 2] == b"x" else 2)].decode("utf-8", "backslashreplace")
            raise UsageError(f'bad escape "{bad}" in key "{text}": write a backslash as \\\\ and a byte as \\xNN')
    return bytes(out)


def _key_arg(text: str) -> bytes:
    from memkv.protocol import DEFAULT_MAX_KEY_BYTES

    key = parse_key(text)
    if not 0 < len(key) <= DEFAULT_MAX_KEY_BYTES:
        raise UsageError(f"a key must be 1..{DEFAULT_MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def _failure(server: str, exc: MemKVError) -> str:
    """What went wrong with `server`, worded by who is at fault: a node that answered but does
    not share our key is not unreachable."""
    if isinstance(exc, AuthError):
        return f"authentication failed on server {server}: {exc}"
    return f"server {server} unreachable: {exc}"


def _unreachable(client: Client, server: str) -> str | None:
    """Why `server` is marked down after a failed call, or None when it answered."""
    for h in client.health():
        if h["server"] == server and not h["up"]:
            return h["last_error"] or "unreachable"
    return None


def cmd_get(args: argparse.Namespace) -> int:
    key = _key_arg(args.key)
    present = down = None
    with _client() as client:
        server = client.owner(key).name
        value = client.get(key)
        if value is None:  # a miss reads like an unreachable node: ask the owner directly
            try:
                present = client.exists_on(server, [key])[0]
            except MemKVError as exc:
                down = _failure(server, exc)
    doc = {"ok": value is not None, "key": args.key, "server": server, "found": value is not None}
    if down:
        doc["error"] = down
    elif present:
        doc["error"] = "stored but not loaded (it failed its checksum, or changed while being read)"
    elif value is None:
        doc["error"] = "miss"
    else:
        doc.update({"bytes": len(value), "sha256": hashlib.sha256(value).hexdigest(), "output": args.output})
        if args.output:
            try:
                with open(args.output, "wb") as f:
                    f.write(value)
            except OSError as exc:
                raise UsageError(f"cannot write {args.output}: {exc.strerror}") from None
        elif not args.json:
            sys.stdout.buffer.write(value)
            sys.stdout.buffer.flush()
    if value is None:
        print(f"memkv: {args.key}: {doc['error']}", file=sys.stderr)
    if args.json:
        print_json(doc)
    return EXIT_OK if value is not None else EXIT_FAILED


def cmd_put(args: argparse.Namespace) -> int:
    key = _key_arg(args.key)
    try:
        if args.file == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(args.file, "rb") as f:
                data = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {args.file}: {exc.strerror}") from None
    if not data:
        raise UsageError("refusing to store an empty value")
    with _client() as client:
        server = client.owner(key).name
        try:
            client.put(key, data)
            error = None
        except MemKVError as exc:
            error = _failure(server, exc) if isinstance(exc, AuthError) else str(exc)
    doc = {"ok": error is None, "key": args.key, "server": server, "bytes": len(data)}
    if error:
        doc["error"] = error
        print(f"memkv: put failed: {error}", file=sys.stderr)
    if args.json:
        print_json(doc)
    elif not error:
        print(f"stored {len(data)} bytes under {args.key} on {server}")
    return EXIT_OK if error is None else EXIT_FAILED


def cmd_del(args: argparse.Namespace) -> int:
    keys = [_key_arg(k) for k in args.keys]
    with _client() as client:
        deleted = client.delete(keys)
        results = []
        for text, key, ok in zip(args.keys, keys, deleted):
            server = client.owner(key).name
            down = None if ok else _unreachable(client, server)
            result = "deleted" if ok else ("unreachable" if down else "missing")
            entry = {"key": text, "server": server, "result": result}
            if down:
                entry["error"] = down
            results.append(entry)
    ok = all(deleted)
    if args.json:
        print_json({"ok": ok, "keys": results})
    else:
        for r in results:
            print(f"{r['result']:<11}  {r['key']}" + (f"  ({r['server']}: {r['error']})" if "error" in r else ""))
    return EXIT_OK if ok else EXIT_FAILED


def cmd_ls(args: argparse.Namespace) -> int:
    from memkv.protocol import DEFAULT_MAX_KEY_BYTES, Limits

    prefix = parse_key(args.prefix)
    if len(prefix) > DEFAULT_MAX_KEY_BYTES:
        raise UsageError(f"a key prefix must be 0..{DEFAULT_MAX_KEY_BYTES} bytes, got {len(prefix)}")
    most = Limits().max_list_keys
    if not 1 <= args.limit <= most:
        raise UsageError(f"--limit must be 1..{most}, got {args.limit}")
    with _client() as client:
        servers = [s.name for s in client.servers()]
        listing = client.list_keys(prefix, args.limit)
    shown = format_key(prefix)
    errors = [f"server {name} did not answer: {why}" for name, why in listing.failed.items()]
    if not listing.keys and not errors:
        errors.append(f'no keys start with "{shown}"' if prefix else "no keys stored")
    if args.json:
        listed = {name: 0 for name in servers}
        for e in listing.keys:
            listed[e.server] = listed.get(e.server, 0) + 1
        doc = {
            "ok": not errors,
            "prefix": shown,
            "limit": args.limit,
            "count": len(listing.keys),
            "truncated": listing.truncated,
            "keys": [{"key": format_key(e.key), "bytes": e.length, "server": e.server} for e in listing.keys],
            "servers": [
                {"server": name, "ok": False, "error": listing.failed[name]}
                if name in listing.failed
                else {"server": name, "ok": True, "listed": listed.get(name, 0)}
                for name in servers
            ],
        }
        if errors:
            doc["error"] = "; ".join(errors)
        print_json(doc)
    else:
        names = [format_key(e.key) for e in listing.keys]
        width = max(map(len, names), default=0)
        for name, e in zip(names, listing.keys):
            print(f"{name:<{width}}  {e.length:>10}  {e.server}")
        sys.stdout.flush()
    if listing.truncated:
        print(
            f"memkv: listing stops at --limit {args.limit}: more keys match (narrow the prefix or raise --limit)",
            file=sys.stderr,
        )
    for error in errors:
        print(
            f"memkv: {error}" + ("; its keys are missing from this listing" if "did not answer" in error else ""),
            file=sys.stderr,
        )
    return EXIT_FAILED if errors else EXIT_OK
