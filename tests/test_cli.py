"""The ``k3serve`` command line (``cli/``): every command answers in this process (no exec),
a missing file is one line, ``--help`` shows each default once, and ``k3serve bench``'s
summary carries a unit on every figure and says n/a (never ``None``) where the plot draws no
line."""

from __future__ import annotations

import http.server
import json
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from cli.bench.client import RequestResult, RunOutcome
from cli.bench.plots import hit_rate_series
from cli.bench.report import SUMMARY, format_summary, summarize
from cli.bench.workload import Workload, random_load
from cli.main import main
from tests.worker_procs import session_left

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [["info"], ["generate"], ["bench"], ["experts", "plan"], ["serve"], ["plan"],
            ["simulate"]]


def test_nothing_in_the_core_execs():
    r = subprocess.run(["grep", "-rn", "execv", "k3serve"], cwd=ROOT, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 1 and r.stdout == "", r.stdout


def test_plan_with_a_missing_config_is_one_line(tmp_path, capsys):
    missing = tmp_path / "MISSING.yaml"
    assert main(["plan", "--config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"k3serve plan: error: --config: cannot read {missing} (No such file or directory)"]


def test_plan_with_a_missing_config_from_the_shell(tmp_path):
    r = subprocess.run([sys.executable, "-m", "cli", "plan", "--config", "MISSING"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("k3serve plan: error: --config: cannot read MISSING")


def test_plan_with_an_unwritable_json_is_one_line(tmp_path, capsys):
    cfg = ROOT / "deploy" / "configs" / "supernode-64.yaml"
    out = tmp_path / "no-such-dir" / "plan.json"
    assert main(["plan", "--config", str(cfg), "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3serve plan: error: --json: cannot write"), err


MISSING = "/nonexistent/MISSING"
COUNTS = ["--counts", "tests/data/expert_load_zipf_896x12.json", "--ranks", "64", "--redundant",
          "64"]
TRACE = ["--trace", "tests/data/agent_trace.jsonl"]
NO_FILE = "(No such file or directory)"


@pytest.mark.parametrize("argv,line", [
    (["info", "--model", MISSING], (
        "k3serve info: error: --model: '/nonexistent/MISSING' is neither a preset ['k3', "
        "'k3-mini', 'k3-tiny'] nor a folder")),
    (["generate", "--prompt", "hi", "--max-tokens", "-5"], (
        "k3serve generate: error: --max-tokens: Input should be greater than or equal to 1, "
        "got -5")),
    (["generate", "--prompt", "hi", "--top-p", "2"], (
        "k3serve generate: error: --top-p: Input should be less than or equal to 1, got 2.0")),
    (["bench", "--url", "http://127.0.0.1:9", "--trace", MISSING],
     f"k3serve bench: error: --trace: cannot read {MISSING} {NO_FILE}"),
    (["bench", "--url", "http://127.0.0.1:9", "--rate", "-1"],
     "k3serve bench: error: --rate: must be > 0, got -1.0"),
    (["bench", "--url", "http://127.0.0.1:9", "--rate", "nan"],
     "k3serve bench: error: --rate: must be > 0, got nan"),
    (["experts", "plan", "--counts", MISSING, "--ranks", "2", "--redundant", "0"],
     f"k3serve experts plan: error: --counts: cannot read {MISSING} {NO_FILE}"),
    (["experts", "plan", *COUNTS, "--ranks", "0"],
     "k3serve experts plan: error: --ranks: must be ≥ 1, got 0"),
    (["experts", "plan", *COUNTS, "--max-moves", "2"],
     "k3serve experts plan: error: --max-moves: only meaningful with --previous"),
    (["experts", "plan", *COUNTS, "--previous", MISSING, "--max-moves", "2"],
     f"k3serve experts plan: error: --previous: cannot read {MISSING} {NO_FILE}"),
    (["experts", "plan", *COUNTS, "--previous", "tests/data/agent_trace.jsonl", "--max-moves",
      "2"], ("k3serve experts plan: error: --previous: tests/data/agent_trace.jsonl is not valid "
             "JSON (Extra data: line 2 column 1 (char 252))")),
    (["experts", "plan", *COUNTS, "--previous", "tests/data/expert_load_zipf_896x12.json",
      "--max-moves", "2"], ("k3serve experts plan: error: --previous: "
                            "tests/data/expert_load_zipf_896x12.json is not a plan (layers: a "
                            "plan needs a non-empty list of layers)")),
    (["plan", "--config", MISSING],
     f"k3serve plan: error: --config: cannot read {MISSING} {NO_FILE}"),
    (["plan", "--config", "tests/data/agent_trace.jsonl"],
     ("k3serve plan: error: --config: tests/data/agent_trace.jsonl is not valid YAML: expected "
      "'<document start>', but found '{' (line 2, column 1)")),
    (["simulate", "--trace", MISSING],
     f"k3serve simulate: error: --trace: cannot read {MISSING} {NO_FILE}"),
    (["simulate", *TRACE, "--calibration", MISSING],
     f"k3serve simulate: error: --calibration: cannot read {MISSING} {NO_FILE}"),
    (["simulate", *TRACE, "--rate", "-5"],
     "k3serve simulate: error: --rate: must be a finite number > 0, got -5.0"),
    (["simulate", *TRACE, "--cache-fraction", "-1"],
     "k3serve simulate: error: --cache-fraction: must be a finite number > 0, got -1.0"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_bad_input_is_one_line_naming_the_command_and_the_flag(argv, line, capsys):
    """Every command's missing file and bad number: ``k3serve COMMAND: error: --FLAG: ...``
    (a file's reason in words, not ``[Errno 2]``), exit status 2."""
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]


def test_an_unwritable_output_names_its_flag(tmp_path, monkeypatch, capsys):
    from cli.bench import client

    out = tmp_path / "no-such-dir" / "plan.json"
    assert main(["experts", "plan", *COUNTS, "--json", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"k3serve experts plan: error: --json: cannot write {out} {NO_FILE}"]
    monkeypatch.setattr(client, "run_load", lambda *a, **k: _run(0))
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    out = blocked / "bench.json"
    assert main(["bench", "--url", "http://127.0.0.1:9", "--rate", "10", "--num", "3",
                 "--no-progress", "--json", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"k3serve bench: error: --json: cannot write {out} (File exists)"]


@pytest.mark.parametrize("spec", ["3", "a:b", "1:2:3", "0:1"])
def test_simulate_workers_must_be_p_colon_d(spec, capsys):
    """``--workers`` takes ``P:D`` only, as its help says (a bare ``3`` is refused, not read as
    3:3); the message names the flag once."""
    with pytest.raises(SystemExit) as e:
        main(["simulate", *TRACE, "--workers", spec])
    assert e.value.code == 2
    want = ("expected P:D with P ≥ 1, D ≥ 0" if spec == "0:1" else "expected P:D")
    assert capsys.readouterr().err.strip().splitlines() == [
        (f"k3serve simulate: error: argument --workers: {want}, got {spec!r} (k3serve simulate "
         "--help lists the flags)")]


BENCH = ["bench", "--url", "http://127.0.0.1:1"]
SLICE = ["--trace", "traces/mooncake_ci_slice_3940_3963.jsonl"]
SIM = ["simulate", *SLICE, "--workers", "2:2", "--cache-fraction", "1", "--no-progress",
       "--policy", "random"]


@pytest.mark.parametrize("argv,line", [
    ([*BENCH, *SLICE, "--time-scale", "nan"],
     "argument --time-scale: must be a finite number > 0, got 'nan'"),
    ([*BENCH, *SLICE, "--time-scale", "inf"],
     "argument --time-scale: must be a finite number > 0, got 'inf'"),
    ([*BENCH, "--trace", MISSING, "--time-scale", "0"],
     "argument --time-scale: must be a finite number > 0, got '0'"),
    ([*BENCH, "--rate", "4", "--num", "0"], "argument --num: must be an integer ≥ 1, got '0'"),
    ([*BENCH, "--rate", "4", "--input-len", "0"],
     "argument --input-len: must be an integer ≥ 1, got '0'"),
    ([*BENCH, "--rate", "4", "--output-len", "-5"],
     "argument --output-len: must be an integer ≥ 1, got '-5'"),
    ([*BENCH, "--rate", "4", "--slo-ttft", "-1"],
     "argument --slo-ttft: must be a finite number > 0, got '-1'"),
    ([*BENCH, *SLICE, "--limit", "0"], "argument --limit: must be an integer ≥ 1, got '0'"),
    ([*SIM, "--jobs", "0"], "argument --jobs: must be an integer ≥ 1, got '0'"),
    ([*SIM, "--jobs", "-2"], "argument --jobs: must be an integer ≥ 1, got '-2'"),
    ([*SIM, "--time-scale", "inf"],
     "argument --time-scale: must be a finite number > 0, got 'inf'"),
    ([*SIM, "--limit", "0"], "argument --limit: must be an integer ≥ 1, got '0'"),
    ([*SIM, "--length-scale", "0.125", "--num-pages", "0"],
     "argument --num-pages: must be an integer ≥ 1, got '0'"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_a_degenerate_number_is_refused_while_parsing(argv, line, capsys):
    """A count below 1, or a time scale, length scale or SLO that is no finite number > 0, is
    refused by bench's and simulate's parsers before anything runs: one line naming the flag
    and the value, exit status 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    cmd = f"k3serve {argv[0]}"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{cmd}: error: {line} ({cmd} --help lists the flags)"]


def test_simulate_keeps_minus_one_dense_snapshot_blocks_as_the_automatic_rule():
    """``--dense-snapshot-blocks -1`` is the workers' automatic rule (its help says so), not a
    bad value; below it is refused."""
    from simulate.cli import build_parser

    args = build_parser().parse_args([*SIM[1:], "--dense-snapshot-blocks", "-1"])
    assert args.dense_snapshot_blocks == -1


def test_plan_with_a_config_that_is_not_yaml_is_one_line(tmp_path, capsys):
    """PyYAML's error (its excerpt and caret over four lines) becomes one line that keeps the
    line and column."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  prefill: [1, 2\n  decode: 3\n")
    assert main(["plan", "--config", str(bad)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        (f"k3serve plan: error: --config: {bad} is not valid YAML: while parsing a flow "
         "sequence: expected ',' or ']', but got ':' (line 3, column 9)")]


@pytest.mark.parametrize("argv,line", [
    (["info", "--bogus"], "unrecognized arguments: --bogus"),
    (["generate"], "the following arguments are required: --prompt"),
    (["generate", "--prompt", "hi", "--max-tokens", "abc"],
     "argument --max-tokens: invalid int value: 'abc'"),
    (["bench", "--url", "http://127.0.0.1:9", "--rate", "abc"],
     "argument --rate: invalid float value: 'abc'"),
    (["experts"], "the following arguments are required: COMMAND"),
    (["experts", "plan", *COUNTS, "--ranks", "x"], "argument --ranks: invalid int value: 'x'"),
    (["plan"], "the following arguments are required: --config"),
    (["simulate", *TRACE, "--bogus"], "unrecognized arguments: --bogus"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_a_usage_error_is_one_line_naming_the_command(argv, line, capsys):
    """As ``k3serve serve``'s: ``k3serve COMMAND: error: ... (k3serve COMMAND --help lists the
    flags)``, exit status 2, no usage block."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors exit; an unknown flag is main()'s answer
        code = e.code
    assert code == 2
    cmd = "k3serve " + " ".join(a for a in argv[:2] if not a.startswith("-"))
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{cmd}: error: {line} ({cmd} --help lists the flags)"]


def test_a_model_folder_whose_config_is_not_json_is_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    file = tmp_path / "config.json"
    why = "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    for cmd in (["info"], ["generate", "--prompt", "hi"], ["bench", "--url", "http://x",
                                                           "--rate", "1"]):
        assert main([*cmd, "--model", str(tmp_path)]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"k3serve {cmd[0]}: error: --model: {file} is not valid JSON ({why})"]


def test_a_model_folder_whose_config_is_not_json_from_the_shell(tmp_path):
    (tmp_path / "config.json").write_text("nope")
    r = subprocess.run([sys.executable, "-m", "cli", "info", "--model", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        (f"k3serve info: error: --model: {tmp_path / 'config.json'} is not valid JSON "
         "(Expecting value: line 1 column 1 (char 0))")], r.stderr


def _help(cmd: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: "-".join(c))
def test_help_shows_each_default_once(cmd, capsys):
    text = " ".join(_help(cmd, capsys).split())  # one line: wrapped help joined
    assert text.startswith(f"usage: k3serve {' '.join(cmd)}"), text[:80]
    assert not re.search(r"\(default:[^()]*\)\s*\(default:", text), text
    assert "default: None" not in text and "(default: False)" not in text, text


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: "-".join(c))
def test_help_says_what_the_command_does(cmd, capsys):
    """Every command's ``--help`` has a description line between its usage and its flags."""
    text = _help(cmd, capsys)
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    assert paragraphs[0].startswith("usage:"), text[:80]
    assert not paragraphs[1].lstrip().startswith(("options:", "positional arguments:")), text


def test_help_still_shows_real_defaults(capsys):
    text = " ".join(_help(["bench"], capsys).split())
    assert "(default: 0.125)" in text and "(default: --length-scale)" in text
    assert "(default: k3-tiny)" in text
    text = " ".join(_help(["generate"], capsys).split())
    assert "(0: greedy) (default: 0.0)" in text and "(default: 64)" in text
    text = " ".join(_help(["serve"], capsys).split())
    assert "(default: 8000)" in text and "(default: prefix_home)" in text


def _run(oracle: int) -> RunOutcome:
    res = [RequestResult(sent_s=0.1 * i, prompt_len=100, max_tokens=4, oracle_cached=oracle,
                         first_s=0.1 * i + 0.05, chunk_s=[0.1 * i + 0.06, 0.1 * i + 0.08],
                         done_s=0.1 * i + 0.08, prompt_tokens=100, completion_tokens=3,
                         cached_tokens=20 * i)
           for i in range(3)]
    return RunOutcome(res, 1.0, [], {}, {})


def test_bench_summary_on_random_load_has_units_and_no_none():
    work = random_load(rate=10.0, input_len=8, output_len=4, num=3, vocab_size=100)
    assert work.oracle_hit_rate is None
    lines = format_summary(summarize(_run(0), work))
    assert len(lines) == len(SUMMARY)
    assert not any("None" in ln for ln in lines), lines
    rows = dict(ln.split(None, 1) for ln in lines)
    assert rows["oracle_hit_rate"] == "n/a (random load: no trace oracle)"
    assert rows["snapshot_rule_ceiling"] == "n/a (random load: no trace oracle)"
    assert rows["num_requests"] == "3 requests"
    assert rows["num_skipped"] == "0 trace rows"
    assert rows["ttft_p50_s"] == "0.0500 s"
    assert rows["hit_rate"] == "20.00 %"  # (0 + 20 + 40) / 300 prompt tokens
    assert rows["output_tokens_per_s"] == "9.0000 tokens/s"
    assert rows["goodput"] == "3.0000 requests/s"
    for key, unit in SUMMARY:
        assert rows[key].endswith(unit) or rows[key].startswith("n/a"), (key, rows[key])
    # the plot agrees: no oracle line for a random load
    assert [name for name, *_ in hit_rate_series(_run(0), oracle=False)] == [
        "actual (cached_tokens)"]


def test_bench_summary_on_a_trace_prints_the_oracle_in_percent():
    work = Workload([], 0, 0.5, 0.25)
    rows = dict(ln.split(None, 1) for ln in format_summary(summarize(_run(50), work)))
    assert rows["oracle_hit_rate"] == "50.00 %" and rows["snapshot_rule_ceiling"] == "25.00 %"
    series = hit_rate_series(_run(50), oracle=True)
    assert [name for name, *_ in series] == ["actual (cached_tokens)",
                                             "token oracle (infinite cache)"]
    assert series[1][2][-1] == pytest.approx(50.0)  # 150 oracle tokens of 300


def test_bench_summary_without_a_finished_request_says_why():
    work = random_load(rate=10.0, input_len=8, output_len=4, num=1, vocab_size=100)
    failed = RunOutcome([RequestResult(0.0, 8, 4, error="boom")], 1.0, [], {}, {})
    rows = dict(ln.split(None, 1) for ln in format_summary(summarize(failed, work)))
    assert rows["ttft_p50_s"] == "n/a (no request finished)"
    assert rows["num_failed"] == "1 requests"
    assert hit_rate_series(failed) == []


def test_bench_prints_the_summary(monkeypatch, capsys, tmp_path):
    """``k3serve bench --rate`` end to end with the client replaced: the printed summary is
    :func:`format_summary`'s, and the hit-rate plot is written without an oracle line."""
    from cli.bench import client, plots

    monkeypatch.setattr(client, "run_load", lambda *a, **k: _run(0))
    drawn: list[bool] = []
    real = plots.write_plots

    def spy(run, out_dir, **kw):
        drawn.append(kw.get("oracle", True))
        return real(run, out_dir, **kw)

    monkeypatch.setattr(plots, "write_plots", spy)
    rc = main(["bench", "--url", "http://127.0.0.1:9", "--rate", "10", "--num", "3",
               "--no-progress", "--plots", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "None" not in out and "oracle_hit_rate          n/a" in out
    assert drawn == [False] and (tmp_path / "hit_rate.png").exists()


class _Unauthorized(http.server.BaseHTTPRequestHandler):
    """Answers every request 401 with the router's OpenAI-style body unless it carries
    ``Bearer right``; records each Authorization header."""

    seen: ClassVar[list[str | None]] = []

    def _answer(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        if self.headers.get("Authorization") == "Bearer right":
            body, status = b"k3serve:num_requests_waiting 0\n", 200
        else:
            body, status = json.dumps({"error": {
                "message": "Incorrect API key provided.", "type": "invalid_request_error",
                "param": None, "code": "invalid_api_key"}}).encode(), 401
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def unauthorized_server():
    _Unauthorized.seen = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unauthorized)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


BENCH_ARGS = ["--rate", "inf", "--num", "1", "--input-len", "4", "--output-len", "1",
              "--no-progress"]


def test_bench_401_is_one_line_with_the_servers_message(unauthorized_server, monkeypatch,
                                                        capsys):
    monkeypatch.delenv("K3SERVE_API_KEY", raising=False)
    rc = main(["bench", "--url", unauthorized_server, "--api-key", "wrong", *BENCH_ARGS])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [(f"k3serve bench: error: HTTP 401 Unauthorized from GET {unauthorized_server}"
                   "/metrics: Incorrect API key provided. (give the key with --api-key or "
                   "K3SERVE_API_KEY)")], err
    assert _Unauthorized.seen == ["Bearer wrong"]


def test_bench_reads_the_api_key_from_the_environment(unauthorized_server, monkeypatch,
                                                      capsys):
    """``K3SERVE_API_KEY`` is the bearer key when ``--api-key`` is not given; ``--api-key``
    wins over it. A request that fails with an HTTP error is one line, with the message."""
    monkeypatch.setenv("K3SERVE_API_KEY", "right")
    rc = main(["bench", "--url", unauthorized_server, *BENCH_ARGS])
    out = capsys.readouterr()
    assert _Unauthorized.seen and set(_Unauthorized.seen) == {"Bearer right"}
    # /metrics answers 200, the completion too (a body without events): no token came
    assert rc == 1 and "num_failed               1 requests" in out.out, out
    _Unauthorized.seen.clear()
    assert main(["bench", "--url", unauthorized_server, "--api-key", "wrong", *BENCH_ARGS]) == 2
    assert _Unauthorized.seen == ["Bearer wrong"]


def test_bench_without_a_server_is_one_line(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert main(["bench", "--url", f"http://127.0.0.1:{port}", *BENCH_ARGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"k3serve bench: error: cannot reach GET http://127.0.0.1:{port}/metrics: "), err


def test_bench_failed_request_prints_the_servers_message():
    """A completion answered 4xx is recorded as ``HTTP 4xx: MESSAGE`` (no raw bytes repr)."""
    import httpx

    from cli.bench.client import error_message

    r = httpx.Response(400, json={"error": {"message": "max_tokens: must be >= 1",
                                            "type": "invalid_request_error", "code": None}})
    assert error_message(r) == "max_tokens: must be >= 1"
    assert error_message(httpx.Response(503, json={"error": "draining",
                                                   "message": "worker is draining"})) == (
        "worker is draining")
    assert error_message(httpx.Response(502, text="Bad Gateway")) == "Bad Gateway"


def _parsers():
    """Every parser behind ``k3serve`` (each subcommand, nested ones included) and the
    router's and workers' entry points: ``(name, parser)``."""
    import argparse

    from cli.main import build_parser
    from deploy.plan import build_parser as plan_parser
    from deploy.serve import build_parser as serve_parser
    from router.config import build_parser as router_parser
    from simulate.cli import build_parser as simulate_parser
    from worker.config import WorkerEnv
    from worker.config import build_parser as worker_parser

    out = []

    def walk(name: str, p: argparse.ArgumentParser) -> None:
        out.append((name, p))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    if sub not in ("serve", "plan", "simulate"):  # their flags: below
                        walk(f"{name} {sub}", sp)

    walk("k3serve", build_parser())
    for name, p in [("k3serve serve", serve_parser()), ("k3serve plan", plan_parser()),
                    ("k3serve simulate", simulate_parser()), ("python -m router", router_parser()),
                    ("python -m prefill.worker", worker_parser("prefill", WorkerEnv())),
                    ("python -m decode.worker", worker_parser("decode", WorkerEnv()))]:
        walk(name, p)
    return out


def _options(p):
    import argparse

    return [a for a in p._actions
            if a.option_strings and a.help != argparse.SUPPRESS]


@pytest.mark.parametrize("name,parser", _parsers(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_option_has_a_help_text(name, parser):
    missing = [a.option_strings[0] for a in _options(parser) if not (a.help or "").strip()]
    assert not missing, f"{name}: options without a help text: {missing}"


@pytest.mark.parametrize("name,parser", _parsers(), ids=lambda x: x if isinstance(x, str) else "")
def test_help_texts_name_only_flags_of_their_command(name, parser):
    """A help text that points at another flag (``default: 0.9 / --workers-per-gpu``) names
    one this command has; another command's flag is named with its owner (``the router's
    --prefill-rate``, ``k3serve serve --block-size``, a command in backticks)."""
    flags = {f for a in parser._actions for f in a.option_strings}
    flags |= {"--no-" + f[2:] for f in flags}
    owned = r"`[^`]*`|(?:'s|\bk3serve(?: [a-z]+)+|python -m \S+) --[a-z0-9-]+"
    wrong = {(a.option_strings[0], f) for a in _options(parser)
             for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*",
                                 re.sub(owned, "", a.help or ""))
             if f not in flags}
    assert not wrong, f"{name}: help names flags it does not have: {sorted(wrong)}"


def _no_stack(monkeypatch):
    """``k3serve serve`` must refuse before starting anything: starting fails the test."""
    import deploy.serve

    def start_stack(**kw):
        raise AssertionError("a stack was started")

    monkeypatch.setattr(deploy.serve, "start_stack", start_stack)


@pytest.mark.parametrize("flags,line", [
    (["--model", "/nonexistent"], ("--model: /nonexistent does not exist; give a model checkout "
                                  "folder or a preset (k3, k3-mini, k3-tiny)")),
    (["--prefill", "0"], "--prefill: must be >= 1 (got 0)"),
    (["--decode", "0"], "--decode: must be >= 1 (got 0)"),
    (["--routers", "0"], "--routers: must be >= 1 (got 0)"),
    (["--monolithic", "-1"], "--monolithic: must be >= 0 (got -1)"),
    (["--block-size", "0"], "--block-size: must be >= 1 (got 0)"),
    (["--port", "70000"], "--port: must be 0-65535 (got 70000)"),
    (["--prefill-rate", "0"], "prefill_rate: must be > 0 (got 0.0)"),
    (["--max-model-len", "0"], "max_model_len: must be >= 1 (got 0)"),
])
def test_serve_refuses_bad_flags_in_one_line(flags, line, monkeypatch, capsys):
    _no_stack(monkeypatch)
    assert main(["serve", *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"k3serve serve: error: {line}"]


def test_serve_refuses_a_folder_that_is_not_a_model(tmp_path, monkeypatch, capsys):
    _no_stack(monkeypatch)
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        (f"k3serve serve: error: --model: {tmp_path} is not a model checkout (no config.json "
        "in it)")]
    (tmp_path / "config.json").write_text("{not json")
    assert main(["serve", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"k3serve serve: error: --model: {tmp_path}: its config cannot be used ("), err
    file = tmp_path / "config.json"
    assert main(["serve", "--model", str(file)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        (f"k3serve serve: error: --model: {file} is not a folder; give a model checkout folder "
        "or a preset (k3, k3-mini, k3-tiny)")]


def test_serve_refuses_a_taken_port_and_a_bad_choice_in_one_line(monkeypatch, capsys):
    _no_stack(monkeypatch)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        (f"k3serve serve: error: port {port} on 127.0.0.1 is already in use; choose another "
        "with --port")]
    with pytest.raises(SystemExit) as e:
        main(["serve", "--policy", "bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "k3serve serve: error: argument --policy: invalid choice: 'bogus'"), err


def test_serve_with_a_missing_model_from_the_shell_starts_nothing():
    r = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--model", "/nonexistent"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    out, err = r.communicate(timeout=120)
    assert r.returncode == 2, err
    assert "Traceback" not in err and err.strip().splitlines() == [
        ("k3serve serve: error: --model: /nonexistent does not exist; give a model checkout "
        "folder or a preset (k3, k3-mini, k3-tiny)")], err
    assert out == ""
    left = session_left(r.pid)  # anything still in the launcher's session (its leader)
    assert left == []


@pytest.mark.parametrize("cmd", [["plan", "--config", "deploy/configs/supernode-64.yaml"],
                                 ["experts", "plan", "--counts",
                                  "tests/data/expert_load_zipf_896x12.json", "--ranks", "64",
                                  "--redundant", "64"]], ids=["plan", "experts-plan"])
def test_a_reader_that_stops_reading_ends_the_command_quietly(cmd):
    """``k3serve plan ... | head -1``: no traceback and no error line when head exits."""
    p = subprocess.Popen([sys.executable, "-m", "cli", *cmd], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # before the command writes: its first write meets a closed pipe
    err = p.stderr.read()
    assert p.wait(120) == 1 and err == "", err


def test_serve_ray_refuses_the_store_in_one_line(monkeypatch, capsys):
    """The Ray backend runs no store master: an explicit ``--store`` is refused, not ignored."""
    _no_stack(monkeypatch)
    assert main(["serve", "--ray", "--config", "deploy/configs/local-cpu.yaml", "--store"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3serve serve: error: --store: the Ray backend")


def test_a_signal_passed_on_again_by_a_wrapper_counts_once(monkeypatch):
    """``make serve`` passes a SIGTERM sent to the group on to the launcher once more: within
    ``Stopper.REPEAT_S`` it is the same signal (the drain goes on); later, a second one kills."""
    import signal

    from deploy import serve as serve_mod

    killed = []

    class FakeStack:
        stopping = False

        def kill(self):
            killed.append(True)

    clock = [100.0]
    monkeypatch.setattr(serve_mod.time, "monotonic", lambda: clock[0])
    s = serve_mod.Stopper()
    s.stack = FakeStack()
    s.handle(signal.SIGTERM, None)
    assert s.requested and s.stack.stopping and not killed
    clock[0] += s.REPEAT_S / 2
    s.handle(signal.SIGTERM, None)
    assert not killed
    clock[0] += s.REPEAT_S
    s.handle(signal.SIGINT, None)
    assert killed == [True]


def test_a_negative_drain_timeout_is_refused():
    """A negative ``--drain-timeout`` would skip the drain and cut the streams in flight."""
    from worker.config import parse_config

    with pytest.raises(ValueError, match=r"drain_timeout_s: must be >= 0 \(got -5.0\)"):
        parse_config("decode", ["--drain-timeout", "-5", "--device", "cpu"])


def test_version_and_a_missing_command(capsys):
    """``k3serve --version`` prints the installed version; ``k3serve`` alone names what is
    missing in the words of its usage line (``COMMAND``)."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"k3serve {version('k3serve')}"
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: k3serve [-h] [--version] COMMAND ..." in err
    assert err.strip().splitlines()[-1] == (
        "k3serve: error: the following arguments are required: COMMAND")
