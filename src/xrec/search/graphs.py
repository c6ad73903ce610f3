"""Captured decode rounds (CUDA graphs), one `DecodeGraphs` per pipeline.

Round 0 (the prompt or encoder pass) runs eagerly; rounds 1 .. R-1 of a batch (decode
steps, constrained top-k, beam update, beam K/V reorder: `RecStep.decode_rounds`) are
one graph per bucket. A bucket is everything the decode rounds' kernels depend on but
the values: the structure of the `DecodeState` round 0 leaves, each tensor's shape,
strides and dtype, and its host values (beam width, results, which rows normalise
over the full vocabulary, filters present...). Batches of one bucket replay one graph:
their state's tensors are copied into the captured ones (the static inputs), except
those already at the captured address (the workspace's prefix / prompt K/V), and the
outputs are cloned out of the graph's memory.

- A bucket is captured the second time it runs (the first runs eagerly: one-off shapes
  cost no capture); at most `max_graphs` per pipeline, least recently used dropped.
- Graphs belong to one `RecStep`, i.e. one served catalog: a batch on another step
  (after a catalog reload) drops them, and its buckets are captured again. The
  captured tables are never patched in place, and the step is not referenced (a
  released catalog's tables go; its graphs are dropped before anything could replay
  them).
- Each entry holds what its kernels read or write: the static inputs and every
  workspace buffer at capture time (a workspace that grows later keeps the old buffer
  alive for the graph).
- Stopping between rounds (`before_round`) happens before the replay: a replayed batch
  runs its decode rounds to the end.

The backend captures: `CudaGraphs` on CUDA (one memory pool per pipeline, thread-local
capture so that other pipelines keep running), `EagerReplay` elsewhere, which runs the
rounds again on the static inputs: the same data path (copy in, run, read the static
outputs), so a value that bypasses the static inputs gives a wrong answer in tests.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from xrec.search.workspace_buffers import Workspace

if TYPE_CHECKING:
    from xrec.search.step import DecodeState, DeviceOutput, RecStep

logger = logging.getLogger(__name__)

Replay = Callable[[], None]


class CudaGraphs:
    """Captures with `torch.cuda.CUDAGraph` into one memory pool (a pipeline's)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], DeviceOutput]) -> tuple[Replay, DeviceOutput]:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        # capture on the pipeline's own stream; a default-stream caller gets torch's side stream
        side = None if stream == torch.cuda.default_stream(stream.device) else stream
        with torch.cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode="thread_local"):
            output = run()
        return graph.replay, output


class EagerReplay:
    """Not a graph: `replay` runs the rounds again on the static inputs and copies the result
    into the first run's output tensors. Where CUDA graphs are not (a CPU), it runs the
    graph code path: bucketing, static inputs, copies in and out, re-capture."""

    def capture(self, run: Callable[[], DeviceOutput]) -> tuple[Replay, DeviceOutput]:
        output = run()

        def replay() -> None:
            again = run()
            for static, new in zip(_fields(output), _fields(again)):
                static.copy_(new)
        return replay, output


@dataclasses.dataclass(frozen=True)
class _Captured:
    """A captured bucket: its replay, static inputs and outputs, and the workspace buffers
    its kernels address (held alive)."""

    replay: Replay
    inputs: list[torch.Tensor]
    output: DeviceOutput
    held: tuple[torch.Tensor, ...]


class DecodeGraphs:
    """One pipeline's captured decode rounds, keyed by bucket (see the module's notes)."""

    def __init__(self, backend: CudaGraphs | EagerReplay, max_graphs: int = 32):
        self.backend, self.max_graphs = backend, max_graphs
        self._step: weakref.ref | None = None   # not a reference: a released catalog goes
        self._graphs: OrderedDict[Any, _Captured] = OrderedDict()
        self._seen: OrderedDict[Any, None] = OrderedDict()   # buckets run once, not captured
        self.num_captures = 0
        self.num_replays = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, step: RecStep, state: DecodeState, workspace: Workspace | None,
            before_round: Callable[[int], None] | None = None) -> DeviceOutput:
        """Rounds 1 .. R-1 of `state`: replayed when its bucket is captured, else eagerly
        (and captured when the bucket runs the second time)."""
        if self._step is None or self._step() is not step:
            self._step = weakref.ref(step)
            self._graphs.clear()
            self._seen.clear()
        inputs, key = flatten(state)
        entry = self._graphs.get(key)
        if entry is None:
            output = step.decode_rounds(state, before_round)
            if key in self._seen:
                self._capture(step, state, inputs, key, workspace)
            else:
                self._remember(key)
            return output
        self._graphs.move_to_end(key)
        if before_round is not None:
            for round_index in range(1, step.rounds):
                before_round(round_index)
        for static, live in zip(entry.inputs, inputs):
            if not _same_view(static, live):
                static.copy_(live)
        entry.replay()
        self.num_replays += 1
        return type(entry.output)(*(t.clone() for t in _fields(entry.output)))

    def _capture(self, step: RecStep, state: DecodeState, inputs: list[torch.Tensor], key: Any,
                 workspace: Workspace | None) -> None:
        if self.max_graphs == 0:
            return
        self._seen.pop(key, None)
        started = time.perf_counter()
        replay, output = self.backend.capture(lambda: step.decode_rounds(state))
        seconds = time.perf_counter() - started
        held = () if workspace is None else workspace.buffers()
        self._graphs[key] = _Captured(replay, inputs, output, held)
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        self.num_captures += 1
        logger.info("captured the decode rounds of a bucket (batch %d x beam width %d) in %.1f ms; "
                    "%d graphs on this pipeline", state.num_batch, state.num_beams,
                    1000 * seconds, len(self._graphs))

    def _remember(self, key: Any) -> None:
        """A bucket run once (bounded: the most recent 4 x max_graphs)."""
        self._seen[key] = None
        while len(self._seen) > 4 * max(self.max_graphs, 1):
            self._seen.popitem(last=False)


def flatten(state: Any) -> tuple[list[torch.Tensor], Any]:
    """The tensors of `state` (dataclasses, plain objects, tuples, lists, dicts, walked in
    order) and its bucket: a hashable description of everything but the tensors' values
    (each tensor's shape, strides, dtype and device; every other value as it is)."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device)
        if isinstance(value, (tuple, list)):
            return (type(value), tuple(walk(v) for v in value))
        if isinstance(value, dict):
            return (dict, tuple((k, walk(v)) for k, v in value.items()))
        if _is_record(value):
            return (type(value), tuple((k, walk(v)) for k, v in vars(value).items()))
        return value

    return tensors, walk(state)


def _is_record(value: Any) -> bool:
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)) or (
        hasattr(value, "__dict__") and not callable(value) and not isinstance(value, type)
        and type(value).__module__.startswith("xrec."))


def _same_view(static: torch.Tensor, live: torch.Tensor) -> bool:
    return static.data_ptr() == live.data_ptr() and static.stride() == live.stride()


def _fields(output: DeviceOutput) -> tuple[torch.Tensor, ...]:
    return tuple(getattr(output, f.name) for f in dataclasses.fields(output))


__all__ = ["CudaGraphs", "DecodeGraphs", "EagerReplay", "flatten"]
