"""Structured outputs over HTTP: the request fields that constrain what a request may
generate, and their mapping to one ``StructuredOutputsParams`` (vLLM's names).

A request may say what it wants in three ways:

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}`` and vLLM's ``{"type": "structural_tag", ...}`` (xgrammar's structural tag,
  ``format`` or the older ``structures`` + ``triggers``);
- vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``, ``structural_tag`` and the options ``disable_any_whitespace``,
  ``disable_additional_properties``, ``whitespace_pattern``);
- vLLM's older top-level ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  and ``guided_whitespace_pattern``. (``guided_decoding_backend`` is not a field: as in current
  vLLM, the server's ``--structured-outputs-backend`` serves every request.)

At most one constraint per request; the options of ``structured_outputs`` apply to a
``response_format`` constraint too. Whether a schema, regex or grammar compiles is the
engine's to say (its refusal is a 400 naming why).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vpage.sampling_params import StructuredOutputsParams

_MAX_CHOICES = 4096
NonEmpty = Annotated[str, Field(min_length=1)]
Choices = Annotated[list[str], Field(min_length=1, max_length=_MAX_CHOICES)]
JsonSchema = Union[NonEmpty, dict[str, Any]]  # a schema as an object or as its JSON text


class _Strict(BaseModel):
    # protocol.py's request models' settings (this module is imported by it)
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class JsonSchemaSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: Optional[str] = None
    # "schema" shadows a BaseModel attribute, hence the alias
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class StructuralTagItem(_Strict):
    begin: str
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    end: str


class ResponseFormat(_Strict):
    """OpenAI's ``response_format`` (one model for every type, so errors name the field
    plainly): ``json_schema`` goes with "json_schema"; a "structural_tag" has xgrammar's
    ``format`` (its current form) or ``structures`` with ``triggers`` (the older one)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaSpec] = None
    format: Optional[dict[str, Any]] = None
    structures: Optional[Annotated[list[StructuralTagItem], Field(min_length=1)]] = None
    triggers: Optional[Annotated[list[NonEmpty], Field(min_length=1)]] = None

    @model_validator(mode="after")
    def _fields_of_the_type(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("a json_schema response format needs json_schema.schema")
        if self.type == "structural_tag":
            legacy = self.structures is not None or self.triggers is not None
            if (self.format is not None) == legacy or (legacy and (self.structures is None or self.triggers is None)):
                raise ValueError("a structural tag needs either format, or structures and triggers")
        return self

    def constraint(self) -> Optional[tuple[str, Any]]:
        """(StructuredOutputsParams field, value), or None for "text"."""
        if self.type == "json_object":
            return "json_object", True
        if self.type == "json_schema":
            return "json", self.json_schema.schema_
        if self.type == "structural_tag":  # the JSON text the engine takes
            return "structural_tag", json.dumps(self.model_dump(by_alias=True, exclude_none=True,
                                                                include={"type", "format", "structures", "triggers"}))
        return None


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` request field."""

    json_: Optional[JsonSchema] = Field(None, alias="json")
    regex: Optional[NonEmpty] = None
    choice: Optional[Choices] = None
    grammar: Optional[NonEmpty] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[NonEmpty] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True  # strict JSON unless asked (False)
    whitespace_pattern: Optional[NonEmpty] = None

    def constraints(self) -> dict[str, Any]:
        given = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": self.json_object or None, "structural_tag": self.structural_tag}
        return {name: value for name, value in given.items() if value is not None}


class StructuredOutputsError(ValueError):
    """A request whose structured-output fields do not say one constraint; ``param`` names
    the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def structured_outputs_params(req: Any) -> Optional[StructuredOutputsParams]:
    """The one constraint ``req`` (a completions or chat request) asks for, or None."""
    found: list[tuple[str, str, Any]] = []  # (field as the request names it, kind, value)
    constraint = None if req.response_format is None else req.response_format.constraint()
    if constraint is not None:
        found.append(("response_format", *constraint))
    so = req.structured_outputs
    if so is not None:
        found += [(f"structured_outputs.{kind}", kind, value) for kind, value in so.constraints().items()]
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", kind, value))
    if len(found) > 1:
        names = ", ".join(name for name, _, _ in found)
        raise StructuredOutputsError(f"a request takes one structured output constraint; this one has {names}",
                                     found[1][0])
    if not found:
        if so is not None:
            raise StructuredOutputsError("structured_outputs needs one of json, regex, choice, grammar, "
                                         "json_object or structural_tag", "structured_outputs")
        if req.guided_whitespace_pattern is not None:
            raise StructuredOutputsError("guided_whitespace_pattern needs guided_json", "guided_whitespace_pattern")
        return None
    _, kind, value = found[0]
    options = {}
    if so is not None:
        options = dict(disable_any_whitespace=so.disable_any_whitespace,
                       disable_additional_properties=so.disable_additional_properties,
                       whitespace_pattern=so.whitespace_pattern)
    if req.guided_whitespace_pattern is not None:
        options["whitespace_pattern"] = req.guided_whitespace_pattern
    return StructuredOutputsParams(**{kind: value}, **options)
