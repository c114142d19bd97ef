"""Triton-compatible Python backend: ``model.py`` runs in a worker process per instance.

Kept import-free: the worker imports this package, and its start-up time is the model's.
The backend class is ``kiln.backends.python.backend.PythonBackend``; the model-side API is
``kiln.backends.python.pb_utils`` (``triton_python_backend_utils`` in the worker).
"""
