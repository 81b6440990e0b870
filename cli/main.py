"""k3serve command line: info, generate, serve, bench, plan, simulate, experts plan.

``serve`` runs :func:`deploy.serve.run`, ``plan`` :func:`deploy.plan.run` and ``simulate``
:func:`simulate.cli.run` in this process, each with its own flags. Heavy modules (torch, the
model, the engine, the servers) are imported inside the commands, so ``k3serve info`` answers
without loading torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from cli.help import HelpFormatter, use_formatter

if TYPE_CHECKING:
    from k3serve.parallel.expert_plan import Plan

DEFAULT_MODEL = "k3-tiny"


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or prefix == "Ti":
            return f"{n:.1f} {prefix}{unit}" if prefix else f"{int(n)} {unit}"
        n /= 1024
    return f"{n:.1f} {unit}"


def _count(n: int) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.2f} {suffix}"
    return str(n)


def cmd_info(args: argparse.Namespace) -> int:
    from k3serve.config import load_config

    cfg = load_config(args.model)
    info = cfg.info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"model                      {info['name']}")
    print(f"layers                     {info['num_layers']} ({info['num_kda_layers']} KDA + "
          f"{info['num_mla_layers']} MLA)")
    print(f"parameters                 {_count(info['num_params'])} "
          f"({info['num_params']:,})")
    print(f"active parameters / token  {_count(info['num_active_params'])} "
          f"({info['num_active_params']:,})")
    print(f"KDA state / sequence       {_human(info['kda_state_bytes_per_seq'])} "
          f"(recurrent fp32 {_human(info['kda_recurrent_state_bytes_per_seq'])} + conv)")
    print(f"MLA latents / token        {_human(info['mla_latent_bytes_per_token'])} "
          f"({info['dtype']})")
    per_tok = info["mla_latent_bytes_per_token"]
    if per_tok:
        eq = info["kda_state_bytes_per_seq"] / per_tok
        print(f"one KDA snapshot ≈         {eq:,.0f} tokens of MLA latents")
    print(f"max context                {info['max_position_embeddings']:,} tokens")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from k3serve.sampling import SamplingParams

    params = SamplingParams(  # a bad flag is refused before the model loads
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    from k3serve.engine.llm import LLM

    llm = LLM(model=args.model, enable_prefix_caching=False)
    out = llm.generate([args.prompt], params)[0]
    sys.stdout.write(args.prompt + out.text + "\n")
    return 0


def cmd_serve(argv: list[str]) -> int:
    """``k3serve serve [flags]``: the launcher (``deploy/serve.py``) in this process."""
    from deploy import serve

    return serve.run(use_formatter(serve.build_parser()).parse_args(argv))


def cmd_plan(argv: list[str]) -> int:
    """``k3serve plan [flags]``: the memory plan of a deployment config (``deploy/plan.py``)."""
    from deploy import plan

    return plan.run(use_formatter(plan.build_parser()).parse_args(argv))


def cmd_simulate(argv: list[str]) -> int:
    """``k3serve simulate [flags]``: the simulator (``simulate/cli.py``) in this process."""
    from simulate import cli as sim

    return sim.run(use_formatter(sim.build_parser()).parse_args(argv))


#: Commands whose flags belong to a package above the core: ``k3serve CMD [flags]``.
OUTER = {"serve": cmd_serve, "plan": cmd_plan, "simulate": cmd_simulate}


def cmd_experts_plan(args: argparse.Namespace) -> int:
    from deploy import experts as planner
    from k3serve.process import writing

    counts = planner.load_counts(args.counts)
    previous = None
    if args.previous is not None:
        if args.max_moves is None:
            raise ValueError("max-moves: required with --previous")
        previous = read_plan(args.previous)
    elif args.max_moves is not None:
        raise ValueError("max-moves: only meaningful with --previous")
    plan = planner.plan(counts, args.ranks, args.redundant, previous, args.max_moves)
    s = plan.layers[0].slots_per_rank
    print(f"{len(counts[0])} experts x {len(counts)} layer(s) on {args.ranks} ranks, "
          f"{s} slots per rank; max/mean rank load")
    for i, (b, a) in enumerate(zip(plan.max_over_mean_before, plan.max_over_mean_after)):
        moved = f"  moves {plan.moves[i]}" if previous is not None else ""
        print(f"layer {i:3d}  before {b:7.4f}  after {a:7.4f}{moved}")
    if args.json:
        with writing("--json", args.json), open(args.json, "w") as f:
            json.dump(plan.to_dict(), f)
    return 0


def read_plan(path: str) -> Plan:
    """The plan JSON in ``path`` (``k3serve experts plan --previous``); a file that cannot be
    read, is not JSON or is not a plan is a ``ValueError`` naming ``--previous`` and ``path``."""
    from k3serve.parallel.expert_plan import Plan
    from k3serve.process import read_json_object

    doc = read_json_object(path, "--previous")
    try:
        return Plan.from_dict(doc)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--previous: {path} is not a plan ({e})") from None


def cmd_bench(args: argparse.Namespace) -> int:
    """``k3serve bench``: :func:`cli.bench.command.main`; an error answer from the router or
    no answer at all ends in one line on stderr (exit status 2): the status, the URL and the
    server's message (:func:`cli.bench.client.describe_error`)."""
    import httpx

    from cli.bench.client import describe_error
    from cli.bench.command import main as bench_main

    try:
        return bench_main(args)
    except httpx.HTTPError as e:
        print(f"k3serve bench: error: {describe_error(e)}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    from k3serve.process import CommandParser

    fmt = HelpFormatter
    p = argparse.ArgumentParser(prog="k3serve", description=__doc__.splitlines()[0],
                                formatter_class=fmt)
    p.add_argument("--version", action=VersionAction, help="print the version and exit")
    # each command's usage errors are one line (the bare ``k3serve`` still prints its usage)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True,
                           parser_class=CommandParser)

    about = "parameter counts and cache sizes of a model"
    pi = sub.add_parser("info", formatter_class=fmt, help=about, description=about)
    pi.add_argument("--model", default=DEFAULT_MODEL, help="preset name or checkpoint folder")
    pi.add_argument("--json", action="store_true", help="print JSON")
    pi.set_defaults(fn=cmd_info, prog=pi.prog)

    about = "generate a continuation of a prompt offline (no server) and print it"
    pg = sub.add_parser("generate", formatter_class=fmt, help=about, description=about)
    pg.add_argument("--model", default=DEFAULT_MODEL, help="preset name or checkpoint folder")
    pg.add_argument("--prompt", required=True, help="the text to continue")
    pg.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    pg.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (0: greedy)")
    pg.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus sampling: the smallest set of tokens with this probability")
    pg.add_argument("--seed", type=int, default=None,
                    help="sampling seed (default: none, a fresh draw each run)")
    pg.set_defaults(fn=cmd_generate, prog=pg.prog)

    about = "replay a trace (or a random load) against a running stack"
    pb = sub.add_parser("bench", formatter_class=fmt, help=about,
                        description=f"{about}: give --trace or --rate; prints TTFT, ITL, "
                                    "throughput and the prefix-cache hit rate")
    from cli.bench.command import add_arguments

    add_arguments(pb)
    pb.set_defaults(fn=cmd_bench, prog=pb.prog)

    ps = sub.add_parser("serve", add_help=False,
                        help="start router + prefill and decode workers on this machine "
                             "(k3serve serve --help lists its flags)")
    ps.add_argument("flags", nargs=argparse.REMAINDER, help="the flags of the launcher")

    about = "expert placement tools"
    pe = sub.add_parser("experts", formatter_class=fmt, help=about, description=about)
    esub = pe.add_subparsers(dest="experts_cmd", metavar="COMMAND", required=True)
    about = "place experts + redundant copies on ranks (equal slots per rank)"
    pp = esub.add_parser("plan", formatter_class=fmt, help=about,
                         description=f"{about}; prints each layer's max/mean rank load before "
                                     "and after")
    pp.add_argument("--counts", required=True,
                    help="JSON: per-expert token counts, or a list of such lists (per layer)")
    pp.add_argument("--ranks", type=int, required=True, help="expert-parallel ranks N")
    pp.add_argument("--redundant", type=int, required=True,
                    help="extra expert copies R (experts + R must be a multiple of ranks)")
    pp.add_argument("--previous", default=None, help="plan JSON in service: re-plan from it")
    pp.add_argument("--max-moves", type=int, default=None,
                    help="with --previous: most expert copies moved per layer")
    pp.add_argument("--json", default=None, help="write the plan JSON here")
    pp.set_defaults(fn=cmd_experts_plan, prog=pp.prog)

    sub.add_parser("plan", add_help=False,
                   help="memory plan of a deployment config; refuses what cannot fit "
                        "(k3serve plan --help lists its flags)")
    sub.add_parser("simulate", add_help=False,
                   help="replay a trace through the router's placement, no model "
                        "(k3serve simulate --help lists its flags)")
    return p


class VersionAction(argparse.Action):
    """``--version``: print ``k3serve VERSION`` and exit; the version is looked up only then
    (reading the package metadata costs every other command's start-up ~25 ms)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {_version()}", flush=True)
        parser.exit()


def _version() -> str:
    """The installed k3serve's version (``unknown`` when run from a tree that is not
    installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("k3serve")
    except PackageNotFoundError:
        return "unknown"


def error_line(e: ValueError | OSError, args: argparse.Namespace) -> str:
    """The one line that reports ``e``, naming the flag of ``args`` it is about: a
    ``ValueError`` whose message starts with a field gets the flag's spelling
    (:func:`k3serve.process.flag_message`); an ``OSError`` on a file a flag names says
    ``--FLAG: cannot use PATH (reason)`` (the commands turn the files they read or write into
    ``cannot read`` / ``cannot write`` errors; this covers the rest)."""
    from k3serve.process import flag_message

    if isinstance(e, OSError):
        if e.filename is None:
            return str(e.strerror or e)
        flags = [k for k, v in vars(args).items() if isinstance(v, str) and v == e.filename]
        where = f"--{flags[0].replace('_', '-')}: " if flags else ""
        return f"{where}cannot use {e.filename} ({e.strerror or e})"
    return flag_message(str(e), args)


def main(argv: list[str] | None = None) -> int:
    """Run ``k3serve ARGV``; bad input, a missing file or an unreachable server end in one
    line on stderr, ``k3serve COMMAND: error: --FLAG: ...`` (exit status 2). A reader that
    stops reading (``k3serve plan ... | head``) ends the command quietly (exit status 1, as
    ``python -c ... | head`` recommends). Ctrl-C before a command has set its own handler
    (``serve`` sets one before it starts anything; until then it is importing) ends it with
    one line and exit status 130, no traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print("k3serve: interrupted", file=sys.stderr, flush=True)
        return 130


def _run(argv: list[str]) -> int:
    """:func:`main` without its Ctrl-C handling."""
    try:
        if argv[:1] and argv[0] in OUTER:  # their flags belong to deploy/ and simulate/
            return OUTER[argv[0]](argv[1:])
        args, extra = build_parser().parse_known_args(argv)
        if extra:  # argparse would blame the top-level parser: name the command instead
            print(f"{args.prog}: error: unrecognized arguments: {' '.join(extra)} "
                  f"({args.prog} --help lists the flags)", file=sys.stderr)
            return 2
        try:
            return int(args.fn(args) or 0)
        except BrokenPipeError:
            raise
        except (ValueError, OSError) as e:  # bad input, a missing or unwritable file
            print(f"{args.prog}: error: {error_line(e, args)}", file=sys.stderr)
            return 2
    except BrokenPipeError:
        # stdout's reader is gone: later writes (the interpreter's last flush) go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
