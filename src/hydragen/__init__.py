"""hydragen: LLM inference built around shared prefixes."""

from hydragen.engine.outputs import CompletionOutput, RequestOutput
from hydragen.engine.sampling_params import SamplingParams
from hydragen.llm import LLM
from hydragen.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
