"""Which project files one streaming chat completion executes, across router, prefill and decode.

Starts a 1 prefill + 1 decode stack (k3-tiny, CPU) whose every process runs under coverage.py
from its first line (a ``sitecustomize`` on ``PYTHONPATH``), warms it up with streaming chat
completions, then switches every process's coverage to the dynamic context ``request``
(SIGUSR1), sends one streaming chat completion, and stops and saves (SIGUSR2). Prints the
project files with at least one line executed in that context, per process and in all, and
writes them as JSON to ``--out``, with the lines executed per file and the lines of the
functions that ran (whole), a lower bound on the code the request's files must hold however
the project is split. Background work that runs during the request (health polls,
cache-event sync) is counted too: it is what the processes execute meanwhile.

    python scripts/request_path_coverage.py [--out FILE] [--monolithic]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITECUSTOMIZE = """
import os, signal
_d = os.environ.get("K3_REQCOV_DIR")
if _d:
    import coverage
    _cov = coverage.Coverage(data_file=os.path.join(_d, f"cov.{os.getpid()}"),
                             source=[os.environ["K3_REQCOV_ROOT"]], concurrency=["thread"])
    _cov.start()
    signal.signal(signal.SIGUSR1, lambda *a: _cov.switch_context("request"))
    def _stop(*a):
        _cov.stop(); _cov.save()
        open(os.path.join(_d, f"done.{os.getpid()}"), "w").close()
    signal.signal(signal.SIGUSR2, _stop)
"""


def chat(url: str, text: str, max_tokens: int = 16) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    out = []
    for chunk in client.chat.completions.create(
            model="k3-tiny", messages=[{"role": "user", "content": text}], stream=True,
            max_tokens=max_tokens, temperature=0):
        if chunk.choices and chunk.choices[0].delta.content:
            out.append(chunk.choices[0].delta.content)
    return "".join(out)


def measure(work: Path, monolithic: bool) -> dict:
    from coverage import CoverageData

    sys.path.insert(0, str(ROOT))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    os.environ["K3_REQCOV_DIR"] = str(work)
    os.environ["K3_REQCOV_ROOT"] = str(ROOT)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(work / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    from deploy.launcher import start_stack

    kw = {"monolithic": 1} if monolithic else {"num_prefill": 1, "num_decode": 1}
    stack = start_stack(log_dir=str(work / "logs"), **kw)
    try:
        for i in range(3):
            chat(stack.url, f"warm-up {i}: say something about caches")
        pids = [p.pid for p in stack.procs]
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.2)
        chat(stack.url, "Tell me about disaggregated serving.")
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + 60
        while any(not (work / f"done.{pid}").exists() for pid in pids):
            if time.monotonic() > deadline:
                raise RuntimeError("a process did not save its coverage")
            time.sleep(0.1)
    finally:
        stack.stop()
    per_process: dict[str, list[str]] = {}
    executed: dict[str, set[int]] = {}
    for pid, name in zip(pids, [f"proc{i}" for i in range(len(pids))]):
        data = CoverageData(str(work / f"cov.{pid}"))
        data.read()
        data.set_query_contexts(["request"])
        files = []
        for f in data.measured_files():
            if data.lines(f) and Path(f).is_relative_to(ROOT):
                rel = str(Path(f).relative_to(ROOT))
                files.append(rel)
                executed.setdefault(rel, set()).update(data.lines(f))
        per_process[name] = sorted(files)
    union = sorted(executed)
    spans = {f: function_lines(ROOT / f, executed[f]) for f in union}
    return {"per_process": per_process, "files": union, "count": len(union),
            "executed_lines": {f: len(executed[f]) for f in union},
            "function_lines": spans,
            "total_file_lines": sum(len((ROOT / f).read_text().splitlines()) for f in union),
            "total_executed_lines": sum(len(v) for v in executed.values()),
            "total_function_lines": sum(spans.values())}


def function_lines(path: Path, lines: set[int]) -> int:
    """Lines of the innermost functions of ``path`` with a line in ``lines``, whole (from
    ``def`` to their last line), plus the executed lines outside every function: the code that
    must sit in the files of the request's path however the project is split into files."""
    import ast

    tree = ast.parse(path.read_text())
    funcs = [n for n in ast.walk(tree)
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    taken: set[tuple[int, int]] = set()
    outside = 0
    for ln in lines:
        inner = [f for f in funcs if f.lineno <= ln <= f.end_lineno]
        if inner:
            f = max(inner, key=lambda f: f.lineno)  # the innermost
            taken.add((f.lineno, f.end_lineno))
        else:
            outside += 1
    covered: set[int] = set()
    for a, b in taken:
        covered.update(range(a, b + 1))
    return len(covered) + outside


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the result as JSON here")
    ap.add_argument("--monolithic", action="store_true", help="one monolithic worker instead")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        res = measure(Path(d), args.monolithic)
    for name, files in res["per_process"].items():
        print(f"{name}: {len(files)} files")
        for f in files:
            print("   ", f)
    print(f"project files executed by the request, all processes: {res['count']}")
    print(f"their lines: {res['total_file_lines']}; lines executed: "
          f"{res['total_executed_lines']}; lines of the functions that ran (whole) plus the "
          f"executed lines outside functions: {res['total_function_lines']} "
          f"(at 500 lines a file, at least {-(-res['total_function_lines'] // 500)} files)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
