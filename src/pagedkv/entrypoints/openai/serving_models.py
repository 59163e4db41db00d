"""``/v1/models``: the one served model, and the 404 for any other name."""

from __future__ import annotations

from pagedkv.entrypoints.openai.errors import OpenAIError
from pagedkv.entrypoints.openai.protocol import ModelCard, ModelList, now


class OpenAIServingModels:
    """The served model's name and card.

    Args:
        model_name: the name clients pass as ``model``; other names get 404.
        max_model_len: most tokens (prompt + output) of one request, shown in the card.
    """

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len

    def check_model(self, model: str | None) -> None:
        """Raises OpenAIError (404, ``model_not_found``) for a name that is not served; None
        (the field left out) means the served model."""
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=now(), max_model_len=self.max_model_len)

    def models(self) -> ModelList:
        return ModelList(data=[self.model_card()])
