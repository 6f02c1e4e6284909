"""Models turnout has no class for, run through transformers' own modeling code with turnout's paged attention,
KV cache and kernels (vLLM's "Transformers modeling backend"). ``support`` says which architectures can;
``TransformersForCausalLM`` (model.py) is the model."""

from turnout.models.transformers_backend.support import unsupported_reason


def __getattr__(name):  # the model class imports torch and transformers' modeling code: only when asked for
    if name == "TransformersForCausalLM":
        from turnout.models.transformers_backend.model import TransformersForCausalLM

        return TransformersForCausalLM
    raise AttributeError(name)


__all__ = ["TransformersForCausalLM", "unsupported_reason"]
