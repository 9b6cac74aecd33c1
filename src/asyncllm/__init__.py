"""asyncllm: an LLM inference engine that runs inside your application's event loop."""

from asyncllm.engine._detokenizer import Tokenizer
from asyncllm.engine._engine import Engine
from asyncllm.engine._metrics import EngineMetrics
from asyncllm.engine._options import EngineOptions
from asyncllm.engine._stream import RequestStream
from asyncllm.engine._tools import ToolCallDelta, ToolCallParser, ToolPlan
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
    InvalidToolsError,
    ModelLoadError,
    ModelNotFoundError,
    PromptTooLongError,
    RequestFailedError,
    SchedulerStalledError,
    StructuredOutputError,
    UnsupportedModelError,
    WorkerDiedError,
)
from asyncllm.executor._runner import ModelRunner
from asyncllm.outputs import (
    Completion,
    Embedding,
    EngineStatistics,
    Logprobs,
    Sample,
    StreamChunk,
    TokenLogprob,
    ToolCall,
)
from asyncllm.sampling_params import SamplingParams, StructuredOutput

__version__ = "0.1.0"

__all__ = [
    "AsyncLLMError",
    "ChatTemplateError",
    "Completion",
    "DeviceOutOfMemoryError",
    "DeviceStepTimeoutError",
    "Embedding",
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
    "InvalidToolsError",
    "Logprobs",
    "ModelLoadError",
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
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolPlan",
    "UnsupportedModelError",
    "WorkerDiedError",
    "__version__",
]
