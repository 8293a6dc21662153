"""`nanoserve serve`: the OpenAI-compatible server over the engine (the bundled model by default)."""

from __future__ import annotations

import argparse

from nanoserve.entrypoints.cli import add_engine_args
from nanoserve.tool_parsers import PARSERS

DESCRIPTION = """\
Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
/tokenize, /detokenize, /health, /ping, /version, /metrics, /openapi.json), and a chat and live
dashboard page at / (--no-web turns it off). The engine core runs in a child process. With no --model
it serves the bundled SmolLM2-135M-Instruct.

example:
  nanoserve serve --port 8000
  python -c 'from openai import OpenAI; c = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none"); \\
    print(c.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello").choices[0].text)'
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default=None, help="address to listen on (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=None, help="port to listen on (default: 8000)")
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on every /v1 route (default: $NANOSERVE_API_KEY, else none)",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients send and see (default: the model's own name)",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="larger request bodies get 413 (default: 4 MiB)",
    )
    group.add_argument(
        "--health-hang-timeout",
        type=float,
        default=None,
        help="seconds the engine may be silent with requests in flight before /health says 503 (default: 120)",
    )
    group.add_argument(
        "--shutdown-grace-period",
        type=float,
        default=None,
        help="seconds in-flight requests may take to finish after SIGTERM (default: 30)",
    )
    group.add_argument(
        "--exit-on-engine-death",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="exit with status 1 when the engine core dies, so a supervisor restarts the server (default: on)",
    )
    group.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None)
    group.add_argument(
        "--no-web",
        dest="web",
        action="store_false",
        default=None,
        help="no chat and dashboard page at / (nor its data endpoint)",
    )
    group.add_argument(
        "--root-path",
        default=None,
        help="the path prefix a reverse proxy serves this server under and strips, e.g. /nanoserve",
    )
    group.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one log line per request: method, path, status, tokens, latency (default: on)",
    )
    group.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="sequences that may wait for the engine beyond its running batch; more get 429 (default: no limit)",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take; then it is aborted and the client gets a 408 error (default: none)",
    )
    group.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="CORS: origins whose pages may call the server, or '*' (default: none)",
    )
    group.add_argument(
        "--metrics-prefix",
        default=None,
        help="prefix of the /metrics names; 'vllm' gives vLLM's names for its dashboards (default: nanoserve)",
    )
    group.add_argument(
        "--enable-sleep-endpoints",
        action="store_true",
        default=None,
        help="mount POST /sleep, POST /wake_up and GET /is_sleeping (for a trusted operator)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template (inline, or a file) used instead of the tokenizer's, e.g. one that renders tools",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="how tool calls are read out of outputs for tool_choice auto (default: found from the chat template)",
    )
    add_engine_args(parser)
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from nanoserve.entrypoints.openai.api_server import run_server

    return run_server(args)
