"""python -m hubdouble generate|serve|manifest (run with PYTHONPATH=<repo>/tests, or from inside tests/)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from hubdouble.repo import generate, index_repo
from hubdouble.server import serve

MIB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hubdouble", description="A TEST DOUBLE of the Hugging Face Hub.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="write a synthetic safetensors model repo")
    gen.add_argument("--out", required=True)
    gen.add_argument("--shards", type=int, default=4, help="number of shards")
    gen.add_argument("--shard-kib", type=int, default=1024, help="tensor bytes per shard, in KiB")
    gen.add_argument("--big-shards", type=int, default=1,
                     help="how many of the shards (the first ones) are big instead (resume needs > 10 MiB)")
    gen.add_argument("--big-kib", type=int, default=12 * 1024)
    srv = sub.add_parser("serve", help="serve a directory as one model repo")
    srv.add_argument("--root", required=True)
    srv.add_argument("--repo", required=True, help="org/name")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8080)
    srv.add_argument("--cdn-port", type=int, default=0, help="port of the LFS 'CDN' origin (0: any free port)")
    srv.add_argument("--token-env", help="require this env var's value as the bearer token")
    srv.add_argument("--drop-once", action="append", default=[], metavar="FILE:BYTES",
                     help="cut the first GET of FILE after BYTES body bytes (repeatable)")
    srv.add_argument("--rate", type=int, help="cap each response at this many bytes/s")
    srv.add_argument("--link-rate", type=int, help="cap all responses together at this many bytes/s (one link)")
    srv.add_argument("--no-redirect", action="store_true", help="serve LFS files in place instead of a 302")
    srv.add_argument("--log", help="append one JSON line per request to this file")
    srv.add_argument("--alias", action="append", default=["main"], help="revision names for the commit")
    man = sub.add_parser("manifest", help="print the repo's commit and per-file hub metadata as JSON")
    man.add_argument("--root", required=True)
    args = parser.parse_args(argv)

    if args.cmd == "generate":
        sizes = [args.big_kib * 1024] * args.big_shards + [args.shard_kib * 1024] * (args.shards - args.big_shards)
        index = generate(args.out, sizes)
        print(json.dumps({"commit": index.commit, "files": len(index.files), "bytes": index.total_size}))
    elif args.cmd == "manifest":
        index = index_repo(args.root)
        print(json.dumps({"commit": index.commit, "files": {p: vars(f) for p, f in index.files.items()}}, indent=1))
    else:
        token = os.environ[args.token_env] if args.token_env else None
        drops = {}
        for item in args.drop_once:
            name, _, count = item.rpartition(":")
            drops[name] = int(count)
        serve(args.root, args.repo, host=args.host, port=args.port, cdn_port=args.cdn_port, token=token,
              drop_once=drops, rate=args.rate, link_rate=args.link_rate, redirect_lfs=not args.no_redirect,
              log_path=args.log, aliases=tuple(args.alias))
    return 0


if __name__ == "__main__":
    sys.exit(main())
