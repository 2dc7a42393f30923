"""Triton Inference Server glue: pure conversions and the logic behind model_repository/*/1/model.py.

Nothing here imports ``triton_python_backend_utils`` at module level: the Python backend injects it
only inside the stub process, so the model.py files pass it in (``pb``). That keeps every conversion
importable and testable in a plain interpreter.
"""
