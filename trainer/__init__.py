"""packtrain.trainer."""
