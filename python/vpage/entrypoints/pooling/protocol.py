"""Request bodies of the pooling routes (strict pydantic models): OpenAI's embeddings
(``input`` as text, texts, token ids or lists of them; ``encoding_format`` float or base64;
``dimensions``), vLLM's ``/pooling``, ``/classify``, ``/score`` (``text_1`` against ``text_2``) and the
Jina/Cohere ``/rerank`` (``query``, ``documents``, ``top_n``)."""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

_INT32 = 2**31 - 1
_MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=-_INT32 - 1, le=_INT32)]], Field(min_length=1)]
Truncate = Optional[Annotated[int, Field(ge=-1, le=_INT32)]]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _not_empty(value: object) -> object:
    """A clear message for an empty input (a union's first member would name itself instead)."""
    if value == [] or value == "":
        raise ValueError("must not be empty")
    return value


class EmbeddingRequest(_Strict):
    model: Optional[str] = None
    input: Union[Text, Annotated[list[Text], Field(min_length=1, max_length=_MAX_INPUTS)], TokenIds,
                 Annotated[list[TokenIds], Field(min_length=1, max_length=_MAX_INPUTS)]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1, le=_INT32)
    user: Optional[str] = Field(None, max_length=1024)
    truncate_prompt_tokens: Truncate = None  # vLLM's: keep the last k tokens (-1: the last max_model_len)
    normalize: Optional[bool] = None  # vLLM's: None is the model's own choice

    _input_not_empty = field_validator("input", mode="before")(_not_empty)

    def inputs(self) -> list[Union[str, list[int]]]:
        """The inputs as a list of texts or token id lists."""
        p = self.input
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


class PoolingRequest(EmbeddingRequest):
    """vLLM's ``/pooling``: the model's pooled output (an embedding, or class probabilities for
    a classification model) under ``data``."""


Texts = Union[Text, Annotated[list[Text], Field(min_length=1, max_length=_MAX_INPUTS)]]


class ClassificationRequest(_Strict):
    """vLLM's ``/classify``: each input's class probabilities and its most likely label."""

    model: Optional[str] = None
    input: Union[Texts, TokenIds, Annotated[list[TokenIds], Field(min_length=1, max_length=_MAX_INPUTS)]]
    truncate_prompt_tokens: Truncate = None
    use_activation: Optional[bool] = None

    _input_not_empty = field_validator("input", mode="before")(_not_empty)

    def inputs(self) -> list[Union[str, list[int]]]:
        p = self.input
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


class ScoreRequest(_Strict):
    model: Optional[str] = None
    text_1: Texts
    text_2: Texts
    truncate_prompt_tokens: Truncate = None
    use_activation: Optional[bool] = None

    _texts_not_empty = field_validator("text_1", "text_2", mode="before")(_not_empty)


class RerankRequest(_Strict):
    model: Optional[str] = None
    query: Text
    documents: Annotated[list[str], Field(min_length=1, max_length=_MAX_INPUTS)]
    top_n: int = Field(0, ge=0, le=_INT32)  # 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: Truncate = None
    use_activation: Optional[bool] = None
