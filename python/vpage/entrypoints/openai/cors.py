"""Cross-origin requests (browsers): Starlette's CORSMiddleware with vLLM's flags and
defaults (``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``: JSON lists,
``["*"]`` by default; ``--allow-credentials``: off)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field


@dataclass
class CorsOptions:
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def add_cors(app, options: CorsOptions) -> None:
    """Answers preflight requests and adds the CORS headers to every response of ``app``."""
    from starlette.middleware.cors import CORSMiddleware  # not at import: the CLI parser reads this module

    app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins, allow_methods=options.allowed_methods,
                       allow_headers=options.allowed_headers, allow_credentials=options.allow_credentials)


def json_string_list(text: str) -> list[str]:
    """argparse type of the list flags: a JSON list of strings, e.g. '["https://a.example"]'."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def add_cors_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allowed-origins", type=json_string_list, default=["*"],
                        help='CORS: origins allowed to call the API, a JSON list (default: ["*"])')
    parser.add_argument("--allowed-methods", type=json_string_list, default=["*"],
                        help='CORS: allowed methods, a JSON list (default: ["*"])')
    parser.add_argument("--allowed-headers", type=json_string_list, default=["*"],
                        help='CORS: allowed request headers, a JSON list (default: ["*"])')
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: allow credentials (cookies, Authorization) in cross-origin requests")


def cors_options(args: argparse.Namespace) -> CorsOptions:
    return CorsOptions(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)
