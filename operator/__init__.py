"""packtrain.operator."""
