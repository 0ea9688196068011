"""``torchvision.transforms`` names SGLang imports at module level; using any raises (see ../../README.md)."""
from .. import _unusable
from . import functional
from .functional import InterpolationMode

__all__ = ["InterpolationMode", "functional"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unusable(f"transforms.{name}")
