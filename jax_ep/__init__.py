"""jax_ep."""
