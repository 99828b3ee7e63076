"""The fork server the engine runs go through (run_engine.py --serve): a child that fails is
reported as failed, with its traceback in its own log, and the server goes on serving."""

from __future__ import annotations


def test_a_failing_child_reports_its_status_and_leaves_its_traceback(fork_server, tmp_path):
    log = tmp_path / "log.txt"
    missing = tmp_path / "no-such-spec.json"
    code = fork_server.run("missing-spec", "run_engine", [str(missing), str(tmp_path / "out.pt")],
                           log, {})  # fmt: skip
    assert code == 1
    assert "FileNotFoundError" in log.read_text() and str(missing) in log.read_text()
