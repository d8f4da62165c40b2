"""`asyncrl serve CONFIG`: train on agents in other processes that call the OpenAI-compatible endpoint.

Place in the dataflow: the command line's entry to `Runtime` + `rt.serve_openai` — the roles start (in this
process, or as Ray actors with --ray), the endpoint listens (127.0.0.1 unless --host says otherwise) and
the agents drive everything over HTTP: POST /episodes, the OpenAI routes under each episode's base_url,
POST /groups with the rewards (asyncrl/serve/control.py). The command ends when training has taken
`trainer.total_steps` steps.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from asyncrl.config.schema import Config

log = logging.getLogger(__name__)


def add_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="train on agents that call an OpenAI-compatible endpoint over HTTP")
    s.add_argument("config", help="path to the run's TOML file")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set trainer.lr=1e-4 (repeatable)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0 = a free one, printed)")
    s.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template replacing the tokenizer's")
    s.add_argument("--tool-parser", default="hermes",
                   help="format of the tool calls read out of replies to requests with tools (default hermes; "
                        "json, name_args; 'none' returns the raw text)")
    s.add_argument("--ray", action="store_true", help="run the roles as Ray actors (default: in this process)")


def serve(cfg: Config, args: argparse.Namespace) -> int:
    template = None
    if args.chat_template:
        try:
            template = Path(args.chat_template).read_text()
        except OSError as exc:
            print(f"serve: --chat-template: {exc}", file=sys.stderr)
            return 2
    try:
        parser = None if args.tool_parser.lower() == "none" else args.tool_parser
        rows = asyncio.run(_serve(cfg, args.host, args.port, template, local=not args.ray, tool_parser=parser))
    except KeyboardInterrupt:
        print("interrupted; the endpoint and the roles are stopped", file=sys.stderr)
        return 130
    except OSError as exc:  # the address is taken or cannot be bound
        print(f"serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a failed run: one line here, the traceback in the log
        log.exception("serve failed")
        print(f"run failed: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    print(f"run directory: {cfg.run.output_dir} ({len(rows)} metric rows)")
    return 0


async def _serve(cfg: Config, host: str, port: int, template: str | None, local: bool,
                 tool_parser: str | None = "hermes") -> list[dict]:
    from asyncrl.runtime import Runtime

    async with Runtime(cfg, local=local) as rt:
        server = await rt.serve_openai(host, port, chat_template=template, tool_parser=tool_parser)
        print(f"serving {server.model_name} at {server.url}: POST {server.url}/episodes opens an episode "
              f"(its base_url for the OpenAI client), POST {server.url}/groups submits rewarded episodes",
              flush=True)
        return await rt.wait_done()
