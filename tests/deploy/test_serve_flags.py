"""``k3serve serve`` refuses bad worker flags and a ``--max-model-len`` past the model's
context length in one line (exit status 2) before anything starts: the worker flags it
passes on are parsed by the workers' own parser and their engine config is built in the
serve process (``deploy.serve.check_worker_flags``, ``worker.config.check_flags``); the
router refuses the same ``--max-model-len`` at its own start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from tests.worker_procs import session_left

ROOT = Path(__file__).resolve().parents[2]


class Started(Exception):
    """``start_stack`` was reached: every check passed."""


def _no_stack(monkeypatch):
    """``start_stack`` raises :class:`Started`; the router port counts as free (a stack the
    user runs on the default port meanwhile changes nothing here)."""
    import deploy.serve

    def start_stack(**kw):
        raise Started(kw)

    monkeypatch.setattr(deploy.serve, "start_stack", start_stack)
    monkeypatch.setattr(deploy.serve, "check_port_free", lambda host, port: None)


@pytest.mark.parametrize("flags,line", [
    (["--num-pages", "-5"], "--num-pages: must be an int ≥ 1, got -5"),
    (["--num-slots", "0"], "--num-slots: must be an int ≥ 1, got 0"),
    (["--num-snapshots", "-1"], "--num-snapshots: must be an int ≥ 0, got -1"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens: must be an int ≥ 1, got 0"),
    (["--max-num-seqs", "-2"], "--max-num-seqs: must be an int ≥ 1 or None, got -2"),
    (["--dense-snapshot-blocks", "-2"], "--dense-snapshot-blocks: must be an int ≥ -1, got -2"),
    (["--gpu-memory-utilization", "2"],
     "--gpu-memory-utilization: must be a number in (0, 1] or None, got 2.0"),
    (["--drain-timeout", "-1"], "--drain-timeout: must be >= 0 (got -1.0)"),
    (["--max-prefill-backlog", "-3"], "--max-prefill-backlog: must be ≥ 0, got -3"),
    (["--worker-max-queued", "-1"], "--worker-max-queued: must be ≥ 0, got -1"),
    (["--tp", "0"], "--tp: must be ≥ 1, got 0"),
    (["--expert-plan", "plan.json"], "--expert-plan: needs --ep > 1"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"],
     "--speculative: SpecConfig.num_speculative_tokens: must be in [1, 64], got 0"),
    (["--max-model-len", "8193"], ("--max-model-len: 8193 is above the context length of "
                                   "k3-tiny (8192 tokens, max_position_embeddings)")),
], ids=lambda x: x[0][2:] if isinstance(x, list) else "")
def test_serve_refuses_a_bad_worker_flag_in_one_line(flags, line, monkeypatch, capsys):
    _no_stack(monkeypatch)
    assert main(["serve", "--no-store", "--device", "cpu", *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"k3serve serve: error: {line}"]


def test_monolithic_workers_get_the_decode_workers_checks(monkeypatch, capsys):
    """``--monolithic N`` starts decode workers only: their parser checks the flags."""
    _no_stack(monkeypatch)
    assert main(["serve", "--no-store", "--monolithic", "1", "--device", "cpu",
                 "--num-pages", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "k3serve serve: error: --num-pages: must be an int ≥ 1, got 0"]


@pytest.mark.parametrize("flags", [
    [], ["--num-pages", "64", "--max-num-seqs", "8", "--speculative", "ngram"],
    ["--max-model-len", "8192"], ["--drain-timeout", "0", "--max-prefill-backlog", "0"],
    ["--gpu-memory-utilization", "0.5", "--no-cuda-graphs"],
])
@pytest.mark.parametrize("device", ["cpu", None])
def test_good_worker_flags_reach_the_start(flags, device, monkeypatch):
    _no_stack(monkeypatch)
    dev = ["--device", device] if device else []
    with pytest.raises(Started) as e:
        main(["serve", "--no-store", *dev, *flags])
    passed = e.value.args[0]["extra_worker_args"]
    for f in flags:
        if f.startswith("--") and f != "--max-model-len":
            assert f in passed


def test_worker_check_names_an_unknown_flag():
    """An unknown worker flag (``k3serve serve``'s own parser refuses it first; the worker
    parser's check names it too)."""
    from worker.config import check_flags

    with pytest.raises(ValueError, match=r"^unrecognized worker flags: --bogus 1$"):
        check_flags(["--bogus", "1"], "cpu")
    with pytest.raises(ValueError, match=r"^argument --num-pages: invalid int value: 'x'$"):
        check_flags(["--num-pages", "x"], "cpu")


def test_router_refuses_a_max_model_len_past_the_model():
    """The router's own start (``python -m router`` builds its config with
    ``config_from_args``) refuses it too; up to the model's length is accepted."""
    from router.config import build_parser, config_from_args

    with pytest.raises(ValueError) as e:
        config_from_args(build_parser().parse_args(["--max-model-len", "9000"]))
    assert str(e.value) == ("--max-model-len: 9000 is above the context length of k3-tiny "
                            "(8192 tokens, max_position_embeddings)")
    ok = config_from_args(build_parser().parse_args(["--max-model-len", "8192"]))
    assert ok.max_model_len == 8192


def test_a_bad_worker_flag_from_the_shell_starts_nothing():
    """From the shell: one line, exit status 2, no traceback from any worker, and no process
    left in the launcher's session (none was started)."""
    r = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", "0", "--no-store",
                          "--device", "cpu", "--num-pages", "-5"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    out, err = r.communicate(timeout=120)
    assert r.returncode == 2, err
    assert err.strip().splitlines() == [
        "k3serve serve: error: --num-pages: must be an int ≥ 1, got -5"], err
    assert out == ""
    assert session_left(r.pid) == []


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_serve_refuses_an_otlp_endpoint_without_a_scheme_in_one_line(how, monkeypatch, capsys):
    """The router and the workers would refuse it at their start; ``serve`` refuses it first,
    in one line, whether it comes as the flag or as the OpenTelemetry environment variable."""
    from k3serve.tracing import ENDPOINT_ENV

    _no_stack(monkeypatch)
    monkeypatch.delenv(ENDPOINT_ENV, raising=False)
    flags = ["--otlp-traces-endpoint", "127.0.0.1:4318"] if how == "flag" else []
    if how == "environment":
        monkeypatch.setenv(ENDPOINT_ENV, "127.0.0.1:4318")
    assert main(["serve", "--no-store", "--device", "cpu", *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        (f"k3serve serve: error: --otlp-traces-endpoint / ${ENDPOINT_ENV}: expected an "
         "http(s) URL such as http://127.0.0.1:4318, got '127.0.0.1:4318'")]


@pytest.mark.parametrize("flags,line", [
    (["--device", "tpu"], "argument --device: must be cpu, cuda or cuda:N (got 'tpu')"),
    (["--device", "cuda:x"], "argument --device: must be cpu, cuda or cuda:N (got 'cuda:x')"),
    (["--log-level", "loud"], ("argument --log-level: must be one of critical, error, warning, "
                               "info, debug (got 'loud')")),
], ids=["device", "device-index", "log-level"])
def test_serve_refuses_a_bad_device_or_log_level_before_anything_starts(flags, line,
                                                                         monkeypatch, capsys):
    """The workers and the router would each fail at their start with a traceback; the
    launcher's parser refuses the value in one line."""
    _no_stack(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--no-store", *flags])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"k3serve serve: error: {line} (k3serve serve --help lists the flags)"]


def test_log_level_and_device_are_read_in_any_case(monkeypatch):
    _no_stack(monkeypatch)
    with pytest.raises(Started) as e:
        main(["serve", "--no-store", "--device", "CPU", "--log-level", "DEBUG"])
    assert e.value.args[0]["device"] == "cpu"
    assert e.value.args[0]["extra_router_args"] == ["--log-level", "debug"]


@pytest.mark.parametrize("device,count,line", [
    ("cuda", 0, "--device: 'cuda' asked for, but torch sees no CUDA device"),
    ("cuda:2", 2, ("--device: 'cuda:2' asked for, but torch sees 2 CUDA devices (cuda:0 to "
                   "cuda:1)")),
])
def test_serve_refuses_a_cuda_device_the_machine_lacks(device, count, line, monkeypatch,
                                                       capsys):
    import torch

    _no_stack(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert main(["serve", "--no-store", "--device", device]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"k3serve serve: error: {line}"]


def test_serve_takes_several_api_keys_and_the_router_accepts_each(monkeypatch):
    """``--api-key K1 K2 --api-key K3`` reaches the launcher as three keys; they travel to the
    router in the environment (never in ``ps``) and the router accepts every one."""
    from k3serve.protocol import API_KEY_ENV, api_keys_env
    from router.config import build_parser, config_from_args

    _no_stack(monkeypatch)
    with pytest.raises(Started) as e:
        main(["serve", "--no-store", "--device", "cpu", "--api-key", "k1", "k2",
              "--api-key", "k3"])
    keys = e.value.args[0]["api_key"]
    assert keys == ["k1", "k2", "k3"]
    monkeypatch.setenv(API_KEY_ENV, api_keys_env(keys))
    cfg = config_from_args(build_parser().parse_args([]))
    assert (cfg.api_key, cfg.api_keys) == ("k1", ("k2", "k3"))
    with pytest.raises(ValueError, match=r"^--api-key: a key must be non-empty"):
        api_keys_env(["k1", "two words"])


def test_serve_refuses_an_empty_api_key_in_one_line(monkeypatch, capsys):
    _no_stack(monkeypatch)
    assert main(["serve", "--no-store", "--device", "cpu", "--api-key", ""]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        ("k3serve serve: error: --api-key: a key must be non-empty and hold no whitespace "
         "(got 0 characters)")]


def test_make_serve_echoes_its_command_with_the_api_keys_masked():
    """``make serve`` prints the command it runs; the keys in ``ARGS`` show as ``***``
    (``-o install``: the environment is taken as installed; the bad ``--port`` ends the run
    at the parser)."""
    args = "ARGS=--api-key sekrit other --api-key=third --api-key-file k.txt --port"
    r = subprocess.run(["make", "-s", "-o", "install", "serve", args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0
    assert "sekrit" not in r.stdout + r.stderr and "third" not in r.stdout + r.stderr
    assert r.stdout.splitlines()[0].endswith(
        "--api-key *** *** --api-key=*** --api-key-file k.txt --port"), r.stdout
