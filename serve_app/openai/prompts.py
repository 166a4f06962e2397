"""Request prompt -> token ids, with the tokenizer's own rules.

Owns: `PromptBuilder`: completions encode the text as given (with the tokenizer's default special
tokens, like vLLM and the HF pipeline); chat renders the tokenizer's chat template with
`add_generation_prompt` and encodes the result without adding special tokens again (the template
already wrote them). Token-id prompts are checked against the vocabulary.

Must not import: ray, torch, fastapi, tidal_core.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from serve_app.openai.errors import bad_request
from serve_app.openai.requests import ChatMessage


class PromptBuilder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        # The most characters one token can stand for (special tokens included): a text of C
        # characters has at least C / max_token_chars tokens, so a prompt far past the context
        # can be refused before the tokenizer spends seconds on it.
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.max_token_chars = max((len(str(tok)) for tok in vocab), default=0) or 64

    def min_tokens(self, num_chars: int) -> int:
        """A lower bound on the tokens of a text of `num_chars` characters, with a 2x margin for
        normalizers that drop characters."""
        return num_chars // (2 * self.max_token_chars)

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = [int(t) for t in self.tokenizer.encode(prompt, add_special_tokens=True)]
        else:
            ids = list(prompt)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise bad_request(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        if not ids:
            raise bad_request("the prompt encodes to no tokens", "prompt")
        return ids

    def chat_ids(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        # OpenAI's "developer" role is the newer name of "system"; templates only know the latter.
        conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except TemplateError as err:  # the template's own checks (e.g. roles must alternate)
            raise bad_request(f"the model's chat template rejected the messages: {err}", "messages",
                              "chat_template_error") from err
        except ValueError as err:  # no chat template configured for this tokenizer
            raise bad_request(f"chat is not available for this model ({err}); use /v1/completions", "messages",
                              "chat_template_error") from err
        ids = [int(t) for t in self.tokenizer.encode(str(text), add_special_tokens=False)]
        if not ids:
            raise bad_request("the messages encode to no tokens", "messages")
        return ids
