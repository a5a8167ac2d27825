"""The int8 lowering rules, one module per op family, found through INT_RULES (op type -> rule).

A rule is `rule(c, node)`, c the Compiler (its helpers: views, vals, out_quant, weight, bias,
emit_q, nhwc_input, ...): it returns None when it emitted the node's step(s), or a string, the
reason it does not apply, and leaves everything as it was; the node then runs in fp32 (after
`rule_region` had its try on an elementwise op). The checks rules open with are in common.py.
Adding a rule: one function in its family's module and one entry in that module's RULES.
"""
from __future__ import annotations

from qtool.runtime.lower import conv, dynamic, elementwise, gemm, lut, pool, shape
from qtool.runtime.lower.lut import ELEMENTWISE, rule_region

FAMILIES = (lut, shape, conv, gemm, elementwise, pool, dynamic)



def _registry(families) -> dict:
    rules = {}
    for family in families:
        for op, rule in family.RULES.items():
            if op in rules:
                raise RuntimeError(f"two int8 rules for {op}: {family.__name__} and {rules[op].__module__}")
            rules[op] = rule
    return rules


INT_RULES = _registry(FAMILIES)

__all__ = ["INT_RULES", "ELEMENTWISE", "rule_region"]
