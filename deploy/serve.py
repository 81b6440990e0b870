"""``k3serve serve`` (= ``python -m deploy``): the flags, and the stack they describe run until
Ctrl-C / SIGTERM.

Stopping (:class:`Stopper`): the first SIGTERM or SIGINT — sent to the launcher alone (``kill
-TERM PID``) or to its whole process group (a terminal's Ctrl-C, ``kill -TERM -PGID``) — stops
supervision at once, then :meth:`deploy.launcher.Stack.stop` sends one SIGTERM to the router and
every worker: the workers drain what they hold (up to ``--drain-timeout``, :data:`DEFAULT_DRAIN_TIMEOUT_S`
by default, passed to every worker), the router finishes its open streams, everything exits 0
and the launcher exits 0.
A second signal to the launcher kills what is left at once. A signal during startup stops
what has started. The process title is ``k3serve serve`` (setproctitle).

The launcher's own flags come first; every router and worker flag the launcher does not set
itself is offered too, in two groups, and passed on only when given (:func:`passthrough_args`).
The local backend runs :func:`deploy.launcher.start_stack` with a supervisor; ``--ray`` runs
:func:`deploy.ray_backend.serve_ray` from a deployment config.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from types import FrameType

from deploy.launcher import (
    PortInUseError,
    Stack,
    StartupCancelled,
    StartupError,
    check_port_free,
    start_stack,
)
from k3serve.process import CommandParser, FlagParser, device_name, exit_now, set_title
from k3serve.protocol import api_keys_env

#: every worker's ``--drain-timeout`` when ``k3serve serve`` is not given one, seconds: long
#: enough for the streams in flight to end by themselves. A drain ends as soon as nothing is
#: held; this bounds it. 1,024-token streams, 8 at once on a loaded 2-core CPU box, run at
#: about 9 tokens/s each (about 520 tokens in 60 s: docs/results/shutdown.md), so they need
#: about 115 s; 180 s leaves room for a slower box or longer outputs (at 6 tokens/s a stream of
#: 1,024 tokens ends within it). On a GPU a stream of that length ends in seconds.
DEFAULT_DRAIN_TIMEOUT_S = 180.0
#: seconds past the drain timeout a component has to exit before it is killed (a drained
#: worker's server closes its connections within 3 s, then releases its engine)
STOP_GRACE_S = 15.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopper:
    """The launcher's SIGTERM / SIGINT handler (module docstring): the first signal marks the
    stack stopping (so the supervisor restarts nothing; during startup ``start_stack`` sees
    :meth:`cancelled` and stops what it started); a second one kills what is left. A second
    signal within :data:`REPEAT_S` of the first counts as the same one: ``make`` and other
    wrappers pass a signal sent to the whole group on to the launcher once more."""

    #: seconds after the first signal in which another one is taken as its echo
    REPEAT_S = 1.0

    def __init__(self) -> None:
        self.stack: Stack | None = None
        self.requested = False
        self.first_at = 0.0
        #: set by the first signal: :func:`serve`'s watch loop wakes at once
        self.event = threading.Event()

    def cancelled(self) -> bool:
        return self.requested

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested and time.monotonic() - self.first_at < self.REPEAT_S:
            return  # the same signal, passed on again by a wrapper (make)
        if self.requested:
            # one write, newline included: the workers write to the same terminal meanwhile
            print(f"k3serve: {name} again: stopping every component now\n", end="",
                  file=sys.stderr, flush=True)
            if self.stack is not None:
                self.stack.kill()
            return
        self.requested = True
        self.first_at = time.monotonic()
        self.event.set()
        if self.stack is not None:
            self.stack.stopping = True
        print(f"k3serve: {name}: stopping; the workers drain their requests first "
              f"({name} again: stop at once)\n", end="", file=sys.stderr, flush=True)


def build_parser(prog: str = "k3serve serve") -> argparse.ArgumentParser:
    """The flags of ``k3serve serve`` (= ``python -m deploy``)."""
    p = CommandParser(prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                      description="start router + prefill and decode workers")
    p.add_argument("--model", default="k3-tiny", help="preset name or checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument("--prefill", type=int, default=2, help="number of prefill workers")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--monolithic", type=int, default=0, metavar="N",
                   help="N > 0: N workers that each prefill and decode (no disaggregation; "
                        "--prefill / --decode ignored)")
    p.add_argument("--routers", type=int, default=1, metavar="N",
                   help="router processes behind the one address (each keeps its own index "
                        "from the workers' events; router/replicas.py)")
    p.add_argument("--api-key", default=None, nargs="+", action="extend", metavar="KEY",
                   help="bearer token(s) required on the public API; repeat or list several "
                        "(or set K3SERVE_API_KEY, keys separated by spaces)")
    from router.policies.table import DEFAULT_POLICY, POLICIES

    p.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                   metavar="POLICY",
                   help="prefill placement policy: " + " | ".join(sorted(POLICIES)))
    p.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    p.add_argument("--device", default=None, type=device_name,
                   help="worker device, cpu or cuda[:N] (default: cuda when torch sees a GPU)")
    p.add_argument("--ray", action="store_true",
                   help="run every instance as a Ray actor (needs --config; `pip install -e .[ray]`)")
    p.add_argument("--config", default=None,
                   help="deployment config for --ray (deploy/configs/*.yaml); its model, pools "
                        "and router replace --model/--prefill/--decode/--policy")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: start a local one on loopback)")
    p.add_argument("--sd-dir", default=None,
                   help="write Prometheus file-SD targets here (see deploy/prometheus)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts allowed per crashed component (exponential backoff between "
                        "failed starts); 0: none")
    p.add_argument("--store", action=argparse.BooleanOptionalAction, default=None,
                   help="start a mooncake_master on loopback: a shared DRAM store below the "
                        "workers (prefixes cross workers; a chat's next turn reuses the "
                        "decode side's state at the end of the previous answer). Default: on "
                        "when mooncake_master is installed (a warning and no store when it is "
                        "not); --store without it is an error; --no-store: off")
    _add_passthrough(p)
    return p


#: Flags of ``router.app`` / ``{prefill,decode}.worker`` the launcher sets itself.
_LAUNCHER_OWNS = {"help", "host", "port", "model", "policy", "api_key", "replicas",
                  "replica_index", "fd", "advertise_host", "router_url", "worker_id",
                  "block_size", "device", "store_url", "workers_per_gpu"}


def _component_parsers() -> dict[str, FlagParser]:
    from router.config import build_parser as router_parser
    from worker.config import WorkerEnv
    from worker.config import build_parser as worker_parser

    return {"router": router_parser(), "worker": worker_parser("prefill", WorkerEnv())}


#: Flags the router and the workers both have that mean the same there: one flag, both get it.
_BOTH = {"log_level", "otlp_traces_endpoint"}


def _passthrough_specs() -> list[tuple[str, argparse.Action, str, list[str]]]:
    """(component, its action, dest in ``k3serve serve``, the flags there) for every router
    and worker flag the launcher does not set. A worker flag whose name the router has too
    with another meaning (``--max-queued``: the router's admission queue vs a worker's
    own) is ``--worker-NAME`` in ``k3serve serve``; those in ``_BOTH`` are one flag."""
    out, taken = [], set()
    for name, parser in _component_parsers().items():
        for a in parser.flags:
            if a.dest in _LAUNCHER_OWNS or a.help == argparse.SUPPRESS:
                continue
            dest, flags = a.dest, list(a.option_strings)
            if isinstance(a, argparse.BooleanOptionalAction):
                flags = flags[:1]  # argparse adds the --no- form itself
            if dest in taken and dest not in _BOTH:
                dest, flags = f"worker_{dest}", ["--worker-" + flags[0][2:]]
            out.append((name, a, dest, flags))
            taken.add(a.dest)
    return out


#: Help texts of passed-through flags whose component help names a flag the launcher sets
#: itself (``--workers-per-gpu``): what the flag means under ``k3serve serve``.
SERVE_HELP = {
    "gpu_memory_utilization": "CUDA: each worker's share of the card's total memory (weights + "
    "activations + pools, counted against what the worker holds); sizes the pools after the "
    "weights load (default: 0.9 split evenly among the workers k3serve serve places on the "
    "card, or none with an explicit --num-pages)",
}


def _add_passthrough(p: argparse.ArgumentParser) -> None:
    """Add the router's and the workers' own flags (those the launcher does not set) to
    ``p``, in two groups, defaulting to "not given" so only what the user typed is passed on
    (:func:`_passthrough_specs` names them)."""
    groups = {name: p.add_argument_group(
        f"{name} flags", "passed to the router process(es)" if name == "router" else
        "passed to every prefill and decode worker (python -m prefill.worker --help); a name "
        "the router has too is --worker-NAME here") for name in ("router", "worker")}
    added: set[str] = set()
    for name, a, dest, flags in _passthrough_specs():
        if dest in added:  # a flag of _BOTH: added with the router's
            continue
        added.add(dest)
        text = SERVE_HELP.get(a.dest, a.help)
        default = DEFAULT_DRAIN_TIMEOUT_S if dest == "drain_timeout" else a.default
        shown = "" if default in (None, False) or "default" in (text or "") else (
            f"(default: {default})")
        kwargs: dict = {"dest": dest, "default": argparse.SUPPRESS, "metavar": a.metavar,
                        "help": " ".join(filter(None, [text, shown])) or None}
        if isinstance(a, argparse.BooleanOptionalAction):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif a.nargs == 0:  # store_true
            kwargs["action"] = "store_true"
            kwargs.pop("metavar")
        else:
            kwargs.update(type=a.type, choices=a.choices)
        groups[name].add_argument(*flags, **kwargs)


def passthrough_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """The flags of ``args`` that belong to the router / the workers, as the argv lists of
    those processes (``{"router": [...], "worker": [...]}``); empty lists when none given."""
    out: dict[str, list[str]] = {"router": [], "worker": []}
    for name, a, dest, _flags in _passthrough_specs():
        if not hasattr(args, dest):
            continue
        value, flag = getattr(args, dest), a.option_strings[0]
        if isinstance(a, argparse.BooleanOptionalAction):
            out[name].append(flag if value else "--no-" + flag[2:])
        elif a.nargs == 0:
            out[name] += [flag] if value else []
        else:
            out[name] += [flag, str(value)]
    return out


def check_args(args: argparse.Namespace) -> None:
    """Refuse flags the local stack cannot start with, before anything starts: a ``--model``
    that is neither a preset nor a model checkout, a CUDA ``--device`` this machine lacks, an
    empty ``--api-key``, counts out of range, a router address that cannot be bound.

    Raises:
        ValueError: the flag and the value (one line).
        PortInUseError: ``--host:--port`` is taken or cannot be bound.
    """
    check_model(args.model)
    check_cuda(args.device)
    api_keys_env(args.api_key)
    for flag, value, least in (("--prefill", args.prefill, 1), ("--decode", args.decode, 1),
                               ("--monolithic", args.monolithic, 0), ("--routers", args.routers, 1),
                               ("--block-size", args.block_size, 1),
                               ("--max-restarts", args.max_restarts, 0)):
        if value < least:
            raise ValueError(f"{flag}: must be >= {least} (got {value})")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: must be 0-65535 (got {args.port})")
    if args.port:
        check_port_free(args.host, args.port)


def check_cuda(device: str | None) -> None:
    """Refuse ``--device cuda[:N]`` when this machine's torch sees no CUDA device, or fewer
    than N + 1 (the workers would each fail at their start). Imports torch only for a CUDA
    device; the components start by exec, so CUDA touched here is not inherited.

    Raises:
        ValueError: ``--device``, the value and what torch sees (one line).
    """
    if device is None or not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--device: {device!r} asked for, but torch sees no CUDA device")
    index = device.partition(":")[2]
    if index and int(index) >= count:
        raise ValueError(f"--device: {device!r} asked for, but torch sees {count} CUDA "
                         f"device{'s' if count > 1 else ''} (cuda:0 to cuda:{count - 1})")


def check_router_flags(flags: list[str], model: str = "k3-tiny") -> None:
    """Build the router's config from the router flags ``serve`` passes on (serving
    ``model``), in this process: a value the router would refuse at its start
    (``--prefill-rate 0``, a ``--max-model-len`` above the model's context length) is refused
    here, before anything starts.

    Raises:
        ValueError: the router config's field and the value (one line).
    """
    from router.config import build_parser as router_parser
    from router.config import config_from_args

    config_from_args(router_parser().parse_args(["--model", model, *flags]))


def check_worker_flags(flags: list[str], device: str | None, monolithic: bool) -> None:
    """Parse the worker flags ``serve`` passes on with the workers' own parser and build their
    engine config, in this process (:func:`worker.config.check_flags`): a value a worker would
    refuse at its start (``--num-pages -5``) is refused here, before anything starts.

    Args:
        flags: the workers' flags (:func:`passthrough_args`).
        device: ``--device``.
        monolithic: only decode workers run (``--monolithic N``).

    Raises:
        ValueError: the flag and the value (one line).
    """
    from worker.config import check_flags

    try:
        check_flags(flags, device, ("decode",) if monolithic else ("prefill", "decode"))
    except ValueError as e:  # a worker flag under its ``k3serve serve`` name
        flag, sep, rest = str(e).partition(":")
        renamed = {a.option_strings[0]: names[0] for role, a, _dest, names in _passthrough_specs()
                   if role == "worker" and names[0] != a.option_strings[0]}
        if not sep or flag not in renamed:
            raise
        raise ValueError(renamed[flag] + sep + rest) from None


def check_model(model: str) -> None:
    """Raise ``ValueError`` naming ``--model`` and the path when ``model`` is neither a preset
    nor a folder with a readable ``config.json`` / ``k3serve_config.json`` of this model
    family (:func:`k3serve.config.load_config`)."""
    from k3serve.config import PRESETS, load_config

    if model in PRESETS:
        return
    presets = ", ".join(sorted(PRESETS))
    if not os.path.isdir(model):
        what = "is not a folder" if os.path.exists(model) else "does not exist"
        raise ValueError(f"--model: {model} {what}; give a model checkout folder or a preset "
                         f"({presets})")
    if not any(os.path.isfile(os.path.join(model, f))
               for f in ("k3serve_config.json", "config.json")):
        raise ValueError(f"--model: {model} is not a model checkout (no config.json in it)")
    try:
        load_config(model)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ValueError(f"--model: {model}: its config cannot be used ({e!s:.200})") from None


def use_store(flag: bool | None) -> bool:
    """Whether the stack gets the shared store: ``--store`` / ``--no-store`` as given; by
    default (``None``) on when ``mooncake_master`` is installed, else off with one warning
    (an explicit ``--store`` without it fails at the master's start)."""
    if flag is not None:
        return flag
    from deploy.local import mooncake_master_path

    try:
        mooncake_master_path()
    except FileNotFoundError as e:
        print(f"warning: no shared store ({e}): a chat's next turn reuses only its prompt, "
              "not the previous answer; install the Mooncake wheel (`pip install -e .[cpu]` or "
              "`.[gpu]`) or pass --no-store to silence this", file=sys.stderr, flush=True)
        return False
    return True


def drain_timeout(args: argparse.Namespace, extra: dict[str, list[str]]) -> float:
    """The workers' drain timeout of ``args``, seconds: ``--drain-timeout`` as given, else
    :data:`DEFAULT_DRAIN_TIMEOUT_S`, which is then added to the workers' flags in ``extra``
    (:func:`passthrough_args`; a worker's own default is shorter)."""
    if hasattr(args, "drain_timeout"):
        return float(args.drain_timeout)
    extra["worker"] += ["--drain-timeout", str(DEFAULT_DRAIN_TIMEOUT_S)]
    return DEFAULT_DRAIN_TIMEOUT_S


def serve(args: argparse.Namespace) -> int:
    """Run the stack of ``args`` (:func:`build_parser`) until Ctrl-C / SIGTERM, restarting
    crashed components; once every component has stopped, the process ends
    (:func:`k3serve.process.exit_now`) with exit status 0, or 1 when the router could not be
    restarted. Returns only when the start was cancelled (0). ``--ray`` runs it on the Ray
    backend (deploy/ray_backend.py) and returns its exit status.

    Raises:
        ValueError: ``--ray`` without ``--config``, or ``--config`` without ``--ray``.
    """
    extra = passthrough_args(args)
    if args.ray:
        if extra["router"] or extra["worker"]:
            given = " ".join(x for x in extra["router"] + extra["worker"] if x.startswith("--"))
            raise ValueError(f"{given}: with --ray the router and worker settings come from "
                             "--config (deploy/configs/*.yaml)")
        if not args.config:
            raise ValueError("--config: `serve --ray` needs a deployment config "
                             "(deploy/configs/*.yaml)")
        if getattr(args, "store", None):
            raise ValueError("--store: the Ray backend runs without the shared store (prefix "
                             "hits come from each worker's own cache)")
        from deploy.ray_backend import serve_ray

        set_title("k3serve serve")
        return serve_ray(args)
    if args.config:
        raise ValueError("--config: only used with --ray (the local backend takes flags)")
    check_args(args)
    check_router_flags(extra["router"], args.model)
    check_worker_flags(extra["worker"], args.device, args.monolithic > 0)
    set_title("k3serve serve")
    stopper = Stopper()
    stopper.install()
    drain_s = drain_timeout(args, extra)
    try:
        stack = start_stack(
            model=args.model, host=args.host, port=args.port, num_prefill=args.prefill,
            num_decode=args.decode, api_key=args.api_key, policy=args.policy,
            block_size=args.block_size, device=args.device, sd_dir=args.sd_dir,
            store=use_store(args.store), monolithic=args.monolithic, supervise=True,
            max_restarts=args.max_restarts, routers=args.routers,
            extra_router_args=extra["router"], extra_worker_args=extra["worker"],
            cancelled=stopper.cancelled)
    except StartupCancelled:
        print("k3serve: stopped", flush=True)
        return 0
    stopper.stack = stack
    if stopper.requested:  # a signal between the end of startup and the line above
        stack.stopping = True
    shape = (f"{args.monolithic} monolithic workers" if args.monolithic
             else f"{args.prefill} prefill + {args.decode} decode workers")
    if args.routers > 1:
        shape += f", {args.routers} router replicas"
    print(f"k3serve: serving {args.model} at {stack.url}/v1  ({shape}; Ctrl-C stops)",
          flush=True)
    status = 0
    try:
        while not stopper.requested:
            sup = stack.supervisor
            if sup is not None and sup.fatal:
                print(f"k3serve: {sup.fatal}; stopping the stack", file=sys.stderr, flush=True)
                status = 1
                break
            stopper.event.wait(0.5)
    finally:
        stack.stop(timeout=drain_s + STOP_GRACE_S)
    print("k3serve: stopped", flush=True)
    exit_now(status)  # every component has exited; skip the interpreter's finalization


def run(args: argparse.Namespace) -> int:
    """:func:`serve` ``args``; a bad flag value (:func:`check_args`: exit status 2), a taken
    port, a missing program or file, or a component that exits during startup (exit status 1)
    end with one line on stderr."""
    try:
        return serve(args)
    except (PortInUseError, StartupError) as e:
        print(f"k3serve serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    except FileNotFoundError as e:  # --store without mooncake_master, --sd-dir, ...
        print(f"k3serve serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    except ValueError as e:
        print(f"k3serve serve: error: {e}", file=sys.stderr, flush=True)
        return 2


def main(argv: list[str] | None = None) -> int:
    """``python -m deploy [flags]`` = ``k3serve serve [flags]``."""
    return run(build_parser().parse_args(argv))


__all__ = ["DEFAULT_DRAIN_TIMEOUT_S", "STOP_GRACE_S", "Stopper", "build_parser", "check_args",
           "check_model", "check_router_flags", "check_worker_flags", "drain_timeout", "main", "passthrough_args", "run", "serve"]
