"""The `specdec` command (the console script): the core's commands (specdec/cli.py: generate, bench,
distill, models), the serving ones (cluster/commands.py: serve, client) and the tools' (bench-served,
soak). Parsing a command line imports no torch: `specdec client` and `specdec bench-served` start in a
fraction of a second; the commands that run models import it when they run."""

import argparse
from typing import get_args

from cluster import commands as serving
from cluster.config import Dtype
from specdec import cli
from specdec.workload import DEFAULT_TURNS, Workload

from .served_bench import Mode, bench_main


def build_parser() -> argparse.ArgumentParser:
    parser, sub = cli.build_parser()
    serving.add_serving_commands(sub)
    add_tool_commands(sub)
    return parser


def add_tool_commands(sub: argparse._SubParsersAction) -> None:
    sb = sub.add_parser("bench-served", help="a running server's tokens/s and time per output token: clients x "
                                             "speculation off/on/auto, with transformers as reference lines")
    sb.add_argument("--address", default="localhost:9000", help="host:port of specdec.v1.SpecDecode")
    serving.add_connection_arguments(sb)
    sb.add_argument("--http", default="http://localhost:8000",
                    help="the server's HTTP root, for its step timing in GET /v1/stats ('' to skip it)")
    sb.add_argument("--prompts", required=True, help="JSONL rows with 'task_type' and 'prompt' text or chat 'messages' "
                        "(rendered by the target's chat template)")
    sb.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                    help="concurrent clients, one grid row each (default 1 2 4 8 16)")
    sb.add_argument("--modes", nargs="+", type=Mode.parse, default=[Mode.parse(m) for m in ("off", "on", "auto")],
                    metavar="{off,on,auto,on:DRAFTER}",
                    help="default off on auto; off always runs first (every other mode must equal it); on:DRAFTER "
                         "asks for that drafter (one the server runs: on:suffix, on:model+ngram)")
    sb.add_argument("--max-new-tokens", type=int, default=64)
    sb.add_argument("--limit", type=int, help="use only the first N prompts of each task type")
    sb.add_argument("--workload", choices=[w.value for w in Workload], default=Workload.SINGLE.value,
                    help="single: each prompt once; shared-prefix: each prompt once after one shared system prompt "
                         "(chat rows need --target); multi-turn: each prompt opens a conversation whose every turn "
                         "resends the last prompt, its answer and a follow-up, one client's turns in order (needs "
                         "--target)")
    sb.add_argument("--turns", type=int, default=DEFAULT_TURNS, help=f"turns per conversation of multi-turn "
                    f"(default {DEFAULT_TURNS})")
    sb.add_argument("--target", metavar="DIR", help="the served target's model folder: its chat template renders "
                    "chat rows, and transformers generate() and generate_batch on it are measured in this process after "
                    "the grid (default: no references; chat rows need it)")
    sb.add_argument("--no-references", action="store_true",
                    help="skip the transformers references even with --target (which multi-turn needs for its "
                         "tokenizer): the grid alone, where a reference decode would take minutes")
    sb.add_argument("--dtype", choices=get_args(Dtype), default="float32",
                    help="the server's target dtype (its models.target.dtype): the references run in it; a server "
                         "in another dtype than float32 is held to its greedy agreement with off, not equality")
    sb.add_argument("--forget-outputs", action="store_true",
                    help="before each cell, ask the server's draft replicas to forget earlier outputs (POST "
                         "/v1/admin/forget_outputs; the server needs server.allow_forget_outputs), so suffix drafts "
                         "of a cell never read the answers of a cell before it that sent the same prompts")
    sb.add_argument("--forget-prefixes", action="store_true",
                    help="before each cell, ask the server's target and draft replicas to empty their prefix caches "
                         "(POST /v1/admin/forget_prefixes; the server needs server.allow_forget_prefixes), so a cell "
                         "that re-sends an earlier cell's prompts prefills them as the first did, not from its cache")
    sb.add_argument("--salt-per-client", action="store_true",
                    help="each client sends a cache_salt of its own (as tenants that must not share cached prompts "
                         "or outputs): what isolating clients costs, beside a run without it")
    sb.add_argument("--against", metavar="HOST:PORT",
                    help="a second server (b) of the same target, measured cell by cell beside the first (a) in "
                         "the same run; its outputs must equal a's, the summary gives its tok/s over a's per round")
    sb.add_argument("--against-http", default="", metavar="URL",
                    help="the second server's HTTP root, for its /v1/stats and --forget-outputs (default: none)")
    sb.add_argument("--rounds", type=int, default=1,
                    help="run each client count's modes this many times, the order reversed every other round, each "
                         "cell's vs off over its own round's off; a summary gives each mode's median tok/s and the "
                         "geometric mean of its ratios (default 1)")
    sb.add_argument("--fresh-prompts", action="store_true",
                    help="each client count's every round sends its own share of the prompts (of n such groups the "
                         "k-th sends prompts k, k+n, ...; the last prompt only warms up), so a server's first cell of "
                         "a group sends prompts no earlier cell sent: a prefix cache measured on first sendings")
    sb.add_argument("--timeout", type=float, default=600, help="deadline per request in seconds (default 600)")
    sb.add_argument("--json", action="store_true",
                    help='end with one JSON line {"rows": [...], "summary": [...], "references": {...}}')
    sb.add_argument("--plot", metavar="PNG", help="write tokens/s against clients, one line per mode, "
                                                  "the references as horizontal lines")

    so = sub.add_parser("soak", help="mixed traffic and faults (a draft replica, then a target rank, killed) for a "
                                     "bounded time on a local cluster of its own (loopback); checks and reports")
    so.add_argument("--config", help="operator YAML (examples: configs/); default: the embedded default pair")
    so.add_argument("--minutes", type=float, default=10.0, help="how long the traffic runs (default 10)")
    so.add_argument("--max-requests", type=int, default=1_000_000, help="stop after this many requests")
    so.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    so.add_argument("--max-new-tokens", type=int, default=32, help="each request asks for 4..N tokens (default 32)")
    so.add_argument("--prompts", help="JSONL rows with 'prompt' and 'task_type' (default: a few built-in code and "
                                      "prose prompts)")
    so.add_argument("--seed", type=int, default=0, help="seeds the traffic's random mix")
    so.add_argument("--no-kills", action="store_true", help="traffic only: kill nothing")
    so.add_argument("--hostile-share", type=float, default=None,
                    help="share of shots from the hostile mix (default 0.1; 0: none)")
    so.add_argument("--json", action="store_true", help="end with the report as one JSON line")


def soak_main(args) -> None:
    from .soak import soak_main as run  # the soak imports ray, which no other command needs at start

    run(args)


COMMANDS = cli.COMMANDS | serving.COMMANDS | {"bench-served": bench_main, "soak": soak_main}


def main(argv: list[str] | None = None) -> None:
    cli.main(argv, build_parser(), COMMANDS)


if __name__ == "__main__":
    main()
