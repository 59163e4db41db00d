"""The offline leg of bench_chat_latency.py: its chats through pagedkv's engine in this process,
timed as its client times a server.

    python benchmarks/_offline_chat.py SPEC.json

``SPEC.json``: ``{"serve_args": [...], "chats": [messages, ...], "max_tokens": N,
"warmup_tokens": M}``. ``serve_args`` are the ``pagedkv serve`` arguments the served leg gets
(model, threads, max model len, the configuration's): the engine is built from them as
``pagedkv serve`` builds it (:meth:`EngineConfig.from_cli_args` of the serve parser). The first
chat is the warm-up (``warmup_tokens`` tokens, untimed), then each other chat alone, as the
server's one client sends them: greedy (temperature 0), ``ignore_eos``, ``max_tokens`` tokens.

Per chat, the times a streaming client takes (:class:`pagedkv.entrypoints.bench_serving.
RequestResult`): from before the chat template is applied (the server applies it after the
request arrived) to the end of the engine step that produced the first text (TTFT), the gaps
between the steps that produced text (ITL), and to the step that finished it (latency). Printed
on stdout as one JSON line ``{"results": [...]}`` (RequestResult's fields).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
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

    spec = json.loads(Path(argv[0]).read_text())
    args = build_parser().parse_args(["serve", *spec["serve_args"]])
    source = resolve_model(args.model_tag or args.model)
    config = dataclasses.replace(EngineConfig.from_cli_args(args), model=str(source.path))
    engine = LLMEngine(config)
    try:
        chats = spec["chats"]
        time_chat(engine, "warmup", chats[0], spec["warmup_tokens"])
        results = [
            time_chat(engine, f"chat-{i}", messages, spec["max_tokens"])
            for i, messages in enumerate(chats[1:])
        ]
    finally:
        engine.shutdown()
    print(json.dumps({"results": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
