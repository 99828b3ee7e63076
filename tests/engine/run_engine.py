"""One engine run of the engine tier: ``python run_engine.py SPEC.json OUT.pt``.

Builds ``vllm.LLM`` from the JSON spec (vLLM's default multiprocess mode, engine core and
workers spawned, unless the run's environment sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), runs
its phases and saves what they returned; the engine is always shut down. A spec: ``llm``
(keyword arguments of ``LLM``), ``prompts`` (lists of token ids), ``max_tokens`` and ``phases``
(names below).
"""

from __future__ import annotations

import json
import sys


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


if __name__ == "__main__":
    main(*sys.argv[1:])
