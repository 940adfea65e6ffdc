"""`triton-mtp generate` against a real tritonserver (tests/models/toy_spec_decode as `spec_decode`):
output on stdout, the summary on stderr, --json, stdin prompts, exit codes and Ctrl-C."""
from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys

import pytest

from triton_mtp.cli import main
from triton_mtp.client import Client
from triton_mtp.serving.server import free_port
from test_client import LIVE, LONG, gauge, wait_for

SUMMARY = re.compile(
    r"^(\d+) tokens in [\d.]+ s \([\d.]+ tokens/s\), finish (\w+), "
    r"acceptance ([\d.]+)% \((\d+)/(\d+)\), mean accepted length ([\d.]+)$"
)


@pytest.fixture(scope="module")
def server(toy_spec_decode_server):
    return toy_spec_decode_server


def generate(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("stream", [False, True])
def test_prints_the_completion_and_a_summary(server, capsys, protocol, stream):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    with Client(url, protocol=protocol) as client:
        expected = client.generate("def f():", max_tokens=20, num_draft_tokens=3)
    argv = ["def f():", "--url", url, "--protocol", protocol, "--max-tokens", "20", "--num-draft-tokens", "3"]
    code, out, err = generate(capsys, *argv, *(["--stream"] if stream else []))
    assert code == 0, err
    assert out == expected.text + "\n"
    tokens, finish, rate, accepted, drafted, length = SUMMARY.match(err.strip()).groups()
    assert (int(tokens), finish) == (20, "length")
    stats = expected.acceptance
    assert (int(accepted), int(drafted)) == (stats.accepted_draft_tokens, stats.draft_tokens)
    assert float(rate) == pytest.approx(100 * stats.acceptance_rate, abs=0.05)
    assert float(length) == pytest.approx(stats.mean_accepted_length, abs=0.005)


def test_json_has_every_response_field(server, capsys):
    code, out, err = generate(capsys, "hi", "--url", server.grpc_url, "--max-tokens", "7", "--logprobs", "--json")
    assert code == 0 and err == ""
    reply = json.loads(out)
    assert {"text_output", "output_ids", "logprobs", "finish_reason", "num_input_tokens", "num_output_tokens",
            "total_draft_tokens", "total_accepted_draft_tokens", "accepted_per_position"} <= reply.keys()
    assert len(reply["output_ids"]) == len(reply["logprobs"]) == reply["num_output_tokens"] == 7
    assert reply["num_input_tokens"] == 2 and reply["finish_reason"] == "length"


def test_reads_the_prompt_from_stdin(server, capsys, monkeypatch):
    code, from_arg, _ = generate(capsys, "some prompt", "--url", server.grpc_url, "--max-tokens", "9")
    monkeypatch.setattr(sys, "stdin", io.StringIO("some prompt"))
    code_stdin, from_stdin, _ = generate(capsys, "-", "--url", server.grpc_url, "--max-tokens", "9")
    assert code == code_stdin == 0 and from_stdin == from_arg
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, out, err = generate(capsys, "-", "--url", server.grpc_url)
    assert code == 2 and out == "" and "PROMPT is empty" in err


def test_server_error_exits_1_with_the_servers_message(server, capsys):
    for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
        code, out, err = generate(capsys, "hi", "--url", url, "--protocol", protocol, "--max-tokens", "0")
        assert code == 1 and out == ""
        assert err.strip() == "triton-mtp generate: error: max_tokens must be positive, got 0"


def test_connection_refused_exits_1_naming_the_url(capsys):
    url = f"127.0.0.1:{free_port()}"
    code, out, err = generate(capsys, "hi", "--url", url)
    assert code == 1 and out == "" and url in err and err.count("\n") == 1


def test_bad_usage_exits_2(capsys):
    for argv in (["hi", "--protocol", "udp"], ["hi", "--max-tokens", "many"], []):
        with pytest.raises(SystemExit) as raised:
            main(["generate", *argv])
        assert raised.value.code == 2
        assert "usage: triton-mtp generate" in capsys.readouterr().err
    code, out, err = generate(capsys, "hi", "--seed", "-1")
    assert code == 2 and out == ""
    assert err.strip() == "triton-mtp generate: error: seed must be >= 0 (it is sent as UINT64), got -1"


def test_streams_as_text_arrives_and_ctrl_c_cancels_the_request(server):
    command = [sys.executable, "-m", "triton_mtp.cli", "generate", "hi", "--url", server.grpc_url,
               "--max-tokens", str(LONG), "--stream"]
    # SIGINT at its default in the client: a test run started in the background without job control has it
    # ignored, and a child process inherits that
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as process:
        first = process.stdout.read(8)  # arrives while the request is still running
        assert len(first) == 8 and process.poll() is None
        assert gauge(server, LIVE) == 1
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    assert process.returncode == 130, err
    assert b"request cancelled" in err
    wait_for(server, LIVE, 0)
