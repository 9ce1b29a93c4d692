"""codagen: GEMM-epilogue programs in YAML -> Triton kernels and PyTorch ops.

The API (build, check, generate, load) loads on first use, so that generated code, which imports
codagen.runtime, does not import the generator (its YAML loader, templates and emitters)."""

__all__ = ["build", "check", "generate", "load"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'codagen' has no attribute '{name}'")
