"""Tool calling for chat completions: the request's tool fields as a plan (``request``), one
parser per call format (``glm``, ``hermes``, and ``forced`` for grammar-decoded choices), and
the template-based choice of format (``call_format``)."""

from .base import CallFolder, ParsedDelta, ToolParser, parse_whole
from .choose import call_format
from .request import ToolPlan, plan_tools


__all__ = ["CallFolder", "ParsedDelta", "ToolParser", "ToolPlan", "call_format", "parse_whole", "plan_tools"]
