"""zerolab: supervised fine-tuning of causal LMs as Ray Train jobs with DeepSpeed workers."""

__version__ = "0.1.0"
