"""``/v1/models``: the served model under each of its names, and the 404 for any other name."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.entrypoints.openai.errors import OpenAIError
from pagedkv.entrypoints.openai.protocol.responses import ModelCard, ModelList, now
from pagedkv.errors import ConfigError


class OpenAIServingModels:
    """The served model's names and card.

    Args:
        model_name: the name clients pass as ``model``, or several (vLLM's
            ``--served-model-name a b``): each is accepted, the first is the one responses
            report; other names get 404.
        max_model_len: most tokens (prompt + output) of one request, shown in the card.

    Raises:
        ConfigError: no name, or an empty one.
    """

    def __init__(self, model_name: str | Sequence[str], max_model_len: int) -> None:
        names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        if not names or any(not isinstance(n, str) or not n.strip() for n in names):
            raise ConfigError(f"served model names must be non-empty strings, got {names!r}")
        #: every accepted name, the reported one first (duplicates dropped).
        self.model_names: tuple[str, ...] = tuple(dict.fromkeys(names))
        self.model_name = self.model_names[0]
        self.max_model_len = max_model_len

    def check_model(self, model: str | None) -> None:
        """Raises OpenAIError (404, ``model_not_found``) for a name that is not served; None
        (the field left out) means the served model."""
        if model is not None and model not in self.model_names:
            served = ", ".join(f"`{n}`" for n in self.model_names)
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist; this server serves {served}.",
                param="model",
                code="model_not_found",
            )

    def model_card(self, name: str | None = None) -> ModelCard:
        """The card of ``name`` (default: the reported name)."""
        return ModelCard(
            id=name or self.model_name, created=now(), max_model_len=self.max_model_len
        )

    def models(self) -> ModelList:
        return ModelList(data=[self.model_card(name) for name in self.model_names])
