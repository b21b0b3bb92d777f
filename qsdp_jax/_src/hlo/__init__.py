"""qsdp_jax internals: reading compiled HLO text for comm.py: sites, loops, async chains, multislice sends, wire bytes."""
