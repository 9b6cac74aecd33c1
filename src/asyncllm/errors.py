"""asyncllm's errors: one tree, raised at the call that caused them.

```
AsyncLLMError(Exception)
├── InvalidRequestError(ValueError)         bad input; raised before anything is scheduled
│   ├── InvalidSamplingParamsError          a SamplingParams field is out of range or of the wrong type
│   │   └── StructuredOutputError           a schema, regex or grammar does not compile, or uses what is unsupported
│   ├── InvalidPromptError                  empty prompt, or token ids outside the vocabulary
│   ├── PromptTooLongError                  prompt (+ max_tokens) does not fit max_model_len
│   ├── ChatTemplateError                   the model has no chat template, or it rejected the messages
│   └── InvalidToolsError                   a chat's tools, tool_choice or parallel_tool_calls are malformed
├── ModelNotFoundError(FileNotFoundError)   the model folder, hub model or the default model's package is missing
├── UnsupportedModelError(ValueError)       the model is found, but asyncllm cannot run it (architecture,
│                                           trust_remote_code, quantized weights)
├── ModelLoadError(ValueError)              checkpoint and model disagree, or the model does not fit the device
├── EngineOverloadedError(RuntimeError)     the waiting queue is full (max_waiting_requests); retry later
├── EngineClosedError(RuntimeError)         the engine is not open (not entered yet, or already left)
├── RequestFailedError(RuntimeError)        one request failed inside the engine; the others go on
│   └── SchedulerStalledError               the request could not be scheduled while nothing else ran
└── EngineDeadError(RuntimeError)           a model step failed; the cause is chained (``__cause__``)
    ├── DeviceOutOfMemoryError              the device ran out of memory during a step
    ├── DeviceStepTimeoutError              a step did not return within ``step_timeout`` seconds
    └── WorkerDiedError                     a tensor-parallel rank's process exited
```

Every ``InvalidRequestError`` is also a ``ValueError``, so code that already catches ``ValueError``
around parameter handling keeps working. Its ``param`` names the request field at fault when one is
(the HTTP app reports it as the OpenAI error's ``param``); a request beyond one of the engine's
limits says which limit and which option raises it.
"""

from __future__ import annotations


class AsyncLLMError(Exception):
    """Base class of every error asyncllm raises."""


class InvalidRequestError(AsyncLLMError, ValueError):
    """A request was rejected before it was scheduled; the engine keeps serving.

    Args:
        message: What is wrong with the request.
        param: The request field at fault (``"seed"``, ``"prompt"``, ``"cache_salt"``, ...), if one is.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidSamplingParamsError(InvalidRequestError):
    """A ``SamplingParams`` field is out of range or of the wrong type."""


class StructuredOutputError(InvalidSamplingParamsError):
    """A request's ``structured_output`` cannot be enforced: its JSON Schema is invalid or uses a keyword the
    grammar engine does not support, its regex or grammar does not parse, or it is too large. The message
    names the problem. Raised at the call where the grammar compiles then (a cached grammar, or an async
    call); otherwise the request's stream ends with it.

    Args:
        message: What is wrong.
        param: The request field at fault.
        code: ``"invalid_schema"`` (the spec is at fault) or ``"structured_output_unavailable"`` (this
            engine cannot apply grammars at all: its runner or tokenizer).
    """

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_schema") -> None:
        super().__init__(message, param=param)
        self.code = code


class InvalidPromptError(InvalidRequestError):
    """The prompt is empty or holds token ids outside the model's vocabulary."""


class PromptTooLongError(InvalidRequestError):
    """The prompt, plus the tokens asked for, does not fit the engine's ``max_model_len``."""


class ChatTemplateError(InvalidRequestError):
    """``Engine.chat()`` cannot build a prompt: the model's tokenizer has no chat template, the
    messages are malformed, or the template itself rejected them (e.g. roles that do not alternate)."""


class InvalidToolsError(InvalidRequestError):
    """A chat's ``tools``, ``tool_choice`` or ``parallel_tool_calls`` cannot be used: a tool is malformed
    (no ``parameters`` schema, a bad or duplicate name), or ``tool_choice`` names no given tool.

    Args:
        message: What is wrong.
        param: ``"tools"``, ``"tool_choice"`` or ``"parallel_tool_calls"``.
        code: A short machine-readable code (the HTTP error's ``code``): ``"missing_parameters"``,
            ``"invalid_tool_name"``, ``"duplicate_tool_name"``, ``"invalid_tool"``, ``"unknown_tool"``,
            ``"invalid_tool_choice"`` or ``"invalid_parallel_tool_calls"``.
    """

    def __init__(self, message: str, *, param: str, code: str) -> None:
        super().__init__(message, param=param)
        self.code = code


class ModelNotFoundError(AsyncLLMError, FileNotFoundError):
    """The model cannot be found: no such local folder, a hub id neither cached nor downloadable (no
    such repository or revision, a gated one without access, or offline), or the default model's
    package is missing. The message names what was tried."""


class UnsupportedModelError(AsyncLLMError, ValueError):
    """The model was found but asyncllm cannot run it, as its ``config.json`` tells before any weight is
    read: an architecture asyncllm does not implement (the message lists those it does), one whose
    code lives in the repository (``trust_remote_code``: asyncllm never runs a model's own code), or
    quantized weights (the message names the method)."""


class ModelLoadError(AsyncLLMError, ValueError):
    """The model cannot be loaded as asked: its checkpoint lacks a tensor, has an unknown one or one of
    the wrong shape, or the device cannot hold its weights, its activation peak and one KV block."""


class EngineOverloadedError(AsyncLLMError, RuntimeError):
    """The engine's waiting queue is full (``max_waiting_requests``); the request was not queued."""


class EngineClosedError(AsyncLLMError, RuntimeError):
    """The engine is not running: it was not entered yet, or it has been closed."""


class RequestFailedError(AsyncLLMError, RuntimeError):
    """Work that belongs to this request alone failed (e.g. detokenizing its output); the cause is
    chained. The request's stream ends with it and the engine keeps serving the others."""


class SchedulerStalledError(RequestFailedError):
    """The request could not be scheduled although nothing else was running: an engine bug, turned
    into an error on the stuck requests rather than a silent wait that never ends."""


class EngineDeadError(AsyncLLMError, RuntimeError):
    """A model step failed; every open request ends with this error, chained to the cause."""


class DeviceOutOfMemoryError(EngineDeadError):
    """The device ran out of memory during a model step."""


class DeviceStepTimeoutError(EngineDeadError):
    """A model step did not return within the engine's ``step_timeout``; the device thread is left
    behind (it cannot be interrupted) and every open request ends with this error."""


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel rank's worker process exited while the engine ran (it crashed, was killed, or
    failed to load: the message names the rank, its pid, how it ended and its own error if it sent
    one); every open request ends with this error, and the other ranks are stopped."""
