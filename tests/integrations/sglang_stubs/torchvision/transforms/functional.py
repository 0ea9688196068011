"""``torchvision.transforms.functional``: the enum SGLang imports; any function raises (see ../../README.md)."""
import enum

from .. import _unusable


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unusable(f"transforms.functional.{name}")
