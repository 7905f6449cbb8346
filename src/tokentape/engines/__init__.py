"""Engines: token IDs in, sampled token IDs and logprobs out. No messages, no text templates."""
