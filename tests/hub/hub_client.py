"""One Hub client operation in a fresh process, for tests/hub: ``huggingface_hub`` reads its endpoint and offline
switch at import (../shared/reference/HUB.md §1), and the test process has imported it already, pointed away.

    python hub_client.py OUT.json push DIR REPO [--revision R] [--tag T ...] [--results FILE]
    python hub_client.py OUT.json download REPO [--revision R]
    python hub_client.py OUT.json cli ARG ...        (compound's Typer app, as the ``compound`` script runs it)

First it installs an audit hook that refuses every connection and name lookup except 127.0.0.1, and records them.
OUT.json receives ``{"connects": [[host, port], ...], "refused": [...], "result": ..., "error": {"type",
"message"} | null, "exit_code": int | null}``.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

CONNECTS: list = []
REFUSED: list = []


def _guard(event: str, args: tuple) -> None:
    if event == "socket.connect" and isinstance(args[1], tuple):
        CONNECTS.append(list(args[1][:2]))
        host = args[1][0]
    elif event == "socket.getaddrinfo":
        host = args[0]
    else:
        return
    if host not in ("127.0.0.1", b"127.0.0.1"):
        REFUSED.append([event, str(host)])
        raise ConnectionRefusedError(f"tests/hub: refused {event} to {host!r}: only 127.0.0.1 is allowed")


def _push(argv: list[str]) -> dict:
    from huggingface_hub import HfApi

    from toolkit.hub import push

    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("repo")
    parser.add_argument("--revision")
    parser.add_argument("--tag", action="append", default=[])
    parser.add_argument("--results")
    args = parser.parse_args(argv)
    results = json.loads(Path(args.results).read_text()) if args.results else None
    out = push(HfApi(), args.directory, args.repo, revision=args.revision, tags=args.tag, results=results)
    return {"repo_url": out.repo_url, "commit_oid": out.commit_oid, "files": out.files}


def _download(argv: list[str]) -> dict:
    from huggingface_hub import snapshot_download

    parser = argparse.ArgumentParser()
    parser.add_argument("repo")
    parser.add_argument("--revision")
    args = parser.parse_args(argv)
    folder = Path(snapshot_download(args.repo, revision=args.revision))
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def main() -> int:
    sys.addaudithook(_guard)
    out_path, op, argv = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    report = {"result": None, "error": None, "exit_code": None}
    try:
        if op == "cli":
            from toolkit.cli import app

            try:
                app(argv, prog_name="compound")
            except SystemExit as stop:
                report["exit_code"] = stop.code if isinstance(stop.code, int) else 1
        else:
            report["result"] = {"push": _push, "download": _download}[op](argv)
    except Exception as err:  # reported to the test, which asserts on type and message
        report["error"] = {"type": type(err).__name__, "message": str(err),
                           "cause": type(err.__cause__).__name__ if err.__cause__ else None}
    out_path.write_text(json.dumps({**report, "connects": CONNECTS, "refused": REFUSED}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
