"""vpage: a high-throughput LLM inference engine built on PagedAttention."""

__version__ = "0.1.0"
