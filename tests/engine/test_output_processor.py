"""OutputProcessor without a model: detokenized deltas, stop strings held back and cut, abort,
and what it hands back to the engine (sequences to stop, sequences to forget)."""

from __future__ import annotations

from _tiny_model import CharTokenizer

from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.sampling_params import SamplingParams


def add(processor: OutputProcessor, request_id: str, params: SamplingParams) -> list[Request]:
    prompt = CharTokenizer().encode("ab")
    requests = [
        Request(request_id=f"{request_id}#{i}", prompt_token_ids=prompt, sampling_params=params)
        for i in range(params.n)
    ]
    processor.add_request(request_id, "ab", prompt, params, requests, arrival_time=0.0)
    return requests


def emit(processor: OutputProcessor, request: Request, text: str):
    request.append_output_token_ids(CharTokenizer().encode(text))
    return processor.process_outputs([request])


def test_stop_string_is_held_back_then_cut_and_the_sequence_stopped():
    processor = OutputProcessor(CharTokenizer())
    (request,) = add(processor, "r", SamplingParams(stop=["END"], max_tokens=50))
    deltas = []
    for piece in ["xy", "E", "N", "D", "zz"]:
        result = emit(processor, request, piece)
        (output,) = result.request_outputs
        deltas.append(output.new_text)
        if output.finished:
            break
    assert deltas == ["xy", "", "", ""]
    assert output.text == "xy" and output.finish_reason == "stop"
    assert output.outputs[0].stop_reason == "END"
    assert output.token_ids == CharTokenizer().encode("xyEND")
    assert result.seq_ids_to_stop == ["r#0"]
    assert not processor.has_unfinished_requests()


def test_include_stop_str_and_a_false_start_is_released():
    processor = OutputProcessor(CharTokenizer())
    params = SamplingParams(stop=["END"], include_stop_str_in_output=True, max_tokens=50)
    (request,) = add(processor, "r", params)
    assert emit(processor, request, "EN").request_outputs[0].new_text == ""
    assert emit(processor, request, "x").request_outputs[0].new_text == "ENx"
    final = emit(processor, request, "END").request_outputs[0]
    assert final.text == "ENxEND" and final.new_text == "END" and final.finished


def test_finish_from_the_scheduler_and_abort_of_siblings():
    processor = OutputProcessor(CharTokenizer())
    first, _ = add(processor, "r", SamplingParams(n=2, max_tokens=5))
    first.status = RequestStatus.FINISHED_LENGTH_CAPPED
    result = emit(processor, first, "hi")
    (output,) = result.request_outputs
    assert [o.finish_reason for o in output.outputs] == ["length", None]
    assert not output.finished and result.seq_ids_to_stop == []
    # Abort: only the unfinished sibling goes back to the scheduler; reported once.
    assert processor.finish_request("r", "abort") == ["r#1"]
    assert processor.finish_request("r", "abort") == []
    result = processor.process_outputs([])
    (output,) = result.request_outputs
    assert [o.finish_reason for o in output.outputs] == ["length", "abort"] and output.finished
    assert processor.process_outputs([]).request_outputs == []
    assert processor.finish_request("r", "abort") == []  # forgotten: ignored
