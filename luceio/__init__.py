"""luceio: LLM inference for the hardware people own."""
from .async_engine import AsyncEngine
from .config import EngineArgs
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncEngine", "LLM", "LLMEngine", "EngineArgs", "SamplingParams",
           "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
