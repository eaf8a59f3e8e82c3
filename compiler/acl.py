"""The ACL table moved to compiler/backends/acl/ (the ACL backend's folder); this module is kept
for the callers that have not moved yet (partition.py, codegen.py, cost.py and tests import
``tandoor_compiler.acl``) and re-exports the names they use. New code imports
``tandoor_compiler.backends.acl``."""

from .backends.acl import (ARMNN_RELEASES, ENTRIES, GELU_SINCE, RELAX_OPS, Entry, Match, Rule, bias_limit, entry_for,
                           explain, relax_op, release_reason, rules, weight_grid)

__all__ = ["ARMNN_RELEASES", "ENTRIES", "GELU_SINCE", "RELAX_OPS", "Entry", "Match", "Rule", "bias_limit", "entry_for",
           "explain", "relax_op", "release_reason", "rules", "weight_grid"]
