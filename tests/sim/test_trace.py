"""JSONL traces: valid fields, line-numbered errors, strict vs skip."""

from __future__ import annotations

import json

import pytest

from pagedkv.errors import ConfigError
from pagedkv.sim.trace import read_trace


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_lengths_ids_groups_and_conversations(tmp_path):
    path = _write(
        tmp_path,
        [
            "# a comment",
            json.dumps({"prompt_len": 20, "output_len": 5, "arrival_time": 0.5}),
            json.dumps({"prompt_token_ids": [5, 6, 7], "output_len": 2, "request_id": "ids"}),
            "",
            json.dumps(
                {"prompt_len": 40, "output_len": 3, "prefix_group": "sys", "prefix_len": 32}
            ),
            json.dumps(
                {"prompt_len": 36, "output_len": 3, "prefix_group": "sys", "prefix_len": 32}
            ),
            json.dumps({"prompt_len": 10, "output_len": 4, "conversation_id": "c"}),
            json.dumps(
                {"prompt_len": 20, "output_len": 4, "conversation_id": "c", "arrival_time": 2}
            ),
        ],
    )
    workload, issues = read_trace(path, seed=3)
    assert issues == []
    reqs = workload.requests
    assert [r.request_id for r in reqs] == ["line-2", "ids", "line-5", "line-6", "line-7", "line-8"]
    assert reqs[0].num_prompt_tokens == 20 and reqs[0].num_output_tokens == 5
    assert reqs[0].arrival_time == 0.5
    assert reqs[1].prompt_token_ids == [5, 6, 7]
    # One prefix group shares its first 32 token ids; the rest differ.
    assert reqs[2].prompt_token_ids[:32] == reqs[3].prompt_token_ids[:32]
    assert reqs[2].prompt_token_ids[32:36] != reqs[3].prompt_token_ids[32:36]
    # The second turn extends the first turn's prompt + output, after a think time of 2 s.
    first, second = reqs[4], reqs[5]
    assert second.prompt_token_ids[:14] == first.prompt_token_ids + first.output_token_ids
    assert second.num_prompt_tokens == 20
    assert second.parent_index == 4 and second.think_time == 2.0


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "invalid JSON"),
        ('{"prompt_len": 10}', "output_len"),
        ('{"prompt_len": 0, "output_len": 1}', "prompt_len must be an int >= 1"),
        ('{"prompt_len": 10, "output_len": 1, "arrival": 3}', "unknown field"),
        ('{"prompt_len": 10, "prompt_token_ids": [1], "output_len": 1}', "exactly one"),
        ('{"prompt_len": 10, "output_len": 1, "prefix_len": 4}', "needs prefix_group"),
        ('{"prompt_len": 10, "output_len": 1, "arrival_time": -1}', "arrival_time"),
        ('{"prompt_token_ids": [1, "a"], "output_len": 1}', "prompt_token_ids"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_strict_names_the_line(tmp_path, bad_line, message):
    good = json.dumps({"prompt_len": 8, "output_len": 2})
    path = _write(tmp_path, [good, good, bad_line, good])
    with pytest.raises(ConfigError, match=rf"trace\.jsonl:3: .*{message}"):
        read_trace(path)


def test_skip_reports_line_numbers_and_keeps_good_lines(tmp_path):
    good = json.dumps({"prompt_len": 8, "output_len": 2})
    path = _write(
        tmp_path,
        [good, "{oops", good, '{"prompt_len": 8, "output_len": 0}', good],
    )
    workload, issues = read_trace(path, on_error="skip")
    assert len(workload.requests) == 3
    assert [i.line_no for i in issues] == [2, 4]
    assert "invalid JSON" in issues[0].message and "output_len" in issues[1].message
    assert str(issues[1]).startswith("line 4:")


def test_duplicate_ids_and_short_turns_are_errors(tmp_path):
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt_len": 8, "output_len": 2, "request_id": "x"}),
            json.dumps({"prompt_len": 8, "output_len": 2, "request_id": "x"}),
        ],
    )
    with pytest.raises(ConfigError, match=":2: duplicate request_id"):
        read_trace(path)
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt_len": 8, "output_len": 4, "conversation_id": "c"}),
            json.dumps({"prompt_len": 12, "output_len": 4, "conversation_id": "c"}),
        ],
    )
    with pytest.raises(ConfigError, match=r":2: .*already holds 12 tokens"):
        read_trace(path)


def test_empty_or_missing_trace_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")
    path = _write(tmp_path, ["{bad"])
    with pytest.raises(ConfigError, match="no valid request"):
        read_trace(path, on_error="skip")
    with pytest.raises(ConfigError, match="on_error"):
        read_trace(path, on_error="ignore")


def test_same_seed_same_token_ids(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt_len": 30, "output_len": 5})])
    a, _ = read_trace(path, seed=1)
    b, _ = read_trace(path, seed=1)
    c, _ = read_trace(path, seed=2)
    assert a.requests[0].prompt_token_ids == b.requests[0].prompt_token_ids
    assert a.requests[0].prompt_token_ids != c.requests[0].prompt_token_ids
