"""Prefill/decode disaggregation (DESIGN.md, "PD disaggregation"): the router, and the KV
connectors that move a prompt's KV blocks from a prefill instance into a decode instance."""
