"""The command line fails like a command line: a bad value is argparse's one-line error
(exit 2) before anything starts, ``--help`` is fast, explicit flags beat ``--quick``, and a
cluster address nothing answers at fails within ``--timeout`` (exit 1, one line)."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from apps.cli import _parser, main
from apps.cli_args import MODEL_PRESETS
from apps.cli_experiments import experiment_options


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["demo", "--write-policy", "bogus"], "invalid choice: 'bogus'"),
        (["demo", "--model", "bogus"], "invalid choice: 'bogus'"),
        (["demo", "--user", "abc"], "not N or LOW-HIGH"),
        (["demo", "--answer", "9-3"], "LOW <= HIGH"),
        (["demo", "--page-size", "3", "--quick"], "page_size=3"),
        (["demo", "--clients", "-1", "--quick"], "-1 is not positive"),
        (["demo", "--rate", "nan"], "not a finite number"),
        (["demo", "--quick", "--device-tokens", "8"], "device_tokens"),
        (["bench", "multiturn", "--modes", "bogus"], "unknown ['bogus']"),
        (["bench", "multiturn", "--tp", "3", "--quick"], "tp_size"),
        (["bench", "faults", "--scenarios", "bogus"], "unknown ['bogus']"),
        (["bench", "serve", "--modes", "l1"], "unknown ['l1']"),
        (["bench", "serve", "--http", "--rate", "2"], "closed loop"),
        (["bench", "trace", "--overload", "maybe"], "'maybe' is not a switch value"),
        (["bench", "pd", "--prompt-tokens", "100"], "outside [1024, 32768]"),
        (["bench", "pd", "--decode-tp", "3"], "invalid choice: 3"),
        (["bench", "pd", "--faults", "--sweep"], "not allowed with argument --faults"),
        (["serve", "--model", "tiny", "--prefill-tp", "2"], "decode_tp"),
        (["serve", "--model", "tiny", "--prefill-replicas", "2"], "prefill_replicas"),
        (["bench", "storage", "--device", "cpu"], "unrecognized arguments: --device"),
        (["bench", "runtime", "--device", "cpu"], "unrecognized arguments: --device"),
        (["bench", "micro", "--device", "gpu"], "not auto, cpu, cuda or cuda:N"),
        (["stats", "--address", "ftp://x:1"], "is not auto, HOST:PORT"),
        (["stats", "--address", "localhost"], "needs a port"),
        (["stats", "--timeout", "0"], "not positive"),
        (["serve", "--model", "tiny", "--page-size", "x"], "page_size"),
        (["serve", "--model", "nowhere/at/all"], "nowhere/at/all"),
        (["serve", "--model", "tiny", "--storage-bytes", "-1"], "capacity_bytes=-1"),
        (["serve", "--model", "tiny", "--api-key-sha256", "abc"], "not a SHA-256 hex digest"),
        (["serve", "--model", "tiny", "--api-keys", "/nowhere/keys"], "api_keys="),
    ],
)
def test_a_bad_value_is_one_line_exit_2_before_anything_starts(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    started = ray.is_initialized()
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and err[-1].startswith("hicache-ray"), err
    assert "Traceback" not in "\n".join(err)
    assert ray.is_initialized() == started  # nothing was started


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "micro", "--device", "cuda", "--quick"])
    assert exited.value.code == 2
    assert "CUDA is not available here" in capsys.readouterr().err


def test_help_is_fast_and_imports_neither_torch_nor_ray() -> None:
    code = (
        "import sys\n"
        "from apps.cli import main\n"
        "for argv in (['--help'], ['demo', '--help'], ['bench', 'storage', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('HEAVY', 'torch' in sys.modules, 'ray' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY False False" in done.stdout  # fast: neither torch nor Ray is imported
    assert "[bench; --quick: tiny4]" in done.stdout  # defaults (and --quick's) are shown
    assert "{tiny,tiny4,bench}" in done.stdout  # choices are shown


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("hicache-ray 0.")


def test_explicit_flags_beat_quick() -> None:
    args = _parser().parse_args(["demo", "--quick", "--clients", "5", "--page-size", "8"])
    opts = experiment_options(args)
    assert (opts.clients, opts.page_size, opts.model, opts.rounds) == (5, 8, "tiny4", 2)
    plain = experiment_options(_parser().parse_args(["bench", "multiturn"]))
    assert (plain.clients, plain.model) == (12, "bench")


def test_the_cli_knows_what_the_code_knows() -> None:
    from apps.multiturn.options import ExperimentOptions
    from hicache_ray.engine.model import PRESETS

    assert set(MODEL_PRESETS) == set(PRESETS)
    assert ExperimentOptions().model in PRESETS


@pytest.fixture
def not_ray() -> Iterator[int]:
    """A port that accepts connections and answers HTTP, not Ray."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "apps.cli", *argv], capture_output=True, text=True, timeout=60
    )


def test_an_address_nothing_answers_at_fails_within_the_timeout(not_ray: int) -> None:
    for address in ("127.0.0.1:1", f"127.0.0.1:{not_ray}", "ray://127.0.0.1:1"):
        start = time.monotonic()
        done = _cli("stats", "--address", address, "--timeout", "2")
        assert done.returncode == 1, done.stderr
        # bounded by the timeout (plus the interpreter and Ray's import, slow on a loaded
        # machine: the bound only tells a bounded wait from a hang)
        assert time.monotonic() - start < 60
        lines = [line for line in done.stderr.splitlines() if line.startswith("hicache-ray:")]
        assert len(lines) == 1 and address in lines[0], done.stderr
        assert "Traceback" not in done.stderr


def test_the_start_says_who_may_call_the_server() -> None:
    from apps.cli_commands import _door_note

    assert "bound to 127.0.0.1 only" in _door_note({}, "127.0.0.1")
    assert "WARNING" in _door_note({}, "0.0.0.0")
    assert "need an API key" in _door_note({"api_key_sha256": "ab"}, "0.0.0.0")
    assert "need an API key" in _door_note({"api_keys": "/k"}, "0.0.0.0")
