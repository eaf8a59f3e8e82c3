#!/usr/bin/env python3
"""Materialise the Tandoor model zoo into ${TANDOOR_CACHE:-~/.cache/tandoor}/models and print
"name<TAB>path" per model. Cached files are reused; exports log one line each to stderr.

    .venv/bin/python scripts/fetch-models.py                 # everything
    .venv/bin/python scripts/fetch-models.py resnet18 labels # just these
"""

import argparse
import importlib.util
import sys
from pathlib import Path

try:
    from tandoor_zoo import models as zoo
except ImportError:  # run from a checkout without `pip install -e`
    _spec = importlib.util.spec_from_file_location(
        "tandoor_zoo_models", Path(__file__).resolve().parent.parent / "zoo" / "models.py")
    zoo = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(zoo)

MODELS = {
    **zoo.ALL_CNNS,
    "with_unsupported_middle": zoo.with_unsupported_middle,
    "dynamic_batch": zoo.dynamic_batch,
    "unsupported_op": zoo.unsupported_op,
    "labels": zoo.imagenet_labels,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"any of: {', '.join(MODELS)} (default: all)")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s): {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    for name in args.names or MODELS:
        print(f"{name}\t{MODELS[name]()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
