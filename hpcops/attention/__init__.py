"""Paged attention for decode (load-balanced persistent schedule) and prefill/extend."""
