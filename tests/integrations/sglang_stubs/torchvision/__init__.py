"""A stand-in for torchvision on SGLang's import chain (see ../README.md): importable, never usable."""
__version__ = "0.0.0+gpuxfer.stub"


def _unusable(name: str):
    class _Unusable:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"torchvision.{name} is gpuxfer's test stand-in (tests/integrations/sglang_stubs): "
                               "install a real torchvision to transform images")

        def __call__(self, *args, **kwargs):
            raise RuntimeError(f"torchvision.{name} is gpuxfer's test stand-in")
    _Unusable.__name__ = name.rsplit(".", 1)[-1]
    return _Unusable
