"""The API layer (vLLM's AsyncLLM): ``Engine`` and its options, input processing (tokenize,
validate), output processing (detokenize, stop strings), the per-request ``RequestStream`` and the
metrics. The request's journey starts and ends here."""

from asyncllm.engine._detokenizer import Tokenizer
from asyncllm.engine._engine import Engine
from asyncllm.engine._metrics import EngineMetrics
from asyncllm.engine._options import EngineOptions
from asyncllm.engine._stream import RequestStream

__all__ = ["Engine", "EngineMetrics", "EngineOptions", "RequestStream", "Tokenizer"]
