"""Structured outputs (constrained decoding): a grammar per request masks the tokens it does
not allow before sampling. Backends: xgrammar (default) and llguidance ("guidance").

The package sits below ``core`` (the scheduler keeps each request's grammar) and imports
neither torch nor a grammar library at import time: the backends load on first use.
"""
