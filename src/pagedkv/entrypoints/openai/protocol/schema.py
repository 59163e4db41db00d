"""The base of every request model, and the JSON Schema that says what it accepts.

:class:`StrictModel` makes a request model strict: its fields' types are strict (fields.py),
JSON ``null`` for a field with a default means that default, a list longer than its bound is
refused before pydantic reads it, and a field the model does not declare, at any depth
(``foo_bar``, ``messages[0].foo``), is a 400 naming it, as OpenAI answers ("Unrecognized request
argument supplied"; errors.py).

Its JSON Schema (pydantic's, completed by :func:`document`) accepts what the server accepts, so
that the OpenAPI schema (openapi.py) is exact: ``additionalProperties: false``, ``null`` for a
field with a default, only the no-op values of a refused field (refusals.py), and the rules between
fields a schema can state (``SCHEMA_RULES``: ``STREAM_RULE``, ``CONTINUE_RULE``...).
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from pagedkv.entrypoints.openai.protocol.fields import (
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_STOPS,
    MAX_TOKEN_IDS,
    MAX_TOOLS,
)
from pagedkv.entrypoints.openai.protocol.refusals import (
    NULL_SCHEMA,
    Refused,
    UnsupportedFieldError,
)


def _allows_null(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "null" or any(
        member.get("type") == "null" for member in schema.get("anyOf", ())
    )


def document(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """pydantic's JSON Schema of a request model, told what the validators add on top of the
    types, so that the OpenAPI schema accepts what the server accepts: ``null`` for a field with
    a default (``_null_means_default``), only the no-op values of a refused field (``REFUSED``),
    and the rules between fields (``SCHEMA_RULES``, the schema's side of ``check_supported``)."""
    properties = schema.get("properties", {})
    refused: dict[str, Refused] = getattr(cls, "REFUSED", {})
    for name, field in cls.model_fields.items():
        prop = properties.get(name)
        if prop is None:
            continue
        docs = {k: v for k, v in prop.items() if k in ("title", "description", "default")}
        if name in refused:
            accepted = refused[name].accepts.schema
            properties[name] = {**docs, **copy.deepcopy(accepted or {})}
        elif not field.is_required() and field.default is not None and not _allows_null(prop):
            inner = {k: v for k, v in prop.items() if k not in docs}
            properties[name] = {**docs, "anyOf": [inner, NULL_SCHEMA]}
    rules = getattr(cls, "SCHEMA_RULES", ())
    if rules:
        schema["allOf"] = [*schema.get("allOf", ()), *copy.deepcopy(rules)]


def field_is(name: str, value: Any) -> dict[str, Any]:
    """JSON Schema: the field ``name`` is present and equal to ``value``."""
    return {"required": [name], "properties": {name: {"const": value}}}


#: prompt_logprobs only when not streaming, stream_options only when streaming
#: (check_supported). Few if/then rules: schemathesis gives up on a schema with five.
STREAM_RULE = {
    "if": field_is("stream", True),
    "then": {"properties": {"prompt_logprobs": NULL_SCHEMA}},
    "else": {"properties": {"stream_options": NULL_SCHEMA}},
}
#: continue_final_message needs add_generation_prompt false (its default is true).
CONTINUE_RULE = {
    "if": field_is("continue_final_message", True),
    "then": field_is("add_generation_prompt", False),
}


class StrictModel(BaseModel):
    """Strict types; ``null`` for a field whose default is not None means that default; a
    field the model does not declare is refused (a 400 naming it)."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=document)
    #: JSON Schema rules between fields, added to the model's schema (``allOf``): the rules of
    #: ``check_supported`` that a schema can state.
    SCHEMA_RULES: ClassVar[tuple[dict[str, Any], ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_sizes(data)
            fields = cls.model_fields
            return {
                key: value
                for key, value in data.items()
                if value is not None or key not in fields or fields[key].default is None
            }
        return data


#: Field -> most items its list (or dict) may hold, and its inner lists (prompt: token-id lists).
_SIZE_LIMITS: dict[str, tuple[int, int | None]] = {
    "prompt": (MAX_TOKEN_IDS, MAX_TOKEN_IDS),
    "messages": (MAX_MESSAGES, None),
    "stop": (MAX_STOPS, None),
    "stop_token_ids": (MAX_STOPS, None),
    "logit_bias": (MAX_LOGIT_BIAS, None),
    "tokens": (MAX_TOKEN_IDS, None),
    "tools": (MAX_TOOLS, None),
}


def _check_sizes(data: dict[str, Any]) -> None:
    """Refuse a list longer than its bound before pydantic reads it item by item (a union
    field such as ``prompt`` would be read once per member: 18 s for 7M prompts). A list of
    prompts is bounded by MAX_PROMPTS, token ids by MAX_TOKEN_IDS.

    Raises:
        UnsupportedFieldError: naming the field (a 400).
    """
    for name, (limit, inner_limit) in _SIZE_LIMITS.items():
        value = data.get(name)
        if not isinstance(value, list | dict):
            continue
        if name == "prompt" and isinstance(value, list) and value and not isinstance(value[0], int):
            limit = MAX_PROMPTS  # a list of prompts
        if len(value) > limit:
            raise UnsupportedFieldError(
                name, f"`{name}` holds {len(value)} items, more than the {limit} allowed"
            )
        if inner_limit is not None and isinstance(value, list):
            for item in value:
                if isinstance(item, list) and len(item) > inner_limit:
                    raise UnsupportedFieldError(
                        name,
                        f"`{name}`: a prompt of {len(item)} token ids, more than {inner_limit}",
                    )
