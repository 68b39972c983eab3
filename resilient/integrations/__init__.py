"""Thin adapters that fit resilient into workflow engines (Snakemake, Parsl)."""
