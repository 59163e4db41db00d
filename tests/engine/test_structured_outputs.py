"""Structured outputs (issue 27): StructuredOutputsParams' checks, grammar compilation and the
token mask, and the default model's greedy output under each kind of constraint."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams, StructuredOutputsParams
from pagedkv.errors import InvalidRequestError

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
