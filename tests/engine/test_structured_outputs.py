"""Structured outputs (issue 27): StructuredOutputsParams' checks, grammar compilation and the
token mask, and the default model's greedy output under each kind of constraint."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams, StructuredOutputsParams
from pagedkv.engine.spec_decode.step_costs import StepCosts
from pagedkv.errors import InvalidRequestError
from pagedkv.worker.outputs import ModelRunnerOutput

# ---------------------------------------------------------------- StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of json, regex, choice, grammar and json_object, got none"),
        ({"json": {}, "regex": "a"}, "got json, regex"),
        ({"choice": ["a"], "json_object": True}, "got choice, json_object"),
        ({"json": "[1]"}, "must be a JSON Schema object"),
        ({"json": "{"}, "not valid JSON text"),
        ({"json": 3}, "must be a dict or JSON text"),
        ({"regex": ""}, "regex must be a non-empty str"),
        ({"grammar": 1}, "grammar must be a non-empty str"),
        ({"choice": []}, "non-empty list of str"),
        ({"choice": ["a", 1]}, "hold str only"),
        ({"json_object": 1}, "json_object must be a bool"),
        ({"regex": "\ud800"}, "not valid Unicode"),
    ],
)
def test_params_refuse_bad_constraints(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == "structured_outputs"


def test_params_kind_and_key():
    a = StructuredOutputsParams(json={"type": "object", "required": ["a"]})
    b = StructuredOutputsParams(json='{"required": ["a"], "type": "object"}')
    assert a.kind == b.kind == "json"
    assert a.key == b.key  # canonical JSON: equal schemas share a compiled grammar
    assert StructuredOutputsParams(json_object=False, regex="a+").kind == "regex"
    assert StructuredOutputsParams(choice=("x", "y")).choice == ["x", "y"]
    assert StructuredOutputsParams(json_object=True).key == ("json_object", "", False)


def test_sampling_params_takes_structured_outputs():
    constraint = StructuredOutputsParams(regex="[0-9]+")
    params = SamplingParams(n=2, structured_outputs=constraint)
    assert params.for_sample(1).structured_outputs is constraint
    with pytest.raises(InvalidRequestError, match="StructuredOutputsParams") as info:
        SamplingParams(structured_outputs={"regex": "a"})
    assert info.value.param == "structured_outputs"


# ---------------------------------------------------------------- parsing (no model)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"json": {"type": "foo"}}, 'Unsupported type "foo"'),
        ({"json": {"$ref": "#/nope"}}, "nope"),
        ({"regex": "(a"}, "parenthesis is not closed"),
        ({"grammar": "root ::= x"}, 'Rule "x" is not defined'),
    ],
)
def test_a_constraint_xgrammar_cannot_parse_is_refused_with_its_reason(kwargs, reason):
    from pagedkv.engine.structured_output import parse_constraint

    with pytest.raises(InvalidRequestError, match="cannot be compiled") as info:
        parse_constraint(StructuredOutputsParams(**kwargs))
    assert reason in str(info.value)
    assert "/project/" not in str(info.value)  # xgrammar's source location is cut off
    assert info.value.param == "structured_outputs"


def test_choice_literals_are_escaped():
    import xgrammar as xgr

    from pagedkv.engine.structured_output import parse_constraint

    choices = ['say "hi"', "back\\slash", "tab\there", "é"]
    grammar = parse_constraint(StructuredOutputsParams(choice=choices))
    compiled = xgr.GrammarCompiler(_byte_tokenizer_info()).compile_grammar(grammar)
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(choice), choice
        assert matcher.is_completed()
    assert not xgr.GrammarMatcher(compiled).accept_string("say hi")


def _byte_tokenizer_info():
    """A tokenizer info of 256 single-byte tokens (no model needed)."""
    import xgrammar as xgr

    return xgr.TokenizerInfo([bytes([b]).decode("latin-1") for b in range(256)])


# ---------------------------------------------------------------- the bitmask (no model)


def test_apply_grammar_bitmask_masks_the_rows_of_their_requests_only():
    import numpy as np
    import torch

    from pagedkv.worker.sampler import apply_grammar_bitmask

    vocab = 70  # 3 words per row, the last partly used
    logits = torch.arange(4 * vocab, dtype=torch.float32).reshape(4, vocab)
    before = logits.clone()
    bitmask = np.zeros((2, 3), dtype=np.int32)
    bitmask[0, 0] = 1 << 5  # request "c": token 5 only
    bitmask[1, 2] = 1 << 1  # request "a": token 65 only
    apply_grammar_bitmask(logits, ["a", "b", "c", "d"], ["c", "a"], bitmask)
    assert torch.equal(logits[1], before[1]) and torch.equal(logits[3], before[3])
    assert torch.isfinite(logits[2]).tolist() == [t == 5 for t in range(vocab)]
    assert torch.isfinite(logits[0]).tolist() == [t == 65 for t in range(vocab)]
    assert logits[2, 5] == before[2, 5]


def test_apply_grammar_bitmask_gives_a_drafting_request_one_row_per_logits_row():
    """Speculative decoding: a request with k drafts has k + 1 logits rows and as many bitmask
    rows, which go to its rows in order."""
    import numpy as np
    import torch

    from pagedkv.worker.sampler import apply_grammar_bitmask

    vocab = 40
    logits = torch.zeros(5, vocab)
    bitmask = np.zeros((4, 2), dtype=np.int32)
    for j, token in enumerate([1, 2, 3, 33]):  # "d": tokens 1, 2, 3 in its rows; "c": 33
        bitmask[j, token // 32] = 1 << token % 32
    apply_grammar_bitmask(logits, ["a", "d", "d", "d", "c"], ["d", "d", "d", "c"], bitmask)
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert allowed == [list(range(vocab)), [1], [2], [3], [33]]
    with pytest.raises(InvalidRequestError, match="one row per logits row"):
        apply_grammar_bitmask(logits, ["a", "d", "d", "d", "c"], ["d", "c"], bitmask[[0, 3]])


def test_apply_grammar_bitmask_refuses_a_mask_that_does_not_fit():
    import numpy as np
    import torch

    from pagedkv.worker.sampler import apply_grammar_bitmask

    logits = torch.zeros(2, 64)
    with pytest.raises(InvalidRequestError, match="int32 array"):
        apply_grammar_bitmask(logits, ["a", "b"], ["a"], np.zeros((1, 3), dtype=np.int32))
    with pytest.raises(InvalidRequestError, match="do not sample"):
        apply_grammar_bitmask(logits, ["a", "b"], ["z"], np.zeros((1, 2), dtype=np.int32))
    assert torch.equal(logits, torch.zeros(2, 64))


# ---------------------------------------------------------------- the scheduler waits


class _Compiling:
    """A constraint whose grammar compiles until ``done`` is set (no matcher needed)."""

    def __init__(self, error: str | None = None) -> None:
        self.done = False
        self._error = error
        self.freed = False

    def ready(self) -> bool:
        return self.done

    @property
    def error(self) -> str | None:
        return self._error if self.done else None

    def accept(self, token_id: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False

    def free(self) -> None:
        self.freed = True


def _scheduler():
    from pagedkv.core.manager import KVCacheManager
    from pagedkv.engine.scheduler import Scheduler

    return Scheduler(KVCacheManager(64, block_size=4), 8, 64, 128)


def _request(scheduler, request_id, constraint=None):
    from pagedkv.engine.request import Request

    request = Request(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=4),
        structured_output=constraint,
    )
    scheduler.add_request(request)
    return request


def test_a_request_waits_for_its_grammar_and_not_the_others():
    scheduler = _scheduler()
    compiling = _Compiling()
    _request(scheduler, "constrained", compiling)
    _request(scheduler, "free")
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["free"]  # FCFS, yet not blocked behind it
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=["free"], sampled_token_ids=[7]))
    compiling.done = True
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["free", "constrained"]


def test_a_request_whose_grammar_failed_finishes_with_the_error():
    from pagedkv.engine.request import RequestStatus

    scheduler = _scheduler()
    failed = _Compiling(error="structured_outputs cannot be compiled: too deep")
    failed.done = True
    request = _request(scheduler, "bad", failed)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {}
    changed = scheduler.update_from_output(out, ModelRunnerOutput())
    assert changed == [request]
    assert request.status == RequestStatus.FINISHED_ERROR
    assert "too deep" in request.error
    assert failed.freed and not scheduler.has_unfinished_requests()


# ---------------------------------------------------------------- the default model, greedy

#: Held-out schemas of each shape (bounded strings, so greedy decoding ends).
SCHEMAS = {
    "object with required fields": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 1,
        "maxItems": 3,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "country": {"type": "string", "maxLength": 16},
                },
                "required": ["name", "country"],
                "additionalProperties": False,
            },
        },
        "required": ["city"],
        "additionalProperties": False,
    },
}
SCHEMA_PROMPTS = {
    "object with required fields": "Describe a person named Ann aged 31 as JSON.",
    "enum": "What colour is the sky? Answer in JSON.",
    "array": "List three small numbers as a JSON array.",
    "nested": "Where is the Eiffel Tower? Answer in JSON.",
}

JSON_OBJECT = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
REGEX = StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8}, [0-9]{4}")
CHOICE = StructuredOutputsParams(choice=["yes", "no", "maybe"])
GRAMMAR = StructuredOutputsParams(grammar='root ::= "The sky is " ("red" | "blue") "."')


@pytest.fixture(scope="module")
def llm(loaded_fp32):
    from pagedkv import LLM

    return LLM(loaded_model=loaded_fp32, dtype="float32", max_model_len=512)


def _chat(text):
    return [{"role": "user", "content": text}]


def _greedy(constraint, max_tokens=48, **kwargs):
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=constraint, **kwargs
    )


def _accepted_by(constraint, token_ids, llm) -> bool:
    """Whether a fresh matcher of the constraint takes every one of ``token_ids`` (the output
    is a prefix of a string the constraint accepts)."""
    import xgrammar as xgr

    manager = llm.engine.structured_output_manager
    matcher = xgr.GrammarMatcher(manager.request(constraint).result())
    return all(matcher.accept_token(t) for t in token_ids)


@pytest.mark.slow
def test_greedy_outputs_satisfy_each_kind_of_constraint(llm):
    import json
    import re

    import jsonschema

    names = list(SCHEMAS)
    constraints = [StructuredOutputsParams(json=SCHEMAS[n]) for n in names]
    prompts = [_chat(SCHEMA_PROMPTS[n]) for n in names]
    constraints += [JSON_OBJECT, REGEX, CHOICE, GRAMMAR]
    prompts += [
        _chat("Give me a tiny JSON object about a cat."),
        _chat("Name a city and a year."),
        _chat("Is water wet?"),
        _chat("What colour is the sky?"),
    ]
    outputs = llm.chat(prompts, [_greedy(c) for c in constraints], use_tqdm=False)
    for constraint, output in zip(constraints, outputs, strict=True):
        completion = output.outputs[0]
        assert _accepted_by(constraint, completion.token_ids, llm)
        if constraint.kind == "json":
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), constraint.json)
    for name, output in zip(names, outputs, strict=False):
        assert output.outputs[0].finish_reason == "stop", name
    by_kind = {c.kind: o.outputs[0] for c, o in zip(constraints, outputs, strict=True)}
    if by_kind["json_object"].finish_reason == "stop":
        assert isinstance(json.loads(by_kind["json_object"].text), dict)
    assert re.fullmatch(REGEX.regex, by_kind["regex"].text)
    assert by_kind["choice"].text in CHOICE.choice
    assert by_kind["grammar"].text in ("The sky is red.", "The sky is blue.")
    for kind in ("regex", "choice", "grammar"):
        assert by_kind[kind].finish_reason == "stop"


@pytest.mark.slow
def test_speculative_decoding_leaves_constrained_requests_as_they_were(llm, loaded_fp32):
    """With n-gram speculation on, constrained requests draft too (their drafts checked against
    the grammar, a mask for each verification row), and they and the free request beside them
    give the tokens of an engine without speculation (the torch backend, whose attention per
    sequence does not depend on the batch)."""
    from pagedkv import LLM

    prompts = [_chat("Copy exactly: the cat sat on the mat, the cat sat on the mat."),
               _chat("Is water wet?"),
               _chat("Say 'The sky is blue.' The sky is blue. The sky is blue.")]  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=24), _greedy(CHOICE), _greedy(GRAMMAR)]
    outputs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}):
        engine = LLM(
            loaded_model=loaded_fp32,
            dtype="float32",
            max_model_len=512,
            attention_backend="torch",
            speculative_config=spec,
        )
        # fixed step costs: the draft lengths must not follow this machine's load (a busy
        # machine's measured costs can rule every draft out)
        if spec is not None:
            engine.engine.scheduler.drafts.step_costs = StepCosts(1024, learn=False)
        execute = engine.engine.executor.execute_model
        constrained_drafts = []

        def recording(out, execute=execute, constrained_drafts=constrained_drafts):
            constrained = set(out.structured_output_request_ids)
            constrained_drafts.extend(
                len(d) for r, d in out.scheduled_spec_decode_tokens.items() if r in constrained
            )
            return execute(out)

        engine.engine.executor.execute_model = recording
        outputs[spec is None] = [
            o.outputs[0].token_ids for o in engine.chat(prompts, params, use_tqdm=False)
        ]
    assert outputs[False] == outputs[True]
    assert sum(constrained_drafts) > 0  # the grammar's request drafted from its prompt


@pytest.mark.slow
def test_a_constrained_request_leaves_the_others_in_its_batch_unchanged(llm):
    free = [_chat("Hi!"), _chat("What is the capital of France?")]
    free_params = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.chat(free, free_params, use_tqdm=False)
    constrained_alone = llm.chat([_chat("Is water wet?")], _greedy(CHOICE), use_tqdm=False)
    mixed = llm.chat(
        [free[0], _chat("Is water wet?"), free[1], _chat("What colour is the sky?")],
        [free_params, _greedy(CHOICE), free_params, _greedy(GRAMMAR)],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2])] == [
        o.outputs[0].token_ids for o in alone
    ]
    assert mixed[1].outputs[0].token_ids == constrained_alone[0].outputs[0].token_ids
    assert mixed[3].outputs[0].text in ("The sky is red.", "The sky is blue.")


@pytest.mark.slow
def test_each_sample_follows_the_constraint_on_its_own(llm):
    import re

    constraint = StructuredOutputsParams(regex=r"[0-9]{1,3}(, [0-9]{1,3}){2}")
    params = SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=16, structured_outputs=constraint
    )
    (output,) = llm.chat([_chat("Give me three random numbers.")], params, use_tqdm=False)
    texts = [c.text for c in output.outputs]
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        assert re.fullmatch(constraint.regex, completion.text), completion.text
    assert len(set(texts)) > 1  # the samples are not one matcher's output shared


def test_an_uncompilable_constraint_is_refused_before_anything_is_queued(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a"))
    with pytest.raises(InvalidRequestError, match="parenthesis is not closed") as info:
        llm.engine.add_request("bad", "Hi", bad)
    assert info.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_preempted_constrained_requests_still_satisfy_their_constraint(loaded_fp32):
    import json

    import jsonschema

    from pagedkv import LLM

    llm = LLM(
        loaded_model=loaded_fp32, dtype="float32", max_model_len=128, num_blocks=9, block_size=16
    )
    schema = SCHEMAS["object with required fields"]
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    prompts = [_chat(f"Describe a person named {n} as JSON.") for n in ("Ann", "Bob", "Eve")]
    outputs = llm.chat(prompts, _greedy(constraint, max_tokens=40), use_tqdm=False)
    assert llm.engine.get_stats().scheduler.num_preemptions > 0
    for output in outputs:
        completion = output.outputs[0]
        assert _accepted_by(constraint, completion.token_ids, llm)
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), schema)


def test_the_input_processor_pickles_without_the_engines_manager(llm):
    # A cluster's front end gets the replica's input processor pickled: the engine's manager
    # (a lock, a compile thread) stays behind and the copy parses constraints on its own.
    import pickle

    processor = llm.engine.input_processor
    assert processor.structured_outputs is not None
    twin = pickle.loads(pickle.dumps(processor))
    assert twin.structured_outputs is None and processor.structured_outputs is not None
    twin.check_structured_outputs(
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    )
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        twin.check_structured_outputs(
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a"))
        )
    assert processor.copy().structured_outputs is processor.structured_outputs
