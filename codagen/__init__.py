"""codagen: GEMM-epilogue programs in YAML -> Triton kernels and PyTorch ops."""
from .api import build, check, load, plan

__all__ = ["build", "check", "load", "plan"]
__version__ = "0.1.0"
