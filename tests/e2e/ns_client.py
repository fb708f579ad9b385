"""A client run inside a network namespace, for tests whose own process cannot reach it.

``python -m tests.e2e.ns_client get URL``: prints the body of a GET (e.g. ``/metrics``).
``python -m tests.e2e.ns_client stream URL BODY``: POSTs the JSON ``BODY`` to an OpenAI
streaming endpoint and prints every SSE ``data:`` payload as one JSON line as it arrives,
then ``{"done": true}`` for ``[DONE]``; an HTTP error is one line ``{"http_error": code,
"body": ...}``, a broken connection ``{"exception": ...}``. Lines carry ``"t"``: this
process's monotonic clock when the payload arrived. Every read has ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request


def _emit(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps({**obj, "t": time.monotonic()}) + "\n")
    sys.stdout.flush()


def stream(url: str, body: str, timeout_s: float) -> int:
    req = urllib.request.Request(
        url, data=body.encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    _emit({"done": True})
                    return 0
                if line.startswith("data: "):
                    _emit({"data": json.loads(line[6:])})
    except urllib.error.HTTPError as e:
        _emit({"http_error": e.code, "body": e.read().decode(errors="replace")})
        return 1
    except OSError as e:  # a timeout or a connection the gateway dropped
        _emit({"exception": repr(e)})
        return 1
    _emit({"exception": "the stream ended without [DONE]"})
    return 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("get", "stream"))
    parser.add_argument("url")
    parser.add_argument("body", nargs="?", default="")
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    if args.command == "get":
        with urllib.request.urlopen(args.url, timeout=args.timeout) as r:
            sys.stdout.write(r.read().decode())
        return 0
    return stream(args.url, args.body, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
