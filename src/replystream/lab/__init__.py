"""Experiments and measuring tools built on the server and the client (nothing imports this)."""
