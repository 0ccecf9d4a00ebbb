"""Model families, checkpoint loading and fetching."""
