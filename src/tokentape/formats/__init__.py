"""File and text formats that several layers read or write: GGUF headers (the embedded engine checks
weights by them, the renderer builds a vocabulary from them) and GBNF grammars (the gateway writes them
for tool calls, the embedded engine enforces them). No engine, renderer or store in here."""
