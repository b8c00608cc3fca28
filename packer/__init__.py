"""packtrain.packer."""
