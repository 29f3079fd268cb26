"""A stand-in for the transformers package whose model classes take a long time to import, as
the real ones do on a busy node (torch, CUDA kernels, a shared filesystem): a job can be
stopped in the middle of that import, deterministically. Put ``tests/fakes/slow_transformers``
first on a job's PYTHONPATH; the job's engine (engines/transformers_engine.py) imports it.

Like transformers' own lazy module (transformers/utils/import_utils.py, ``_LazyModule``), an
exception raised while the module behind a name is imported comes out as
``ModuleNotFoundError: Could not import module '<name>'``: what a stop signal raised inside the
import looks like from outside. ``$SLOW_TRANSFORMERS_IMPORTING`` names a file created when the
slow import starts.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    try:
        module = importlib.import_module(".models_auto", __name__)
    except Exception as e:
        raise ModuleNotFoundError(
            f"Could not import module '{name}'. Are this object's requirements defined correctly? "
            "Set the logging verbosity to DEBUG for the original import error."
        ) from e
    return getattr(module, name)
