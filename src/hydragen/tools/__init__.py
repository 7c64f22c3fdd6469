"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` turned into prompts, grammars and parsed calls."""

from hydragen.tools.formats import FORMATS, CallFormat, detect_format
from hydragen.tools.request import ToolRequest
from hydragen.tools.session import ToolSession
from hydragen.tools.spec import Tool, ToolCall, ToolChoice

__all__ = [
    "FORMATS",
    "CallFormat",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolRequest",
    "ToolSession",
    "detect_format",
]
