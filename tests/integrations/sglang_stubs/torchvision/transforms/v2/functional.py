"""``torchvision.transforms.v2.functional``: importable; any name taken from it raises when used (see the stand-in's README)."""
from ... import _unusable


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unusable(f"transforms.v2.functional.{name}")
