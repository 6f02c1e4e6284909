"""turnout: a portable LLM inference engine.

Every kernel call is routed through one dispatch layer (``turnout.ops``): each op has a PyTorch
reference, a portable Triton kernel and optional vendor kernels, and a policy picks one per op
per platform, with fallback.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # Lazy so that `import turnout` (e.g. for `turnout ops`) does not load the engine.
    if name == "LLM":
        from turnout.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from turnout.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
