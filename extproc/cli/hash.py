"""``extproc hash``: print a request's prompt block hashes, for compatibility checks.

Reads an OpenAI-style JSON body (a file or ``-`` for stdin), renders it as the router
does and prints one unsigned decimal hash per line, so the output can be compared with
another router's for the same request.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from extproc.cli import CLI_REFERENCE
from extproc.errors import BadRequest
from extproc.prefix.hashing import hash_prompt
from extproc.request.parse import Api, parse_request
from extproc.request.render import Rendering

DESCRIPTION = f"""\
Print the prefix-cache block hashes of a request body, one unsigned decimal a line, as
serve computes them: compare them with another router's for the same request.

Most common:
  extproc hash body.json                                   a chat completions body
  extproc hash --api /v1/completions - < body.json         a completions body, from stdin

Documentation: the site `make docs` builds from docs/ (docs/kthena-parity.md; every flag
in {CLI_REFERENCE})."""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "hash",
        help="print the prefix-cache block hashes of a request body",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("body", help="JSON request body file, or - for standard input")
    p.add_argument(
        "--api",
        choices=[a.value for a in Api],
        default=Api.CHAT_COMPLETIONS.value,
        help="the endpoint the body is for (default: %(default)s)",
    )
    p.add_argument(
        "--prompt-rendering",
        choices=[r.value for r in Rendering],
        default=Rendering.EXTENDED.value,
        help="where the prompt is read from, as serve's flag (default: %(default)s)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=64,
        help="bytes a block: blockSizeToHash (default: %(default)s bytes)",
    )
    p.add_argument(
        "--max-blocks",
        type=int,
        default=128,
        help="blocks hashed at most: maxBlocksToMatch (default: %(default)s blocks)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    body = sys.stdin.buffer.read() if args.body == "-" else Path(args.body).read_bytes()
    try:
        req = parse_request(args.api, body, rendering=Rendering(args.prompt_rendering))
    except BadRequest as exc:
        print(f"extproc hash: {exc.message}", file=sys.stderr)
        return 2
    for h in hash_prompt(req.model, req.prompt, args.block_size, args.max_blocks, req.cache_salt):
        print(h)
    return 0
