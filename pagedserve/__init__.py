"""pagedserve: a router that owns paged KV-cache block tables, executors that run the steps."""

__version__ = "0.1.0"
