"""The ggml plumbing every part of the engine shares: a backend, weight buffers, cached graphs.

A ggml graph here is built once for a shape key (segment, tokens, KV bucket...) and
allocated once; later calls only copy inputs in, compute, and copy outputs out.
Building costs tens of microseconds per op through ctypes, so rebuilding per token
would cost more than a small model's compute (STACK.md). `GraphCache` keeps the most
recent graphs (LRU) and frees the rest, so memory stays bounded.

ggml shapes are written in ggml order (ne0 = contiguous row length) throughout the
engine; numpy arrays cross the boundary in C order, i.e. reversed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import numpy as np

from kvasird.compute.errors import ComputeError

os.environ.setdefault("GGML_NO_BACKTRACE", "1")

import ggml  # noqa: E402  (the environment variable must be set before the library loads)

F32, F16, I32, I64 = ggml.GGML_TYPE_F32, ggml.GGML_TYPE_F16, ggml.GGML_TYPE_I32, ggml.GGML_TYPE_I64
_NP_TYPES = {F32: np.float32, F16: np.float16, I32: np.int32, I64: np.int64}

Tensor = Any
"""A ggml tensor pointer (ctypes); kept untyped because ggml-python's types are not exported."""

_WARN, _CONT = 3, 5
_level = [_WARN]


@ggml.ggml_log_callback
def _ggml_log(level: int, text: bytes, _user: Any) -> None:
    """ggml's warnings and errors go to stderr; its debug and info lines (a line per
    tensor repacked, per buffer allocated) stay out of a node's output."""
    if level != _CONT:
        _level[0] = level
    if _level[0] >= _WARN and text:
        sys.stderr.write(text.decode("utf-8", "replace"))


ggml.ggml_log_set(_ggml_log, None)


_device = ""
"""The ggml device this process computes on ("" = the CPU; see use_device)."""


def use_device(name: str) -> None:
    """Compute on ggml device `name` ("CPU", "CUDA0", "Vulkan0", ...; "" = the CPU) from now
    on in this process: every Backend made without a device of its own starts it
    (`[compute] device`, ``kvasird verify --device``). Refused, with the devices this
    build has, when there is no such device."""
    global _device
    if name and name.upper() != "CPU":
        _find_device(name)
    _device = name


def _find_device(name: str) -> Any:
    dev = ggml.ggml_backend_dev_by_name(name.encode())
    if not dev:
        names = [
            ggml.ggml_backend_dev_name(ggml.ggml_backend_dev_get(i)).decode()
            for i in range(ggml.ggml_backend_dev_count())
        ]
        raise ComputeError(
            f"no ggml device named {name!r}: this build of ggml-python has "
            f"{', '.join(names) or 'none'} (`kvasird native info` lists them): "
            "build it for that device (KVASIR_GGML_BACKEND=cuda, vulkan, hip "
            "or metal native/setup) or set [compute] device to one of those"
        )
    return dev


class Backend:
    """A ggml compute backend (the CPU's, or a device's: use_device) and the thread count
    it runs with."""

    def __init__(self, threads: int, device: str | None = None) -> None:
        if threads < 1:
            raise ComputeError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        name = _device if device is None else device
        if name and name.upper() != "CPU":
            self.handle = ggml.ggml_backend_dev_init(_find_device(name), None)
            if not self.handle:
                raise ComputeError(
                    f"ggml could not start device {name!r}: is its driver "
                    "loaded (`kvasird native info`)?"
                )
        else:
            self.handle = ggml.ggml_backend_cpu_init()
            if not self.handle:
                raise ComputeError("ggml could not start its CPU backend")
        self.cpu = bool(ggml.ggml_backend_is_cpu(self.handle))
        """Whether it computes on the CPU (threads and the repacked weights apply there)."""
        if self.cpu:
            ggml.ggml_backend_cpu_set_n_threads(self.handle, threads)
        self.buffer_type = ggml.ggml_backend_get_default_buffer_type(self.handle)
        self.name = ggml.ggml_backend_name(self.handle).decode()
        self.lock = threading.RLock()
        """Held for a whole set-compute-get: one backend computing two graphs at once gives
        wrong results (STACK.md), so everything sharing a backend shares this lock.
        Reentrant, so that a caller may take it ahead of a forward (`stage.held_now`)."""
        self.locks = (self.lock,)
        """What a computation on this backend alone holds (for `stage.held_now`)."""

    def compute(self, graph: Any) -> None:
        if not self.handle:
            raise ComputeError("the compute backend was closed (its stage was closed)")
        status = ggml.ggml_backend_graph_compute(self.handle, graph)
        if status != 0:
            raise ComputeError(f"ggml graph compute failed with status {status}")

    def close(self) -> None:
        if self.handle:
            ggml.ggml_backend_free(self.handle)
            self.handle = None


REPACKED_TYPES = frozenset({ggml.GGML_TYPE_Q4_0, ggml.GGML_TYPE_Q4_K, ggml.GGML_TYPE_IQ4_NL})
"""Q4_0, Q4_K, IQ4_NL: what ggml's CPU backend repacks for AVX2 (``repack_buffer_type``)."""


@functools.cache
def repack_buffer_type() -> Any:
    """ggml's CPU_REPACK buffer type on an x86 CPU with AVX2, else None.

    Weights set into it are interleaved eight rows at a time, so that its matrix kernels
    (gemv for one row, gemm for several) read eight output rows' blocks with each load:
    llama.cpp holds Q4_0 and Q4_K weights so by default, and its logits for such files come
    from those kernels. It takes only whole 2-D or 3-D tensors of REPACKED_TYPES with rows
    in multiples of eight, used as the weights of MUL_MAT / MUL_MAT_ID (``repackable``),
    and cannot be read back."""
    if not ggml.ggml_cpu_has_avx2():
        return None  # ARM's kernels repack other types at other sizes: not used here
    reg = ggml.ggml_backend_cpu_reg()
    fn = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not reg or not fn:
        return None
    get = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)
    bufts = get(ggml.ggml_backend_reg_dev_get(reg, 0))
    i = 0
    while bufts and bufts[i]:
        if ggml.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return ctypes.c_void_p(bufts[i])
        i += 1
    return None


def repackable(name: str, type_: int, ne: tuple[int, ...]) -> bool:
    """Whether a weight goes into the repack buffer: a 2-D matrix (not the embedding, which
    is read by row) of a repacked type, rows in eights. Not the 3-D expert stacks: ggml's
    repacked MUL_MAT_ID gives a batch of 17 other rows on an 8-expert range than on the
    whole stack (0.15.3 and 0.25.3: ``test_a_range_of_4_bit_experts_computes_as_the_whole_layer``),
    and a range of experts must compute what the whole layer does."""
    return (
        type_ in REPACKED_TYPES
        and len(ne) == 2
        and ne[1] % 8 == 0
        and name != "token_embd.weight"
        and repack_buffer_type() is not None
    )


class TensorArena:
    """A ggml context of tensors that live in one backend buffer (weights, a KV pool)."""

    def __init__(self, n_tensors: int) -> None:
        params = ggml.ggml_init_params(
            mem_size=ggml.ggml_tensor_overhead() * (n_tensors + 8), mem_buffer=None, no_alloc=True
        )
        self.ctx = ggml.ggml_init(params)
        self.buffer: Any = None
        self.tensors: dict[str, Tensor] = {}

    def new(self, name: str, type_: int, ne: tuple[int, ...]) -> Tensor:
        makers = {
            1: ggml.ggml_new_tensor_1d,
            2: ggml.ggml_new_tensor_2d,
            3: ggml.ggml_new_tensor_3d,
            4: ggml.ggml_new_tensor_4d,
        }
        t = makers[len(ne)](self.ctx, type_, *ne)
        ggml.ggml_set_name(t, name.encode()[:63])
        self.tensors[name] = t
        return t

    def allocate(self, backend: Backend, buffer_type: Any = None) -> None:
        """Allocate every tensor, in the backend's buffer type or ``buffer_type``."""
        self.buffer = (
            ggml.ggml_backend_alloc_ctx_tensors(self.ctx, backend.handle)
            if buffer_type is None
            else ggml.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, buffer_type)
        )
        if not self.buffer:
            raise ComputeError("ggml could not allocate the backend buffer (out of memory?)")
        if ggml.ggml_backend_buffer_is_host(self.buffer):
            _huge_pages(
                int(ggml.ggml_backend_buffer_get_base(self.buffer) or 0),
                int(ggml.ggml_backend_buffer_get_size(self.buffer)),
            )
        ggml.ggml_backend_buffer_clear(self.buffer, 0)

    @property
    def nbytes(self) -> int:
        return int(ggml.ggml_backend_buffer_get_size(self.buffer)) if self.buffer else 0

    def close(self) -> None:
        if self.buffer:
            ggml.ggml_backend_buffer_free(self.buffer)
            self.buffer = None
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None


_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def _huge_pages(base: int, size: int) -> None:
    """Ask Linux to back [base, base + size) with transparent huge pages, before first touch.

    Weights are read whole on every token, 4 KiB pages at a time through the TLB. With
    several stages (processes) taking turns on a core their TLB entries evict each other,
    which huge pages make cheaper (the bundled model split over 3 processes: see
    bench/bench_swarm.py's 3-stage ring; one process alone: no difference). A no-op where
    THP is off or not Linux.
    """
    start, end = -(-base // _HUGE) * _HUGE, (base + size) // _HUGE * _HUGE
    if end <= start or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def set_bytes(t: Tensor, data: np.ndarray, offset: int = 0) -> None:
    """Copy `data` (any dtype, C-contiguous) into tensor `t` at byte `offset`."""
    data = np.ascontiguousarray(data)
    ggml.ggml_backend_tensor_set(t, data.ctypes.data, offset, data.nbytes)


class Builder:
    """What a graph-building function receives: the context, and a way to declare inputs."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.inputs: dict[str, Tensor] = {}
        self.effects: list[Tensor] = []
        """Writes into backend tensors that no output depends on (a session's recurrent
        state): computed with the graph, never read back."""

    def input(self, name: str, type_: int, *ne: int) -> Tensor:
        makers = {
            1: ggml.ggml_new_tensor_1d,
            2: ggml.ggml_new_tensor_2d,
            3: ggml.ggml_new_tensor_3d,
            4: ggml.ggml_new_tensor_4d,
        }
        t = makers[len(ne)](self.ctx, type_, *ne)
        ggml.ggml_set_name(t, name.encode())
        ggml.ggml_set_input(t)
        self.inputs[name] = t
        return t


BuildFn = Callable[[Builder], dict[str, Tensor]]


class Graph:
    """One built and allocated graph; `run` sets inputs, computes and returns outputs."""

    def __init__(self, backend: Backend, build: BuildFn, max_nodes: int = 16384) -> None:
        overhead = ggml.ggml_tensor_overhead() * max_nodes * 2
        overhead += ggml.ggml_graph_overhead_custom(max_nodes, False)
        self.ctx = ggml.ggml_init(
            ggml.ggml_init_params(mem_size=overhead, mem_buffer=None, no_alloc=True)
        )
        self.backend = backend
        builder = Builder(self.ctx)
        try:
            self.outputs = build(builder)
        except BaseException:  # a build that refuses (a tensor not loaded) frees its context
            ggml.ggml_free(self.ctx)
            raise
        self.inputs = builder.inputs
        self.graph = ggml.ggml_new_graph_custom(self.ctx, max_nodes, False)
        for t in self.outputs.values():
            ggml.ggml_set_output(t)
            ggml.ggml_build_forward_expand(self.graph, t)
        for t in builder.effects:
            ggml.ggml_build_forward_expand(self.graph, t)
        self.users = 0
        """Forwards between fetching this graph and getting its outputs (GraphCache.using):
        a graph in use is never evicted, since it may be running in another thread."""
        self.allocr = ggml.ggml_gallocr_new(backend.buffer_type)
        if not ggml.ggml_gallocr_alloc_graph(self.allocr, self.graph):
            self.close()
            raise ComputeError("ggml could not allocate a compute graph (out of memory?)")

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.ctx is None:
            raise ComputeError("internal: this graph was freed")
        with self.backend.lock:
            for name, t in self.inputs.items():
                set_bytes(t, inputs[name])
            self.backend.compute(self.graph)
            return {name: read(t) for name, t in self.outputs.items()}

    def close(self) -> None:
        if self.allocr:
            ggml.ggml_gallocr_free(self.allocr)
            self.allocr = None
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None


def read(t: Tensor) -> np.ndarray:
    """A tensor's contents as a new 4-D numpy array (ne3, ne2, ne1, ne0): callers reshape,
    because ggml cannot tell a [k, 1] tensor from a [k] one."""
    c = t.contents
    shape = tuple(int(c.ne[d]) for d in (3, 2, 1, 0))
    out = np.empty(shape, dtype=_NP_TYPES[c.type])
    if not ggml.ggml_is_contiguous(t):
        raise ComputeError("internal: graph output is not contiguous")
    ggml.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
    return out


class GraphCache:
    """Graphs by shape key, least recently used evicted past `capacity`."""

    def __init__(self, backend: Backend, capacity: int = 16) -> None:
        self.backend = backend
        self.capacity = capacity
        self._graphs: OrderedDict[Hashable, Graph] = OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0
        """Graphs built so far (a test counts them to prove reuse)."""

    def get(self, key: Hashable, build: Callable[[], BuildFn]) -> Graph:
        with self._lock:
            return self._get(key, build)

    @contextlib.contextmanager
    def using(self, key: Hashable, build: Callable[[], BuildFn]) -> Iterator[Graph]:
        """The graph for `key`, kept from eviction until the block ends: for a forward that
        may wait between fetching a graph and running it while other forwards fetch theirs
        (decode steps of several sessions interleaved on an event loop)."""
        with self._lock:
            graph = self._get(key, build)
            graph.users += 1
        try:
            yield graph
        finally:
            with self._lock:
                graph.users -= 1

    def _get(self, key: Hashable, build: Callable[[], BuildFn]) -> Graph:
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            return graph
        graph = Graph(self.backend, build())
        self.builds += 1
        self._graphs[key] = graph
        if len(self._graphs) > self.capacity:  # the least recently used that nobody uses
            idle = [k for k, g in self._graphs.items() if not g.users and k != key]
            for k in idle[: len(self._graphs) - self.capacity]:
                self._graphs.pop(k).close()
        return graph

    def items(self) -> list[tuple[Hashable, Graph]]:
        """(key, graph) pairs, least recently used first (benchmarks time one graph alone)."""
        with self._lock:
            return list(self._graphs.items())

    def close(self) -> None:
        for g in self._graphs.values():
            g.close()
        self._graphs.clear()


def ne_of(t: Tensor) -> tuple[int, ...]:
    c = t.contents
    return tuple(int(c.ne[d]) for d in range(ggml.ggml_n_dims(t)))


__all__ = [
    "Backend",
    "Builder",
    "Graph",
    "GraphCache",
    "TensorArena",
    "ggml",
    "ne_of",
    "read",
    "set_bytes",
    "F32",
    "F16",
    "I32",
    "I64",
]
