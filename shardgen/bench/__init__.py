"""The throughput benchmark behind ``python -m jobs.bench``: measuring helpers, the two ways, the report."""
