"""The fields that constrain a request's output, and the one constraint they give.

A request gives at most one constraint, in any of OpenAI's and vLLM's fields: ``response_format``
(``json_object`` / ``json_schema``), vLLM's ``structured_outputs``, or the older ``guided_json``
/ ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. :func:`output_constraint` reads them
into the engine's :class:`~pagedkv.sampling_params.StructuredOutputsParams` once per request (the
request model caches it), and :func:`rename_constraint_error` tells the engine's refusal of it
with the field the client wrote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from pagedkv.entrypoints.openai.protocol.fields import Choices, JsonSchema, Text
from pagedkv.entrypoints.openai.protocol.refusals import UnsupportedFieldError
from pagedkv.entrypoints.openai.protocol.schema import StrictModel
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedkv.entrypoints.openai.protocol.sampling_request import SamplingRequest

#: A request's constraint and the path of the field that gave it, as the client wrote it
#: (``"response_format.json_schema.schema"``...); ``(None, None)`` without one.
Constraint = tuple[StructuredOutputsParams | None, str | None]


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema`` (OpenAI's): the schema the output follows. ``strict``
    is accepted either way: the output always follows the schema (its grammar masks every
    token)."""

    name: Text | None = None
    description: Text | None = None
    json_schema: JsonSchema = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: ``{"type": "text"}`` (free text), ``{"type":
    "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(StrictModel):
    """vLLM's ``structured_outputs`` request field: one of ``json`` (a JSON Schema), ``regex``,
    ``choice``, ``grammar`` (EBNF) or ``json_object``, as
    :class:`~pagedkv.sampling_params.StructuredOutputsParams`. ``disable_fallback`` and
    ``disable_additional_properties`` are what pagedkv does anyway (one backend, xgrammar,
    whose schemas allow no property they do not list); ``structural_tag`` and
    ``whitespace_pattern`` are refused."""

    json_: JsonSchema | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Choices | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    structural_tag: None = None
    whitespace_pattern: None = None


def output_constraint(request: SamplingRequest) -> Constraint:
    """The request's output constraint, from whichever field gives it (``response_format``
    json_object / json_schema, ``structured_outputs``, ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar``), and the path of that field as a client wrote
    it (``"response_format.json_schema.schema"``...); ``(None, None)`` without one. Read it
    through ``request.structured_output_params()``, which builds it once per request.

    Raises:
        UnsupportedFieldError: more than one constraint (naming the fields), a json_schema
            response_format without its schema, a constraint of the wrong shape.
    """
    given: list[tuple[str, str, dict[str, Any]]] = []  # (field, path, kwargs)
    whitespace = False
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", "response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise UnsupportedFieldError(
                "response_format",
                "`response_format` of type json_schema needs `json_schema` "
                "({'name': ..., 'schema': {...}})",
            )
        given.append(
            (
                "response_format",
                "response_format.json_schema.schema",
                {"json": fmt.json_schema.json_schema},
            )
        )
    so = request.structured_outputs
    if so is not None:
        whitespace = so.disable_any_whitespace
        for kind, value in (
            ("json", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object if so.json_object else None),
        ):
            if value is not None:
                path = f"structured_outputs.{kind}"
                given.append(("structured_outputs", path, {kind: value}))
        if not given or given[-1][0] != "structured_outputs":
            raise UnsupportedFieldError(
                "structured_outputs",
                "`structured_outputs` needs one of json, regex, choice, grammar and json_object",
            )
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(request, name)
        if value is not None:
            given.append((name, name, {kind: value}))
    if not given:
        return None, None
    if len(given) > 1:
        paths = ", ".join(f"`{path}`" for _, path, _ in given)
        raise UnsupportedFieldError(
            given[1][0], f"give at most one structured output constraint, got {paths}"
        )
    field_name, path, kwargs = given[0]
    try:
        params = StructuredOutputsParams(**kwargs, disable_any_whitespace=whitespace)
    except InvalidRequestError as e:
        message = _rename_constraint(str(e), next(iter(kwargs)), path)
        raise UnsupportedFieldError(field_name, message) from None
    return params, path


def _rename_constraint(message: str, kind: str, path: str) -> str:
    """An engine message about ``structured_outputs.<kind>`` told with the request's field."""
    return message.replace(f"structured_outputs.{kind}", f"`{path}`").replace(
        "structured_outputs", f"`{path}`"
    )


def rename_constraint_error(
    exc: InvalidRequestError, request: SamplingRequest
) -> InvalidRequestError:
    """The engine's refusal of a request's constraint (``param`` ``structured_outputs``) told
    with the field the request gave it in (``guided_regex``, ``response_format``...)."""
    params, path = request.structured_output_params()
    if params is None or exc.param != "structured_outputs":
        return exc
    field_name = path.split(".", 1)[0]
    return InvalidRequestError(_rename_constraint(str(exc), params.kind, path), param=field_name)
