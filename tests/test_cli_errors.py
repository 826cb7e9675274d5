"""Bad command lines end in one line on stderr and a non-zero exit, never a traceback: numbers and
paths are checked when parsed, trace rows with the row number, long runs bounded by a stated limit."""

import socket

import pytest

from laneserve.cli import main
from laneserve.workloads import load_trace


def _refused(argv, capsys) -> str:
    """``argv`` refused by argparse (exit 2); its one error line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, flag, why", [
    (["bench", "--timeout", "0"], "--timeout", "above 0"),
    (["bench", "--timeout", "nan"], "--timeout", "finite"),
    (["bench", "--target", "7"], "--target", "at most 1"),
    (["bench", "--temperature", "nan"], "--temperature", "finite"),
    (["bench", "--request-rate", "nan"], "--request-rate", "finite"),
    (["bench", "--request-rate", "2,-1"], "--request-rate", "above 0"),
    (["bench", "--random-input-len", "1000000000"], "--random-input-len", "at most"),
    (["bench", "--base-url", "htp:/nowhere"], "--base-url", "http://"),
    (["bench", "--burstiness", "0"], "--burstiness", "above 0"),
    (["bench", "--max-concurrency", "0"], "--max-concurrency", "at least 1"),
    (["plan", "--request-rate", "inf"], "--request-rate", "finite"),
    (["plan", "--tp", "0"], "--tp", "at least 1"),
    (["plan", "--tp", "2,x"], "--tp", "integer"),
    (["plan", "--chunks", "0"], "--chunks", "at least 1"),
    (["plan", "--max-batch", "0"], "--max-batch", "at least 1"),
    (["plan", "--prune-slack", "nan"], "--prune-slack", "finite"),
    (["plan", "--budget", "100000"], "--budget", "at most 1024"),
    (["plan", "--target", "0"], "--target", "above 0"),
    (["sim", "--num-requests", "-1"], "--num-requests", "at least 0"),
    (["sim", "--request-rate", "1,nan"], "--request-rate", "finite"),
    (["sim", "--rate", "inf"], "--rate", "finite"),
    (["sim", "--slo-scale", "0"], "--slo-scale", "above 0"),
    (["sim", "--prefill", "0"], "--prefill", "at least 1"),
    (["sim", "-tp", "0"], "--tensor-parallel-size", "at least 1"),
    (["sim", "--target", "1.5"], "--target", "at most 1"),
    (["sim", "--jobs", "0"], "--jobs", "at least 1"),
    (["sim", "--trace", "/no/such/trace.csv"], "--trace", "no such file"),
    (["plan", "--ttft-slo-ms", "-5"], "--ttft-slo-ms", "above 0"),
])
def test_bad_numbers_are_refused_when_parsed(argv, flag, why, capsys):
    line = _refused(argv, capsys)
    assert flag in line and why in line


def test_output_paths_must_be_the_right_kind(tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert "is a file" in _refused(["plan", "--output", str(a_file)], capsys)
    assert "a file" in _refused(["plan", "--output", str(a_file / "sub")], capsys)
    assert "is a file" in _refused(["bench", "--result-dir", str(a_file)], capsys)
    assert "is a folder" in _refused(["bench", "--output-json", str(tmp_path)], capsys)
    assert main(["plan", "--trace", str(tmp_path / "missing.csv")]) == 2
    assert "trace file not found" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_against_no_server_is_one_line(capsys):
    rc = main(["bench", "--base-url", f"http://127.0.0.1:{_free_port()}", "--num-requests", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "cannot reach the server" in err and "Traceback" not in err


def test_a_rate_too_low_to_finish_is_refused_before_sending(capsys):
    rc = main(["bench", "--base-url", f"http://127.0.0.1:{_free_port()}", "--request-rate", "1e-300",
               "--num-requests", "100", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "bounded at 86400 s" in err


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize("name, text, where, why", [
    ("huge.csv", AZURE_HEADER + "2023-11-16 18:15:46.0,100,5\n2023-11-16 18:15:47.0,100000000000000000000000,5\n",
     ":3:", "above the limit"),
    ("inf.csv", AZURE_HEADER + "2023-11-16 18:15:46.0,1e400,5\n", ":2:", "malformed"),
    ("nan.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 2}\n'
                  '{"timestamp": NaN, "input_length": 10, "output_length": 2}\n', ":2:", "finite"),
    ("inf.jsonl", '{"timestamp": 0, "input_length": 1e400, "output_length": 2}\n', ":1:", "malformed"),
    ("big.jsonl", '{"timestamp": 0, "input_length": 100000000000000000000000, "output_length": 2}\n', ":1:",
     "above the limit"),
    ("empty.csv", AZURE_HEADER, "", "no request rows"),
])
def test_trace_rows_are_checked_with_their_row_number(tmp_path, name, text, where, why, capsys):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_trace(path)
    assert where in str(info.value) and why in str(info.value)
    rc = main(["sim", "--trace", str(path), "--no-progress", "--jobs", "1", "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and why in err and "Traceback" not in err


def test_an_unexpected_failure_is_one_line_unless_asked(monkeypatch, capsys):
    from laneserve.commands import sim

    def boom(args):
        raise RuntimeError("something broke")
    monkeypatch.setattr(sim, "run", boom)
    assert main(["sim", "--list"]) == 1
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: something broke" in err and "LANESERVE_TRACEBACK=1" in err
    monkeypatch.setenv("LANESERVE_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        main(["sim", "--list"])
