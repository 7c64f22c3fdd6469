"""hydragen: LLM inference built around shared prefixes."""

from hydragen.engine.llm import LLM
from hydragen.engine.outputs import CompletionOutput, RequestOutput
from hydragen.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
