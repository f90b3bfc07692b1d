"""Bounds-checked torch stand-ins for compiled vLLM ops a host lacks, and the CPU shims vLLM needs.

A stand-in implements the real op's semantics, including what it does when misused, and checks every
index it follows: an index the real op would follow out of bounds is recorded as a memory violation
(as the interpreter sanitizer records Triton's) and skipped. Every result lists the stand-ins used.
"""
