"""codagen: GEMM-epilogue programs in YAML -> Triton kernels and PyTorch ops."""
from .api import build, check, generate, load

__all__ = ["build", "check", "generate", "load"]
__version__ = "0.1.0"
