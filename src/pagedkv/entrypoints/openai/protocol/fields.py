"""The types of request fields and the bounds on what one request may hold.

A new request field takes one of these annotated types (``Text``, ``Int64``, ``TokenId``,
``FiniteFloat``...), so that it gets the same checks as the others: types are strict (strings are
not numbers, numbers are not booleans), a number with no fractional part is an integer (``8.0``,
as JSON Schema has it), ints stay within int64 (what torch tensors and the block hash hold),
floats are finite and strings are valid Unicode (no lone surrogates, which JSON can carry but
UTF-8 cannot). Each failure is a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from pagedkv.sampling_params import INT64_MAX
from pagedkv.validation import SEED_MAX as SEED_MAX  # the seed range: one home
from pagedkv.validation import utf8_error

#: Most samples one request may ask for (``n``); each sample is a sequence in the engine.
MAX_N = 128
INT64_MIN = -(2**63)


def valid_unicode(value: str) -> str:
    """``value`` unchanged when UTF-8 can encode it.

    Raises:
        ValueError: a lone surrogate (pydantic makes it a 400 naming the field).
    """
    error = utf8_error(value)
    if error is not None:
        raise ValueError(
            f"not valid Unicode text: {error} (a lone surrogate such as \\ud800 cannot be "
            "tokenized)"
        )
    return value


def _integral(value: Any) -> Any:
    """JSON has one number type: ``8.0`` is the integer 8 (as JSON Schema's ``integer`` says,
    and as some clients write it); any other float stays a float, which an int field refuses."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: Put last in an int type's Annotated (after its Field: pydantic's JSON schema keeps the bounds
#: only then): a float with no fractional part counts as an int.
INTEGRAL = BeforeValidator(_integral)
#: A string the tokenizer and the block hash can take (valid Unicode: no lone surrogates).
Text = Annotated[str, AfterValidator(valid_unicode)]
#: Text of at least one character (stop strings).
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(valid_unicode)]
#: An int within int64 (what torch tensors and the block hash hold).
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), INTEGRAL]
#: A token id: >= 0 and within int64 (the engine also checks it against the vocabulary).
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX), INTEGRAL]

# Bounds on what one request may hold, so that one body cannot make the server build millions of
# objects (a 28 MB body of 7M one-token prompts used to grow the server to 18 GB): checked by
# pydantic while it reads the list, so a longer one stops early; also in the schema (maxItems).
#: Most prompts in one completion request.
MAX_PROMPTS = 1024
#: Most sequences (prompts x samples) one request may start.
MAX_SEQUENCES = 4096
#: Most token ids in one list (a prompt, /detokenize's tokens): 2**20, beyond any max_model_len.
MAX_TOKEN_IDS = 2**20
#: Most chat messages in one request.
MAX_MESSAGES = 4096
#: Most stop strings, stop token ids and logit_bias entries (each is checked every step).
MAX_STOPS = 64
MAX_LOGIT_BIAS = 4096
#: Most tools one chat request may offer, and tool calls one message may hold.
MAX_TOOLS = 1024
#: A count >= 1 within int64 (max_tokens: the engine also checks it against max_model_len).
PositiveInt64 = Annotated[int, Field(ge=1, le=INT64_MAX), INTEGRAL]
#: A count >= 0 within int64 (logprobs: the engine checks it against its max_logprobs, which
#: ``serve --max-logprobs`` sets; the OpenAPI schema states that limit, see openapi.py).
NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX), INTEGRAL]
#: A finite float (JSON parsers accept NaN and Infinity).
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]

#: Most strings of a choice constraint (``guided_choice``, ``structured_outputs.choice``).
MAX_CHOICES = 1024
#: A JSON Schema: an object, or its JSON text (xgrammar parses it; a 400 when it cannot).
JsonSchema = dict[str, Any] | Text
Choices = Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)]

# The types of the known fields a local server accepts without effect (refusals.py's IGNORED):
# no effect does not mean any value. They take OpenAI's types, so that a client's mistake is a
# 400 naming the field here as it would be there.
#: ``metadata``: at most 16 pairs, keys of at most 64 characters, values of at most 512.
Metadata = Annotated[
    dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
    Field(max_length=16),
]
#: ``reasoning_effort`` / ``reasoning.effort``: OpenAI's levels.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
#: ``verbosity`` / ``text.verbosity``.
Verbosity = Literal["low", "medium", "high"]
#: ``prompt_cache_retention``.
PromptCacheRetention = Literal["in_memory", "24h"]
#: A short identifier (``service_tier``, ``safety_identifier``, ``request_id``): text of at most
#: 512 characters (OpenAI's tiers change over time: any name is accepted).
Identifier = Annotated[Text, Field(max_length=512)]
