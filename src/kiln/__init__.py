__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # ``kiln.optimize(...)`` without importing onnxruntime's quantization tools on ``import kiln``.
    if name == "optimize":
        import importlib

        return importlib.import_module("kiln.optimize")
    raise AttributeError(f"module 'kiln' has no attribute '{name}'")
