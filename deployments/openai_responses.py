"""The OpenAI-shaped replies of the router: completions and chat completions from the decoded
beams, with the text the client sees (special tokens and the stop token left out)."""

from typing import Any

from deployments.api_models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    Usage,
)
from dsbd_core.algorithm.result import Beam


class BeamText:
    """Token ids to the text a client sees, with the target's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def text(self, beam: Beam) -> str:
        """The beam's text without its stop token (OpenAI leaves the stop sequence out)."""
        ids = beam.token_ids
        if beam.finished and ids:
            ids = ids[:-1]
        return self.decode(ids)


def finish_reason(beam: Beam) -> str:
    return "stop" if beam.finished else "length"


def usage(prompt_ids: list[int], beams: list[Beam]) -> Usage:
    completion = sum(len(b.token_ids) for b in beams)
    return Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion,
                 total_tokens=len(prompt_ids) + completion)  # fmt: skip


def completion_response(
    model_name: str, prompt_ids: list[int], beams: list[Beam], texts: BeamText, *, chat: bool
) -> ChatCompletionResponse | CompletionResponse:
    """The non-streamed reply: one choice per returned beam, best first."""
    usage_ = usage(prompt_ids, beams)
    if chat:
        return ChatCompletionResponse(
            model=model_name,
            usage=usage_,
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=texts.text(b)),
                    finish_reason=finish_reason(b),
                )  # fmt: skip
                for i, b in enumerate(beams)
            ],
        )
    return CompletionResponse(
        model=model_name,
        usage=usage_,
        choices=[
            CompletionChoice(index=i, text=texts.text(b), finish_reason=finish_reason(b))
            for i, b in enumerate(beams)
        ],
    )
