"""kvgate: an LLM inference server that governs where the KV memory is."""

from kvgate.model import cpu_isa
from kvgate.sampling_params import SamplingParams

# Before any tensor work: a forced KVGATE_CPU_ISA level applies to PyTorch's kernels too.
cpu_isa.pin_torch_env()

__all__ = ["LLM", "AsyncLLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The engine pulls in torch; keep `import kvgate` cheap for tools that only need params/errors.
    if name == "LLM":
        from kvgate.entrypoints.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from kvgate.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
