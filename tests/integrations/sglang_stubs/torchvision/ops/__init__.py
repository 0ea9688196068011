"""``torchvision.ops``: importable; any name taken from it raises when used (see the stand-in's README)."""
from .. import _unusable
from . import boxes  # noqa: F401  (a submodule, not a name to stand in for)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unusable(f"ops.{name}")
