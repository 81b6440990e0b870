"""k3serve command line: info, generate, plan, serve.

Heavy modules (torch, the model, the engine, the servers) are imported inside the commands, so
``k3serve info`` answers without loading torch.
"""

from __future__ import annotations

import argparse
import json
import sys

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
    from k3serve.engine.llm import LLM
    from k3serve.sampling import SamplingParams

    llm = LLM(model=args.model, enable_prefix_caching=False)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    out = llm.generate([args.prompt], params)[0]
    sys.stdout.write(args.prompt + out.text + "\n")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from deploy.plan import PlanError, load_deploy_config, make_plan

    try:
        plan = make_plan(load_deploy_config(args.config))
    except PlanError as e:
        print(f"k3serve plan: refused: {e}", file=sys.stderr)
        return 1
    print(plan.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan.to_dict(), f, indent=2)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.ray:
        if not args.config:
            raise ValueError("--config: `serve --ray` needs a deployment config "
                             "(deploy/configs/*.yaml)")
        from deploy.ray_backend import serve_ray

        return serve_ray(args)
    if args.config:
        raise ValueError("--config: only used with --ray (the local backend takes flags)")
    from k3serve.launcher import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(prog="k3serve", description=__doc__.splitlines()[0],
                                formatter_class=fmt)
    sub = p.add_subparsers(dest="cmd", required=True)

    pi = sub.add_parser("info", formatter_class=fmt, help="parameter counts and cache sizes of a model")
    pi.add_argument("--model", default=DEFAULT_MODEL, help="preset name or checkpoint folder")
    pi.add_argument("--json", action="store_true", help="print JSON")
    pi.set_defaults(fn=cmd_info)

    pg = sub.add_parser("generate", formatter_class=fmt, help="generate a continuation offline (no server)")
    pg.add_argument("--model", default=DEFAULT_MODEL, help="preset name or checkpoint folder")
    pg.add_argument("--prompt", required=True)
    pg.add_argument("--max-tokens", type=int, default=64)
    pg.add_argument("--temperature", type=float, default=0.0)
    pg.add_argument("--top-p", type=float, default=1.0)
    pg.add_argument("--seed", type=int, default=None)
    pg.set_defaults(fn=cmd_generate)

    ps = sub.add_parser("serve", formatter_class=fmt, help="start router + prefill and decode workers on this machine")
    ps.add_argument("--model", default=DEFAULT_MODEL, help="preset name or checkpoint folder")
    ps.add_argument("--host", default="127.0.0.1", help="router bind address")
    ps.add_argument("--port", type=int, default=8000, help="router port")
    ps.add_argument("--prefill", type=int, default=2, help="number of prefill workers")
    ps.add_argument("--decode", type=int, default=1, help="number of decode workers")
    ps.add_argument("--api-key", default=None,
                    help="bearer token required on the public API (or set K3SERVE_API_KEY)")
    ps.add_argument("--policy", default="cache_aware",
                    help="placement policy: cache_aware | round_robin | least_load | random")
    ps.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    ps.add_argument("--device", default="cpu", help="worker device (cpu or cuda)")
    ps.add_argument("--ray", action="store_true",
                    help="run every instance as a Ray actor (needs --config; `pip install "
                         "-e .[ray]`)")
    ps.add_argument("--config", default=None,
                    help="deployment config for --ray (deploy/configs/*.yaml); its model, "
                         "pools and router replace --model/--prefill/--decode/--policy")
    ps.add_argument("--ray-address", default=None,
                    help="join this Ray cluster (default: start a local one on loopback)")
    ps.add_argument("--sd-dir", default=None,
                    help="write Prometheus file-SD targets here (see deploy/prometheus)")
    ps.set_defaults(fn=cmd_serve)

    pp = sub.add_parser("plan", formatter_class=fmt,
                        help="memory plan of a deployment config; refuses what cannot fit")
    pp.add_argument("--config", required=True, help="deploy/configs/*.yaml")
    pp.add_argument("--json", default=None, metavar="OUT", help="also write the plan as JSON")
    pp.set_defaults(fn=cmd_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except ValueError as e:
        print(f"k3serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
