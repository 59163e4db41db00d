"""The rejection sampler: greedy verification, and emitted tokens distributed as the target."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.errors import OpsInputError
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.rejection_sampler import rejection_sample
from pagedkv.worker.sampler import Sampler

GREEDY = SamplingParams(temperature=0.0)
RANDOM = SamplingParams(temperature=1.0)


def verify(logits, params, num_draft_tokens, drafts, draft_probs=None, generators=None, seed=0):
    generators = generators if generators is not None else [None] * len(params)
    return rejection_sample(
        logits.clone(),
        params,
        num_draft_tokens,
        torch.tensor(drafts, dtype=torch.int64),
        draft_probs,
        generators,
        Sampler(seed=seed),
    )


def test_greedy_accepts_exactly_the_argmax_prefix():
    torch.manual_seed(0)
    logits = torch.randn(4 + 1 + 3 + 1, 32)  # k = 3, 0, 2, 0: drafts + a bonus row each
    best = logits.argmax(dim=-1).tolist()
    params = [GREEDY] * 4
    # Request 0: drafts agree at rows 0, 1, then disagree at row 2.
    wrong = (best[2] + 1) % 32
    drafts = [best[0], best[1], wrong, best[5], best[6]]
    out = verify(logits, params, [3, 0, 2, 0], drafts)
    assert out == [
        [best[0], best[1], best[2]],
        [best[4]],
        [best[5], best[6], best[7]],  # all accepted: the bonus row's argmax follows
        [best[8]],
    ]
    # A first draft that disagrees gives the first row's argmax only.
    assert verify(logits, params, [3, 0, 2, 0], [wrong, *drafts[1:]])[0] == [best[0]]


def test_greedy_sees_the_logit_bias():
    logits = torch.zeros(2, 8)
    logits[:, 3] = 1.0
    params = [SamplingParams(temperature=0.0, logit_bias={5: 2.0})]
    assert verify(logits, params, [1], [3]) == [[5]]
    assert verify(logits, params, [1], [5]) == [[5, 5]]


def test_mixed_batch_keeps_greedy_rows_greedy():
    torch.manual_seed(1)
    logits = torch.randn(2 + 1 + 2 + 1, 16)
    best = logits.argmax(dim=-1).tolist()
    out = verify(logits, [RANDOM, GREEDY], [2, 2], [1, 2, best[3], best[4]])
    assert out[1] == [best[3], best[4], best[5]]
    assert 1 <= len(out[0]) <= 3


def _emitted_first_tokens(p, q, temperature, num_trials, one_hot_draft=None, seed=0):
    """One call: ``num_trials`` copies of a request with one draft drawn from q (or the fixed
    ``one_hot_draft``), target p; returns (first emitted tokens, accepted fractions)."""
    p = torch.tensor(p, dtype=torch.float64)
    vocab_size = len(p)
    rng = np.random.default_rng(seed)
    if one_hot_draft is None:
        q = np.asarray(q, dtype=np.float64)
        drafts = rng.choice(vocab_size, size=num_trials, p=q / q.sum())
        draft_probs = torch.tensor(q, dtype=torch.float32).expand(num_trials, vocab_size)
    else:
        drafts = np.full(num_trials, one_hot_draft)
        draft_probs = None
    # logits / temperature = log p: rows alternate draft, bonus.
    row = (p.log() * temperature).float()
    logits = row.expand(2 * num_trials, vocab_size).contiguous()
    params = [SamplingParams(temperature=temperature)] * num_trials
    out = verify(logits, params, [1] * num_trials, drafts.tolist(), draft_probs, seed=seed)
    first = np.array([tokens[0] for tokens in out])
    accepted = np.mean([len(tokens) == 2 for tokens in out])
    return first, accepted


@pytest.mark.parametrize(
    ("p", "q", "temperature"),
    [
        ([0.1, 0.2, 0.3, 0.15, 0.15, 0.1], [1 / 6] * 6, 1.0),
        ([0.5, 0.0, 0.25, 0.05, 0.1, 0.1], [0.05, 0.6, 0.05, 0.1, 0.1, 0.1], 1.0),
        ([0.02, 0.02, 0.9, 0.02, 0.02, 0.02], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1], 0.5),
        ([0.3, 0.3, 0.1, 0.1, 0.1, 0.1], [0.02, 0.02, 0.9, 0.02, 0.02, 0.02], 2.0),
    ],
)
def test_emitted_token_is_distributed_as_the_target(p, q, temperature):
    num_trials = 20_000
    first, accepted = _emitted_first_tokens(p, q, temperature, num_trials)
    frequencies = np.bincount(first, minlength=6) / num_trials
    # 4 standard deviations of a frequency of 20k draws is at most 0.0142.
    assert np.abs(frequencies - np.array(p)).max() < 0.0142
    assert frequencies[np.array(p) == 0].sum() == 0  # a token p forbids never appears
    # The acceptance rate is sum_x min(p(x), q(x)) (Leviathan et al., section 3.1).
    assert accepted == pytest.approx(np.minimum(p, np.array(q) / sum(q)).sum(), abs=0.0142)


@pytest.mark.parametrize("draft", [0, 2, 1])
def test_one_hot_drafts_keep_the_target_distribution(draft):
    p = [0.5, 0.0, 0.25, 0.05, 0.1, 0.1]
    num_trials = 20_000
    first, accepted = _emitted_first_tokens(p, None, 1.0, num_trials, one_hot_draft=draft)
    frequencies = np.bincount(first, minlength=6) / num_trials
    assert np.abs(frequencies - np.array(p)).max() < 0.0142
    assert accepted == pytest.approx(p[draft], abs=0.0142)  # accepted with probability p(x)
    if p[draft] == 0:
        assert accepted == 0


def test_bonus_token_is_distributed_as_the_target_when_all_drafts_are_accepted():
    p = np.array([0.4, 0.3, 0.2, 0.1])
    num_trials = 20_000
    row_draft = torch.tensor([-30.0, -30.0, 0.0, -30.0])  # draft row: token 2 (p ~ 1)
    row_bonus = torch.tensor(np.log(p), dtype=torch.float32)
    logits = torch.stack([row_draft, row_bonus]).repeat(num_trials, 1)
    out = verify(logits, [RANDOM] * num_trials, [1] * num_trials, [2] * num_trials)
    assert all(tokens[0] == 2 and len(tokens) == 2 for tokens in out)
    frequencies = np.bincount([tokens[1] for tokens in out], minlength=4) / num_trials
    assert np.abs(frequencies - p).max() < 0.0142


def test_seeded_requests_repeat_whatever_the_batch():
    torch.manual_seed(2)
    rows = torch.randn(4, 10)  # one request: 3 drafts + bonus

    def run(batch_before: int, sampler_seed: int) -> list[int]:
        others = torch.randn(batch_before, 10)
        logits = torch.cat([others, rows])
        params = [RANDOM] * batch_before + [SamplingParams(temperature=1.0, seed=7)]
        generators = [None] * batch_before + [torch.Generator().manual_seed(7)]
        counts = [0] * batch_before + [3]
        return verify(logits, params, counts, [1, 2, 3], None, generators, seed=sampler_seed)[-1]

    first = run(0, 0)
    assert run(3, 1) == first
    assert run(5, 2) == first
    # Another seed gives other draws (over several requests, not all outputs coincide).
    outputs = set()
    for seed in range(8):
        logits = rows.clone()
        out = rejection_sample(
            logits,
            [SamplingParams(temperature=1.0, seed=seed)],
            [3],
            torch.tensor([1, 2, 3]),
            None,
            [torch.Generator().manual_seed(seed)],
            Sampler(),
        )
        outputs.add(tuple(out[0]))
    assert len(outputs) > 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.5, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.5),
    ],
)
def test_tokens_outside_top_k_top_p_min_p_are_never_emitted(params):
    torch.manual_seed(3)
    num_reqs, vocab_size = 2_000, 12
    row = torch.tensor([4.0, 3.8, 1.0, 0.5, 0.0, -1.0, 0.2, 0.1, 0.3, 0.0, -0.5, 0.9])
    logits = row.repeat(3 * num_reqs, 1)  # 2 drafts + bonus per request
    allowed = {0, 1}  # top-2; top-p 0.5 at T 1.5 keeps 0, 1; min_p 0.5 keeps 0, 1
    drafts = torch.randint(0, vocab_size, (2 * num_reqs,))
    out = verify(logits, [params] * num_reqs, [2] * num_reqs, drafts.tolist())
    emitted = {t for tokens in out for t in tokens}
    assert emitted <= allowed
    assert emitted == allowed  # both are reachable


def test_dense_draft_probs_residual_never_emits_where_q_covers_p():
    # p = q on tokens 0..2; p has extra mass on 3: a rejection must emit 3.
    p = np.array([0.2, 0.2, 0.2, 0.4])
    q = np.array([0.3, 0.3, 0.4, 0.0])
    num_trials = 5_000
    rng = np.random.default_rng(5)
    drafts = rng.choice(4, size=num_trials, p=q)
    logits = torch.tensor(np.log(p), dtype=torch.float32).repeat(2 * num_trials, 1)
    draft_probs = torch.tensor(q, dtype=torch.float32).expand(num_trials, 4)
    out = verify(logits, [RANDOM] * num_trials, [1] * num_trials, drafts.tolist(), draft_probs)
    rejected = [tokens[0] for tokens in out if len(tokens) == 1]
    assert rejected and set(rejected) == {3}


def test_no_drafts_is_plain_sampling():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0]])
    assert verify(logits, [GREEDY, GREEDY], [0, 0], []) == [[1], [0]]
    assert verify(torch.zeros(0, 3), [], [], []) == []
    # Draft ids as a plain list (empty or not) as the model runner builds them.
    sampler = Sampler()
    assert rejection_sample(
        logits.clone(), [GREEDY] * 2, [0, 0], [], None, [None] * 2, sampler
    ) == [
        [1],
        [0],
    ]
    three = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    assert rejection_sample(three, [GREEDY] * 2, [1, 0], [1], None, [None] * 2, sampler) == [
        [1, 0],
        [2],
    ]


@pytest.mark.parametrize(
    ("num_rows", "counts", "drafts", "draft_probs", "words"),
    [
        (5, [2, 0], [1, 2], None, "logits must be [4, vocab_size]"),
        (5, [2, 1], [1, 2], None, "draft_token_ids must be [3]"),
        (5, [2, 1], [1, 2, 99], None, "draft_token_ids must be in [0, 8)"),
        (5, [2, 1], [1, 2, 3], torch.zeros(2, 8), "draft_probs must be [3, 8]"),
        (5, [3], [1, 2, 3], None, "one of each per request"),
        (3, [-1, 2], [1], None, "num_draft_tokens must be >= 0"),
    ],
)
def test_inputs_that_do_not_fit_are_refused(num_rows, counts, drafts, draft_probs, words):
    logits = torch.zeros(num_rows, 8)
    params = [RANDOM, RANDOM]
    with pytest.raises(OpsInputError) as info:
        verify(logits, params, counts, drafts, draft_probs)
    assert words in str(info.value)
