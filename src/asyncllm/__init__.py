"""asyncllm: an LLM inference engine that runs inside your application's event loop."""

from asyncllm.engine._detokenizer import Tokenizer
from asyncllm.engine._engine import Engine
from asyncllm.engine._metrics import EngineMetrics
from asyncllm.engine._options import EngineOptions
from asyncllm.engine._stream import RequestStream
from asyncllm.errors import (
    AsyncLLMError,
    ChatTemplateError,
    DeviceOutOfMemoryError,
    DeviceStepTimeoutError,
    EngineClosedError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    ModelNotFoundError,
    PromptTooLongError,
    RequestFailedError,
    SchedulerStalledError,
    StructuredOutputError,
)
from asyncllm.executor._runner import ModelRunner
from asyncllm.outputs import Completion, EngineStatistics, Logprobs, Sample, StreamChunk, TokenLogprob
from asyncllm.sampling_params import SamplingParams, StructuredOutput

__version__ = "0.1.0"

__all__ = [
    "AsyncLLMError",
    "ChatTemplateError",
    "Completion",
    "DeviceOutOfMemoryError",
    "DeviceStepTimeoutError",
    "Engine",
    "EngineClosedError",
    "EngineDeadError",
    "EngineMetrics",
    "EngineOptions",
    "EngineOverloadedError",
    "EngineStatistics",
    "InvalidPromptError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "Logprobs",
    "ModelNotFoundError",
    "ModelRunner",
    "PromptTooLongError",
    "RequestFailedError",
    "RequestStream",
    "Sample",
    "SamplingParams",
    "SchedulerStalledError",
    "StreamChunk",
    "StructuredOutput",
    "StructuredOutputError",
    "TokenLogprob",
    "Tokenizer",
    "__version__",
]
