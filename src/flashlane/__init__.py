"""flashlane: serve, benchmark, explain and tune hybrid sparse/linear-attention MoE models."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # Lazy so that torch-free parts (analyze, bench, config) import without loading torch.
    if name == "LLM":
        from .engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
