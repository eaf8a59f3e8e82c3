"""The onnxruntime executor: runs the compiler's ONNX rendering of an order.

The universal executor and the host stand-in for ACL: any board with onnxruntime runs it.

``run_into`` binds the caller's buffers with an IOBinding (OrtValues over the numpy views'
memory), so onnxruntime reads the VM's input buffers and writes straight into its DPS output
buffers: no copies on either side. Buffers are bound with the order's dtypes (float32, or the
int8/uint8 codes of a quantized order's tensors). The binding is kept while the buffers stay the
same (the VM reuses its storage from run to run). ``zero_copy=False`` gives the plain
``session.run`` + copy path, kept for comparison (tests/test_agent_runtime.py measures both).
"""

from __future__ import annotations

import time

import numpy as np


def available() -> tuple[bool, str]:
    try:
        import onnxruntime  # noqa: F401
    except Exception as err:
        return False, f"onnxruntime not importable ({type(err).__name__}: {err})"
    return True, ""


# an order dtype -> the type onnxruntime names for an ONNX graph's input/output of it
# (an onnx order, contract/orders.py KINDS, carries the source model's own dtypes: TopK's int64 indices)
_ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "float64": "tensor(double)",
              "int8": "tensor(int8)", "uint8": "tensor(uint8)", "int16": "tensor(int16)", "int32": "tensor(int32)",
              "int64": "tensor(int64)", "bool": "tensor(bool)"}


def _bindable(a: np.ndarray, dtype: np.dtype) -> bool:
    return a.dtype == dtype and a.flags.c_contiguous


class OrtExecutor:
    name = "onnxruntime"

    def __init__(self, order: dict, onnx_bytes: bytes, threads: int = 0, zero_copy: bool = True,
                 external: dict[str, bytes] | None = None) -> None:
        """``external``: the files the model's external data names (the order's weights blob),
        handed to onnxruntime in memory: nothing is written to disk."""
        import onnxruntime as ort

        from ..board import ort_session_config

        so = ort.SessionOptions()
        so.log_severity_level = 3
        # Workers that spin between runs fight TVM's pool (and the camera thread) on a few cores
        # (measured 2-5x slower with onnxruntime's defaults); within a run they are its speed.
        for key, value in ort_session_config().items():
            so.add_session_config_entry(key, value)
        if threads:
            so.intra_op_num_threads = threads
        if external:
            # onnxruntime may use these buffers in place: they live as long as the session
            self._external = [np.frombuffer(b, np.uint8) for b in external.values()]
            so.add_external_initializers_from_files_in_memory(list(external), self._external,
                                                              [len(b) for b in self._external])
        self.session = ort.InferenceSession(onnx_bytes, so, providers=["CPUExecutionProvider"])
        self.in_names = [i["name"] for i in order["inputs"]]
        self.out_names = [o["name"] for o in order["outputs"]]
        have_in = [i.name for i in self.session.get_inputs()]
        have_out = [o.name for o in self.session.get_outputs()]
        if have_in != self.in_names or have_out != self.out_names:
            raise ValueError(f"the order's ONNX graph has inputs {have_in} and outputs {have_out}, "
                             f"the order says {self.in_names} and {self.out_names}")
        specs = [*order["inputs"], *order["outputs"]]
        self._dtypes = [np.dtype(str(s.get("dtype", "float32"))) for s in specs]
        for spec, arg in zip(specs, [*self.session.get_inputs(), *self.session.get_outputs()]):
            want = _ORT_TYPES.get(str(spec.get("dtype", "float32")))
            if arg.type != want:   # a binding of the wrong type would reinterpret the bytes
                raise ValueError(f"the order's ONNX graph has {arg.name!r} as {arg.type}, the order says "
                                 f"{spec.get('dtype', 'float32')}")
        self.in_shapes = [tuple(int(d) for d in i["shape"]) for i in order["inputs"]]
        self.out_shapes = [tuple(int(d) for d in o["shape"]) for o in order["outputs"]]
        self.backend = "CPUExecutionProvider"
        self.zero_copy = zero_copy
        self.last_run_ns = 0
        self.last_zero_copy = False
        self._binding = None
        self._bound: list[int | None] = []
        self._lists = [list(s) for s in (*self.in_shapes, *self.out_shapes)]
        self._sizes = [int(np.prod(s)) for s in (*self.in_shapes, *self.out_shapes)]

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return self.session.run(self.out_names, dict(zip(self.in_names, inputs)))

    def run_into(self, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        n_in = len(inputs)
        if (self.zero_copy and all(_bindable(a, d) for a, d in zip(inputs, self._dtypes))
                and all(out.flags.writeable and _bindable(out, d) for out, d in zip(outputs, self._dtypes[n_in:]))):
            self._run_bound(inputs, outputs)
            self.last_zero_copy = True
            return
        t0 = time.perf_counter_ns()
        results = self.run(inputs)
        self.last_run_ns = time.perf_counter_ns() - t0
        self.last_zero_copy = False
        for dst, src in zip(outputs, results):
            np.copyto(dst, src.reshape(dst.shape))

    def _run_bound(self, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        arrays = (*inputs, *outputs)
        if len(arrays) != len(self._sizes) or any(a.size != n for a, n in zip(arrays, self._sizes)):
            raise ValueError(f"buffers {[list(a.shape) for a in arrays]} do not fit the order's "
                             f"{[list(s) for s in (*self.in_shapes, *self.out_shapes)]}")
        b = self._binding
        if b is None:
            b = self._binding = self.session.io_binding()
            self._bound = [None] * len(arrays)
        bound = self._bound
        n_in = len(inputs)
        for k, a in enumerate(arrays):
            p = a.ctypes.data
            if p != bound[k]:  # (re)bind only what moved: the VM mostly reuses its buffers
                dtype = self._dtypes[k].type
                if k < n_in:
                    b.bind_input(self.in_names[k], "cpu", 0, dtype, self._lists[k], p)
                else:
                    b.bind_output(self.out_names[k - n_in], "cpu", 0, dtype, self._lists[k], p)
                bound[k] = p
        t0 = time.perf_counter_ns()
        self.session.run_with_iobinding(b)
        self.last_run_ns = time.perf_counter_ns() - t0
