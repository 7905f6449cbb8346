"""Chat templates and tokenizers: the only place that turns text into token IDs."""
