"""The one shape of a step: what the row path (shard/rows.py ``RowPath``) needs of every output.

Each kind of step declares on its class what it can, and the row path reads only that:

- ``calls_engine``: the row path builds the step's ``request``, gets the answer from the
  engine (or the request cache), and hands it to ``assign`` (the LLM step, ``llm.LLMStep``:
  the hot path, so the sending, caching and booking stay in the row path). Every other step
  is awaited as ``run(variables, unit)``, which sets its variables and says whether the row
  goes on (``python.FilterStep``, ``python.CustomStep``, ``image.ImageStep``).
- ``once_per_row``: running it once serves every sample of a row (n_samples > 1): it reads
  only what the samples share (a filter before the first LLM step).
- ``base_seed``: the base of the per-request seeds (shard/samples.py) the step asks for
  (``sampling_params.seed`` of an LLM step); None: none.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from mirageflow.config.types import OutputVar


class Unit(NamedTuple):
    """Where a row (sample) stands: its dataset, source index and sample (0 without n_samples)."""

    dataset: int
    source_index: int
    sample: int = 0


class _Filtered:
    def __repr__(self) -> str:
        return "FILTERED"


# What the row path returns for a row a filter dropped (no record, no error).
FILTERED = _Filtered()


class Step:
    """One output's step. A step that does not call the engine implements ``run``; one that
    does implements ``request`` and ``assign`` (llm.LLMStep) and has ``engine`` and ``cache_keys``."""

    calls_engine: ClassVar[bool] = False
    once_per_row: ClassVar[bool] = False
    base_seed: int | None = None
    output: OutputVar

    async def run(self, variables: dict, unit: Unit) -> bool:
        """Set this step's variables for the row (sample) at ``unit``; False: the row stops here (filtered)."""
        raise NotImplementedError(f"{type(self).__name__} calls the engine: the row path sends its request")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # a kind says what it is: a step that does not call the engine must run
        if not cls.calls_engine and cls.run is Step.run:
            raise TypeError(f"{cls.__name__}: a step that does not call the engine implements run(variables, unit)")


def first_engine_step(steps: list[Step]) -> int | None:
    """The index of the first step that calls the engine when only steps that are the same for
    every sample of a row (``once_per_row``: filters) come before it, else None: the step a
    row's samples can share a request of (shard/rows.py), and whose prompt orders the rows
    (shard/prefix_order.py)."""
    for i, step in enumerate(steps):
        if step.calls_engine:
            return i
        if not step.once_per_row:  # a Python step may differ per sample
            return None
    return None
