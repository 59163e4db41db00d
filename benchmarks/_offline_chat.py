"""The offline leg of bench_chat_latency.py: chats through pagedkv's engine in this process,
timed as its client times a server.

    python benchmarks/_offline_chat.py SERVE_ARGS...

``SERVE_ARGS`` are the ``pagedkv serve`` arguments the served leg gets (model, threads, max model
len, the configuration's): the engine is built from them as ``pagedkv serve`` builds it
(:meth:`EngineConfig.from_cli_args` of the serve parser). Then this process says
``{"ready": true}`` on stdout and reads chats from stdin, one JSON line each (``{"request_id":
ID, "messages": [...], "max_tokens": N}``), runs each alone, greedy (temperature 0),
``ignore_eos``, as the server's one client sends them, and answers each with one JSON line
``{"result": RequestResult's fields}``; it shuts the engine down at the end of its input. The
process stays up between chats, as a server does, so that the benchmark can send the same chat
to every leg in turn (bench_chat_latency.py's default).

Per chat, the times a streaming client takes (:class:`pagedkv.entrypoints.bench_serving.
RequestResult`): from before the chat template is applied (the server applies it after the
request arrived) to the end of the engine step that produced the first text (TTFT), the gaps
between the steps that produced text (ITL), and to the step that finished it (latency).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any


def time_chat(engine: Any, request_id: str, messages: list, max_tokens: int) -> dict[str, Any]:
    """One chat through ``engine`` (an LLMEngine with nothing else running), stepped here until
    it finished; its RequestResult as a dict (times in seconds)."""
    from pagedkv.entrypoints.bench_serving import RequestResult
    from pagedkv.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    processed = engine.input_processor.process_chat(messages)
    engine.add_request(request_id, {"prompt_token_ids": processed.token_ids}, params)
    result = RequestResult(ok=False, num_prompt_tokens=len(processed.token_ids))
    last = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            sample = output.outputs[0]
            now = time.perf_counter()
            if sample.new_text:
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
            if output.finished:
                result.latency = now - start
                result.num_output_tokens = len(sample.token_ids)
                result.ok = last is not None and sample.finish_reason != "error"
                result.error = "" if result.ok else f"finished with {sample.finish_reason}"
    return dataclasses.asdict(result)


def main(argv: list[str]) -> int:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.entrypoints.cli import build_parser
    from pagedkv.model.loader import resolve_model

    args = build_parser().parse_args(["serve", *argv])
    source = resolve_model(args.model_tag or args.model)
    config = dataclasses.replace(EngineConfig.from_cli_args(args), model=str(source.path))
    engine = LLMEngine(config)
    try:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            chat = json.loads(line)
            result = time_chat(engine, chat["request_id"], chat["messages"], chat["max_tokens"])
            print(json.dumps({"result": result}), flush=True)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
