"""``kvtune dashboard``: serve optuna-dashboard on a study database, on localhost."""

from __future__ import annotations

import argparse

from kvtune.studies.names import DEFAULT_STORAGE
from kvtune.tuner.dashboard import DEFAULT_PORT, DashboardServer, study_url

NAME = "dashboard"
HELP = "serve optuna-dashboard on the study database at http://127.0.0.1:PORT (read-only by default)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage", default=DEFAULT_STORAGE, help=f"study database URL (default {DEFAULT_STORAGE})"
    )
    parser.add_argument("--study", help="print the link to this study's page (checked to exist)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"local port (default {DEFAULT_PORT})")
    parser.add_argument(
        "--writable", action="store_true", help="allow the web page to write (notes, deletes)"
    )


def run(args: argparse.Namespace) -> int:
    server = DashboardServer(args.storage, port=args.port, writable=args.writable)
    try:
        url = study_url(server.url, args.storage, args.study) if args.study else server.url
        print(f"kvtune: dashboard at {url} (Ctrl-C stops it)", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        print("kvtune: dashboard stopped")
    finally:
        server.stop()
    return 0
