"""The pinned llama-cpp-python binding: imported once and checked (``binding``), its errors (``LlamaCppError``),
its build (``build_info``), and llama.cpp's log, dropped except while a context is made."""

from __future__ import annotations

import contextlib
import ctypes
import functools

PINNED_VERSION = "0.3.36"


class LlamaCppError(RuntimeError):
    """One-line message naming the problem and the fix."""


@functools.cache
def binding():
    """The binding, imported once, its version checked and its log sent nowhere (it would drown job logs)."""
    try:
        import llama_cpp
    except ImportError as error:
        raise LlamaCppError(
            f"llama_cpp is not importable ({error}) — install the llama.cpp engine: pip install -e .[llamacpp] (envs/llamacpp.txt)"
        ) from None
    if llama_cpp.__version__ != PINNED_VERSION:
        raise LlamaCppError(
            f"llama-cpp-python {llama_cpp.__version__} is installed, stagereplay is pinned to {PINNED_VERSION} (its state format is parsed) — pip install llama-cpp-python=={PINNED_VERSION}"
        )
    llama_cpp.llama_log_set(_SILENT, None)
    llama_cpp.llama_backend_init()
    return llama_cpp


# llama.cpp's log is dropped, except while a context is made: what it says then (whether it rotates the
# cache) is read from it.
_CAPTURED: list[str] | None = None


def _silent(level, text, user_data) -> None:
    if _CAPTURED is not None and text:
        _CAPTURED.append(text.decode("utf-8", errors="replace"))


_SILENT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(_silent)


@contextlib.contextmanager
def captured_log():
    global _CAPTURED
    _CAPTURED = lines = []
    try:
        yield lines
    finally:
        _CAPTURED = None


def last_error(log: list[str]) -> str:
    errors = [line.strip() for line in log if "error" in line.lower() or "requires" in line.lower()]
    return errors[-1] if errors else "no reason logged"


def build_info() -> str:
    """The binding's version and the CPU features its build enables: what llama.cpp's kernels depend on."""
    llama_cpp = binding()
    return llama_cpp.llama_print_system_info().decode().strip()
