"""luceio: LLM inference for the hardware people own.

It is also a vLLM drop-in: vLLM's documented offline, chat and async examples run with `vllm`
replaced by `luceio` in their import lines. Of the names vLLM exports from its top-level package,
these are luceio's own classes: LLM, LLMEngine, EngineArgs, AsyncEngineArgs (the same class as
EngineArgs), AsyncLLMEngine (the same class as AsyncLLM, as in vLLM v1), SamplingParams,
RequestOutput, CompletionOutput, PromptType, TextPrompt and TokensPrompt. `luceio.inputs`,
`luceio.outputs` and `luceio.sampling_params` (with StructuredOutputsParams and
GuidedDecodingParams) mirror vLLM's modules. Two deep paths are not mirrored, so import their
names from `luceio`: `vllm.engine.arg_utils` (luceio.engine is the engine's module, not a package)
and `vllm.v1.engine.async_llm` (a v1 tree would copy vLLM's history, not luceio's layout).
The vLLM names luceio does not provide raise ImportError with the reason (`_ABSENT`)."""
from .async_engine import AsyncEngine, AsyncLLM, AsyncLLMEngine
from .config import AsyncEngineArgs, EngineArgs
from .engine import LLMEngine
from .inputs import PromptType, TextPrompt, TokensPrompt
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncEngine", "AsyncLLM", "AsyncLLMEngine", "LLM", "LLMEngine", "EngineArgs",
           "AsyncEngineArgs", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "Logprob", "PromptType", "TextPrompt", "TokensPrompt"]
__version__ = "0.1.0"
__version_tuple__ = (0, 1, 0)

_NO_POOLING = "luceio generates text only: it has no pooling (embedding, classification, " \
              "scoring) runner"
_ABSENT = {
    "ModelRegistry": "luceio's architectures are built in (luceio.models: llama, qwen2, qwen3); "
                     "there is no registry for out-of-tree models",
    "initialize_ray_cluster": "luceio runs in one process; there is no Ray cluster to start",
    **dict.fromkeys(["PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
                     "EmbeddingRequestOutput", "ClassificationOutput",
                     "ClassificationRequestOutput", "ScoringOutput", "ScoringRequestOutput"],
                    _NO_POOLING),
}


def __getattr__(name: str):
    if name in _ABSENT:  # ImportError, not AttributeError: `from luceio import X` keeps the reason
        raise ImportError(f"luceio has no {name}: {_ABSENT[name]}", name=name)
    raise AttributeError(f"module 'luceio' has no attribute {name!r}")
