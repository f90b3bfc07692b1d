"""The only code that drives vLLM: one file per target; `registry.py` names them."""
