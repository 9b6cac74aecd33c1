"""``POST /tokenize`` and ``POST /detokenize``: vLLM's tokenizer endpoints (served with and without ``/v1``).

Clients count tokens before they send a prompt (to fit ``max_model_len``) and read token ids back
as text (lm-evaluation-harness's remote tokenizer). Text is bounded as a prompt is
(``max_prompt_bytes``), tokenized in a worker thread when long; ids are checked against the
vocabulary before they are decoded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncllm.http._app import Exchange, HTTPError
from asyncllm.http._completions import chat_messages
from asyncllm.http._protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

if TYPE_CHECKING:
    from asyncllm.http._app import OpenAIApp


class TokenizerHandlers:
    """The tokenizer endpoints of one ``OpenAIApp``."""

    def __init__(self, app: OpenAIApp) -> None:
        self.app = app
        self.engine = app.engine

    async def tokenize(self, exchange: Exchange) -> None:
        """``POST /tokenize``: ``{"prompt"}`` or ``{"messages", "add_generation_prompt", "tools"}`` ->
        ``{"count", "max_model_len", "tokens"}`` (and ``token_strs`` when ``return_token_strs``)."""
        body = await exchange.json(TokenizeRequest)
        self.app.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(
                400, "send either `prompt` (text) or `messages`, not both", param="prompt", code="invalid_value"
            )
        tokens: list[int] = []
        if body.messages is not None:
            if body.add_special_tokens:
                # The chat template writes the special tokens the model expects; adding more is what
                # vLLM's flag does, but this server renders and tokenizes in one pass.
                raise HTTPError(
                    400,
                    "`add_special_tokens: true` with `messages` is not supported by this server",
                    param="add_special_tokens",
                    code="unsupported_parameter",
                )
            messages = chat_messages(body.messages)
            # The tools the chat request would send: the template writes them into the prompt.
            plan = self.engine.tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
            tokens = await self.engine.encode_chat(
                messages, tools=plan, add_generation_prompt=body.add_generation_prompt
            )
        elif body.tools is not None:
            raise HTTPError(400, "`tools` goes with `messages`, not `prompt`", param="tools", code="invalid_value")
        elif body.prompt is not None:
            add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await self.engine.tokenize(body.prompt, add_special_tokens=add_special_tokens)
        strings = None
        if body.return_token_strs:
            decode = self.engine.tokenizer.decode
            strings = [decode([token], skip_special_tokens=False) for token in tokens]
        await exchange.respond_json(200, TokenizeResponse(len(tokens), self.engine.max_model_len, tokens, strings))

    async def detokenize(self, exchange: Exchange) -> None:
        """``POST /detokenize``: ``{"tokens"}`` -> ``{"prompt"}``; an id outside the vocabulary is a 400."""
        body = await exchange.json(DetokenizeRequest)
        self.app.check_model(body.model)
        await exchange.respond_json(200, DetokenizeResponse(await self.engine.detokenize(body.tokens)))
