"""`tandoor`: the host-side tools (compile, inspect, verify, bench, profile, quantize, keygen, cache,
fleet), one module each in host/commands/ (quantize: host/quantize.py), assembled here into the
group that answers any failure in one line (host/cli_base.py).

Every command answers a bad input with one line naming the problem and the fix (exit 2, or the
error family's own code) and an unexpected failure with one line naming where it happened (exit 3);
``--debug`` (or TANDOOR_DEBUG=1) adds the traceback and what TVM printed natively.
"""

from __future__ import annotations

import click

from .cli_base import Tool, debug_option
from .commands import bench, cache, compile, fleet, inspect, keygen, profile, verify
from .quantize import quantize


@click.group(cls=Tool, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tandoor")
@debug_option
def main() -> None:
    """Tandoor: compile ONNX vision models into ACL-partitioned hybrid modules for ARM boards."""


for _cmd in (compile.compile, inspect.inspect, verify.verify, bench.bench, profile.profile, quantize, keygen.keygen,
             cache.cache_cmd, fleet.fleet):
    main.add_command(_cmd)


if __name__ == "__main__":
    main()
