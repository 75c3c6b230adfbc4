"""Thin adapters that drive :class:`ckptavg.MergeHook` from training frameworks.

Each module imports its framework at import time and nothing here imports them eagerly:
``from ckptavg.hook.integrations.transformers import MergeCallback`` needs ``transformers``,
``...lightning`` needs ``lightning``, ``...olmo_core`` needs ``ai2-olmo-core``, ``...torchtitan``
needs ``torchtitan``.
"""


def require(module: str, package: str) -> None:
    """Raise an ImportError that says what to install."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"this ckptavg integration needs {package}: pip install {package}") from exc
