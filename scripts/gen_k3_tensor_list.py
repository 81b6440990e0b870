#!/usr/bin/env python3
"""Write tests/data/k3_tensors.json: every tensor of the published K3 checkpoint (name, shape, dtype).

The list comes from the ``k3`` ModelConfig preset and the naming rules in
``k3serve/model/k3_names.py`` (confirmed against public K3 implementations; see
``docs/k3_tensor_names.md``). It is stored compactly — per-layer templates plus the layer sets
they apply to, and one routed-expert template repeated for every expert of every MoE layer —
with the expanded count, total bytes and a SHA-256 of the expanded list, so a reader can check
its expansion (``k3serve.model.k3_names.expand_listing``).

Usage::

    python scripts/gen_k3_tensor_list.py            # (re)write the file
    python scripts/gen_k3_tensor_list.py --check    # exit 1 if the file is stale
    python scripts/gen_k3_tensor_list.py --print-summary
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3serve.config import PRESETS
from k3serve.model.k3_names import compact_listing

DEFAULT_OUT = ROOT / "tests" / "data" / "k3_tensors.json"


def render(preset: str = "k3") -> str:
    """The JSON text for a preset (stable key order, one template entry per line)."""
    listing = compact_listing(PRESETS[preset])
    listing["generated_by"] = "scripts/gen_k3_tensor_list.py"
    listing["sources"] = "docs/k3_tensor_names.md"
    return _dump(listing, 0) + "\n"


def _dump(value: object, depth: int) -> str:
    """JSON with dicts broken over lines and every list (shape, spec, layer set) on one line."""
    if not isinstance(value, dict):
        return json.dumps(value, separators=(", ", ": "))
    if not value:
        return "{}"
    pad = "  " * (depth + 1)
    items = [f"{pad}{json.dumps(k)}: {_dump(v, depth + 1)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true", help="compare with the file, write nothing")
    ap.add_argument("--print-summary", action="store_true")
    args = ap.parse_args(argv)

    text = render(args.preset)
    if args.print_summary:
        d = json.loads(text)
        print(
            f"{d['num_tensors']} tensors, {d['total_bytes'] / 1e12:.4f} TB, sha256 {d['expanded_sha256']}"
        )
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run scripts/gen_k3_tensor_list.py", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
