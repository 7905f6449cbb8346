"""Orchestration: request -> session -> renderer -> engine -> tape. No HTTP here."""
