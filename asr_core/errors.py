"""Exceptions of asr_core. One base class; messages are one line and name the file/tensor at fault."""

from __future__ import annotations


class AsrError(Exception):
    """Base class of every asr_core error."""


class BundleError(AsrError):
    """The model bundle is missing, partial, mis-shaped or has unknown config values.

    Raised by the loader before anything is half-loaded; the message names the file (and tensor).
    """


class StreamClosedError(AsrError):
    """Audio was pushed to a stream that was already finished or closed."""


class EngineStoppedError(AsrError):
    """The engine was shut down (or its encoder thread failed) while a stream still used it."""


class EngineFullError(AsrError):
    """The engine holds as many streams as its device pools may (`AsrEngine.max_streams`)."""
