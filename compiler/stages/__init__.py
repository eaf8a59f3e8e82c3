"""The compiler's stages, in the order compiler/pipeline.py runs them: ``frontend`` (read, check,
``normalise``), ``importer`` (ONNX -> Relax), ``passes`` (with ``written_out``: ops exporters write
as chains folded back), ``partition`` (mark, merge, keep what pays by ``cost``, measured numbers
from ``profile``), ``codegen`` (orders and TVM libraries, CPU ``schedule``) and ``check_facts``
(what the bundle's golden self-check promises). Backends' own tables live in compiler/backends/."""
