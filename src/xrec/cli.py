"""`xrec` command line: serve | recommend | batch | make-model | catalog | bench | sid | train |
eval | demo. Heavy imports stay inside commands."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING, Sequence

from xrec.config import MODEL_SIZES, EngineOptions
from xrec.config.engine import add_catalog_flags, check_catalog_flags, parse_generation_prefix
from xrec.demo import model_dir_or_demo

if TYPE_CHECKING:
    import numpy as np


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the bench command parses its own arguments, --help included
        from xrec.bench.cli import main as bench_main
        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args) or 0
    except (ValueError, OSError) as e:
        print(f"xrec {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:   # Ctrl-C: one line, not a traceback, and how to go on
        hint = getattr(args, "interrupted_hint", None)
        print(f"xrec {args.command}: interrupted{hint(args) if hint else ''}", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xrec", description="Serve OneRec-style generative "
                                     "recommendation models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    make = sub.add_parser("make-model", help="write a random model directory of a named size")
    make.add_argument("--size", choices=sorted(MODEL_SIZES), default="onerec-0.015b")
    make.add_argument("--out", required=True, help="directory to write")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--items", type=int, default=100_000, help="random catalog size (0: none)")
    make.set_defaults(run=_make_model)

    rec = sub.add_parser("recommend", help="run one request and print the recommended items")
    rec.add_argument("--model", help="model directory (default: the built-in demo model)")
    add_catalog_flags(rec)
    source = rec.add_mutually_exclusive_group()
    source.add_argument("--token-ids", help="comma-separated input token ids, e.g. 1,2,3")
    source.add_argument("--embedding", help=".npy file holding a [L, d_model] float32 array")
    source.add_argument("--prompt", help="prompt text (models with a tokenizer.json)")
    source.add_argument("--chat", help="one user chat message (models with a chat template)")
    rec.add_argument("--generation-prefix", type=parse_generation_prefix, help="decoder-only models: appended to "
                     "the prompt, text or a JSON list of ids (OpenOneRec: '<|sid_begin|>')")
    rec.add_argument("--beam-width", type=int, default=128)
    rec.add_argument("--top-n", type=int, default=10, help="rows to print")
    rec.add_argument("--normalize", choices=("allowed", "full"), default="allowed")
    filters = rec.add_argument_group("filters (models with a catalog; docs/beam-search.md)")
    filters.add_argument("--exclude-items", help="comma-separated catalog item ids never to "
                         "recommend, e.g. 1,2,3 (a negative first id after '=': "
                         "--exclude-items=-5,3)")
    filters.add_argument("--item-types", help="comma-separated item types to recommend only "
                         "(extended catalogs), e.g. video,live")
    filters.add_argument("--exclude-history", action="store_true", help="decoder-only models: "
                         "exclude the items the prompt or chat names")
    rec.add_argument("--device", default="auto")
    rec.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rec.set_defaults(run=_recommend)

    serve = sub.add_parser("serve", help="serve a model over HTTP (default: the demo model)")
    serve.add_argument("--model", help="model directory (default: the built-in demo model)")
    add_catalog_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0-65535; 0: any free port (not with "
                       "--ray) (default 8000)")
    serve.add_argument("--api-key", help="bearer token required on every route but /health "
                       "(default: $XREC_API_KEY; none when unset; an empty key is refused)")
    serve.add_argument("--served-model-name", help="model name in the API (default: the directory's)")
    serve.add_argument("--max-body-bytes", type=int, default=None, help="default: the size of "
                       "the largest valid request for the model (35 MiB for onerec-0.015b)")
    serve.add_argument("--grace-s", type=float, default=30.0, help="drain time on SIGTERM, in seconds "
                       "(default 30, at most 86400)")
    serve.add_argument("--catalog-dir", help="turn catalog loads (POST /v1/admin/catalog) on: "
                       "they may read regular files under this directory only (default: off)")
    serve.add_argument("--max-catalog-bytes", type=int, default=None,
                       help="largest catalog file read from --catalog or a load (default 4 GiB)")
    limits = serve.add_argument_group("connection limits (README, \"Limits and hostile clients\")")
    limits.add_argument("--max-header-bytes", type=int, default=None,
                        help="request line + headers, else 431 (default 16384)")
    limits.add_argument("--header-timeout-s", type=float, default=None,
                        help="from a request's first byte to the end of its head, else 408 "
                        "(default 10)")
    limits.add_argument("--body-timeout-s", type=float, default=None,
                        help="from the end of the head to the end of the body, else 408; "
                        "also how long an answer may wait for a client that reads none of "
                        "it, else the connection is aborted (default 60)")
    limits.add_argument("--keep-alive-s", type=float, default=None,
                        help="an idle connection is closed after this long (default 5)")
    limits.add_argument("--max-connections", type=int, default=None,
                        help="open connections; above it 503 and closed (default 1024)")
    EngineOptions.add_cli_args(serve)
    from xrec.scale.cli import add_batch_parser, add_serve_ray_flags   # no torch, no ray
    add_serve_ray_flags(serve)
    serve.set_defaults(run=_serve)

    from xrec.catalog.cli import add_catalog_parser
    add_catalog_parser(sub)
    add_batch_parser(sub)
    # the real-data path (`pip install xrec[train]`); the serving path never imports it
    from xrec.realdata.movielens import add_demo_parser
    from xrec.realdata.evaluate.cli import add_eval_parser
    from xrec.realdata.sid.cli import add_sid_parser
    from xrec.realdata.train.cli import add_train_parser
    add_sid_parser(sub)
    add_train_parser(sub)
    add_eval_parser(sub)
    add_demo_parser(sub)

    # listed for --help; main() hands `xrec bench ...` to the bench command's own parser
    sub.add_parser("bench", help="benchmarks: offline | scaling | breakdown | roofline | serve | "
                   "embedded | batch | contention (docs/benchmarks.md)")
    for p in (make, rec, serve):
        p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return parser



def _make_model(args: argparse.Namespace) -> int:
    from xrec.demo import write_random_model
    out = write_random_model(args.out, args.size, args.seed, args.items, progress=True)
    print(f"wrote {args.size} (seed {args.seed}, {args.items} items) to {out}")
    return 0


def _recommend(args: argparse.Namespace) -> int:
    from xrec import Engine, RecRequest
    from xrec.errors import XrecError

    check_catalog_flags(args.catalog, args.catalog_extended)
    if args.top_n < 0:   # a negative slice would print all rows but the last ones
        raise ValueError(f"--top-n: got {args.top_n}, expected rows to print >= 0")
    model_dir = model_dir_or_demo(args.model)
    search = dict(beam_width=args.beam_width, normalize=args.normalize,
                  exclude_items=_int_list("--exclude-items", args.exclude_items),
                  item_types=None if args.item_types is None else
                  [t.strip() for t in args.item_types.split(",") if t.strip()],
                  exclude_history=args.exclude_history)
    if args.embedding is not None:
        request = RecRequest(sparse_embedding=_npy_array(args.embedding), **search)
    elif args.prompt is not None:
        request = RecRequest(prompt=args.prompt, **search)
    elif args.chat is not None:
        request = RecRequest(messages=[{"role": "user", "content": args.chat}], **search)
    else:
        given = "1,2,3" if args.token_ids is None else args.token_ids   # "" is no ids, refused
        request = RecRequest(token_ids=_int_list("--token-ids", given), **search)
    with Engine.from_pretrained(model_dir, isolation="thread", catalog=args.catalog,
                                catalog_extended=args.catalog_extended, device=args.device,
                                generation_prefix=args.generation_prefix) as engine:
        try:
            response = engine.recommend([request])[0]
        except XrecError as e:
            print(f"xrec recommend: {e.code}: {e}", file=sys.stderr)
            return 1
    rows = response.results[:args.top_n]
    if args.json:
        print(json.dumps([{"tokens": list(r.tokens), "text": r.text, "score": r.score,
                           "items": [i.item_id for i in r.items]} for r in rows]))
        return 0
    unknown = response.usage.get("excluded_items_unknown")
    excluded = "" if unknown is None else f", {unknown} excluded ids not in the catalog"
    print(f"model {model_dir}: {len(response.results)} results in {response.timing['run_ms']:.1f} ms "
          f"(beam width {request.beam_width}{excluded}); best {len(rows)}:")
    print(f"{'rank':>4}  {'semantic id':<20} {'score':>9}  {'round log-probs':<26} items")
    for rank, r in enumerate(rows, 1):
        ids = ", ".join(str(i.item_id) for i in r.items[:3]) + (" ..." if len(r.items) > 3 else "")
        lps = " ".join(f"{x:7.3f}" for x in r.token_logprobs)
        sid = r.text or str(r.tokens)
        print(f"{rank:>4}  {sid:<20} {r.score:>9.4f}  {lps:<26} {ids}")
    return 0


def _npy_array(path: str) -> np.ndarray:
    """`--embedding`'s array, read as a .npy file (np.load also returns an .npz archive's
    mapping, and unpickles any other file: "contains pickled data")."""
    import numpy as np

    try:
        with open(path, "rb") as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    except ValueError as e:   # the magic string, a short header, object arrays
        raise ValueError(f"--embedding {path}: not a .npy file ({e})") from None
    except OSError as e:
        raise OSError(f"--embedding {path}: {e.strerror or e}") from None


def _int_list(flag: str, text: str | None) -> list[int] | None:
    """Comma-separated integers ("1,2,3") as a list; None stays None."""
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def _serve(args: argparse.Namespace) -> int:
    _check_serve_args(args)
    if args.ray:   # the same app, one Engine per Ray Serve replica (xrec.scale.serve_app)
        from xrec.scale.cli import run_serve_ray
        return run_serve_ray(args, model_dir_or_demo(args.model),
                             EngineOptions.kwargs_from_cli(args))
    from xrec.server.run import serve
    return serve(args, model_dir_or_demo(args.model), EngineOptions.kwargs_from_cli(args),
                 owns_process=True)


def _check_serve_args(args: argparse.Namespace) -> None:
    """What `xrec serve` checks before loading anything: the port, the engine options (else
    the server listened, answered /health 503, then stopped when the load refused them),
    the flags --ray cannot take (without --ray: the flags only --ray takes), and the
    --catalog file (a regular file of at most --max-catalog-bytes: a FIFO would block the
    load, /dev/zero would never end it; --catalog-extended only with it)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: got {args.port}, port must be 0–65535")
    EngineOptions.from_kwargs(**EngineOptions.kwargs_from_cli(args))
    from xrec.scale.cli import check_serve_ray_args
    check_serve_ray_args(args)
    from xrec.server.admin import DEFAULT_MAX_CATALOG_BYTES
    from xrec.utils.files import FileRefused, check_regular_file
    max_bytes = args.max_catalog_bytes
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"--max-catalog-bytes: got {max_bytes}, expected >= 1")
    check_catalog_flags(args.catalog, args.catalog_extended)
    if args.catalog is not None:  # the catalog reader checks it again when it reads
        try:
            check_regular_file(args.catalog, max_bytes or DEFAULT_MAX_CATALOG_BYTES)
        except FileRefused as e:
            raise ValueError(f"--catalog {args.catalog}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
