"""compound: quantize Hugging Face causal LMs to INT4, train speculative heads, validate and push the results.

The public verbs are imported lazily so that ``import toolkit`` stays cheap (no torch until a verb is used).
"""

from toolkit.version import __version__

__all__ = ["__version__", "quantize", "load_quantized", "perplexity"]


def __getattr__(name):
    if name == "quantize":
        from toolkit.quantize import quantize

        return quantize
    if name == "load_quantized":
        from toolkit.runtime.load import load_quantized

        return load_quantized
    if name == "perplexity":
        from toolkit.evaluate.perplexity import perplexity

        return perplexity
    raise AttributeError(name)
