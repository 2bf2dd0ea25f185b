"""The error the estimator raises for a job whose memory it cannot estimate."""

from __future__ import annotations


class MemoryEstimateError(ValueError):
    """The memory of this job cannot be estimated (for instance an unsupported architecture)."""
