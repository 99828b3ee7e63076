"""The engine tier's engine runs: ``python run_engine.py SPEC.json OUT.pt`` runs one;
``python run_engine.py --serve`` is the fork server the tier runs them through (:func:`serve`).

A run builds ``vllm.LLM`` from the JSON spec (vLLM's default multiprocess mode, engine core and
workers in their own processes, unless the run's environment sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), runs its phases and saves what they returned; the engine
is always shut down. A spec: ``llm`` (keyword arguments of ``LLM``), ``prompts`` (lists of token
ids), ``max_tokens`` and ``phases`` (names below).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _prompt_logprobs(outputs) -> list[list[float]]:
    """Each prompt token's logprob (teacher-forced; the first token has none)."""
    return [
        [next(iter(p.values())).logprob if len(p) == 1 else p[t].logprob
         for t, p in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True)]
        for o in outputs
    ]  # fmt: skip


def main(spec_path: str, out_path: str) -> None:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(open(spec_path).read())
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    results: dict[str, object] = {"prompts": spec["prompts"]}
    llm = LLM(skip_tokenizer_init=True, seed=0, **spec["llm"])
    try:
        for phase in spec["phases"]:
            if phase == "prompt_logprobs":
                params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
                results[phase] = _prompt_logprobs(llm.generate(prompts, params, use_tqdm=False))
            elif phase == "generate":
                results[phase] = _tokens(llm.generate(prompts, greedy, use_tqdm=False))
            elif phase == "one_at_a_time":
                # No batching, no chunking, no preemption, a cold prefix cache each time.
                tokens = []
                for prompt in prompts:
                    llm.reset_prefix_cache()
                    tokens += _tokens(llm.generate([prompt], greedy, use_tqdm=False))
                results[phase] = tokens
            elif phase == "all_at_once":
                # Cold prefix cache, then all requests together: chunked prefills and
                # preemptions; then again, now hitting the prefix cache.
                llm.reset_prefix_cache()
                outputs = llm.generate(prompts, greedy, use_tqdm=False)
                results["all_at_once"] = _tokens(outputs)
                outputs = llm.generate(prompts, greedy, use_tqdm=False)
                results["prefix_cached"] = _tokens(outputs)
                results["cached_tokens"] = [o.num_cached_tokens or 0 for o in outputs]
            elif phase == "aborts":
                results |= _aborts(llm, prompts, greedy)
            else:
                raise ValueError(f"unknown phase {phase!r}")
        if spec["llm"].get("disable_log_stats") is False:
            results["preemptions"] = sum(
                getattr(m, "value", 0)
                for m in llm.llm_engine.get_metrics()
                if m.name == "vllm:num_preemptions"
            )
    finally:
        llm.llm_engine.engine_core.shutdown()
    torch.save(results, out_path)


def _aborts(llm, prompts, params) -> dict[str, object]:
    """Every other request aborted after a few engine steps; the rest must run to the end."""
    engine = llm.llm_engine
    ids = [f"abort-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    for _ in range(3):
        engine.step()
    aborted = ids[::2]
    engine.abort_request(aborted)
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    kept = [finished.get(i) for i in ids[1::2]]
    return {"aborts_kept": kept, "aborts_finished": sorted(finished),
            "aborts_unfinished": engine.get_num_unfinished_requests()}  # fmt: skip


def serve() -> None:
    """Fork server: imports vLLM once, then runs each request in a child forked from it.

    Importing vLLM and torch costs a run far more CPU than its small model does (15 s against
    5-10 s on two cores); a forked child starts with both imported and nothing else done. Reads
    one JSON request per line on stdin: ``name``, ``script`` and ``args`` (the child calls
    ``main(*args)`` of that module of this folder: ``run_engine`` for an engine run), ``log``
    (the child's stdout and stderr) and ``env`` (set in the child). Answers one JSON line per
    event on stdout: ``{"name", "pid"}`` once forked (the child leads its own process group,
    which its engine core and workers join) and ``{"name", "status"}`` once reaped (exit code,
    or minus the signal). Returns when stdin closes and every child is reaped.
    """
    import selectors

    from vllm import LLM, SamplingParams  # noqa: F401  (what main imports, loaded once here)
    from vllm.inputs import TokensPrompt  # noqa: F401
    from vllm.model_executor.models import registry

    # vLLM inspects a model class in a fresh interpreter, so as not to initialise CUDA in its
    # own; there is no CUDA here, and each such interpreter imports vLLM again (per run and
    # architecture until its cache is written), so the runs inspect in their own process.
    registry._run_in_subprocess = lambda inspect: inspect()

    def answer(message: dict) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    selector = selectors.DefaultSelector()
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
    pending, reading, children = b"", True, 0
    while reading or children:
        for key, _ in selector.select():
            if key.data is None:  # a request, or stdin closed
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    reading = False
                    continue
                *lines, pending = (pending + chunk).split(b"\n")
                for line in filter(None, lines):
                    request = json.loads(line)
                    pid = _fork_run(request)
                    selector.register(os.pidfd_open(pid), selectors.EVENT_READ,
                                      (request["name"], pid))  # fmt: skip
                    children += 1
                    answer({"name": request["name"], "pid": pid})
            else:  # a child exited
                name, pid = key.data
                _, status = os.waitpid(pid, 0)
                selector.unregister(key.fd)
                os.close(key.fd)
                children -= 1
                answer({"name": name, "status": os.waitstatus_to_exitcode(status)})


def _fork_run(request: dict) -> int:
    """Forks a child that runs ``request`` (see :func:`serve`) and exits; returns its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.dup2(2, 1)  # nothing the child prints reaches the server's answers
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(request["env"])
        importlib.import_module(request["script"]).main(*request["args"])
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(*sys.argv[1:])
