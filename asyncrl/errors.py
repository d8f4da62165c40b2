"""Exceptions that user code catches, raised by more than one part of asyncrl: a leaf (it imports nothing of
asyncrl), so that the Runtime and the OpenAI-compatible endpoint share them without importing each other."""

from __future__ import annotations


class TrainingFinished(RuntimeError):
    """The background training ended (all steps taken, or it failed: the cause is chained)."""
