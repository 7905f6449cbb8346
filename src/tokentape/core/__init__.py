"""Pure logic: tapes, session trees, bridges, sampling checks, exports. No I/O, no asyncio."""
