"""`xrec catalog import`: write a model directory's binary catalog from a project's item index.

    xrec catalog import --model DIR --format {sid2pid,json,csv} INPUT [--out FILE]
                        [--codebook-size N]

Without `--out` it writes `DIR/catalog.bin` and names it in
`DIR/tokenizer_config.json` (`"item_catalog"`, other keys kept); with `--out`
it writes only FILE, to be served with `--catalog FILE`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from xrec.utils.files import write_file_atomically

__all__ = ["CATALOG_FILE", "FORMATS", "add_catalog_parser", "import_catalog", "main",
           "run_catalog_import"]

CATALOG_FILE = "catalog.bin"
FORMATS = ("sid2pid", "json", "csv")


def add_catalog_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `catalog import` to the `xrec` command's subparsers; returns the `catalog` parser."""
    catalog = subparsers.add_parser("catalog", help="item catalogs: import one from a project's "
                                    "item index")
    actions = catalog.add_subparsers(dest="catalog_command", metavar="ACTION", required=True)
    imp = actions.add_parser(
        "import", help="write the binary catalog from sid2pid.json, a token map or a CSV",
        description="Maps each item's semantic-ID tokens to ids with the model's tokenizer and "
                    "writes xrec's binary catalog.")
    imp.add_argument("--model", required=True, help="model directory (with tokenizer.json and "
                     "config.json)")
    imp.add_argument("--format", required=True, choices=FORMATS,
                     help="sid2pid: OpenOneRec sid2pid.json; json: {item id: [tokens]}; "
                          "csv: item_id,token,token,token")
    imp.add_argument("input", help="the file to import")
    imp.add_argument("--out", help="write the catalog here and leave the model directory alone "
                     f"(default: MODEL/{CATALOG_FILE}, named in MODEL/tokenizer_config.json)")
    imp.add_argument("--codebook-size", type=int, default=8192,
                     help="sid2pid: codes per level in the keys (default 8192)")
    imp.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    imp.set_defaults(run=run_catalog_import)
    return catalog


def import_catalog(model_dir: str | os.PathLike, fmt: str, input_path: str | os.PathLike,
                   codebook_size: int = 8192):
    """The catalog of `input_path` in format `fmt`, through `model_dir`'s tokenizer."""
    from xrec.catalog.importers import import_sid2pid, import_token_csv, import_token_map
    from xrec.config import read_model_config
    from xrec.tokenizer import PromptTokenizer

    model_dir = Path(model_dir)
    if fmt not in FORMATS:
        raise ValueError(f"format: got {fmt!r}, allowed: {', '.join(FORMATS)}")
    vocab_size = read_model_config(model_dir / "config.json").vocab_size
    tokenizer = PromptTokenizer.from_model_dir(model_dir)
    if tokenizer is None:
        raise ValueError(f"no tokenizer.json in {model_dir}: the importer maps token strings "
                         f"to ids with the model's tokenizer")
    if fmt == "sid2pid":
        return import_sid2pid(input_path, tokenizer, vocab_size, codebook_size)
    if fmt == "json":
        return import_token_map(input_path, tokenizer, vocab_size)
    return import_token_csv(input_path, tokenizer, vocab_size)


def _name_catalog(model_dir: Path, catalog_file: str) -> None:
    """Sets "item_catalog" in tokenizer_config.json, other keys kept (written atomically)."""
    path = model_dir / "tokenizer_config.json"
    config = {}
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    config["item_catalog"] = catalog_file
    if config.get("extended_item_info"):
        config["extended_item_info"] = False  # the importer writes default records
    write_file_atomically(path, (json.dumps(config, indent=2, ensure_ascii=False) + "\n")
                          .encode("utf-8"))


def run_catalog_import(args: argparse.Namespace) -> int:
    """The `xrec catalog import` handler: 0 on success; errors are ValueError / OSError."""
    model_dir = Path(args.model)
    catalog = import_catalog(model_dir, args.format, args.input, args.codebook_size)
    if catalog.num_items == 0:   # it would be written and named, and the model then unservable
        raise ValueError(f"{args.input}: no items to import; nothing written")
    out = Path(args.out) if args.out else model_dir / CATALOG_FILE
    catalog.write(out)
    summary = (f"imported {catalog.num_items} items, {catalog.num_triples} distinct semantic "
               f"IDs -> {out}")
    if args.out:
        print(f"{summary}; serve with --catalog {out}")
    else:
        _name_catalog(model_dir, CATALOG_FILE)
        print(f"{summary} (tokenizer_config.json \"item_catalog\")")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m xrec.catalog.cli import ...`: the `xrec catalog` command on its own."""
    parser = argparse.ArgumentParser(prog="xrec")
    add_catalog_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["catalog", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.run(args)
    except (ValueError, OSError) as exc:
        print(f"xrec catalog: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
